"""The weight-update process group and its bucket format, as SGLang 0.5.23 opens and reads them.

The trainer's source rank (group rank 0) and every rollout engine's ranks (``rank_offset +
tp_rank``) form one torch.distributed group outside the trainer's own world; tensors go from
rank 0 to all others by broadcast. SGLang builds its side in
``srt/model_executor/model_runner_components/weight_updater.py: init_weights_update_group`` with
``srt/utils/common.py: init_custom_process_group``: a ``tcp://master_address:master_port``
rendezvous (a ``TCPStore``, served by rank 0), wrapped in ``PrefixStore(group_name)``, and then
torch's own process-group constructor, which adds ``PrefixStore(group_name + "/")`` and
``PrefixStore(device + "/")`` (``cpu/`` for gloo, ``cuda/`` for NCCL) before it makes the
backend. `open_group` builds the same store layout and the backend object directly, so:

- the backend is made at the group's first broadcast, on every side: SGLang's NCCL group
  (``device_id=None``) creates its communicator only at the first broadcast inside
  ``/update_weights_from_distributed``, which a worker sends after the trainer has moved to the
  send phase; a source that connected at join (``eager_connect_single_device``, or gloo's
  constructor, which connects its full mesh) would wait for engines that are not there yet
  until the join timed out. The built-in engine joins the same way, so the gloo tests see
  what NCCL does (tests/test_weight_sync_protocol.py);
- the two sides find each other's keys (tests/test_weight_sync_protocol.py runs SGLang's own
  ``init_custom_process_group``, read from the wheel, against it);
- the group is not registered in torch's process-group table and never splits from the
  trainer's bound NCCL communicator (torch's constructor would try ``ncclCommSplit`` from it,
  a collective over the trainer's world that only rank 0 joins);
- every operation has this group's own timeout: a peer that dies or stops fails the
  collective on every live rank within ``timeout_s`` instead of hanging it;
- a failure costs this group only, under NCCL too: the group's communicator is made with its own
  error handling (`GROUP_NCCL_ENV`: the watchdog aborts the communicator and the process goes
  on, ``TORCH_NCCL_ASYNC_ERROR_HANDLING=2``; the communicator comes up non-blocking, so that a
  peer that never starts its side fails the first broadcast within ``timeout_s`` instead of
  blocking it), whatever the process's own groups use: the trainer keeps tearing itself down
  on a hang of its training groups (app/torchx_component.py ``NCCL_ENV``), and an engine rank
  keeps serving and reloads from the store (``ENGINE_NCCL_ENV``). torch reads both variables
  when it makes each process group (``ProcessGroupNCCL``'s constructor), so they are set for
  that moment only.

Bucket format: SGLang's ``load_format="flattened_bucket"``
(``srt/weight_sync/tensor_bucket.py: FlattenedTensorBucket``): one uint8 tensor holding each
tensor's bytes back to back in the order of the request's ``names``, shapes and dtypes given
alongside; one broadcast per bucket. Only torch is imported here (the GPU images lack the
rest of moerl's dependencies).
"""

from __future__ import annotations

import os
import threading
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

# "cuda:gloo": gloo over CUDA tensors, device-strict like NCCL (a CPU tensor is refused); the
# layout where trainer ranks and engines share one GPU (tests and debugging; NCCL refuses two
# ranks on one device). torch reads the same string as a device:backend map.
BACKENDS = ("gloo", "nccl", "cuda:gloo")
BUCKET_FORMAT = "flattened_bucket"  # SGLang's load_format name for the layout below
# SGLang's default group name (io_struct.InitWeightsUpdateGroupReqInput.group_name).
DEFAULT_GROUP_NAME = "weight_update_group"
# Dtypes a bucket may carry, by the name SGLang's receiver resolves with getattr(torch, name).
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
          "float8_e4m3fn": torch.float8_e4m3fn, "uint8": torch.uint8, "int32": torch.int32,
          "int64": torch.int64}


# The weight-update group's own NCCL settings (module doc): CleanUpOnly error handling and a
# non-blocking communicator start (torch's TORCH_NCCL_* environment variables).
GROUP_NCCL_ENV = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2", "TORCH_NCCL_USE_COMM_NONBLOCKING": "1"}
_ENV_LOCK = threading.Lock()


@contextmanager
def group_nccl_env():
    """`GROUP_NCCL_ENV` in the process environment while a group's backend is made; the
    process's own values (the pod's) afterwards."""
    with _ENV_LOCK:
        saved = {k: os.environ.get(k) for k in GROUP_NCCL_ENV}
        os.environ.update(GROUP_NCCL_ENV)
        try:
            yield
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v


class GroupError(RuntimeError):
    """Opening the group, or a broadcast over it, failed or timed out (the message says which)."""


def dtype_name(dtype: torch.dtype) -> str:
    """The name of ``dtype`` as a weight-update request carries it (``torch.bfloat16`` -> "bfloat16")."""
    return str(dtype).removeprefix("torch.")


def parse_dtype(name: str, field: str = "dtypes") -> torch.dtype:
    """The torch dtype of a request's dtype name.

    Raises:
        ValueError: not one of `DTYPES` (the message names ``field``).
    """
    if name not in DTYPES:
        raise ValueError(f"{field}: unknown dtype {name!r}; one of {sorted(DTYPES)}")
    return DTYPES[name]


@dataclass
class UpdateGroup:
    """One rank's membership of a weight-update group.

    Attributes:
        name: the group name (also the store prefix).
        rank, world_size: this rank and the group's size.
        backend: one of `BACKENDS`.
        timeout_s: bound of every operation, seconds.
    """

    name: str
    rank: int
    world_size: int
    backend: str
    timeout_s: float
    _pg: object
    _store: object
    _keys: object = None  # the prefixed store the backend is made from, at the first broadcast
    closed: bool = False

    @property
    def connected(self) -> bool:
        """True once the backend exists (after the first broadcast began)."""
        return self._pg is not None

    def _connect(self) -> None:
        """Make the backend (gloo: connect the full mesh; NCCL: the communicator comes up in the
        first collective), as torch's process-group constructor does for SGLang."""
        timeout = timedelta(seconds=self.timeout_s)
        if self.backend == "nccl":
            opts = dist.ProcessGroupNCCL.Options()
            opts.is_high_priority_stream = False
            opts._timeout = timeout
            with group_nccl_env():
                self._pg = dist.ProcessGroupNCCL(self._keys, self.rank, self.world_size, opts)
        else:
            self._pg = dist.ProcessGroupGloo(self._keys, self.rank, self.world_size, timeout)

    def broadcast(self, tensor: torch.Tensor) -> None:
        """Broadcast ``tensor`` (contiguous; on CPU for gloo, on this rank's GPU for NCCL and
        cuda:gloo) from group rank 0 to every rank, in place on the receivers. The first call
        makes the backend (see the module doc): it waits, within ``timeout_s``, for every rank's
        first broadcast.

        Raises:
            GroupError: a peer died or never came, the operation timed out, the tensor is on a
                device the backend refuses, or the group is closed.
        """
        if self.closed:
            raise GroupError(f"group {self.name!r} is closed")
        if self.backend != "gloo" and tensor.device.type != "cuda":
            # What NCCL says of a host tensor; the cuda:gloo layout says the same.
            raise GroupError(f"broadcast over {self.name!r}: a {tensor.device.type} tensor on a "
                             f"{self.backend} group (No backend type associated with device type "
                             f"{tensor.device.type})")
        try:
            if self._pg is None:
                self._connect()
        except Exception as e:  # noqa: BLE001 - a peer that never arrives: gloo times out here
            raise GroupError(f"connecting {self.name!r} (rank {self.rank} of {self.world_size}) "
                             f"failed: {str(e).splitlines()[0][:300]}") from None
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        opts.rootTensor = 0
        opts.timeout = timedelta(seconds=self.timeout_s)
        try:
            work = self._pg.broadcast([tensor], opts)
            work.wait(timedelta(seconds=self.timeout_s))
        except Exception as e:  # noqa: BLE001 - gloo/NCCL raise RuntimeError or DistError subclasses
            raise GroupError(f"broadcast over {self.name!r} (rank {self.rank} of {self.world_size}) "
                             f"failed: {str(e).splitlines()[0][:300]}") from None

    def close(self) -> None:
        """Leave the group (abort its connections; idempotent). Live peers' next operation fails."""
        self.closed = True
        pg, self._pg = self._pg, None
        if pg is not None:
            try:
                pg.abort()
            except Exception:  # noqa: BLE001 - a broken group may refuse; dropping it is enough
                pass
        self._store = self._keys = None


def open_group(backend: str, master_address: str, master_port: int, world_size: int, rank: int,
               group_name: str = DEFAULT_GROUP_NAME, timeout_s: float = 60.0,
               device: torch.device | None = None, store: dist.TCPStore | None = None) -> UpdateGroup:
    """Join (rank 0: create and serve) the weight-update group's rendezvous; blocks until all
    ``world_size`` ranks have reached the store, at most about ``timeout_s`` seconds. The backend
    itself is made at the first broadcast (the module doc says why).

    Args:
        backend: "gloo" (CPU tensors), "nccl" or "cuda:gloo" (GPU tensors).
        master_address, master_port: where rank 0 serves the rendezvous store.
        world_size: 1 (the source) + every engine rank.
        rank: 0 for the trainer's source rank; an engine's ``rank_offset + tp_rank``.
        group_name: the group's name (SGLang's ``group_name`` field).
        timeout_s: bound of the join and of every later operation.
        device: unused (kept for callers; the backend binds no device at join).
        store: rank 0 only: a rendezvous store it already serves, shared by several groups (each
            group's keys are under its own name); the join then waits for nobody (the members'
            arrival shows at the first broadcast).

    Raises:
        ValueError: an unknown backend or a rank outside the group.
        GroupError: not every rank joined in time, or the store could not be reached or served.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside a group of {world_size}")
    timeout = timedelta(seconds=timeout_s)
    try:
        # What rendezvous("tcp://addr:port", rank, world_size) makes: rank 0 serves the store
        # and waits for the others to connect.
        shared = store is not None and rank == 0
        if not shared:
            store = dist.TCPStore(master_address, int(master_port), world_size, is_master=(rank == 0),
                                  timeout=timeout, wait_for_workers=True, multi_tenant=False)
        prefixed = dist.PrefixStore(group_name, store)  # init_custom_process_group's own prefix
        device_kind = "cpu" if backend == "gloo" else "cuda"
        keys = dist.PrefixStore(f"{device_kind}/", dist.PrefixStore(f"{group_name}/", prefixed))
    except (RuntimeError, ValueError) as e:  # DistStoreError / DistNetworkError are RuntimeErrors
        raise GroupError(f"joining weight-update group {group_name!r} at {master_address}:{master_port} "
                         f"as rank {rank} of {world_size} failed: {str(e).splitlines()[0][:300]}") from None
    return UpdateGroup(group_name, rank, world_size, backend, timeout_s, None, None if shared else store, keys)


def bucket_bytes(shapes: list[list[int]], dtypes: list[torch.dtype]) -> int:
    """Bytes of a flattened bucket of tensors of these shapes and dtypes."""
    total = 0
    for shape, dtype in zip(shapes, dtypes):
        n = 1
        for d in shape:
            n *= int(d)
        total += n * dtype.itemsize
    return total


def pack_bucket(tensors: list[torch.Tensor], out: torch.Tensor | None = None) -> torch.Tensor:
    """The flattened bucket (uint8, one dimension) of ``tensors``, in order, in ``out`` if given
    (its first bytes; a reused staging buffer) else a new tensor on the first tensor's device.

    Raises:
        ValueError: ``out`` is too small, or a tensor's byte offset is not a multiple of its
            item size (SGLang's receiver refuses unaligned tensors).
    """
    total = sum(t.numel() * t.element_size() for t in tensors)
    if out is None:
        out = torch.empty(total, dtype=torch.uint8, device=tensors[0].device)
    elif out.numel() < total:
        raise ValueError(f"staging buffer of {out.numel()} bytes is smaller than the bucket ({total} bytes)")
    offset = 0
    for t in tensors:
        n = t.numel() * t.element_size()
        if offset % t.element_size():
            raise ValueError(f"tensor of dtype {t.dtype} at unaligned byte offset {offset}")
        out[offset: offset + n].copy_(t.contiguous().view(-1).view(torch.uint8))
        offset += n
    return out[:total]


def unpack_bucket(flat: torch.Tensor, shapes: list[list[int]], dtypes: list[torch.dtype]) -> list[torch.Tensor]:
    """Views of the tensors inside a received flattened bucket (no copy).

    Raises:
        ValueError: the bucket's size does not match the shapes and dtypes, or a tensor would sit
            at an unaligned offset.
    """
    want = bucket_bytes(shapes, dtypes)
    if flat.numel() != want:
        raise ValueError(f"bucket has {flat.numel()} bytes; the shapes and dtypes need {want}")
    out, offset = [], 0
    for shape, dtype in zip(shapes, dtypes):
        if offset % dtype.itemsize:
            raise ValueError(f"tensor of dtype {dtype} at unaligned byte offset {offset}")
        n = bucket_bytes([shape], [dtype])
        out.append(flat[offset: offset + n].view(dtype).view(*shape))
        offset += n
    return out


def plan_buckets(sizes: list[int], limit: int) -> list[list[int]]:
    """Indices of consecutive tensors grouped into buckets of at most ``limit`` bytes; a tensor
    larger than ``limit`` travels alone (its bucket is as large as it is).

    Raises:
        ValueError: ``limit`` < 1.
    """
    if limit < 1:
        raise ValueError(f"bucket limit must be >= 1 byte, got {limit}")
    buckets: list[list[int]] = []
    size = 0
    for i, n in enumerate(sizes):
        if not buckets or size + n > limit:
            buckets.append([])
            size = 0
        buckets[-1].append(i)
        size += n
    return buckets
