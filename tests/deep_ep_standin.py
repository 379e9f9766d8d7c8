"""STAND-IN for the `deep_ep` module of the `sgl-deep-ep==0.1.2.post1` wheel. Not DeepEP.

The real module needs CUDA 13, torch 2.14.1 and NCCL 2.30.7 and cannot import here. This one
moves rows with torch.distributed collectives (gloo on CPU), so the deepep dispatcher's forward
and backward run end to end in `make test`, and it enforces the argument checks the real wheel
makes for the calls moerl makes. Each check cites where it is in the wheel (paths inside it) or in
upstream DeepEP dd758ca's `csrc/` (the wheel ships no C++ sources; its compiled `_C` carries the
same assertion texts). tests/test_deepep.py compares these signatures with the wheel's own.

Deliberate differences from the real thing: tensors live on the CPU (the wheel asserts
`x.is_cuda()`, csrc/elastic/buffer.hpp:754); received tokens come in (source rank, token) order
(the real order is arbitrary unless `deterministic=True`); buffer sizes are a simple formula that,
like the real hint, grows with tokens, hidden size and top-k. Only normal mode (no expand, no
FP8, no events) is implemented.

`EVENTS` records buffer lifecycles: ("create" | "destroy" | "gc-destroy" | "leak", rank, id).
"gc-destroy" is what the real destructor does for a buffer made without `explicitly_destroy`:
run the all-rank barrier of `destroy()` from the garbage collector (buffer.hpp:142-144); "leak"
is a buffer made with `explicitly_destroy=True` and never destroyed (buffer.hpp:146-149).
"""

from __future__ import annotations

import math
import os
from datetime import timedelta

import torch
import torch.distributed as dist

# deep_ep/__init__.py:103 (`from deep_ep._C import Config, topk_idx_t`): int64 unless the wheel was
# built with EP_NUM_TOPK_IDX_BITS (deep_ep/include/deep_ep/common/compiled.cuh:55). Tests may set it.
topk_idx_t = torch.int64

EVENTS: list[tuple[str, int, int]] = []
_ALIGN = 2 << 20  # buffer sizes are 2 MB-aligned (elastic.py:253)


def _check(cond: bool, text: str, where: str) -> None:
    """An EP_HOST_ASSERT of the wheel's C++ (it raises an EPException naming the condition)."""
    if not cond:
        raise RuntimeError(f"DeepEP stand-in: assertion failed: {text} ({where})")


def _align(n: int, a: int) -> int:
    return (n + a - 1) // a * a


def _value_or(value, default):
    return default if value is None else value


def _bytes_needed(num_max_tokens_per_rank: int, hidden: int, num_topk: int, num_ranks: int) -> int:
    _check(num_max_tokens_per_rank > 0 and hidden > 0, "num_max_tokens_per_rank > 0 and hidden > 0",
           "csrc/elastic/buffer.hpp:657")
    _check(math.ceil(hidden / 32) * 4 <= hidden, "math::ceil_div(hidden, 32) * sizeof(float) <= hidden",
           "csrc/elastic/buffer.hpp:660")
    num_topk = num_topk or 32  # buffer.hpp:663
    per_token = hidden * 2 + num_topk * 8 + 16
    return _align(num_max_tokens_per_rank * num_ranks * per_token, _ALIGN)


def _exchange(group, outgoing: list) -> list:
    """outgoing[r] goes to rank r; returns what every rank sent to this one, by source rank."""
    everything = [None] * group.size()
    dist.all_gather_object(everything, outgoing, group=group)
    return [sent[group.rank()] for sent in everything]


def _check_topk(topk_idx: torch.Tensor, num_tokens: int, num_experts: int, num_ranks: int) -> None:
    _check(topk_idx.dim() == 2 and topk_idx.shape[0] == num_tokens, "num_tokens == num_tokens_",
           "csrc/elastic/buffer.hpp:776")
    _check(topk_idx.dtype == topk_idx_t, "topk_idx.scalar_type() == c10::CppTypeToScalarType<topk_idx_t>::value",
           "csrc/elastic/buffer.hpp:777")
    _check(topk_idx.is_contiguous(), "topk_idx.is_cuda() and topk_idx.is_contiguous()", "csrc/elastic/buffer.hpp:778")
    _check(num_experts % num_ranks == 0, "num_experts % nccl_context->num_ranks == 0", "csrc/elastic/buffer.hpp:805")
    # A token's selections must be distinct experts (a device-side trap in the real one).
    for row in topk_idx.tolist():
        valid = [e for e in row if e >= 0]
        _check(len(set(valid)) == len(valid) and all(e < num_experts for e in valid),
               "ptx::deduplicate(dst_expert_idx, lane_idx) or dst_expert_idx == -1",
               "deep_ep/include/deep_ep/impls/dispatch_copy_epilogue.cuh:107")


def _route(topk_idx: torch.Tensor, num_experts: int, num_ranks: int) -> list[torch.Tensor]:
    """Per destination rank: the indices of this rank's tokens with an expert there."""
    local = num_experts // num_ranks
    owner = torch.where(topk_idx >= 0, topk_idx // local, torch.full_like(topk_idx, -1))
    return [torch.nonzero((owner == r).any(dim=1)).flatten() for r in range(num_ranks)]


def _move(group, x: torch.Tensor, routes: list[torch.Tensor], extra: dict[str, torch.Tensor]):
    """Send x[routes[r]] (and each extra tensor's rows) to rank r; concatenate what arrives."""
    return _exchange(group, [{"x": x[idx], "src": idx, **{k: v[idx] for k, v in extra.items()}} for idx in routes])


class EventOverlap:
    """deep_ep.utils.event.EventOverlap: nothing to wait for here."""

    def __init__(self, event=None):
        self.event = event

    def current_stream_wait(self) -> None:
        pass


class EPHandle:
    """deep_ep.buffers.elastic.EPHandle (elastic.py:25): the fields moerl reads, plus the routes."""

    def __init__(self, num_experts, expert_alignment, num_max_tokens_per_rank, num_sms, topk_idx,
                 num_recv_tokens, num_recv_tokens_per_expert_list, routes, recv_src):
        self.do_expand = False
        self.num_experts = num_experts
        self.expert_alignment = expert_alignment
        self.num_max_tokens_per_rank = num_max_tokens_per_rank
        self.num_sms = num_sms
        self.topk_idx = topk_idx
        self.num_recv_tokens = num_recv_tokens
        self.num_recv_tokens_per_expert_list = num_recv_tokens_per_expert_list
        self.routes = routes  # per destination rank: which of this rank's tokens went there
        self.recv_src = recv_src  # per source rank: (first received row, token indices at the source)


class _Runtime:
    """Stands for the C++ runtime object; `None` after destroy (elastic.py:377)."""

    def dispatch(self):
        return None

    combine = dispatch


class ElasticBuffer:
    """deep_ep.ElasticBuffer (V2; deep_ep/buffers/elastic.py:195), normal mode over gloo.

    `gin_available = False` makes construction fail as the real one does where NCCL has no GIN
    backend (e.g. between nodes over EFA before NCCL 2.31.2), unless EP_DISABLE_GIN=1.
    """

    gin_available = True

    def __init__(self, group, num_bytes=None, num_cpu_bytes=0, num_max_tokens_per_rank=0, hidden=0,
                 num_topk=0, use_fp8_dispatch=False, deterministic=False, allow_hybrid_mode=True,
                 allow_multiple_reduction=True, prefer_overlap_with_compute=True, sl_idx=3,
                 num_allocated_qps=0, num_cpu_timeout_secs=300, num_gpu_timeout_secs=100,
                 explicitly_destroy=False):
        self.group, self.rank_idx, self.num_ranks = group, group.rank(), group.size()
        _check(self.num_ranks == 1 or os.environ.get("EP_DISABLE_GIN", "0") != "0" or self.gin_available,
               "NCCL GIN is unavailable. This is usually due to a network configuration issue",
               "csrc/kernels/backend/nccl.cu:86-89")
        self.deterministic = deterministic
        if num_bytes is None:  # elastic.py:304-309
            num_bytes = _bytes_needed(num_max_tokens_per_rank, hidden, num_topk, self.num_ranks)
        self.num_bytes = num_bytes
        self.num_max_tokens_per_rank = num_max_tokens_per_rank
        self.explicitly_destroy = explicitly_destroy
        self.runtime = _Runtime()
        dist.barrier(group=group)  # elastic.py:365-367: every rank builds it together
        EVENTS.append(("create", self.rank_idx, id(self)))

    def destroy(self) -> None:
        """elastic.py:369-379; the C++ destroy is a barrier of all ranks (buffer.hpp:152-156)."""
        assert self.explicitly_destroy
        if self.runtime is not None:
            dist.monitored_barrier(group=self.group, timeout=timedelta(seconds=30))
            self.runtime = None
            EVENTS.append(("destroy", self.rank_idx, id(self)))

    def __del__(self):
        if getattr(self, "runtime", None) is not None:
            EVENTS.append(("leak" if self.explicitly_destroy else "gc-destroy", self.rank_idx, id(self)))

    @staticmethod
    def get_buffer_size_hint(group, num_max_tokens_per_rank, hidden, num_topk=0, use_fp8_dispatch=False,
                             allow_hybrid_mode=True, allow_multiple_reduction=True) -> int:
        return _bytes_needed(num_max_tokens_per_rank, hidden, num_topk, group.size())

    def get_theoretical_num_sms(self, num_experts, num_topk, num_scaleout_topk=0, rdma_gbs=0, nvlink_gbs=0,
                                sm_read_gbs=200, sm_write_gbs=50) -> int:
        # elastic.py:770-778: the expected top-k needs num_experts; None fails here as it does there.
        assert num_experts % self.num_ranks == 0
        return 8

    def get_theoretical_num_qps(self, num_sms: int) -> int:
        return min(num_sms, 9)

    def dispatch(self, x, topk_idx=None, topk_weights=None, cumulative_local_expert_recv_stats=None,
                 num_experts=None, num_max_tokens_per_rank=None, expert_alignment=None, num_sms=0, num_qps=0,
                 previous_event=None, previous_event_before_epilogue=None, async_with_compute_stream=False,
                 allocate_on_comm_stream=False, handle=None, do_handle_copy=True, do_cpu_sync=None,
                 do_expand=False, do_zero_padding=False, use_tma_aligned_col_major_sf=False):
        # elastic.py:927-928: the SM count is estimated before anything else when not given.
        num_topk = (handle.topk_idx if topk_idx is None else topk_idx).shape[1]
        num_sms = self.get_theoretical_num_sms(num_experts, num_topk) if num_sms == 0 else num_sms
        if handle is not None:  # elastic.py:937-948
            assert topk_idx is None
            assert do_cpu_sync is None or not do_cpu_sync, "Cannot do CPU sync with cached handle"
            topk_idx = handle.topk_idx
            num_max_tokens_per_rank = _value_or(num_max_tokens_per_rank, handle.num_max_tokens_per_rank)
            num_experts = _value_or(num_experts, handle.num_experts)
            expert_alignment = _value_or(expert_alignment, handle.expert_alignment)
            assert (num_experts, expert_alignment, num_max_tokens_per_rank) == \
                   (handle.num_experts, handle.expert_alignment, handle.num_max_tokens_per_rank)
        num_max_tokens_per_rank = _value_or(num_max_tokens_per_rank, self.num_max_tokens_per_rank)
        expert_alignment = _value_or(expert_alignment, 1)
        _check(self.runtime is not None, "self.runtime.dispatch (a destroyed buffer has none)", "elastic.py:976")
        assert not do_expand and not isinstance(x, tuple), "stand-in: normal bf16 mode only"
        _check(num_sms > 0, "num_sms > 0", "csrc/elastic/buffer.hpp:728")
        num_tokens, hidden = x.shape
        _check(x.is_contiguous(), "x.is_cuda() and x.is_contiguous()", "csrc/elastic/buffer.hpp:754")
        _check(hidden * x.element_size() % 16 == 0, "(x.size(1) * x.element_size()) % sizeof(int4) == 0",
               "csrc/elastic/buffer.hpp:755")
        _check(num_tokens <= num_max_tokens_per_rank, "num_tokens <= num_max_tokens_per_rank",
               "csrc/elastic/buffer.hpp:756")
        _check_topk(topk_idx, num_tokens, num_experts, self.num_ranks)
        if topk_weights is not None:
            _check(tuple(topk_weights.shape) == (num_tokens, num_topk) and topk_weights.is_contiguous(),
                   "num_tokens == num_tokens__; topk_weights->is_cuda() and topk_weights->is_contiguous()",
                   "csrc/elastic/buffer.hpp:784-785")
            _check(topk_weights.dtype == torch.float32, "topk_weights->data_ptr<float>()",
                   "csrc/elastic/buffer.hpp:786")
        _check(_bytes_needed(num_max_tokens_per_rank, hidden, num_topk, self.num_ranks) <= self.num_bytes,
               "get_dispatch_buffer_size(...) <= num_buffer_bytes", "csrc/elastic/buffer.hpp:963")

        if handle is not None:  # cached: the same rows go to the same ranks, arriving in the same order
            got = _move(self.group, x, handle.routes, {} if topk_weights is None else {"w": topk_weights})
            recv_x = torch.cat([g["x"] for g in got])
            recv_w = None if topk_weights is None else torch.cat([g["w"] for g in got])
            return recv_x, None, recv_w, handle, EventOverlap()

        routes = _route(topk_idx, num_experts, self.num_ranks)
        extra = {"idx": topk_idx} | ({} if topk_weights is None else {"w": topk_weights})
        got = _move(self.group, x, routes, extra)
        recv_x = torch.cat([g["x"] for g in got])
        local = num_experts // self.num_ranks
        start = self.rank_idx * local
        glob = torch.cat([g["idx"] for g in got])
        mine = (glob >= start) & (glob < start + local)
        recv_idx = torch.where(mine, glob - start, torch.full_like(glob, -1))  # dispatch_copy_epilogue.cuh:106
        recv_w = None if topk_weights is None else torch.cat([g["w"] for g in got])  # as sent, every slot
        counts = [int((recv_idx == e).sum()) for e in range(local)]
        recv_src, row = [], 0
        for g in got:
            recv_src.append((row, g["src"]))
            row += g["src"].numel()
        handle = EPHandle(num_experts, expert_alignment, num_max_tokens_per_rank, num_sms,
                          topk_idx.clone() if do_handle_copy else topk_idx, recv_x.shape[0], counts, routes, recv_src)
        return recv_x, recv_idx, recv_w, handle, EventOverlap()

    def combine(self, x, handle, topk_weights=None, bias=None, num_sms=0, num_qps=0, previous_event=None,
                previous_event_before_epilogue=None, async_with_compute_stream=False,
                allocate_on_comm_stream=False):
        num_sms = handle.num_sms if num_sms == 0 else num_sms  # elastic.py:1086
        _check(self.runtime is not None, "self.runtime.combine (a destroyed buffer has none)", "elastic.py:1092")
        assert bias is None, "stand-in: no bias"
        _check(num_sms > 0, "num_sms > 0", "csrc/elastic/buffer.hpp:1198")
        num_tokens, hidden = x.shape
        _check(x.is_contiguous(), "x.is_cuda() and x.is_contiguous()", "csrc/elastic/buffer.hpp:1202")
        _check(x.dtype == torch.bfloat16, "x.scalar_type() == torch::kBFloat16", "csrc/elastic/buffer.hpp:1203")
        _check(hidden * x.element_size() % 16 == 0, "(x.size(1) * x.element_size()) % sizeof(int4) == 0",
               "csrc/elastic/buffer.hpp:1204")
        # The real kernel is compiled for this hidden on first use and rejects it at compile time.
        _check(hidden % 256 == 0, "kHidden % (32 * sizeof(int4) / sizeof(nv_bfloat16)) == 0 (\"Invalid hidden\")",
               "deep_ep/include/deep_ep/impls/combine.cuh:109")
        _check(num_tokens == handle.num_recv_tokens, "num_reduced_tokens == num_tokens", "csrc/elastic/buffer.hpp:1219")
        num_topk = handle.topk_idx.shape[1]
        if topk_weights is not None:
            _check(tuple(topk_weights.shape) == (num_tokens, num_topk) and topk_weights.is_contiguous(),
                   "num_tokens == num_tokens__ and num_topk == num_topk__", "csrc/elastic/buffer.hpp:1230-1233")
            _check(topk_weights.dtype == torch.float32, "topk_weights->scalar_type() == torch::kFloat",
                   "csrc/elastic/buffer.hpp:1234")
        # Each received row goes back to its source token; a token's rows from every rank are summed.
        back = []
        for row, src in handle.recv_src:
            part = {"rows": x[row:row + src.numel()], "src": src}
            if topk_weights is not None:
                part["w"] = topk_weights[row:row + src.numel()]
            back.append(part)
        got = _exchange(self.group, back)
        n = handle.topk_idx.shape[0]
        out = torch.zeros(n, hidden, dtype=torch.float32)
        combined_w = None if topk_weights is None else torch.zeros(n, num_topk, dtype=torch.float32)
        local = handle.num_experts // self.num_ranks
        for r, g in enumerate(got):
            out.index_add_(0, g["src"], g["rows"].float())
            if combined_w is not None:
                # Slot k comes from the rank that owns expert topk_idx[t, k] (combine_reduce_epilogue.cuh:128-138).
                owned = (handle.topk_idx[g["src"]] // local == r) & (handle.topk_idx[g["src"]] >= 0)
                combined_w[g["src"]] += torch.where(owned, g["w"], torch.zeros_like(g["w"]))
        return out.to(torch.bfloat16), combined_w, EventOverlap()


class Config:
    """deep_ep._C.Config (V1 tuning config) with the size hints moerl calls."""

    def __init__(self, num_sms=20, num_max_nvl_chunked_send_tokens=6, num_max_nvl_chunked_recv_tokens=256,
                 num_max_rdma_chunked_send_tokens=6, num_max_rdma_chunked_recv_tokens=128):
        self.num_sms = num_sms
        self.recv_tokens = num_max_nvl_chunked_recv_tokens

    def get_nvl_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        return _align(hidden_bytes * num_ranks * self.recv_tokens, _ALIGN)

    def get_rdma_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        return 0  # intranode


_V1_RANKS = (2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 144, 160)  # legacy.py:245-257


class Buffer:
    """deep_ep.Buffer (V1 legacy, deep_ep/buffers/legacy.py), intranode normal mode over gloo."""

    num_sms = 20

    def __init__(self, group, num_nvl_bytes=0, num_rdma_bytes=0, low_latency_mode=False, num_qps_per_rank=24,
                 allow_nvlink_for_low_latency_mode=True, allow_mnnvl=False, use_fabric=None,
                 explicitly_destroy=False, enable_shrink=False, comm=None):
        self.group, self.rank, self.group_size = group, group.rank(), group.size()
        self.num_nvl_bytes, self.num_rdma_bytes = num_nvl_bytes, num_rdma_bytes
        self.explicitly_destroy = explicitly_destroy
        self.runtime = _Runtime()
        dist.barrier(group=group)
        EVENTS.append(("create", self.rank, id(self)))

    def destroy(self):
        assert self.explicitly_destroy, "`explicitly_destroy` flag must be set"  # legacy.py:144
        dist.monitored_barrier(group=self.group, timeout=timedelta(seconds=30))
        self.runtime = None
        EVENTS.append(("destroy", self.rank, id(self)))

    def __del__(self):
        if getattr(self, "runtime", None) is not None:
            EVENTS.append(("leak" if self.explicitly_destroy else "gc-destroy", self.rank, id(self)))

    @staticmethod
    def get_dispatch_config(num_ranks: int) -> Config:
        assert num_ranks in _V1_RANKS, f"Unsupported number of EP ranks: {num_ranks}"  # legacy.py:259
        return Config()

    @staticmethod
    def get_combine_config(num_ranks: int) -> Config:
        assert num_ranks in _V1_RANKS, f"Unsupported number of EP ranks: {num_ranks}"  # legacy.py:289
        return Config()

    def get_dispatch_layout(self, topk_idx, num_experts, previous_event=None, async_finish=False,
                            allocate_on_comm_stream=False):
        _check(topk_idx.dim() == 2 and topk_idx.is_contiguous(), "topk_idx.dim() == 2; topk_idx.is_contiguous()",
               "csrc/legacy/buffer.hpp:343-344")
        _check(num_experts > 0, "num_experts > 0", "csrc/legacy/buffer.hpp:345")
        _check(topk_idx.dtype == topk_idx_t, "topk_idx.data_ptr<topk_idx_t>()", "csrc/legacy/buffer.hpp:370")
        routes = _route(topk_idx, num_experts, self.group_size)
        in_rank = torch.zeros(topk_idx.shape[0], self.group_size, dtype=torch.bool)
        for r, idx in enumerate(routes):
            in_rank[idx, r] = True
        per_rank = in_rank.sum(0).to(torch.int32)
        valid = topk_idx[topk_idx >= 0]
        per_expert = torch.bincount(valid, minlength=num_experts).to(torch.int32)
        return per_rank, None, per_expert, in_rank, EventOverlap()

    def dispatch(self, x, handle=None, num_tokens_per_rank=None, num_tokens_per_rdma_rank=None,
                 is_token_in_rank=None, num_tokens_per_expert=None, topk_idx=None, topk_weights=None,
                 expert_alignment=1, num_worst_tokens=0, config=None, previous_event=None, async_finish=False,
                 allocate_on_comm_stream=False):
        _check(self.runtime is not None, "self.runtime.intranode_dispatch (a destroyed buffer has none)",
               "legacy.py:390")
        _check(x.dim() == 2 and x.is_contiguous(), "x.dim() == 2 and x.is_contiguous()", "csrc/legacy/buffer.hpp:457")
        _check(x.shape[1] * x.element_size() % 16 == 0, "(x.size(1) * x.element_size()) % sizeof(int4) == 0",
               "csrc/legacy/buffer.hpp:458")
        if handle is not None:  # legacy.py:386-392
            assert topk_idx is None and topk_weights is None
            got = _move(self.group, x, handle.routes, {})
            return torch.cat([g["x"] for g in got]), None, None, None, None, EventOverlap()
        assert num_tokens_per_rank is not None and is_token_in_rank is not None and num_tokens_per_expert is not None
        _check((topk_idx is None) == (topk_weights is None), "topk_idx.has_value() == topk_weights.has_value()",
               "csrc/legacy/buffer.hpp:481")
        num_experts = num_tokens_per_expert.numel()
        _check_topk(topk_idx, x.shape[0], num_experts, self.group_size)
        _check(topk_weights.dtype == torch.float32 and topk_weights.shape == topk_idx.shape,
               "topk_weights->scalar_type() == torch::kFloat32", "csrc/legacy/buffer.hpp:486-489")
        routes = [torch.nonzero(is_token_in_rank[:, r]).flatten() for r in range(self.group_size)]
        got = _move(self.group, x, routes, {"idx": topk_idx, "w": topk_weights})
        local = num_experts // self.group_size
        start = self.rank * local
        glob = torch.cat([g["idx"] for g in got])
        mine = (glob >= start) & (glob < start + local)
        recv_idx = torch.where(mine, glob - start, torch.full_like(glob, -1))
        recv_src, row = [], 0
        for g in got:
            recv_src.append((row, g["src"]))
            row += g["src"].numel()
        handle = EPHandle(num_experts, expert_alignment, 0, self.num_sms, topk_idx.clone(), glob.shape[0],
                          [int((recv_idx == e).sum()) for e in range(local)], routes, recv_src)
        counts = handle.num_recv_tokens_per_expert_list
        recv_x, recv_w = torch.cat([g["x"] for g in got]), torch.cat([g["w"] for g in got])
        return recv_x, recv_idx, recv_w, counts, handle, EventOverlap()

    def combine(self, x, handle, topk_weights=None, bias=None, config=None, previous_event=None,
                async_finish=False, allocate_on_comm_stream=False):
        _check(self.runtime is not None, "self.runtime.intranode_combine (a destroyed buffer has none)",
               "legacy.py:451")
        _check(x.dim() == 2 and x.is_contiguous(), "x.dim() == 2 and x.is_contiguous()", "csrc/legacy/buffer.hpp:732")
        _check(x.shape[1] * x.element_size() % 16 == 0, "(hidden * x.element_size()) % sizeof(int4) == 0",
               "csrc/legacy/buffer.hpp:750")
        if topk_weights is not None:
            _check(topk_weights.dtype == torch.float32 and topk_weights.shape[0] == x.shape[0],
                   "topk_weights->scalar_type() == torch::kFloat32", "csrc/legacy/buffer.hpp:772-774")
        back = []
        for row, src in handle.recv_src:
            part = {"rows": x[row:row + src.numel()], "src": src}
            if topk_weights is not None:
                part["w"] = topk_weights[row:row + src.numel()]
            back.append(part)
        got = _exchange(self.group, back)
        n = handle.topk_idx.shape[0]
        out = torch.zeros(n, x.shape[1], dtype=torch.float32)
        combined_w = None if topk_weights is None else torch.zeros(n, handle.topk_idx.shape[1])
        for g in got:  # V1 sums the rows and the weights that come back from every rank
            out.index_add_(0, g["src"], g["rows"].float())
            if combined_w is not None:
                combined_w.index_add_(0, g["src"], g["w"])
        return out.to(x.dtype), combined_w, EventOverlap()
