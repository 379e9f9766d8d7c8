"""Training state in the object store: saved every ``trainer.save_every`` steps, resumed from the
newest complete one (issue 4).

Layout (DESIGN.md §3: training state lives apart from the policy weights):

    <run>/train/s{step:08d}/rank{r}.pt         rank r: its model shard (EP: its local experts),
                                                optimizer state, torch RNG state(s)
    <run>/train/s{step:08d}/moerl-state.json   manifest, written by rank 0 LAST, after every rank's
                                                file is stored: step, policy version, world size,
                                                files and sizes, buffer commit point, counters
    <run>/train/latest                          "step" of the newest manifest (a hint for people;
                                                resume scans the manifests themselves)

A step directory without its manifest is incomplete (a save that was killed) and is never
loaded, so a kill at any moment of a save leaves the previous state usable. Each object is
written atomically by the store (file: temporary name + rename; S3: PutObject).

Buffer commit point: the trainer commits (deletes) its taken groups from Redis only after the
state that trained on them is saved. The manifest records the newest samples-stream entry id
taken before the save; a resumed trainer deletes every entry up to it (`drop_committed`),
which finishes a commit that a kill interrupted, and re-reads the rest.
"""

from __future__ import annotations

import io
import json
import re
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from app.storage.store import ObjectStore, run_area

MANIFEST = "moerl-state.json"
_STEP_DIR = re.compile(r"^s(\d{8})/")


def _root(run_id: str) -> str:
    return run_area(run_id, "train")


def step_prefix(run_id: str, step: int) -> str:
    """Key prefix of the state after ``step``: '<run>/train/s{step:08d}/'."""
    if not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be an int >= 0, got {step!r}")
    return f"{_root(run_id)}s{step:08d}/"


def state_steps(store: ObjectStore, run_id: str, *, complete_only: bool = True) -> list[int]:
    """Sorted steps that have a state in the store (only those with a manifest if ``complete_only``)."""
    root = _root(run_id)
    found: dict[int, bool] = {}
    for key in store.list(root + "s"):
        m = _STEP_DIR.match(key[len(root):])
        if m:
            s = int(m.group(1))
            found[s] = found.get(s, False) or key.endswith("/" + MANIFEST)
    return sorted(s for s, complete in found.items() if complete or not complete_only)


def read_manifest(store: ObjectStore, run_id: str, step: int) -> dict:
    """The manifest of the state after ``step``.

    Raises:
        FileNotFoundError: no complete state for ``step`` (names the key).
    """
    key = step_prefix(run_id, step) + MANIFEST
    try:
        return json.loads(store.get_bytes(key))
    except FileNotFoundError:
        raise FileNotFoundError(f"{store.uri(key)}: no complete training state for step {step}") from None


def latest_state(store: ObjectStore, run_id: str) -> dict | None:
    """The manifest of the newest complete state (every rank file listed is present), or None."""
    for step in reversed(state_steps(store, run_id)):
        manifest = read_manifest(store, run_id, step)
        prefix = step_prefix(run_id, step)
        if all(store.exists(prefix + name) for name in manifest["files"]):
            return manifest
    return None


def rank_payload(model: torch.nn.Module, optimizer: torch.optim.Optimizer, extra: dict | None = None) -> dict:
    """What one rank saves: its parameters (EP: only its local experts), optimizer, RNG states."""
    payload = {
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "rng_cpu": torch.get_rng_state(),
        "rng_cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
        "extra": extra or {},
    }
    return payload


def _all_ok(ok: bool) -> bool:
    """True on every rank iff ``ok`` on every rank (all-reduce MIN; also a barrier)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return ok
    backend = dist.get_backend()
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else "cpu"
    flag = torch.tensor([1 if ok else 0], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def save_state(
    store: ObjectStore,
    run_id: str,
    step: int,
    payload: dict,
    meta: dict,
    *,
    work_dir: str | Path,
    keep: int = 2,
) -> float:
    """Save this rank's ``payload`` as part of the state after ``step``. Collective: every rank calls it.

    Order: every rank writes its ``rank{r}.pt`` (local file, then the store); once all have
    succeeded, rank 0 writes the manifest (``meta`` + step, world size, file sizes, time), then
    ``latest``, then prunes states older than the newest ``keep``.

    Args:
        store: the run's object store.
        run_id: the run.
        step: optimizer steps done (the state is "after step").
        payload: `rank_payload(...)` of this rank (torch.save-able).
        meta: JSON-able facts of the whole state (rank 0's is used): policy version, buffer
            commit point, counters.
        work_dir: local scratch directory for the file before upload.
        keep: complete states to keep.

    Returns:
        seconds spent.
    Raises:
        RuntimeError: some rank failed to write its file (raised on every rank; no manifest
            is written, so the previous state stays the newest complete one).
    """
    t0 = time.perf_counter()
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    prefix = step_prefix(run_id, step)
    name = f"rank{rank}.pt"
    error: Exception | None = None
    size = 0
    try:
        buf = io.BytesIO()
        torch.save(payload, buf)
        data = buf.getvalue()
        size = len(data)
        local = Path(work_dir) / f"s{step:08d}-{name}"
        local.parent.mkdir(parents=True, exist_ok=True)
        local.write_bytes(data)
        try:
            store.put_file(local, prefix + name)
        finally:
            local.unlink(missing_ok=True)
    except Exception as e:  # noqa: BLE001 - reported to every rank below
        error = e
    sizes = [size]
    if dist.is_initialized() and world > 1:
        gathered: list = [None] * world
        dist.all_gather_object(gathered, (error is None, size))
        ok = all(g[0] for g in gathered)
        sizes = [g[1] for g in gathered]
    else:
        ok = error is None
    if not ok:
        raise RuntimeError(f"saving training state for step {step} failed on some rank: {error!r}")
    if rank == 0:
        try:
            manifest = {**meta, "run_id": run_id, "step": step, "world_size": world, "time": time.time(),
                        "files": {f"rank{r}.pt": sizes[r] for r in range(world)}}
            store.put_bytes(prefix + MANIFEST, json.dumps(manifest, indent=1).encode())
            store.put_bytes(_root(run_id) + "latest", str(step).encode())
            prune_states(store, run_id, keep)
        except Exception as e:  # noqa: BLE001
            error = e
    if not _all_ok(error is None):
        raise RuntimeError(f"writing the manifest of step {step} failed on rank 0: {error!r}")
    return time.perf_counter() - t0


def load_rank_payload(store: ObjectStore, run_id: str, manifest: dict) -> dict:
    """This rank's payload of the state described by ``manifest``.

    Raises:
        ValueError: the state was saved by a different number of ranks (EP layout differs).
        FileNotFoundError: this rank's file is missing.
    """
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    if manifest["world_size"] != world:
        raise ValueError(
            f"training state of step {manifest['step']} was saved by {manifest['world_size']} ranks; "
            f"this run has {world} (keep ep.size and the trainer's --nproc-per-node)")
    key = step_prefix(run_id, manifest["step"]) + f"rank{rank}.pt"
    data = store.get_bytes(key)
    return torch.load(io.BytesIO(data), map_location="cpu", weights_only=False)


def restore(model: torch.nn.Module, optimizer: torch.optim.Optimizer, payload: dict) -> dict:
    """Load ``payload`` into ``model`` and ``optimizer`` and set the RNG states; returns its extra."""
    model.load_state_dict(payload["model"])
    optimizer.load_state_dict(payload["optimizer"])
    torch.set_rng_state(payload["rng_cpu"])
    if payload.get("rng_cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(payload["rng_cuda"])
    return payload.get("extra", {})


def prune_states(store: ObjectStore, run_id: str, keep: int) -> list[int]:
    """Delete states older than the newest ``keep`` complete ones (incomplete older ones too).

    Each state's manifest goes first, so a half-deleted state reads as incomplete.
    Returns the deleted steps.
    """
    if keep < 1:
        raise ValueError(f"keep must be >= 1, got {keep}")
    complete = state_steps(store, run_id)
    if not complete:
        return []
    kept = set(complete[-keep:])
    oldest_kept = min(kept)
    doomed = [s for s in state_steps(store, run_id, complete_only=False) if s < oldest_kept and s not in kept]
    for s in doomed:
        prefix = step_prefix(run_id, s)
        store.delete_prefix(prefix + MANIFEST)
        store.delete_prefix(prefix)
    return doomed


def _entry_key(entry_id: str) -> tuple[int, int]:
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


def newer_entry(a: str | None, b: str | None) -> str | None:
    """The later of two Redis stream entry ids ('ms-seq'); None counts as nothing."""
    if a is None:
        return b
    if b is None:
        return a
    return a if _entry_key(a) >= _entry_key(b) else b


def drop_committed(buffer: Any, commit_point: str | None) -> int:
    """Delete the samples-stream entries up to ``commit_point`` (finish an interrupted commit).

    Entries at or before the commit point were taken by the saved state (trained or skipped);
    entries after it were not and stay to be read again. Returns how many were deleted.
    """
    if not commit_point:
        return 0
    key = buffer.keys["samples"]
    deleted = 0
    while True:
        entries = buffer.r.xrange(key, "-", commit_point, count=500)
        if not entries:
            return deleted
        deleted += int(buffer.r.xdel(key, *[e[0] for e in entries]))
