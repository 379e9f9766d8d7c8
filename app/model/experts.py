"""The routed experts of one EP rank, run as a grouped GEMM over the tokens each expert received.

Weights use transformers 5's fused layout (`Qwen3MoeExperts`, `DeepseekV3Experts`):
`gate_up_proj` [E_local, 2*I, H] (gate rows first, then up rows) and `down_proj` [E_local, H, I];
expert e computes ``down_e(act(gate_e x) * up_e x)`` (SwiGLU for `hidden_act="silu"`).

A row's gate weight w is applied to the [N, I] activation before the down projection:
``down_e(w * h) = w * down_e(h)`` because the projection is linear, and the multiply (and its
backward) then touches I instead of H columns (I/H = 0.375 for Qwen3-30B-A3B, 0.29 for
DeepSeek-V3).
On CUDA with triton, SiLU experts run that activation and its backward as one fused kernel each
(`kernels.swiglu_forward/backward`); elsewhere, plain torch ops.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.tensor import DTensor
from transformers.activations import ACT2FN

from app.model import kernels

IMPLEMENTATIONS = ("auto", "grouped_mm", "loop")


def grouped_mm_supported(weight: Tensor) -> bool:
    """True where `torch._grouped_mm` is the right kernel: CUDA sm90+ with bf16 weights.

    (PyTorch ships the kernel for Hopper bf16 first; elsewhere we use the per-expert loop.)
    """
    return (
        hasattr(torch, "_grouped_mm")
        and weight.is_cuda
        and weight.dtype == torch.bfloat16
        and torch.cuda.get_device_capability(weight.device)[0] >= 9
    )


def local(p: Tensor) -> Tensor:
    """This rank's block of a parameter: under the sharded trainer (app/trainer/parallel.py) the
    expert weights are DTensors sharded over the EP mesh (global [E, ...]); inside forward FSDP has
    gathered the expert-data-parallel shards, so the local tensor is this EP rank's [E_local, ...]."""
    return p.to_local() if isinstance(p, DTensor) else p


class GroupedExperts(nn.Module):
    """E_local SwiGLU experts.

    Parameters:
        gate_up_proj: [E_local, 2*I, H] (a DTensor of global shape [E, 2*I, H] under the sharded trainer)
        down_proj: [E_local, H, I] (likewise [E, H, I])
    """

    def __init__(self, num_local_experts: int, hidden_size: int, intermediate_size: int,
                 hidden_act: str = "silu", implementation: str = "auto"):
        super().__init__()
        if implementation not in IMPLEMENTATIONS:
            raise ValueError(f"experts implementation must be one of {IMPLEMENTATIONS}, got {implementation!r}")
        self.num_local_experts = num_local_experts
        self.intermediate_size = intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(num_local_experts, 2 * intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_local_experts, hidden_size, intermediate_size))
        self.hidden_act = hidden_act
        self.act_fn = ACT2FN[hidden_act]
        self.implementation = implementation

    def forward(self, x: Tensor, tokens_per_expert: Tensor, row_weights: Tensor | None = None) -> Tensor:
        """Run every local expert on its rows.

        Args:
            x: [N, H] rows grouped contiguously by local expert (expert 0's rows first).
            tokens_per_expert: [E_local] int64 row counts, summing to N; stays on x's device.
            row_weights: optional [N] gate weight of each row (any float dtype; the multiply runs
                in the activations' dtype, fp32 inside the fused CUDA kernel); the output of row n
                is scaled by it.

        Returns:
            [N, H] expert outputs in the expert parameters' dtype, same row order.

        Raises:
            ValueError: row_weights is not a float tensor of shape [N].
        """
        if row_weights is not None and (row_weights.shape != (x.shape[0],) or not row_weights.is_floating_point()):
            raise ValueError(f"row_weights must be a float tensor of shape [N] = [{x.shape[0]}], "
                             f"got {row_weights.dtype} {tuple(row_weights.shape)}")
        gate_up_w, down_w = local(self.gate_up_proj), local(self.down_proj)
        impl = self.implementation
        if impl == "auto":
            impl = "grouped_mm" if grouped_mm_supported(gate_up_w) else "loop"
        if impl == "grouped_mm":
            return self._grouped_mm(x, tokens_per_expert, row_weights, gate_up_w, down_w)
        return self._loop(x, tokens_per_expert, row_weights, gate_up_w, down_w)

    def _activation(self, gate_up: Tensor, row_weights: Tensor | None) -> Tensor:
        """[N, 2I] gate_up -> [N, I] act(gate) * up (* row weight)."""
        if row_weights is not None and self.hidden_act == "silu" and kernels.usable(gate_up):
            return _WeightedSwiGLU.apply(gate_up, row_weights)
        gate, up = gate_up.chunk(2, dim=-1)
        h = self.act_fn(gate) * up
        if row_weights is not None:
            h = h * row_weights.to(h.dtype).unsqueeze(-1)
        return h

    def _grouped_mm(self, x: Tensor, tokens_per_expert: Tensor, row_weights: Tensor | None,
                    gate_up_w: Tensor, down_w: Tensor) -> Tensor:
        # Offsets stay on the device: no host sync (torch._grouped_mm takes cumulative int32 ends).
        offs = torch.cumsum(tokens_per_expert, dim=0, dtype=torch.int32)
        x = x.to(gate_up_w.dtype)
        gate_up = torch._grouped_mm(x, gate_up_w.transpose(-2, -1), offs=offs)
        h = self._activation(gate_up, row_weights)
        return torch._grouped_mm(h, down_w.transpose(-2, -1), offs=offs)

    def _loop(self, x: Tensor, tokens_per_expert: Tensor, row_weights: Tensor | None,
              gate_up_w: Tensor, down_w: Tensor) -> Tensor:
        # One host sync for the counts; every expert runs (an empty slice costs nothing) so that
        # each local expert's weights take part in the graph and get a zero, not a missing, grad.
        # unbind (not w[e]) so the backward stacks E gradients once instead of adding E full-size ones.
        counts = tokens_per_expert.tolist()
        x = x.to(gate_up_w.dtype)
        gate_up_w, down_w = gate_up_w.unbind(0), down_w.unbind(0)
        weights = torch.split(row_weights, counts) if row_weights is not None else [None] * len(counts)
        outs = []
        for e, rows in enumerate(torch.split(x, counts, dim=0)):
            h = self._activation(F.linear(rows, gate_up_w[e]), weights[e])
            outs.append(F.linear(h, down_w[e]))
        if not outs:
            return x.new_zeros(0, down_w[0].shape[0] if down_w else 0)
        return torch.cat(outs, dim=0)


class _WeightedSwiGLU(torch.autograd.Function):
    """silu(gate) * up * w with fused Triton forward and backward (see app/model/kernels.py)."""

    @staticmethod
    def forward(ctx, gate_up: Tensor, w: Tensor) -> Tensor:
        ctx.save_for_backward(gate_up, w)
        return kernels.swiglu_forward(gate_up, w)

    @staticmethod
    def backward(ctx, dh: Tensor):
        gate_up, w = ctx.saved_tensors
        dgate_up, dw = kernels.swiglu_backward(dh, gate_up, w)
        return dgate_up, dw.to(w.dtype)
