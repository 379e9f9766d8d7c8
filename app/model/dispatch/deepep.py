"""Expert-parallel dispatch with DeepEP's normal-mode (high-throughput) kernels.

API as documented in the deepseek-ai/DeepEP README (V2 `ElasticBuffer`; V1 `Buffer`) and wrapped
in autograd the way Megatron-LM's `megatron/core/transformer/moe/fused_a2a.py` does:
  dispatch forward  = Buffer.dispatch (one row per (token, destination rank), with the token's
                      top-k ids made local to the receiver, -1 elsewhere; V1 first computes the
                      layout with get_dispatch_layout),
  dispatch backward = Buffer.combine of the row gradients (and of the top-k weight gradients),
  combine forward   = Buffer.combine (sums the rows of a token coming back from every rank),
  combine backward  = cached Buffer.dispatch with the handle (V2: and the handle's SM count).
After the DeepEP dispatch, the received tokens are expanded to one row per (token, local expert)
and sorted by local expert with `permute` (permute.py); combine first sums a token's local rows
with `unpermute`, then calls DeepEP combine.

`deep_ep` is imported only when this dispatcher is used. Where the installed package has
`ElasticBuffer` (DeepEP V2; the `sgl-deep-ep` wheels have both) it is used, else `Buffer`.

What the calls made here must satisfy, read from the `sgl-deep-ep==0.1.2.post1` wheel (paths
inside it) and upstream DeepEP dd758ca's `csrc/` (whose assertion texts the wheel's `_C` carries):
  - hidden states: bf16 rows of width H with H % 256 == 0. V2 combine asserts it at compile time
    (deep_ep/include/deep_ep/impls/combine.cuh:109: `kHidden % (32 * sizeof(int4) /
    sizeof(nv_bfloat16))`); V1 internode combine needs the same (csrc/kernels/legacy/internode.cu:1588,
    `hidden_int4 % 32`). Dispatch alone needs H * 2 % 32 (common/layout.cuh:198, ptx.cuh:16).
  - topk_idx of dtype `deep_ep.topk_idx_t` (int64 unless built with EP_NUM_TOPK_IDX_BITS;
    common/compiled.cuh:55, csrc/elastic/buffer.hpp:777).
  - V2 cached dispatch (the backward of combine) with `num_sms=handle.num_sms`: with the default 0,
    `ElasticBuffer.dispatch` estimates it from `num_experts`, which a cached call leaves None
    (deep_ep/buffers/elastic.py:928, then 771: TypeError). Upstream's README and
    tests/elastic/test_ep.py pass the dispatch's SM count there too.
  - one buffer, created and destroyed by every rank of the group at the same point: `destroy()` is a
    barrier of all ranks (csrc/elastic/buffer.hpp:152-166), and without `explicitly_destroy=True`
    the destructor runs it from the garbage collector (buffer.hpp:142-144), at a different moment
    on each rank. Buffers are therefore made with `explicitly_destroy=True` and destroyed here,
    behind a barrier, only when no rank still has an autograd graph that uses them (below).
"""

from __future__ import annotations

import ctypes
import importlib.metadata
import importlib.util
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from packaging.requirements import Requirement
from packaging.version import Version
from torch import Tensor

from app.model.dispatch import Dispatched
from app.model.dispatch.permute import RowMap, permute, row_map, unpermute
from app.model.dispatch import EPContext, collective_device

# V2 combine's compile-time requirement on the hidden size (module docstring).
HIDDEN_MULTIPLE = 256


def hidden_size_error(hidden: int) -> str | None:
    """Why DeepEP cannot move rows of width `hidden` (bf16), or None if it can."""
    if hidden < 1 or hidden % HIDDEN_MULTIPLE:
        return (f"{hidden} is not a multiple of {HIDDEN_MULTIPLE}: DeepEP's combine kernel only "
                f"accepts such widths (deep_ep/include/deep_ep/impls/combine.cuh:109)")
    return None


def check_hidden_size(hidden: int, field: str = "config.hidden_size") -> None:
    """Raise the one error for a width DeepEP rejects, naming `field`.

    Raises:
        ValueError: `hidden` is not a positive multiple of 256.
    """
    reason = hidden_size_error(hidden)
    if reason:
        raise ValueError(f"ep.backend='deepep' cannot move this model's rows: {field}={reason}; "
                         "use ep.backend='alltoall' for it")


def deepep_unavailable_reason(group: dist.ProcessGroup | None = None, hidden_size: int | None = None) -> str | None:
    """Why the DeepEP backend cannot run here, or None if it can.

    Checked in this order (the first failure is the reason): the `deep_ep` module is installed
    (PyPI `sgl-deep-ep` or a source build); CUDA is available; the EP group uses NCCL; the GPU is
    sm90+ (DeepEP README, "Requirements"); `hidden_size`, when given, is a width DeepEP's kernels
    accept (`hidden_size_error`); `import deep_ep` succeeds (the wheel
    checks there that torch's CUDA major is the one it was built for and that the NCCL library
    loaded is the one it links: deep_ep/prerequisites.py:34, deep_ep/__init__.py:54-76); and, for
    an `sgl-deep-ep` wheel, the versions its metadata pins (`deepep_pin_mismatch`). A failed import
    is reported with its exception type and message.
    """
    if importlib.util.find_spec("deep_ep") is None:
        return "the deep_ep module is not installed (pip install sgl-deep-ep in GPU images)"
    if not torch.cuda.is_available():
        return "CUDA is not available"
    if group is not None and dist.get_backend(group) != "nccl":
        return f"the EP process group uses {dist.get_backend(group)!r}, DeepEP needs 'nccl'"
    major, minor = torch.cuda.get_device_capability()
    if major < 9:
        return f"GPU compute capability {major}.{minor} < 9.0 (DeepEP targets sm90+)"
    if hidden_size is not None:
        reason = hidden_size_error(hidden_size)
        if reason:
            return f"config.hidden_size={reason}"
    try:
        import deep_ep  # noqa: F401, PLC0415 - optional GPU-only dependency; importing runs its checks
    except Exception as e:  # noqa: BLE001 - any failure (ImportError, AssertionError, OSError) is the reason
        return f"import deep_ep failed: {type(e).__name__}: {e}"
    try:
        deepep = importlib.metadata.distribution("sgl-deep-ep")
    except importlib.metadata.PackageNotFoundError:
        return None  # a source build: built against whatever NCCL and torch it found
    loaded = loaded_nccl_version()
    if loaded is None:
        return "no libnccl is mapped into this process, so the NCCL version DeepEP would use is unknown"
    return deepep_pin_mismatch(deepep.version, deepep.requires or [], importlib.metadata.version("torch"),
                               importlib.metadata.requires("torch") or [], loaded)


def loaded_nccl_version() -> tuple[int, int, int] | None:
    """(major, minor, patch) of the libnccl this process has mapped, from its own `ncclGetVersion`;
    None when none is mapped.

    `torch.cuda.nccl.version()` is the version torch was compiled against (torch/csrc/cuda/nccl.cpp
    returns NCCL_MAJOR/MINOR/PATCH), not the library loaded; DeepEP checks the loaded one. Paths are
    read from /proc/self/maps as deep_ep/__init__.py:62-67 does.
    """
    try:
        with open("/proc/self/maps") as f:
            paths = sorted({line.split()[-1] for line in f if "libnccl.so" in line and "/" in line})
    except OSError:
        return None
    if not paths:
        return None
    code = ctypes.c_int()
    if ctypes.CDLL(paths[0]).ncclGetVersion(ctypes.byref(code)) != 0:
        return None
    # NCCL_VERSION(X, Y, Z) = X * 10000 + Y * 100 + Z since NCCL 2.9 (nccl.h).
    return code.value // 10000, code.value % 10000 // 100, code.value % 100


def deepep_pin_mismatch(deepep_version: str, deepep_requires: list[str], torch_version: str,
                        torch_requires: list[str], loaded_nccl: tuple[int, ...]) -> str | None:
    """Why an `sgl-deep-ep` wheel cannot work with this torch and NCCL, or None.

    The wheel's `Requires-Dist` pins torch exactly (0.1.2.post1: `torch==2.14.1`; its C++ extension
    is built against that release), and the wheel is built against the NCCL that torch release pins
    (0.1.2.post1's `_C` compares the loaded NCCL with 23007 = 2.30.7). Below NCCL 2.31 DeepEP needs
    the loaded NCCL to be exactly that version (csrc/kernels/backend/nccl.cu:104 in DeepEP dd758ca:
    "Prior to NCCL 2.31, NCCL compile-time and runtime versions must be the same").

    Args:
        deepep_version / deepep_requires: the wheel's version and Requires-Dist lines.
        torch_version / torch_requires: the installed torch's version and Requires-Dist lines.
        loaded_nccl: (major, minor, patch) of the NCCL this process loaded (`loaded_nccl_version`).
    """
    def pins(lines: list[str]) -> dict[str, Requirement]:
        reqs = (Requirement(line) for line in lines)
        return {r.name.lower(): r for r in reqs if r.marker is None or r.marker.evaluate({"extra": ""})}

    torch_pin = pins(deepep_requires).get("torch")
    if torch_pin is not None and not torch_pin.specifier.contains(torch_version, prereleases=True):
        return (f"sgl-deep-ep {deepep_version} is built for {torch_pin} (its Requires-Dist), this process "
                f"has torch {torch_version}")
    for name, req in pins(torch_requires).items():
        exact = [s.version for s in req.specifier if s.operator == "=="]
        if name.startswith("nvidia-nccl-cu") and exact:
            need = Version(exact[0]).release
            if need < (2, 31) and tuple(loaded_nccl[:3]) != need:
                return (f"sgl-deep-ep {deepep_version} needs NCCL {exact[0]} exactly (torch {torch_version} "
                        f"pins it; below 2.31 DeepEP requires the NCCL it was built with), this process "
                        f"loaded NCCL {'.'.join(map(str, loaded_nccl[:3]))}")
    return None


def _deep_ep():
    import deep_ep  # noqa: PLC0415 - optional GPU-only dependency

    return deep_ep


# One communication buffer per process, shared by every MoE layer (as in the DeepEP README and
# Megatron's fused_a2a.get_buffer). It grows (new buffer, old one destroyed) only when a dispatch
# needs more than it was sized for; token counts are rounded up to a power of two, so that happens
# a few times at most. Call `get_buffer` once with the largest micro-batch to allocate it once.


@dataclass
class _Slot:
    """A DeepEP buffer, what it was sized for, and how many live autograd graphs use it."""

    buffer: Any
    group: Any
    hidden: int
    hidden_bytes: int
    top_k: int
    num_tokens: int
    leases: int = 0


class _Lease:
    """Kept by a dispatch or combine autograd context: its buffer must outlive the graph."""

    def __init__(self, slot: _Slot):
        self.slot = slot
        slot.leases += 1

    def __del__(self):
        self.slot.leases -= 1


_current: _Slot | None = None
_retired: list[_Slot] = []  # replaced while a graph still used them; destroyed once none does


def _is_elastic(buffer) -> bool:
    return hasattr(buffer, "num_bytes") and not hasattr(buffer, "num_nvl_bytes")


def _v1_sizes(Buffer, num_ranks: int, hidden_bytes: int) -> tuple[int, int]:
    """V1 NVLink and RDMA buffer bytes: the larger of the dispatch and combine configs' hints."""
    nvl = rdma = 0
    for config in (Buffer.get_dispatch_config(num_ranks), Buffer.get_combine_config(num_ranks)):
        nvl = max(nvl, config.get_nvl_buffer_size_hint(hidden_bytes, num_ranks))
        rdma = max(rdma, config.get_rdma_buffer_size_hint(hidden_bytes, num_ranks))
    return nvl, rdma


def _fits(slot: _Slot, hidden: int, hidden_bytes: int, num_tokens: int, top_k: int) -> bool:
    # The library's size hints grow with each of these, so a buffer made for larger ones fits.
    return (hidden <= slot.hidden and hidden_bytes <= slot.hidden_bytes and num_tokens <= slot.num_tokens
            and top_k <= slot.top_k)


def _allocate(group, hidden: int, hidden_bytes: int, num_tokens: int, top_k: int) -> _Slot:
    deep_ep = _deep_ep()
    if dist.get_backend(group) == "nccl" and getattr(group, "bound_device_id", None) is None:
        # DeepEP reuses torch's NCCL communicator unless told not to (deep_ep/utils/comm.py:62);
        # SGLang 0.5.23 turns that off for groups not bound to a device (token_dispatcher/
        # deepep_v2.py:190, "Communicator reuse requires a device-bound process group").
        os.environ.setdefault("EP_REUSE_NCCL_COMM", "0")
    if hasattr(deep_ep, "ElasticBuffer"):
        buffer = deep_ep.ElasticBuffer(group, num_max_tokens_per_rank=num_tokens, hidden=hidden,
                                       num_topk=top_k, explicitly_destroy=True)
    else:
        nvl, rdma = _v1_sizes(deep_ep.Buffer, group.size(), hidden_bytes)
        buffer = deep_ep.Buffer(group, nvl, rdma, explicitly_destroy=True)
    return _Slot(buffer, group, hidden, hidden_bytes, top_k, num_tokens)


def _destroy(slots: list[_Slot]) -> None:
    """Destroy buffers on every rank of their group at once, after all their work is done."""
    for slot in slots:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        dist.barrier(group=slot.group)
        slot.buffer.destroy()


def _ensure(group, hidden: int, hidden_bytes: int, num_tokens: int, top_k: int,
            current_in_use: bool, retired_in_use: bool) -> _Slot:
    """The shared buffer for these sizes. Every rank of `group` must call this with the same
    arguments (the `*_in_use` flags: whether any rank still has a graph on those buffers)."""
    global _current
    if _retired and not retired_in_use:
        _destroy(_retired)
        _retired.clear()
    if _current is not None and _current.group is not group:
        raise RuntimeError("the DeepEP buffer belongs to another process group: call "
                           "release_buffers() on every rank of that group first")
    if _current is None or not _fits(_current, hidden, hidden_bytes, num_tokens, top_k):
        if _current is not None:
            if current_in_use:
                _retired.append(_current)
            else:
                _destroy([_current])
        # Never smaller than before: shrinking would only bring the next regrowth closer.
        old = _current
        _current = None
        if old is not None:
            hidden, hidden_bytes = max(hidden, old.hidden), max(hidden_bytes, old.hidden_bytes)
            num_tokens, top_k = max(num_tokens, old.num_tokens), max(top_k, old.top_k)
        _current = _allocate(group, hidden, hidden_bytes, num_tokens, top_k)
    return _current


def get_buffer(group, hidden: int, hidden_bytes: int, num_tokens: int, top_k: int):
    """The shared DeepEP buffer, allocated (or grown) for at least these sizes.

    A collective: every rank of `group` calls it with the same arguments, with no autograd graph
    still using the shared buffer. Calling it once with the largest micro-batch's tokens per rank
    allocates the buffer once for the whole run.

    Sizes come from the library's helpers: V2 `ElasticBuffer.get_buffer_size_hint(group,
    num_max_tokens_per_rank, hidden, num_topk)`; V1 `Buffer.get_dispatch_config/
    get_combine_config(num_ranks).get_nvl_buffer_size_hint/get_rdma_buffer_size_hint(hidden_bytes,
    num_ranks)`.
    """
    return _ensure(group, hidden, hidden_bytes, num_tokens, top_k, False, False).buffer


def release_buffers() -> None:
    """Destroy the shared buffer (and any replaced one) behind a barrier of its group.

    A collective over every rank of the buffers' groups, e.g. before the process group is destroyed.

    Raises:
        RuntimeError: an autograd graph on this rank still uses one of them.
    """
    global _current
    slots = _retired + ([_current] if _current is not None else [])
    if any(s.leases for s in slots):
        raise RuntimeError("a DeepEP buffer is still used by a live autograd graph (run its backward "
                           "or drop its outputs first)")
    _destroy(slots)
    _retired.clear()
    _current = None


_orphans: list[Any] = []  # built on some ranks of a failed trial; destroying them would wait forever


def trial_reason(group) -> str | None:
    """Build and destroy a small V2 buffer on every rank of `group`: why that failed, or None.

    A collective over `group` (`init_ep` runs it before `auto` picks deepep). It is where the
    wheel's run-time checks fire that no import can show: the loaded NCCL against the one it was
    built with (csrc/kernels/backend/nccl.cu:104) and NCCL GIN for more than one rank
    (nccl.cu:86-89; missing between nodes over EFA before NCCL 2.31.2). V1-only builds are not
    tried (their buffer brings up NVSHMEM): None.
    """
    deep_ep = _deep_ep()
    if not hasattr(deep_ep, "ElasticBuffer"):
        return None
    slot, error = None, None
    try:
        slot = _allocate(group, HIDDEN_MULTIPLE, HIDDEN_MULTIPLE * 2, 1, 1)
    except Exception as e:  # noqa: BLE001 - the reason auto falls back
        error = f"{type(e).__name__}: {e}"
    failed = torch.tensor([error is not None], dtype=torch.int32, device=collective_device(group))
    dist.all_reduce(failed, op=dist.ReduceOp.MAX, group=group)
    if not failed.item():
        _destroy([slot])
        return None
    if slot is not None:
        _orphans.append(slot.buffer)
    return f"building a DeepEP buffer failed: {error or 'on another rank'}"


def _acquire(group, hidden: int, num_tokens: int, top_k: int, device) -> tuple[_Slot, int]:
    """The buffer for this dispatch and the group's tokens per rank (its max, as a power of two).

    One all-reduce (MAX) of [tokens, graphs on the current buffer, graphs on replaced buffers], so
    every rank takes the same decision about growing and destroying, at the same call.
    """
    live = [_current.leases if _current is not None else 0, sum(s.leases for s in _retired)]
    stats = torch.tensor([num_tokens, *live], dtype=torch.int64, device=device)
    dist.all_reduce(stats, op=dist.ReduceOp.MAX, group=group)
    tokens, current_in_use, retired_in_use = stats.tolist()
    max_tokens = 1 << max(tokens - 1, 0).bit_length()
    slot = _ensure(group, hidden, hidden * 2, max_tokens, top_k, current_in_use > 0, retired_in_use > 0)
    return slot, max_tokens


class _Dispatch(torch.autograd.Function):
    """DeepEP dispatch; backward is DeepEP combine."""

    @staticmethod
    def forward(ctx, x, topk_idx, topk_weights, slot, num_experts, max_tokens):
        buffer = slot.buffer
        if _is_elastic(buffer):
            recv_x, recv_idx, recv_w, handle, _ = buffer.dispatch(
                x, topk_idx=topk_idx, topk_weights=topk_weights, num_experts=num_experts,
                num_max_tokens_per_rank=max_tokens,
            )
            counts = list(handle.num_recv_tokens_per_expert_list)
            n = int(handle.num_recv_tokens)
            recv_x, recv_idx, recv_w = recv_x[:n], recv_idx[:n], recv_w[:n]
        else:
            per_rank, per_rdma_rank, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk_idx, num_experts)
            recv_x, recv_idx, recv_w, counts, handle, _ = buffer.dispatch(
                x, topk_idx=topk_idx, topk_weights=topk_weights,
                num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_rdma_rank,
                is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
            )
        ctx.buffer, ctx.handle, ctx.lease = buffer, handle, _Lease(slot)
        ctx.mark_non_differentiable(recv_idx)
        return recv_x, recv_idx, recv_w, handle, counts

    @staticmethod
    def backward(ctx, grad_x, _grad_idx, grad_w, _grad_handle, _grad_counts):
        grad_w = None if grad_w is None else grad_w.float().contiguous()
        combined_x, combined_w, _ = ctx.buffer.combine(grad_x.contiguous(), ctx.handle, topk_weights=grad_w)
        return combined_x, None, combined_w, None, None, None


class _Combine(torch.autograd.Function):
    """DeepEP combine; backward is a cached DeepEP dispatch with the handle."""

    @staticmethod
    def forward(ctx, y, slot, handle):
        combined, _, _ = slot.buffer.combine(y.contiguous(), handle)
        ctx.buffer, ctx.handle, ctx.lease = slot.buffer, handle, _Lease(slot)
        return combined

    @staticmethod
    def backward(ctx, grad):
        if _is_elastic(ctx.buffer):
            # The handle's SM count: with 0, V2 would estimate it from num_experts, None here.
            grad_y = ctx.buffer.dispatch(grad.contiguous(), handle=ctx.handle, num_sms=ctx.handle.num_sms)[0]
        else:
            grad_y = ctx.buffer.dispatch(grad.contiguous(), handle=ctx.handle)[0]
        return grad_y, None, None


@dataclass
class DeepEPHandle:
    deepep_handle: Any
    rmap: RowMap  # rows of each received token (slot = received token * K + k)
    slot: _Slot


class DeepEPDispatcher:
    """Dispatcher on DeepEP kernels (see module docstring): bf16 inputs of a width that is a multiple
    of 256, on the device of the EP group's backend (CUDA for NCCL)."""

    def __init__(self, ep: EPContext, num_experts: int):
        reason = deepep_unavailable_reason(ep.group)
        if reason:
            raise ValueError(f"ep.backend='deepep' cannot run here: {reason}")
        self.ep = ep
        self.num_experts = num_experts
        self.num_local_experts = num_experts // ep.size
        self.device_type = "cuda" if dist.get_backend(ep.group) == "nccl" else "cpu"

    def dispatch(self, x: Tensor, topk_idx: Tensor, topk_weights: Tensor) -> Dispatched:
        """x [T, H] bf16, topk_idx [T, K] integer (-1 = none), topk_weights [T, K] -> Dispatched.

        A collective over the EP group (one all-reduce of the token count, then DeepEP's dispatch).

        Raises:
            ValueError: x is not bf16, not on the EP group's device type, or H is not a multiple of 256.
        """
        if x.dtype != torch.bfloat16 or x.device.type != self.device_type:
            raise ValueError(f"deepep dispatch needs bf16 hidden states on {self.device_type}, "
                             f"got {x.dtype} on {x.device}")
        check_hidden_size(x.shape[1], "hidden states' width")
        num_tokens, top_k = topk_idx.shape
        # V2 needs the same num_max_tokens_per_rank on every rank: the group's max, a power of two.
        slot, max_tokens = _acquire(self.ep.group, x.shape[1], num_tokens, top_k, x.device)
        weights = torch.where(topk_idx >= 0, topk_weights.float(), torch.zeros_like(topk_weights, dtype=torch.float32))
        recv_x, recv_idx, recv_w, handle, counts = _Dispatch.apply(
            x.contiguous(), topk_idx.to(_deep_ep().topk_idx_t).contiguous(), weights.contiguous(), slot,
            self.num_experts, max_tokens,
        )
        # Expand received tokens to one row per (token, local expert), sorted by local expert.
        n_recv = recv_x.shape[0]
        flat = recv_idx.reshape(-1)
        key = torch.where(flat >= 0, flat, torch.full_like(flat, self.num_local_experts))
        slot_of_row = torch.sort(key, stable=True).indices[: sum(counts)]
        tokens_per_expert = torch.tensor(counts, dtype=torch.int64, device=x.device)
        rmap = row_map(slot_of_row, n_recv, top_k)
        return Dispatched(
            x=permute(recv_x, rmap),
            weights=recv_w.reshape(-1).index_select(0, slot_of_row),
            tokens_per_expert=tokens_per_expert,
            handle=DeepEPHandle(handle, rmap, slot),
        )

    def combine(self, y: Tensor, handle: DeepEPHandle) -> Tensor:
        """y [N, H] weighted expert outputs -> [T, H] bf16."""
        per_token = unpermute(y, handle.rmap)
        return _Combine.apply(per_token, handle.slot, handle.deepep_handle)
