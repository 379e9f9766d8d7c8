"""EP size 1: every expert is local, so dispatch is a sort by expert and combine a per-token sum.

The rows move with `permute` / `unpermute` (gathers both ways, see permute.py), so the backward
of dispatch is a combine and vice versa without any scatter-add.

A `-1` slot is routed to expert 0 with weight 0: its contribution and its gradients are exactly
zero, and the shapes stay static (no host sync, no uninitialized tail rows for grouped GEMMs).
"""

from __future__ import annotations

import torch
from torch import Tensor

from app.model.dispatch import Dispatched, at_least_fp32
from app.model.dispatch.permute import RowMap, permute, row_map, unpermute


class LocalDispatcher:
    """Reference dispatcher for EP size 1 (see module docstring)."""

    def __init__(self, num_experts: int):
        self.num_experts = num_experts
        self.num_local_experts = num_experts

    def dispatch(self, x: Tensor, topk_idx: Tensor, topk_weights: Tensor) -> Dispatched:
        """x [T, H], topk_idx [T, K] int64 (-1 = none), topk_weights [T, K] fp32 -> Dispatched (N = T*K)."""
        num_tokens, top_k = topk_idx.shape
        flat = topk_idx.reshape(-1)
        valid = flat >= 0
        expert = torch.where(valid, flat, torch.zeros_like(flat))
        weights = at_least_fp32(topk_weights.reshape(-1))
        weights = torch.where(valid, weights, torch.zeros_like(weights))
        slot_of_row = torch.sort(expert, stable=True).indices
        counts = torch.zeros(self.num_experts, dtype=torch.int64, device=x.device)
        counts.scatter_add_(0, expert, torch.ones_like(expert))
        rmap = row_map(slot_of_row, num_tokens, top_k)
        return Dispatched(
            x=permute(x, rmap),
            weights=weights.index_select(0, slot_of_row),
            tokens_per_expert=counts,
            handle=rmap,
        )

    def combine(self, y: Tensor, handle: RowMap) -> Tensor:
        """y [T*K, H] weighted expert outputs -> [T, H]."""
        return unpermute(y, handle)
