"""EP size 1: every expert is local, so dispatch is a sort by expert and combine a scatter-sum.

Plain differentiable indexing gives the required autograd pairing for free: the backward of the
row gather (dispatch) is a scatter-add into tokens (a combine), and vice versa.

A `-1` slot is routed to expert 0 with weight 0: its contribution and its gradients are exactly
zero, and the shapes stay static (no host sync, no uninitialized tail rows for grouped GEMMs).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from app.model.dispatch import Dispatched, at_least_fp32, unpermute


@dataclass
class LocalHandle:
    slot_of_row: Tensor  # [T*K] int64, the flat slot of every dispatched row
    num_tokens: int
    top_k: int


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
        rows = x.index_select(0, torch.div(slot_of_row, top_k, rounding_mode="floor"))
        return Dispatched(
            x=rows,
            weights=weights.index_select(0, slot_of_row),
            tokens_per_expert=counts,
            handle=LocalHandle(slot_of_row, num_tokens, top_k),
        )

    def combine(self, y: Tensor, handle: LocalHandle) -> Tensor:
        """y [T*K, H] weighted expert outputs -> [T, H]."""
        return unpermute(y, handle.slot_of_row, handle.num_tokens, handle.top_k)
