"""Expert-parallel dispatch with torch.distributed.all_to_all_single (gloo on CPU, NCCL on GPU).

In the style of Megatron-LM's `MoEAlltoAllTokenDispatcher`:
  dispatch: sort this rank's (token, k) slots by global expert (so also by destination rank),
            exchange per-expert counts, exchange the rows and their gate weights, then regroup the
            received blocks from (source rank, local expert) order into (local expert, source rank).
  combine:  the same steps in reverse, then sum each token's rows (fp32, deterministic).
The differentiable pieces are the all-to-all (torch's functional collective; its backward is the
all-to-all with the splits swapped) and the local permute/unpermute (permute.py); so the backward
of dispatch is exactly combine and vice versa.

Host syncs: one per dispatch (the split sizes all_to_all_single needs as Python lists).
`-1` slots are dropped before sending.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as fc
from torch import Tensor

from app.model.dispatch import Dispatched, EPContext, at_least_fp32, exchange_cache
from app.model.dispatch.permute import RowMap, permute, row_map, unpermute


def all_to_all(x: Tensor, output_splits: list[int], input_splits: list[int], group) -> Tensor:
    """Differentiable all_to_all_single along dim 0. x [sum(input_splits), ...] -> [sum(output_splits), ...].

    torch's functional collective (its backward is the all-to-all with the splits swapped). Inside
    a selectively checkpointed layer the output is kept, and the recompute replays it instead of
    exchanging again (app/model/dispatch/exchange_cache.py).
    """
    if exchange_cache.replaying():
        def backward(grad: Tensor) -> Tensor:
            return fc.wait_tensor(fc.all_to_all_single(grad, input_splits, output_splits, group))

        return exchange_cache.ReplayedAllToAll.apply(x, [exchange_cache.take("rows")], backward)
    out = fc.wait_tensor(fc.all_to_all_single_autograd(x.contiguous(), output_splits, input_splits, group))
    exchange_cache.keep("rows", out)
    return out


def _exchange_counts(send_counts: Tensor, group) -> Tensor:
    """[E] rows this rank sends to each global expert -> [2, E] (sent, received) on the host: the
    split sizes all_to_all_single needs (the one host sync of a dispatch; replayed, not redone,
    in a selectively checkpointed recompute)."""
    if exchange_cache.replaying():
        return exchange_cache.take("counts")
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts, group=group)
    both = torch.stack([send_counts, recv_counts]).cpu()
    exchange_cache.keep("counts", both)
    return both


def _regroup(x: Tensor, sizes: list[int], rows: int, cols: int) -> Tensor:
    """Blocks laid out row-major as a rows x cols grid (sizes[r*cols + c]) -> column-major order."""
    chunks = torch.split(x, sizes, dim=0)
    return torch.cat([chunks[r * cols + c] for c in range(cols) for r in range(rows)], dim=0)


@dataclass
class AllToAllHandle:
    rmap: RowMap  # the tokens of the rows sent, in send order (for the local permute / unpermute)
    send_splits: list[int]  # rows sent to each rank
    recv_splits: list[int]  # rows received from each rank
    recv_sizes: list[int]  # [size * E_local] rows from (source rank, local expert), row-major


class AllToAllDispatcher:
    """Dispatcher over an EP process group with all_to_all_single (see module docstring)."""

    def __init__(self, ep: EPContext, num_experts: int):
        self.ep = ep
        self.num_experts = num_experts
        self.num_local_experts = num_experts // ep.size

    def dispatch(self, x: Tensor, topk_idx: Tensor, topk_weights: Tensor) -> Dispatched:
        """x [T, H], topk_idx [T, K] int64 global ids (-1 = none), topk_weights [T, K] fp32 -> Dispatched."""
        size, e_local = self.ep.size, self.num_local_experts
        num_tokens, top_k = topk_idx.shape
        flat = topk_idx.reshape(-1)
        key = torch.where(flat >= 0, flat, torch.full_like(flat, self.num_experts))  # -1 sorts last
        slot_of_row = torch.sort(key, stable=True).indices
        counts = torch.zeros(self.num_experts + 1, dtype=torch.int64, device=x.device)
        counts.scatter_add_(0, key, torch.ones_like(key))
        send_counts = counts[: self.num_experts].contiguous()

        # both[1][s * E_local + e]: rows rank s sends to my local expert e.
        both = _exchange_counts(send_counts, self.ep.group)
        send_splits = both[0].view(size, e_local).sum(1).tolist()
        recv_sizes = both[1].tolist()
        recv_splits = both[1].view(size, e_local).sum(1).tolist()

        slot_of_row = slot_of_row[: sum(send_splits)]
        rmap = row_map(slot_of_row, num_tokens, top_k)
        send_x = permute(x, rmap)
        send_w = at_least_fp32(topk_weights.reshape(-1)).index_select(0, slot_of_row)
        recv_x = all_to_all(send_x, recv_splits, send_splits, self.ep.group)
        recv_w = all_to_all(send_w, recv_splits, send_splits, self.ep.group)
        tokens_per_expert = both[1].to(x.device).view(size, e_local).sum(0)
        return Dispatched(
            x=_regroup(recv_x, recv_sizes, size, e_local),
            weights=_regroup(recv_w, recv_sizes, size, e_local),
            tokens_per_expert=tokens_per_expert,
            handle=AllToAllHandle(rmap, send_splits, recv_splits, recv_sizes),
        )

    def combine(self, y: Tensor, handle: AllToAllHandle) -> Tensor:
        """y [N, H] weighted expert outputs in dispatch order -> [T, H]."""
        size, e_local = self.ep.size, self.num_local_experts
        # Undo the regroup: (local expert, source) blocks back to (source, local expert).
        sizes_by_expert = [handle.recv_sizes[s * e_local + e] for e in range(e_local) for s in range(size)]
        y = _regroup(y, sizes_by_expert, e_local, size)
        back = all_to_all(y, handle.send_splits, handle.recv_splits, self.ep.group)
        return unpermute(back, handle.rmap)
