"""Training state in the object store: saved every ``trainer.save_every`` steps, resumed from the
newest complete one (issue 4; sharded through torch.distributed.checkpoint since issue 13).

Layout (docs/ARCHITECTURE.md, "Checkpoint layout": training state lives apart from the policy weights):

    <run>/train/s{step:08d}/dcp/.metadata        DCP's global metadata (rank 0), as torch.save
    <run>/train/s{step:08d}/dcp/__{r}_0.distcp   rank r's tensors: its FSDP shards of the fp32
                                                master weights and AdamW state of every module
                                                (policy, critic), each tensor stored once
    <run>/train/s{step:08d}/rng{r}.pt           rank r's torch RNG state(s)
    <run>/train/s{step:08d}/lineage.json        rank 0: "task_id/attempt" of every group trained on
    <run>/train/s{step:08d}/moerl-state.json    manifest, written by rank 0 LAST, after every
                                                rank's files are stored: step, policy version,
                                                world size, files and sizes, commit point, counters
    <run>/train/latest                          "step" of the newest manifest (a hint for people;
                                                resume scans the manifests themselves)

Each rank writes its DCP file through ``FileSystemWriter`` into a directory of its own (no shared
disk between trainer pods is assumed), streaming tensor by tensor, then uploads it; loading reads
each tensor's byte range from the store (`StoreReader`, a ranged GET per item), so a rank fetches
only the bytes of the shards it owns. A step directory without its manifest is incomplete (a save
that was killed) and is never loaded, so a kill at any moment of a save leaves the previous state
usable. Each object is written atomically by the store (file: temporary name + rename; S3: PutObject).

Nothing read back is unpickled: whoever can write the run's prefix could otherwise run code in
every trainer pod at the next resume. The RNG files and DCP's non-tensor items (the optimizer's
param_groups) load with ``torch.load(weights_only=True)``; DCP's own ``.metadata`` is a plain
pickle, so rank 0 stores it re-saved with ``torch.save`` and resume loads it the same way, with
only DCP's metadata dataclasses allowed (`METADATA_CLASSES`). A state of the older format
(``format: dcp``, a pickled ``.metadata``) is refused, not loaded.

Buffer commit point: the trainer commits (deletes) its taken groups from Redis only after the
state that trained on them is saved. The manifest records the newest samples-stream entry id
taken before the save; a resumed trainer deletes every entry up to it (`drop_committed`),
which finishes a commit that a kill interrupted, and re-reads the rest.
"""

from __future__ import annotations

import io
import json
import re
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import StorageMeta
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from app.model.parallel import collective_device
from app.storage.store import ObjectStore, run_area

MANIFEST = "moerl-state.json"
FORMAT = "dcp-weights-only"  # manifest "format": DCP shards, every file loadable with weights_only=True
# What DCP's Metadata is made of (torch/distributed/checkpoint/metadata.py, filesystem.py): the
# only classes the weights-only unpickler may build when it reads a state's .metadata.
METADATA_CLASSES = [dcp_metadata.Metadata, dcp_metadata.TensorStorageMetadata, dcp_metadata.BytesStorageMetadata,
                    dcp_metadata.ChunkStorageMetadata, dcp_metadata.TensorProperties, dcp_metadata.MetadataIndex,
                    dcp_metadata.StorageMeta, dcp_metadata._MEM_FORMAT_ENCODING, _StorageInfo]
_STEP_DIR = re.compile(r"^s(\d{8})/")


@dataclass
class TrainState:
    """What the trainer carries from step to step; saved in the manifest (``train_state``) and
    restored on resume."""

    step: int = 0  # rollout batches stepped (skipped ones included); trainer.steps counts these
    optimizer_steps: int = 0  # optimizer steps applied: ppo_epochs x mini-batches a batch
    version: int = 0  # last published policy version
    bad_steps: int = 0  # skipped (non-finite) steps in total
    bad_in_row: int = 0
    samples: int = 0  # samples trained on
    overstale: int = 0  # groups dropped here for exceeding max_staleness (the buffer should)
    malformed: int = 0  # groups skipped because a sample did not collate
    error_groups: int = 0  # all-"error" groups skipped (tasks the engine refused)
    duplicates: int = 0  # groups skipped because this lineage had trained on them already
    resumed_from: int | None = None  # step of the state this process resumed from
    started: float = field(default_factory=time.time)


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


class StoreReader(FileSystemReader):
    """A DCP ``StorageReader`` over an `ObjectStore` prefix: metadata with one GET, every tensor
    item with one ranged GET of exactly its bytes (DCP's own deserialisation is reused)."""

    def __init__(self, store: ObjectStore, prefix: str):
        super().__init__(path=".")
        self.store, self.prefix = store, prefix
        self.path = prefix
        self.fs = _StoreFS(store)

    def read_metadata(self, *args: Any, **kwargs: Any):
        """DCP's Metadata, as `metadata_bytes` stored it (weights-only: `METADATA_CLASSES` only).

        Raises:
            pickle.UnpicklingError: the object holds anything else (a pickled payload).
        """
        with torch.serialization.safe_globals(METADATA_CLASSES):
            metadata = torch.load(io.BytesIO(self.store.get_bytes(self.prefix + ".metadata")),
                                  map_location="cpu", weights_only=True)
        if not isinstance(metadata, dcp_metadata.Metadata):
            raise ValueError(f"{self.store.uri(self.prefix + '.metadata')}: not DCP metadata "
                             f"({type(metadata).__name__})")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def _slice_file(self, file, sinfo):
        return io.BytesIO(self.store.get_range(file.key, sinfo.offset, sinfo.length))


def metadata_bytes(local_dir: Path) -> bytes:
    """DCP's ``.metadata`` that this process just wrote into ``local_dir``, re-saved with
    ``torch.save`` so that `StoreReader` loads it weights-only (DCP writes a plain pickle). The
    checkpoint id (a local path) is dropped: a reader sets its own."""
    metadata = FileSystemReader(local_dir).read_metadata()
    if metadata.storage_meta is not None:
        metadata.storage_meta.checkpoint_id = None
    buf = io.BytesIO()
    torch.save(metadata, buf)
    return buf.getvalue()


class WeightsOnlyLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, except that non-tensor items (BYTE_IO: the optimizer's
    param_groups) are read with ``torch.load(weights_only=True)``; DefaultLoadPlanner.load_bytes
    unpickles them with ``weights_only=False``."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        plain = torch.load(value, map_location="cpu", weights_only=True)  # raises on a pickled payload
        # The parent places the value where its state dict wants it; hand it the re-saved plain data.
        buf = io.BytesIO()
        torch.save(plain, buf)
        buf.seek(0)
        super().load_bytes(read_item, buf)


class _StoreFS:
    """The two FileSystem calls FileSystemReader.read_data makes, over store keys."""

    class _Handle:
        def __init__(self, key: str):
            self.key = key

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    def __init__(self, store: ObjectStore):
        self.store = store

    def concat_path(self, path: str, suffix: str) -> str:
        return path + str(suffix)

    def create_stream(self, key: str, mode: str):
        return self._Handle(key)


def module_states(modules: dict[str, tuple[torch.nn.Module, torch.optim.Optimizer]]) -> dict:
    """``{name: {"model": ..., "optim": ...}}`` of each (module, optimizer): FSDP2-aware state dicts
    (DTensor shards keyed by parameter name; ``torch.distributed.checkpoint.state_dict``)."""
    out = {}
    for name, (module, optimizer) in modules.items():
        msd, osd = get_state_dict(module, optimizer)
        out[name] = {"model": msd, "optim": osd}
    return out


def _all_ok(ok: bool) -> bool:
    """True on every rank iff ``ok`` on every rank (all-reduce MIN; also a barrier)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return ok
    flag = torch.tensor([1 if ok else 0], dtype=torch.int32, device=collective_device())
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def _rng_state() -> bytes:
    buf = io.BytesIO()
    torch.save({"cpu": torch.get_rng_state(),
                "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}, buf)
    return buf.getvalue()


def save_state(
    store: ObjectStore,
    run_id: str,
    step: int,
    modules: dict[str, tuple[torch.nn.Module, torch.optim.Optimizer]],
    meta: dict,
    *,
    lineage: list[str] | None = None,
    work_dir: str | Path,
    keep: int = 2,
) -> float:
    """Save the state after ``step``. Collective: every rank calls it with the same modules.

    Order: every rank writes its DCP file into ``work_dir/rank{r}/`` and uploads it with its RNG
    state; once all have succeeded, rank 0 uploads DCP's metadata and ``lineage``, writes the
    manifest (``meta`` + step, world size, file sizes, time), then ``latest``, then prunes states
    older than the newest ``keep``.

    Args:
        store: the run's object store.
        run_id: the run.
        step: optimizer steps done (the state is "after step").
        modules: ``{"policy": (model, optimizer), "critic": ...}``.
        meta: JSON-able facts of the whole state (rank 0's is used): train state, policy
            version, buffer commit point.
        lineage: rank 0: the "task_id/attempt" keys trained on (None elsewhere).
        work_dir: local scratch directory (a rank's own subdirectory is used and removed).
        keep: complete states to keep.

    Returns:
        seconds spent.

    Raises:
        RuntimeError: some rank failed to write or upload (raised on every rank; no manifest is
            written, so the previous state stays the newest complete one).
    """
    t0 = time.perf_counter()
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    prefix = step_prefix(run_id, step)
    local = Path(work_dir) / f"rank{rank}" / f"s{step:08d}"
    error: Exception | None = None
    sizes: dict[str, int] = {}
    try:
        shutil.rmtree(local, ignore_errors=True)
        local.mkdir(parents=True)
        dcp.save(module_states(modules), storage_writer=FileSystemWriter(local))
        for f in sorted(local.iterdir()):
            # Each rank uploads the files it wrote; DCP's metadata is rank 0's (written by the coordinator).
            if f.name.startswith(f"__{rank}_"):
                store.put_file(f, prefix + "dcp/" + f.name)
                sizes["dcp/" + f.name] = f.stat().st_size
            elif rank == 0 and f.name == ".metadata":
                data = metadata_bytes(local)
                store.put_bytes(prefix + "dcp/.metadata", data)
                sizes["dcp/.metadata"] = len(data)
        rng = _rng_state()
        store.put_bytes(prefix + f"rng{rank}.pt", rng)
        sizes[f"rng{rank}.pt"] = len(rng)
    except Exception as e:  # noqa: BLE001 - reported to every rank below
        error = e
    finally:
        shutil.rmtree(local, ignore_errors=True)
    if dist.is_initialized() and world > 1:
        gathered: list = [None] * world
        dist.all_gather_object(gathered, (error is None, sizes, repr(error) if error else None))
        ok = all(g[0] for g in gathered)
        first_error = next((g[2] for g in gathered if g[2]), None)
        files = {k: v for g in gathered for k, v in g[1].items()}
    else:
        ok, first_error, files = error is None, repr(error) if error else None, sizes
    if not ok:
        raise RuntimeError(f"saving training state for step {step} failed on some rank: {first_error}")
    if rank == 0:
        try:
            data = json.dumps(sorted(lineage or [])).encode()
            store.put_bytes(prefix + "lineage.json", data)
            files["lineage.json"] = len(data)
            manifest = {**meta, "run_id": run_id, "step": step, "world_size": world, "time": time.time(),
                        "format": FORMAT, "modules": sorted(modules), "files": files}
            store.put_bytes(prefix + MANIFEST, json.dumps(manifest, indent=1).encode())
            store.put_bytes(_root(run_id) + "latest", str(step).encode())
            prune_states(store, run_id, keep)
        except Exception as e:  # noqa: BLE001
            error = e
    if not _all_ok(error is None):
        raise RuntimeError(f"writing the manifest of step {step} failed on rank 0: {error!r}")
    return time.perf_counter() - t0


def load_state(
    store: ObjectStore, run_id: str, manifest: dict,
    modules: dict[str, tuple[torch.nn.Module, torch.optim.Optimizer]],
) -> list[str]:
    """Load the state of ``manifest`` into ``modules`` (each rank its own shards) and this rank's
    RNG state; returns the lineage ("task_id/attempt" keys). Collective.

    Another layout than the one that saved (other world size, EP, FSDP or HSDP split) loads too:
    DCP stores every tensor once with its global shape and reads, per rank, the byte ranges of
    the shards the current layout gives it (torch.distributed.checkpoint resharding). RNG states
    are per rank: rank r restores the one rank r saved, and a rank the saving run did not have
    keeps its seeded generator.

    Raises:
        ValueError: the state was written by an older trainer (not DCP), or for other modules
            (e.g. a GRPO state resumed as PPO): named.
        FileNotFoundError: a file of the state is missing.
    """
    rank = dist.get_rank() if dist.is_initialized() else 0
    step = manifest["step"]
    if manifest.get("format") != FORMAT:
        raise ValueError(f"training state of step {step} was written by an older trainer (format "
                         f"{manifest.get('format')!r}, not {FORMAT!r}: it cannot be read without unpickling); "
                         "start a new run_id")
    if manifest.get("modules") != sorted(modules):
        raise ValueError(f"training state of step {step} holds {manifest.get('modules')}, this trainer has "
                         f"{sorted(modules)} (was it saved with another trainer.algorithm?)")
    prefix = step_prefix(run_id, step)
    state = module_states(modules)
    dcp.load(state, storage_reader=StoreReader(store, prefix + "dcp/"), planner=WeightsOnlyLoadPlanner())
    for name, (module, optimizer) in modules.items():
        set_state_dict(module, optimizer, model_state_dict=state[name]["model"],
                       optim_state_dict=state[name]["optim"])
    if rank < manifest["world_size"]:
        rng = torch.load(io.BytesIO(store.get_bytes(prefix + f"rng{rank}.pt")), map_location="cpu", weights_only=True)
        torch.set_rng_state(rng["cpu"])
        if rng.get("cuda") is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(rng["cuda"])
    return json.loads(store.get_bytes(prefix + "lineage.json"))


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
    entries after it were not and stay to be read again. Their payloads go with them
    (`ExperienceBuffer.drop_through`). Returns how many entries were deleted.
    """
    if not commit_point:
        return 0
    return buffer.drop_through(commit_point)
