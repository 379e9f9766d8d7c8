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
import torch.distributed as dist
from torch import Tensor


@dataclass
class EPContext:
    """This process's place in expert parallelism.

    Attributes:
        group: the EP process group (None for EP size 1).
        rank: rank inside `group` (0 for EP size 1); it owns experts [rank * E_local, (rank + 1) * E_local).
        size: number of EP ranks.
        backend: resolved dispatcher backend, one of "local", "alltoall", "deepep".
    """

    group: dist.ProcessGroup | None
    rank: int
    size: int
    backend: str

    @classmethod
    def local(cls) -> "EPContext":
        """EP size 1: every expert lives in this process."""
        return cls(group=None, rank=0, size=1, backend="local")


def collective_device(group: dist.ProcessGroup | None = None) -> torch.device:
    """The device whose tensors a collective over ``group`` (default: the world) must use.

    An NCCL group takes only CUDA tensors, and so does the ``cuda:gloo`` test layout (several
    ranks on one GPU: app/trainer/train.py); a CPU-tensor collective there raises "No backend
    type associated with device type cpu". A gloo group on CPU takes CPU tensors. The rule is
    torch's own for object collectives (``distributed_c10d._get_object_coll_device``: the
    group's one device type, or cpu when the group has a CPU backend among several), with the
    CUDA device made concrete as this process's current GPU.
    """
    group = group if group is not None else dist.group.WORLD
    types = {d.type for d in group._device_types}
    if "cuda" in types and "cpu" not in types:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


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
        # the backends import this package's types: a circle at the top
        from app.model.dispatch.local import LocalDispatcher

        return LocalDispatcher(num_experts)
    if ep.backend == "alltoall":
        # the backends import this package's types: a circle at the top
        from app.model.dispatch.alltoall import AllToAllDispatcher

        return AllToAllDispatcher(ep, num_experts)
    if ep.backend == "deepep":
        # the backends import this package's types: a circle at the top
        from app.model.dispatch.deepep import DeepEPDispatcher

        return DeepEPDispatcher(ep, num_experts)
    raise ValueError(f"ep.backend must be local, alltoall or deepep, got {ep.backend!r}")
