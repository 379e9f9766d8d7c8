"""Publish a policy version from the sharded trainer: every rank writes and uploads what it owns.

The order makes a version visible only when it is complete (docs/ARCHITECTURE.md, "Checkpoint layout"), and no rank gathers
the whole model or assumes a disk shared with another trainer pod:

1. every rank derives the same plan from the model's global shapes alone (`plan_version`): each
   Hugging Face tensor (per-expert names, the layout stock transformers and SGLang load) gets an
   owner rank, and each rank's tensors are packed into safetensors files of at most
   ``max_shard_bytes``; files are numbered globally (``model-0000k-of-0000N.safetensors``);
2. parameter by parameter, in the same order on every rank, the shards are gathered in the
   publish dtype: a non-expert tensor with ``full_tensor()`` (an all-gather over the data-parallel
   mesh), an expert tensor only over the expert-data-parallel ranks (each EP rank's [E_local,
   ...] block; never the full [E, ...]); the owner keeps its pieces;
3. a rank writes each of its files into its own work directory as soon as the file's tensors are
   all there, uploads it to ``<run>/policy/v{N}/`` and deletes the local copy;
4. once every rank reports its files uploaded, rank 0 writes the index, config.json,
   generation_config.json and the tokenizer, then the manifest, then ``latest``
   (app/storage/policy.py), prunes old versions and announces ``(N, uri)`` on the buffer.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard

from app.model.checkpoint import DEFAULT_MAX_SHARD_BYTES, INDEX_NAME, _FUSED_EXPERT, write_metadata
from app.model.tokenizer import save_tokenizer
from app.storage.policy import finish_version, prune_policies, version_prefix
from app.trainer import TrainingError
from app.trainer.parallel import gather

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


@dataclass(frozen=True)
class NextVersion:
    """What one optimizer step does with the policy (`next_version`).

    Attributes:
        version: the last published version once the step is done (one more when it publishes).
        publish: the step makes a new version.
        push: it is pushed to the registered engines over the network first
            (``weight_sync.mode: network``, app/trainer/weight_sync.py).
        store: it is written to the store (`publish_version`).
        announce: it is announced on the buffer, which `publish_version` does once it is stored.
    """

    version: int
    publish: bool = False
    push: bool = False
    store: bool = False
    announce: bool = False


def first_version(latest: int | None) -> int:
    """The version a trainer publishes before its first step: 0 for a new run (``latest`` None),
    else the one after the newest in the store, so that versions keep growing across a resume."""
    return 0 if latest is None else latest + 1


def next_version(cfg, step: int, version: int) -> NextVersion:
    """The policy decision of optimizer step ``step`` (1-based, the step just done) of a run whose
    last published version is ``version``.

    Every ``trainer.publish_every``-th step and the last one publish ``version + 1``. With
    ``weight_sync.mode: network`` every version is pushed and only every
    ``weight_sync.store_every``-th version (and the last step's) is stored and announced; with
    ``store`` mode every version is stored and announced.
    """
    t, ws = cfg.trainer, cfg.weight_sync
    last = step == t.steps
    if not (step % t.publish_every == 0 or last):
        return NextVersion(version)
    new = version + 1
    network = ws.mode == "network"
    store = not network or new % ws.store_every == 0 or last
    return NextVersion(new, publish=True, push=network, store=store, announce=store)


def add_tokenizer(out_dir: Path, source_dir: str | Path | None) -> None:
    """Put tokenizer files into ``out_dir`` so AutoTokenizer (and SGLang) load the version alone.

    Copies them from ``source_dir`` (the checkpoint the run started from) if it has a
    tokenizer.json; otherwise writes the built-in character tokenizer (app.model.tokenizer).
    """
    src = Path(source_dir) if source_dir else None
    if src is not None and (src / "tokenizer.json").is_file():
        for name in TOKENIZER_FILES:
            if (src / name).is_file():
                shutil.copy2(src / name, out_dir / name)
        return

    save_tokenizer(out_dir)


@dataclass
class HFTensor:
    """One tensor of the published checkpoint.

    Attributes: name (Hub name), shape, nbytes (in ``dtype``), owner (rank that writes it),
    source (our state-dict name), expert (global expert id for per-expert tensors, else None),
    rows (row range of our [E, 2I, H] gate_up tensor, for gate/up; None otherwise), dtype (what
    it is published in: `publish_dtype`).
    """

    name: str
    shape: tuple[int, ...]
    nbytes: int
    owner: int
    source: str
    expert: int | None = None
    rows: tuple[int, int] | None = None
    dtype: torch.dtype = torch.bfloat16


def publish_dtype(name: str, tensor: torch.Tensor, dtype: torch.dtype, buffers: set[str]) -> torch.dtype:
    """The dtype state entry ``name`` is published (and pushed) in: parameters in ``dtype`` (a
    cast of the fp32 master weights), buffers in their own dtype. The one floating buffer of the
    policies is DeepSeek-V3's fp32 ``e_score_correction_bias``, the routing bias the engines add
    to the router's scores: rounded to bf16 it would pick other experts (transformers keeps it
    fp32 too: ``DeepseekV3PreTrainedModel._keep_in_fp32_modules_strict``)."""
    return tensor.dtype if name in buffers else dtype


@dataclass
class VersionPlan:
    """Every rank's identical plan: tensors in gather order and the files they go to."""

    tensors: list[HFTensor]
    files: list[list[HFTensor]] = field(default_factory=list)  # global order; names from their index
    owners: list[int] = field(default_factory=list)  # rank writing files[k]

    def file_name(self, k: int) -> str:
        return f"model-{k + 1:05d}-of-{len(self.files):05d}.safetensors"


def _ep_coords(mesh) -> tuple[int, int, int]:
    """(dp_replicate, efsdp, ep) coordinates of this rank in the trainer's world mesh."""
    return tuple(mesh.world.get_coordinate())


def plan_version(model: nn.Module, mesh, dtype: torch.dtype,
                 max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> VersionPlan:
    """The publish plan of ``model`` sharded over ``mesh`` (app/trainer/parallel.TrainerMesh), or
    over no mesh (one rank). Deterministic: a function of global shapes and the layout only.

    Owners: a per-expert tensor of global expert e (EP rank r = e // E_local, local index
    i = e % E_local) belongs to the rank at mesh coordinates (0, i % efsdp, r), one of the ranks
    that hold that EP block after the expert-data-parallel gather; every other tensor goes to the
    least-loaded rank so far (bytes), experts counted first.
    """
    world = dist.get_world_size() if dist.is_initialized() else 1
    layout = mesh.layout if mesh is not None else None
    itemsize = torch.empty((), dtype=dtype).element_size()
    buffers = {n for n, _ in model.named_buffers()}
    state = model.state_dict()
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    load = [0] * world
    tensors: list[HFTensor] = []
    dense: list[HFTensor] = []
    for name, t in state.items():
        shape = tuple(t.shape)
        m = _FUSED_EXPERT.match(name)
        if m is None:
            n = 1
            for d in shape:
                n *= d
            kind = publish_dtype(name, t, dtype, buffers)
            dense.append(HFTensor(name, shape, n * kind.itemsize, -1, name, dtype=kind))
            continue
        prefix, kind = m.groups()
        e_total = shape[0]
        e_local = e_total // (layout.ep if layout else 1)
        for e in range(e_total):
            owner = 0
            if layout is not None:
                r, i = divmod(e, e_local)
                owner = int(mesh.world.mesh[0, i % layout.efsdp, r])
            if kind == "down_proj":
                pieces = [(f"{prefix}.{e}.down_proj.weight", shape[1:], None)]
            else:
                inter = shape[1] // 2
                pieces = [(f"{prefix}.{e}.gate_proj.weight", (inter, shape[2]), (0, inter)),
                          (f"{prefix}.{e}.up_proj.weight", (inter, shape[2]), (inter, 2 * inter))]
            for hf_name, hf_shape, rows in pieces:
                nbytes = hf_shape[0] * hf_shape[1] * itemsize
                tensors.append(HFTensor(hf_name, tuple(hf_shape), nbytes, owner, name, e, rows, dtype))
                load[owner] += nbytes
    for t in dense:
        t.owner = min(range(world), key=lambda r: (load[r], r))
        load[t.owner] += t.nbytes
    order = {name: i for i, name in enumerate(state)}
    tensors = sorted(tensors + dense, key=lambda t: order[t.source])  # stable: pieces keep their order
    plan = VersionPlan(tensors)
    for rank in range(world):
        size = 0
        for t in (x for x in tensors if x.owner == rank):
            if not plan.owners or plan.owners[-1] != rank or size + t.nbytes > max_shard_bytes:
                plan.files.append([])
                plan.owners.append(rank)
                size = 0
            plan.files[-1].append(t)
            size += t.nbytes
    return plan


def _gathered(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """This rank's gathered view of a state-dict entry in ``dtype``: the full tensor for dense
    ones; for expert DTensors only this EP rank's [E_local, ...] block. Collective for DTensors."""
    if not isinstance(t, DTensor):
        return t.detach().to(dtype)
    t = t.detach().to(dtype)
    names = t.device_mesh.mesh_dim_names or ()
    if "ep" in names:
        return gather(t, [Shard(0) if n == "ep" else Replicate() for n in names])
    return gather(t)


def publish_version(
    model: nn.Module,
    mesh,
    version: int,
    *,
    store,
    run_id: str,
    work_dir: Path,
    keep: int,
    dtype: torch.dtype,
    buffer=None,
    tokenizer_source: str | Path | None = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
) -> tuple[str, float]:
    """Publish policy ``version`` (see the module docstring). Collective: every rank calls it.

    Args:
        model: the policy (sharded by app/trainer/parallel.py; or a plain module on one rank).
        mesh: the `TrainerMesh`, or None for an unsharded one-rank model.
        version: the new policy version (one more than the last published).
        store: the run's object store (app.storage.open_store).
        run_id: versions land under ``<run_id>/policy/v{N}/``.
        work_dir: this rank's local scratch directory (not shared with other pods).
        keep: versions to keep in the store (app.storage.policy.prune_policies).
        dtype: the published dtype (``model.dtype``; bf16 for bf16 runs, the master weights stay fp32).
        buffer: the ExperienceBuffer to announce on (rank 0); None skips the announcement.
        tokenizer_source: checkpoint dir whose tokenizer files to ship; see `add_tokenizer`.
        max_shard_bytes: upper bound of one file's tensor bytes.

    Returns:
        ``(uri, seconds)``: the version's URI (same on every rank) and the wall time.

    Raises:
        TrainingError: on every rank, if any rank failed to write or upload, or rank 0 failed to
            finish the version (the message carries the first error), so no rank is left waiting.
    """
    t0 = time.perf_counter()
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    prefix = version_prefix(run_id, version)
    plan = plan_version(model, mesh, dtype, max_shard_bytes)
    local = Path(work_dir) / f"rank{rank}" / f"v{version}"
    mine = {k for k, owner in enumerate(plan.owners) if owner == rank}
    pending = {k: {t.name for t in plan.files[k]} for k in mine}
    file_of = {t.name: k for k in mine for t in plan.files[k]}
    ready: dict[int, dict[str, torch.Tensor]] = {k: {} for k in mine}
    sizes: dict[str, int] = {}
    error: str | None = None
    by_source: dict[str, list[HFTensor]] = {}
    for t in plan.tensors:
        by_source.setdefault(t.source, []).append(t)
    state = model.state_dict()
    try:
        shutil.rmtree(local, ignore_errors=True)
        local.mkdir(parents=True)
        for source, pieces in by_source.items():
            value = _gathered(state[source], pieces[0].dtype)  # every rank: same collectives, same order
            e_offset = _ep_offset(state[source], value)
            for t in pieces:
                if t.owner != rank:
                    continue
                if t.expert is None:
                    piece = value
                else:
                    piece = value[t.expert - e_offset]
                    if t.rows is not None:
                        piece = piece[t.rows[0]: t.rows[1]]
                k = file_of[t.name]
                ready[k][t.name] = piece.to("cpu", copy=True).contiguous()
                pending[k].discard(t.name)
                if not pending[k]:
                    sizes[plan.file_name(k)] = _write_and_upload(store, prefix, local, plan.file_name(k), ready.pop(k))
            del value
    except Exception as e:  # noqa: BLE001 - reported to every rank below
        error = f"rank {rank}: {e!r}"
    finally:
        shutil.rmtree(local, ignore_errors=True)

    gathered: list = [(error, sizes)]
    if world > 1:
        gathered = [None] * world
        dist.all_gather_object(gathered, (error, sizes))
    errors = [g[0] for g in gathered if g[0]]
    result: list = [None]
    if not errors and rank == 0:
        try:
            files = {k: v for g in gathered for k, v in g[1].items()}
            files.update(_upload_metadata(model, plan, store, prefix, Path(work_dir), tokenizer_source, dtype))
            uri = finish_version(store, run_id, version, files)
            prune_policies(store, run_id, keep)
            if buffer is not None:
                buffer.announce_policy(version, uri)
            result[0] = ("ok", uri)
        except Exception as e:  # noqa: BLE001 - reported to every rank below
            result[0] = ("error", f"publishing policy v{version} failed on rank 0: {e!r}")
    elif errors:
        result[0] = ("error", f"publishing policy v{version} failed: {errors[0]}")
    if world > 1:
        dist.broadcast_object_list(result, src=0)
    status, value = result[0]
    if status != "ok":
        raise TrainingError(value)
    return value, time.perf_counter() - t0


def _ep_offset(t: torch.Tensor, gathered: torch.Tensor) -> int:
    """Global id of the first expert in ``gathered`` (an EP rank's block of a [E, ...] tensor)."""
    if isinstance(t, DTensor) and "ep" in (t.device_mesh.mesh_dim_names or ()):
        ep = t.device_mesh["ep"]
        return ep.get_local_rank() * gathered.shape[0]
    return 0


def _write_and_upload(store, prefix: str, local: Path, name: str, tensors: dict[str, torch.Tensor]) -> int:
    """Write one safetensors file locally, upload it to ``prefix + name``, delete it; its size."""
    path = local / name
    save_file(tensors, path, metadata={"format": "pt"})
    size = path.stat().st_size
    store.put_file(path, prefix + name)
    path.unlink()
    return size


def _upload_metadata(model, plan: VersionPlan, store, prefix: str, work_dir: Path, tokenizer_source,
                     dtype: torch.dtype) -> dict[str, int]:
    """Rank 0: index, config.json, generation_config.json and tokenizer files, uploaded; sizes."""
    work_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=work_dir, prefix=".meta-") as tmp:
        tmp = Path(tmp)
        weight_map = {t.name: plan.file_name(k) for k, f in enumerate(plan.files) for t in f}
        total = sum(t.nbytes for t in plan.tensors)
        (tmp / INDEX_NAME).write_text(json.dumps(
            {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, indent=2) + "\n")
        write_metadata(model, tmp, dtype)
        add_tokenizer(tmp, tokenizer_source)
        sizes = {}
        for f in sorted(tmp.iterdir()):
            store.put_file(f, prefix + f.name)
            sizes[f.name] = f.stat().st_size
        return sizes
