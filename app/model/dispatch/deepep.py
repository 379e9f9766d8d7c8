"""Expert-parallel dispatch with DeepEP's normal-mode (high-throughput) kernels.

API as documented in the deepseek-ai/DeepEP README (V1 `Buffer`; V2 `ElasticBuffer`) and wrapped
in autograd the way Megatron-LM's `megatron/core/transformer/moe/fused_a2a.py` does:
  dispatch forward  = get_dispatch_layout + Buffer.dispatch (one row per (token, destination rank),
                      with the token's top-k ids made local to the receiver, -1 elsewhere),
  dispatch backward = Buffer.combine of the row gradients (and of the top-k weight gradients),
  combine forward   = Buffer.combine (sums the rows of a token coming back from every rank),
  combine backward  = cached Buffer.dispatch with the handle.
After the DeepEP dispatch, the received tokens are expanded to one row per (token, local expert)
and sorted by local expert with `permute` (permute.py); combine first sums a token's local rows
with `unpermute`, then calls DeepEP combine.

`deep_ep` is imported only when this dispatcher is built. It needs bf16 hidden states on CUDA and
an NCCL group. Where the installed package has `ElasticBuffer` (DeepEP V2) it is used, else `Buffer`.
This module is not exercised on CPU; its tests skip without deep_ep and 2+ GPUs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from app.model.dispatch import Dispatched
from app.model.dispatch.permute import RowMap, permute, row_map, unpermute
from app.model.parallel import EPContext

# One communication buffer per process, reused by every MoE layer and grown when too small
# (as in the DeepEP README and Megatron's fused_a2a.get_buffer).
_buffer: Any = None


def _deep_ep():
    import deep_ep  # noqa: PLC0415 - optional GPU-only dependency

    return deep_ep


def get_buffer(group, hidden: int, hidden_bytes: int, num_tokens: int, top_k: int):
    """The shared DeepEP buffer, (re)allocated when absent or too small for this layer.

    Sizes come from the library's helpers: V1 `Buffer.get_dispatch_config/get_combine_config(
    num_ranks).get_nvl_buffer_size_hint/get_rdma_buffer_size_hint(hidden_bytes, num_ranks)`;
    V2 `ElasticBuffer.get_buffer_size_hint(group, num_max_tokens_per_rank, hidden, num_topk)`.
    """
    global _buffer
    deep_ep = _deep_ep()
    if hasattr(deep_ep, "ElasticBuffer"):
        need = deep_ep.ElasticBuffer.get_buffer_size_hint(group, num_tokens, hidden, num_topk=top_k)
        if _buffer is None or _buffer.group != group or _buffer.num_bytes < need:
            _buffer = deep_ep.ElasticBuffer(
                group, num_max_tokens_per_rank=num_tokens, hidden=hidden, num_topk=top_k
            )
        return _buffer
    Buffer = deep_ep.Buffer
    num_nvl_bytes = num_rdma_bytes = 0
    for config in (Buffer.get_dispatch_config(group.size()), Buffer.get_combine_config(group.size())):
        num_nvl_bytes = max(num_nvl_bytes, config.get_nvl_buffer_size_hint(hidden_bytes, group.size()))
        num_rdma_bytes = max(num_rdma_bytes, config.get_rdma_buffer_size_hint(hidden_bytes, group.size()))
    if (
        _buffer is None
        or _buffer.group != group
        or _buffer.num_nvl_bytes < num_nvl_bytes
        or _buffer.num_rdma_bytes < num_rdma_bytes
    ):
        _buffer = Buffer(group, num_nvl_bytes, num_rdma_bytes)
    return _buffer


def _is_elastic(buffer) -> bool:
    return hasattr(buffer, "num_bytes") and not hasattr(buffer, "num_nvl_bytes")


class _Dispatch(torch.autograd.Function):
    """DeepEP dispatch; backward is DeepEP combine."""

    @staticmethod
    def forward(ctx, x, topk_idx, topk_weights, buffer, num_experts, max_tokens):
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
        ctx.buffer, ctx.handle = buffer, handle
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
    def forward(ctx, y, buffer, handle):
        combined, _, _ = buffer.combine(y.contiguous(), handle)
        ctx.buffer, ctx.handle = buffer, handle
        return combined

    @staticmethod
    def backward(ctx, grad):
        grad_y = ctx.buffer.dispatch(grad.contiguous(), handle=ctx.handle)[0]
        return grad_y, None, None


@dataclass
class DeepEPHandle:
    deepep_handle: Any
    rmap: RowMap  # rows of each received token (slot = received token * K + k)
    buffer: Any


class DeepEPDispatcher:
    """Dispatcher on DeepEP kernels (see module docstring). Needs bf16 CUDA inputs and NCCL."""

    def __init__(self, ep: EPContext, num_experts: int):
        from app.model.parallel import deepep_unavailable_reason

        reason = deepep_unavailable_reason(ep.group)
        if reason:
            raise ValueError(f"ep.backend='deepep' cannot run here: {reason}")
        self.ep = ep
        self.num_experts = num_experts
        self.num_local_experts = num_experts // ep.size

    def dispatch(self, x: Tensor, topk_idx: Tensor, topk_weights: Tensor) -> Dispatched:
        """x [T, H] bf16 CUDA, topk_idx [T, K] int64 (-1 = none), topk_weights [T, K] fp32 -> Dispatched."""
        if x.dtype != torch.bfloat16 or not x.is_cuda:
            raise ValueError(f"deepep dispatch needs bf16 CUDA hidden states, got {x.dtype} on {x.device}")
        num_tokens, top_k = topk_idx.shape
        # V2 needs the same num_max_tokens_per_rank on every rank: the group's max, rounded up to a
        # power of two so the shared buffer is not re-allocated for every small change.
        max_tokens = torch.tensor([num_tokens], dtype=torch.int64, device=x.device)
        dist.all_reduce(max_tokens, op=dist.ReduceOp.MAX, group=self.ep.group)
        max_tokens = 1 << max(int(max_tokens.item()) - 1, 0).bit_length()
        buffer = get_buffer(self.ep.group, x.shape[1], x.shape[1] * x.element_size(), max_tokens, top_k)
        weights = torch.where(topk_idx >= 0, topk_weights.float(), torch.zeros_like(topk_weights, dtype=torch.float32))
        recv_x, recv_idx, recv_w, handle, counts = _Dispatch.apply(
            x.contiguous(), topk_idx.contiguous(), weights.contiguous(), buffer, self.num_experts, max_tokens
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
            handle=DeepEPHandle(handle, rmap, buffer),
        )

    def combine(self, y: Tensor, handle: DeepEPHandle) -> Tensor:
        """y [N, H] weighted expert outputs -> [T, H] bf16."""
        per_token = unpermute(y, handle.rmap)
        return _Combine.apply(per_token, handle.buffer, handle.deepep_handle)
