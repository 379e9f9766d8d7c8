"""Publish a policy version: save it as a Hugging Face directory, upload it, announce it.

The order makes a version visible only when it is complete (DESIGN.md §3): every rank saves
its part into a local directory (app.model.checkpoint.save_policy); rank 0 adds the tokenizer,
uploads the directory (app.storage.policy.publish_policy writes ``<run>/policy/v{N}/`` and then
``latest`` last), prunes old versions (never ``latest``) and only then announces ``(N, uri)``
on the experience buffer, where rollout workers pick it up.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import torch.distributed as dist
from torch import nn

from app.model.parallel import EPContext
from app.trainer import TrainingError

# Files of a Hugging Face tokenizer directory; copied from the source checkpoint when present.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "chat_template.jinja",
)


def add_tokenizer(out_dir: Path, source_dir: str | Path | None) -> None:
    """Put tokenizer files into ``out_dir`` so AutoTokenizer (and SGLang) load the version alone.

    Copies them from ``source_dir`` (the checkpoint the run started from) if it has a
    tokenizer.json; otherwise writes the built-in character tokenizer (app.envs.tokenizer).
    """
    src = Path(source_dir) if source_dir else None
    if src is not None and (src / "tokenizer.json").is_file():
        for name in TOKENIZER_FILES:
            if (src / name).is_file():
                shutil.copy2(src / name, out_dir / name)
        return
    from app.envs.tokenizer import save_tokenizer

    save_tokenizer(out_dir)


def publish_version(
    model: nn.Module,
    ep: EPContext,
    version: int,
    *,
    store,
    run_id: str,
    work_dir: Path,
    keep: int,
    buffer=None,
    tokenizer_source: str | Path | None = None,
) -> tuple[str, float]:
    """Save, upload, prune and announce policy ``version``. Collective: every rank calls it.

    Args:
        model: the policy (each EP rank holds its local experts).
        ep: this rank's EP context (passed to save_policy).
        version: the new policy version (one more than the last published).
        store: an app.storage store (open_store(url)).
        run_id: run id; versions land under ``<run_id>/policy/v{N}/``.
        work_dir: local scratch directory for the save (the same path on every rank of a host).
        keep: how many versions to keep in the store (app.storage.policy.prune_policies).
        buffer: the ExperienceBuffer to announce on (rank 0); None skips the announcement.
        tokenizer_source: checkpoint dir whose tokenizer files to ship; see `add_tokenizer`.

    Returns:
        ``(uri, seconds)``: the published version's URI (same on every rank) and the wall time.

    Raises:
        TrainingError: on every rank, if rank 0 failed to upload or announce (the message
            carries rank 0's error), so no rank is left waiting in a collective.
    """
    from app.model.checkpoint import save_policy
    from app.storage.policy import prune_policies, publish_policy

    t0 = time.perf_counter()
    rank = dist.get_rank() if dist.is_initialized() else 0
    local = Path(work_dir) / f"v{version}"
    if rank == 0 and local.exists():
        shutil.rmtree(local)  # left over from a killed run
    if dist.is_initialized():
        dist.barrier()
    save_policy(model, local, ep)

    result: list = [None]
    if rank == 0:
        try:
            add_tokenizer(local, tokenizer_source)
            uri = publish_policy(store, run_id, version, local)
            prune_policies(store, run_id, keep)
            if buffer is not None:
                buffer.announce_policy(version, uri)
            result[0] = ("ok", uri)
        except Exception as e:  # reported to every rank below
            result[0] = ("error", f"publishing policy v{version} failed on rank 0: {e!r}")
        finally:
            shutil.rmtree(local, ignore_errors=True)
    if dist.is_initialized():
        dist.broadcast_object_list(result, src=0)
    status, value = result[0]
    if status != "ok":
        raise TrainingError(value)
    return value, time.perf_counter() - t0
