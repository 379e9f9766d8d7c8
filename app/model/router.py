"""MoE routers of the two supported families, computed in fp32.

Qwen3-MoE (transformers `Qwen3MoeTopKRouter`): softmax over the router logits, top-k, and, if
`norm_topk_prob`, the k weights renormalized to sum to 1.

DeepSeek-V3 (transformers `DeepseekV3TopkRouter`; DeepSeek-V3 report, arXiv:2412.19437 §2.1.2):
sigmoid scores; experts are *selected* on `scores + e_score_correction_bias` restricted to the
`topk_group` best of `n_group` expert groups (group score = sum of its top-2 biased scores), while
the *weights* come from the unbiased scores, renormalized if `norm_topk_prob`, times
`routed_scaling_factor`.

Routing replay: given top-k indices (e.g. the ones the inference engine used), route by them but
take the weights from the live scores at those indices, so the router still gets gradients.
A `-1` index means "no expert" and gets weight 0.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
import torch.utils._pytree as pytree
from torch import Tensor, nn

FAMILIES = ("qwen3_moe", "deepseek_v3")


@dataclass
class Routing:
    """Router output for T tokens.

    Attributes:
        logits: [T, E] fp32 router logits.
        scores: [T, E] fp32 softmax probabilities (Qwen3) or sigmoid scores (DeepSeek-V3).
        topk_idx: [T, K] int64 global expert ids; -1 = no expert.
        topk_weights: [T, K] fp32 gate weights (0 where topk_idx is -1).
    """

    logits: Tensor
    scores: Tensor
    topk_idx: Tensor
    topk_weights: Tensor


# A pytree node, so that FSDP2 (the router is an FSDP unit of its own, app/trainer/parallel.py)
# finds the tensors of a Routing output and hooks their backward to re-gather the weight.
pytree.register_dataclass(Routing)


def softmax_topk(logits: Tensor, top_k: int, norm_topk_prob: bool) -> tuple[Tensor, Tensor, Tensor]:
    """Qwen3-MoE routing. logits [T, E] fp32 -> (probs [T, E], idx [T, K] int64, weights [T, K] fp32)."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, idx = torch.topk(probs, top_k, dim=-1)
    if norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return probs, idx, weights


def group_limited_topk(
    scores: Tensor, bias: Tensor, top_k: int, n_group: int, topk_group: int
) -> Tensor:
    """DeepSeek-V3 expert selection. scores [T, E] fp32, bias [E] fp32 -> idx [T, K] int64.

    Same operations, in the same order, as transformers' `DeepseekV3TopkRouter.forward`, so that
    ties break identically.
    """
    num_tokens, num_experts = scores.shape
    biased = scores + bias
    group_scores = biased.view(num_tokens, n_group, num_experts // n_group).topk(2, dim=-1)[0].sum(dim=-1)
    group_idx = torch.topk(group_scores, k=topk_group, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
    score_mask = (
        group_mask.unsqueeze(-1).expand(-1, n_group, num_experts // n_group).reshape(-1, num_experts)
    )
    biased = biased.masked_fill(~score_mask.bool(), float("-inf"))
    return torch.topk(biased, k=top_k, dim=-1, sorted=False)[1]


class Router(nn.Module):
    """The gate of one MoE layer (`mlp.gate` in HF checkpoints).

    Parameters:
        weight: [E, H] router weight; logits are computed in fp32 whatever its dtype.
        e_score_correction_bias: [E] fp32 buffer (DeepSeek-V3 only): selection bias, not trained
            by backprop; `update_bias` implements the aux-loss-free update (off by default).
    """

    def __init__(
        self,
        family: str,
        num_experts: int,
        hidden_size: int,
        top_k: int,
        norm_topk_prob: bool,
        n_group: int = 1,
        topk_group: int = 1,
        routed_scaling_factor: float = 1.0,
    ):
        super().__init__()
        if family not in FAMILIES:
            raise ValueError(f"router family must be one of {FAMILIES}, got {family!r}")
        self.family = family
        self.num_experts = num_experts
        self.top_k = top_k
        self.norm_topk_prob = norm_topk_prob
        self.n_group = n_group
        self.topk_group = topk_group
        self.routed_scaling_factor = routed_scaling_factor
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))
        if family == "deepseek_v3":
            self.register_buffer("e_score_correction_bias", torch.zeros(num_experts, dtype=torch.float32))
        else:
            self.e_score_correction_bias = None

    def forward(self, x: Tensor, replay_topk_idx: Tensor | None = None) -> Routing:
        """Route T tokens.

        Args:
            x: [T, H] hidden states (any float dtype; logits in fp32, see `router_logits`).
            replay_topk_idx: optional [T, K] int64 global expert ids to route by (-1 = none).

        Returns:
            Routing with fp32 logits/scores/weights and int64 indices.
        """
        logits = router_logits(x, self.weight)
        if self.family == "qwen3_moe":
            if replay_topk_idx is None:
                scores, idx, weights = softmax_topk(logits, self.top_k, self.norm_topk_prob)
                return Routing(logits, scores, idx, weights)
            scores = torch.softmax(logits, dim=-1, dtype=torch.float32)
            idx = replay_topk_idx
            weights = _gather_weights(scores, idx)
            if self.norm_topk_prob:
                weights = weights / weights.sum(dim=-1, keepdim=True)
            return Routing(logits, scores, idx, weights)

        scores = logits.sigmoid()
        if replay_topk_idx is None:
            idx = group_limited_topk(
                scores, self.e_score_correction_bias.float(), self.top_k, self.n_group, self.topk_group
            )
        else:
            idx = replay_topk_idx
        weights = _gather_weights(scores, idx)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        weights = weights * self.routed_scaling_factor
        return Routing(logits, scores, idx, weights)

    @torch.no_grad()
    def own_topk(self, scores: Tensor) -> Tensor:
        """The experts this router selects from its ``scores`` [T, E] fp32 (softmax or sigmoid, as
        `forward` returns them): [T, K] int64, the same selection `forward` makes without replay."""
        if self.family == "qwen3_moe":
            return torch.topk(scores, self.top_k, dim=-1)[1]
        return group_limited_topk(scores, self.e_score_correction_bias.float(), self.top_k, self.n_group,
                                  self.topk_group)

    @torch.no_grad()
    def update_bias(self, tokens_per_expert: Tensor, rate: float) -> None:
        """Aux-loss-free load balancing (DeepSeek-V3 report §2.1.2): bias -= rate * sign(load - mean load).

        Args:
            tokens_per_expert: [E] token counts of every expert, summed over the whole EP group.
            rate: the update speed gamma.
        """
        if self.e_score_correction_bias is None:
            raise ValueError("router.bias_update_rate > 0 needs a DeepSeek-V3 style router (e_score_correction_bias)")
        load = tokens_per_expert.float()
        self.e_score_correction_bias -= rate * torch.sign(load - load.mean())


def router_logits(x: Tensor, weight: Tensor) -> Tensor:
    """Router logits in fp32: x [T, H] (any float dtype) @ weight [E, H]^T -> [T, E] fp32.

    bf16 inputs on CUDA use a bf16 tensor-core GEMM that writes fp32 (`torch.mm(..., out_dtype=
    torch.float32)`): bf16 products are exact and accumulate in fp32, so the logits are those of
    the fp32 GEMM up to summation order, without its SIMT fp32 kernels (about 7 % of the MoE
    layer's time at Qwen3-30B-A3B shapes on an H200; bench/results/moe.md). The backward rounds the
    logit gradient to bf16 once before its two GEMMs, whose results are bf16 anyway. Everything
    else (CPU, fp32, float64, a torch without `out_dtype`) upcasts to fp32 as before.
    """
    if x.is_cuda and x.dtype == torch.bfloat16 and weight.dtype == torch.bfloat16 and _mm_out_dtype_works(x):
        return _Bf16LogitsFp32.apply(x, weight)
    return F.linear(x.float(), weight.float())


_MM_OUT_DTYPE: bool | None = None


def _mm_out_dtype_works(x: Tensor) -> bool:
    """Whether this torch has `torch.mm(..., out_dtype=)` for bf16 -> fp32 (probed once)."""
    global _MM_OUT_DTYPE
    if _MM_OUT_DTYPE is None:
        try:
            probe = torch.ones(16, 16, dtype=torch.bfloat16, device=x.device)
            _MM_OUT_DTYPE = torch.mm(probe, probe, out_dtype=torch.float32).dtype == torch.float32
        except (TypeError, RuntimeError, NotImplementedError):
            _MM_OUT_DTYPE = False
    return _MM_OUT_DTYPE


class _Bf16LogitsFp32(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor) -> Tensor:
        ctx.save_for_backward(x, weight)
        return torch.mm(x, weight.t(), out_dtype=torch.float32)

    @staticmethod
    def backward(ctx, grad: Tensor):
        x, weight = ctx.saved_tensors
        grad = grad.to(torch.bfloat16)
        grad_x = grad @ weight if ctx.needs_input_grad[0] else None
        grad_w = grad.t() @ x if ctx.needs_input_grad[1] else None
        return grad_x, grad_w


def _gather_weights(scores: Tensor, idx: Tensor) -> Tensor:
    """scores [T, E] at idx [T, K] (-1 -> weight 0)."""
    valid = idx >= 0
    weights = scores.gather(1, idx.clamp(min=0))
    return torch.where(valid, weights, torch.zeros_like(weights))


def load_balancing_loss(scores: Tensor, topk_idx: Tensor, family: str, sequences: int = 1,
                        token_mask: Tensor | None = None) -> Tensor:
    """Auxiliary load-balancing loss of one layer, per sequence, summed over the sequences. Scalar fp32.

    Per sequence, the Switch Transformer form (Fedus et al. 2021, eq. 4-6) as transformers computes
    it for top-k: ``E * sum_e f_e * P_e`` with f_e = (slots routed to e) / T and P_e = the mean
    routing probability of e, over that sequence's T real tokens. For DeepSeek-V3 the
    probabilities are the sigmoid scores normalised per token: the report's sequence-wise balance
    loss (DeepSeek-V3 technical report, eq. 17-20, up to its constant E/K).

    Per sequence, not per batch, so that the trainer's step is the same for any split of a batch
    into micro-batches (whole sequences) and ranks: the step divides the sum by the global count
    of sequences (app/trainer/step.py). A batch-level f_e * P_e is a product of two batch means
    and depends on which sequences share a micro-batch. Padding and dummy rows (``token_mask``
    False) count nowhere; a sequence without real tokens adds 0.

    Args:
        scores: [T, E] fp32 softmax probabilities or sigmoid scores, T = sequences * S.
        topk_idx: [T, K] int64 routed experts (-1 ignored).
        family: "qwen3_moe" or "deepseek_v3".
        sequences: B, the number of sequences the T tokens are (row-major [B, S]).
        token_mask: [T] (or [B, S]) bool, the real tokens; None: every token.

    Raises:
        ValueError: T is not a multiple of ``sequences``, or the mask has another size.
    """
    num_tokens, num_experts = scores.shape
    if num_tokens % max(sequences, 1):
        raise ValueError(f"load_balancing_loss: {num_tokens} tokens are not {sequences} sequences")
    if num_tokens == 0:
        return scores.sum() * 0.0
    probs = scores if family == "qwen3_moe" else scores / scores.sum(dim=-1, keepdim=True)
    mask = (torch.ones(num_tokens, dtype=torch.bool, device=scores.device) if token_mask is None
            else token_mask.reshape(-1).to(device=scores.device, dtype=torch.bool))
    if mask.numel() != num_tokens:
        raise ValueError(f"load_balancing_loss: token_mask has {mask.numel()} entries for {num_tokens} tokens")
    seq_len = num_tokens // sequences
    real = mask.float().view(sequences, seq_len)  # [B, S]
    n = real.sum(dim=1).clamp(min=1.0)  # [B] real tokens per sequence
    slots = ((topk_idx >= 0) & mask[:, None]).float()  # [T, K]
    counts = torch.zeros(sequences, num_experts, dtype=torch.float32, device=scores.device)
    seq_of_slot = torch.arange(num_tokens, device=scores.device).div(seq_len, rounding_mode="floor")
    flat = seq_of_slot[:, None] * num_experts + topk_idx.clamp(min=0)
    counts.view(-1).scatter_add_(0, flat.reshape(-1), slots.reshape(-1))
    mean_probs = (probs.view(sequences, seq_len, num_experts) * real[..., None]).sum(dim=1) / n[:, None]
    return num_experts * torch.sum((counts / n[:, None]) * mean_probs)


def expert_counts(topk_idx: Tensor, num_experts: int, token_mask: Tensor | None = None) -> Tensor:
    """[E] fp32 slots routed to each expert by the real tokens (``token_mask`` [T] or [B, S] bool,
    None: all) of ``topk_idx`` [T, K] (-1 ignored): the load the aux-loss-free bias update reads."""
    valid = topk_idx >= 0
    if token_mask is not None:
        valid = valid & token_mask.reshape(-1, 1).to(device=topk_idx.device, dtype=torch.bool)
    counts = torch.zeros(num_experts, dtype=torch.float32, device=topk_idx.device)
    return counts.scatter_add_(0, topk_idx.clamp(min=0).reshape(-1), valid.reshape(-1).float())
