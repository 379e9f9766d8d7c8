"""Expert-parallel token dispatch and combine (docs/ARCHITECTURE.md, "EP dispatcher").

``dispatch(x[T,H], topk_idx[T,K] int64, topk_weights[T,K] fp32) -> Dispatched`` hands this rank
the rows its local experts must process, grouped contiguously by local expert (expert 0 first),
with their gate weights and the row count of every local expert; ``combine(y[N,H], handle) ->
[T,H]`` sends the (already weighted) expert outputs back and sums each token's contributions.
The local token moves of every backend are `permute.permute` / `permute.unpermute` (gathers both
ways, no atomics).
Both are differentiable: the backward of dispatch is a combine and the backward of combine is a
dispatch. A ``-1`` in topk_idx means "no expert" for that slot.

Backends: `local` (EP size 1; the reference), `alltoall` (all_to_all_single, Megatron-LM's
alltoall token dispatcher style) and `deepep` (DeepEP normal-mode kernels, GPU only; imported
lazily so this package works without it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor

from app.model.parallel import EPContext


@dataclass
class Dispatched:
    """What dispatch hands to the local experts.

    Attributes:
        x: [N, H] rows in the input's dtype, grouped by local expert.
        weights: [N] fp32 gate weight of each row (differentiable). The expert output must be
            scaled by it before `combine`; `GroupedExperts` does so on its [N, I] activation.
        tokens_per_expert: [E_local] int64 rows per local expert, on x's device; sums to N.
        handle: backend state that `combine` needs.
    """

    x: Tensor
    weights: Tensor
    tokens_per_expert: Tensor
    handle: Any


class Dispatcher(Protocol):
    """The dispatcher contract every backend implements."""

    num_experts: int
    num_local_experts: int

    def dispatch(self, x: Tensor, topk_idx: Tensor, topk_weights: Tensor) -> Dispatched: ...

    def combine(self, y: Tensor, handle: Any) -> Tensor: ...


def at_least_fp32(t: Tensor) -> Tensor:
    """Gate weights travel in fp32 (float64 stays float64, e.g. for gradcheck)."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


def make_dispatcher(ep: EPContext, num_experts: int) -> Dispatcher:
    """The dispatcher for `ep.backend`.

    Raises:
        ValueError: unknown backend, or num_experts not divisible by ep.size.
    """
    if num_experts % ep.size:
        raise ValueError(f"num_experts={num_experts} is not divisible by ep.size={ep.size}")
    if ep.backend == "local":
        if ep.size != 1:
            raise ValueError(f"the local dispatcher needs ep.size=1, got {ep.size}")
        from app.model.dispatch.local import LocalDispatcher

        return LocalDispatcher(num_experts)
    if ep.backend == "alltoall":
        from app.model.dispatch.alltoall import AllToAllDispatcher

        return AllToAllDispatcher(ep, num_experts)
    if ep.backend == "deepep":
        from app.model.dispatch.deepep import DeepEPDispatcher

        return DeepEPDispatcher(ep, num_experts)
    raise ValueError(f"ep.backend must be local, alltoall or deepep, got {ep.backend!r}")
