"""Token permutation between token order [T, H] and expert-row order [N, H], without atomics.

Every dispatcher backend ends in the same two local moves: `permute` copies token rows into the
expert-grouped row order (a token appears once per selected expert, so up to K times), and
`unpermute` sums each token's rows back. They are each other's backward:

    permute    forward  out[n] = x[token_of_row[n]]            (a gather, `index_select`)
               backward grad_x[t] = sum over t's rows of grad  (a gather-sum, below)
    unpermute  forward  out[t] = sum over t's rows of y        (a gather-sum)
               backward grad_y[n] = grad[token_of_row[n]]      (a gather)

Plain differentiable indexing would give the same numbers, but its backward is a scatter-add
(`index_add_` / `index_put_` with accumulate) with atomics in the activations' dtype:
nondeterministic, bf16 accumulation, and on an H200 the largest non-GEMM cost of the layer
(profile in bench/results/moe.md). Here both directions are gathers. The gather-sum reads each row
once, accumulates in fp32 and writes [T, H] once, with no [T*K, H] intermediate: on CUDA with
triton, `kernels.gather_sum`; elsewhere `torch.nn.functional.embedding_bag(mode="sum")` with
one bag per token (fp32 accumulation for bf16 on CPU too).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from app.model import kernels


@dataclass
class RowMap:
    """Where each dispatched row comes from and which rows belong to each token.

    Attributes:
        token_of_row: [N] int64 token of each row, in row (expert-grouped) order.
        rows_by_token: [N] int64 row ids listed token by token (token 0's rows first).
        bag_offsets: [T + 1] int64; token t's rows are rows_by_token[bag_offsets[t]:bag_offsets[t+1]].
        num_tokens: T.
        top_k: K, the most rows a token can have.
    """

    token_of_row: Tensor
    rows_by_token: Tensor
    bag_offsets: Tensor
    num_tokens: int
    top_k: int


def row_map(slot_of_row: Tensor, num_tokens: int, top_k: int) -> RowMap:
    """Build the RowMap from the flat (token * K + k) slot of every row. No host sync.

    Args:
        slot_of_row: [N] int64, unique values in [0, T*K); N <= T*K (slots without a row are
            allowed: they contribute nothing to their token).
        num_tokens: T.
        top_k: K.
    """
    device = slot_of_row.device
    n = slot_of_row.numel()
    token_of_row = torch.div(slot_of_row, top_k, rounding_mode="floor")
    if n == num_tokens * top_k:  # every slot has a row: K rows per token, the inverse permutation
        rows_by_token = torch.empty_like(slot_of_row).scatter_(0, slot_of_row, torch.arange(n, device=device))
        bag_offsets = torch.arange(0, n + 1, top_k, device=device)
    else:
        # Sorting the unique slots lists the rows token by token (slot = token * K + k).
        rows_by_token = torch.sort(slot_of_row).indices
        counts = torch.zeros(num_tokens, dtype=torch.int64, device=device)
        counts.scatter_add_(0, token_of_row, torch.ones_like(token_of_row))
        bag_offsets = torch.cat([counts.new_zeros(1), torch.cumsum(counts, 0)])
    return RowMap(token_of_row, rows_by_token, bag_offsets, num_tokens, top_k)


def _sum_rows(rows: Tensor, rmap: RowMap) -> Tensor:
    """[N, H] -> [T, H]: each token's rows summed (0 for a token without rows)."""
    if rows.shape[0] == 0 or rows.shape[1] == 0:  # embedding_bag wants a non-empty table
        return rows.new_zeros(rmap.num_tokens, rows.shape[1])
    if kernels.usable(rows):
        return kernels.gather_sum(rows, rmap.rows_by_token, rmap.bag_offsets, rmap.top_k)
    return F.embedding_bag(rmap.rows_by_token, rows, rmap.bag_offsets, mode="sum", include_last_offset=True)


class _Permute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, rmap: RowMap) -> Tensor:
        ctx.rmap = rmap
        return x.index_select(0, rmap.token_of_row)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return _sum_rows(grad.contiguous(), ctx.rmap), None


class _Unpermute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rows: Tensor, rmap: RowMap) -> Tensor:
        ctx.rmap = rmap
        return _sum_rows(rows.contiguous(), rmap)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return grad.index_select(0, ctx.rmap.token_of_row), None


def permute(x: Tensor, rmap: RowMap) -> Tensor:
    """Token rows into expert-row order: x [T, H] -> [N, H], out[n] = x[rmap.token_of_row[n]].

    Differentiable; the backward sums each token's row gradients (deterministic, fp32 accumulation
    on CUDA for bf16/fp16).
    """
    return _Permute.apply(x, rmap)


def unpermute(rows: Tensor, rmap: RowMap) -> Tensor:
    """Sum expert rows back into tokens: rows [N, H] -> [T, H] in rows' dtype.

    Differentiable; the backward is a gather of the token gradient into every row of the token.
    """
    return _Unpermute.apply(rows, rmap)
