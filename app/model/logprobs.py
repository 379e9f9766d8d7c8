"""Log-probabilities and entropy of chosen tokens, computed in chunks through the LM head.

A full ``[B, L, V]`` fp32 logits tensor is the largest allocation of an RL step at real widths
(8 x 8192 tokens x 151936 vocabulary = 37 GiB; issue 13). `chunked_logprobs` takes the hidden
states of only the positions whose next token is scored, and runs ``lm_head -> log_softmax ->
gather`` over ``chunk`` rows at a time in the forward, saving just the per-row log-sum-exp; the
backward recomputes each chunk's logits and turns them into the gradient of the hidden states
and of the LM-head weight chunk by chunk, so no more than one ``[chunk, V]`` fp32 block (plus its
softmax, computed in place) is alive in either pass. This is the fused linear + cross-entropy
pattern of Liger-Kernel (``fused_linear_cross_entropy``) and verl (``linear_cross_entropy``).
On CUDA the softmax passes over each chunk are one Triton kernel per direction
(app/model/logit_kernels.py) that reads the GEMM's bf16 output once and never materialises an
fp32 block; elsewhere they are plain torch ops.

Math (temperature T, logits z = h W^T / T, p = softmax(z)):
  logp(y) = z_y - logsumexp(z);  d logp(y) / d z = onehot(y) - p;
  dz/dh = W / T, dz/dW = h / T;  entropy H = logsumexp(z) - sum_v p_v z_v,
  dH / dz = -p * (log p + H) (only with ``entropy_grad``: the entropy bonus).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from app.model import kernels
from app.model.logit_kernels import logit_grad, logit_stats


def chunked_logprobs(
    hidden: Tensor, weight: Tensor, targets: Tensor, temperature: float = 1.0, chunk: int = 4096,
    with_entropy: bool = False, fused: bool | None = None, entropy_grad: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """Log-probability of each target token under ``softmax(hidden @ weight.T / temperature)``.

    Args:
        hidden: ``[N, H]`` hidden states (any float dtype; the GEMM runs in it, the softmax in fp32).
        weight: ``[V, H]`` LM-head weight, same dtype as ``hidden``.
        targets: ``[N]`` int64 token ids in ``[0, V)`` (checked: one host sync), on hidden's device.
        temperature: sampling temperature (finite, > 0), as the engine applies it before sampling.
        chunk: rows per chunk (>= 1).
        with_entropy: also return the entropy of each row's distribution.
        fused: the Triton softmax passes (`app.model.logit_kernels`); None (default) uses them
            where they run compiled (CUDA with triton, bf16/fp16/fp32), torch ops otherwise.
        entropy_grad: the entropy carries gradient to hidden and weight (an entropy bonus);
            otherwise it is detached. Its backward runs on torch ops, chunk by chunk.

    Returns:
        ``(logp [N] with gradient to hidden and weight, entropy [N] or None)``, fp32 (float64
        for float64 inputs).

    Raises:
        ValueError: shapes, dtypes, devices or arguments disagree, or a target is outside the
            vocabulary (the tensor is named).
    """
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"hidden {tuple(hidden.shape)} must be [N, H] and weight {tuple(weight.shape)} [V, H]")
    if targets.shape != hidden.shape[:1] or targets.dtype != torch.int64:
        raise ValueError(f"targets must be int64 [N={hidden.shape[0]}], got {targets.dtype} {tuple(targets.shape)}")
    if hidden.dtype != weight.dtype or not hidden.is_floating_point():
        raise ValueError(f"hidden ({hidden.dtype}) and weight ({weight.dtype}) must share a floating-point dtype")
    if not hidden.device == weight.device == targets.device:
        raise ValueError(f"hidden ({hidden.device}), weight ({weight.device}) and targets ({targets.device}) "
                         f"must be on one device")
    # NaN passes "> 0" and gives NaN logprobs; infinity gives a uniform distribution.
    if not 0 < temperature < math.inf or chunk < 1:
        raise ValueError(f"temperature must be > 0 and finite, and chunk >= 1, got {temperature}, {chunk}")
    if targets.numel():
        # One host sync: the fused kernels read z[row, target] unchecked, and the torch path's
        # gather is a device-side assert on CUDA.
        lo, hi = torch.aminmax(targets)
        lo, hi = int(lo), int(hi)
        if lo < 0 or hi >= weight.shape[0]:
            raise ValueError(f"targets must be token ids in [0, V={weight.shape[0]}), got min {lo}, max {hi}")
    if fused is None:
        fused = kernels.usable(hidden)
    logp, ent = _ChunkedLogprobs.apply(hidden, weight, targets, float(temperature), int(chunk), with_entropy,
                                       bool(fused), bool(with_entropy and entropy_grad))
    return logp, (ent if with_entropy else None)


def _acc_dtype(t: Tensor) -> torch.dtype:
    # Softmax math in fp32 at least (float64 stays float64, e.g. for gradcheck).
    return torch.promote_types(t.dtype, torch.float32)


def _chunk_logits(h: Tensor, weight: Tensor, temperature: float) -> Tensor:
    z = (h @ weight.t()).to(_acc_dtype(h))
    if temperature != 1.0:
        z.div_(temperature)
    return z


class _ChunkedLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature, chunk, with_entropy, fused, entropy_grad):
        n = hidden.shape[0]
        acc = _acc_dtype(hidden)
        logp = torch.empty(n, dtype=acc, device=hidden.device)
        lse = torch.empty(n, dtype=acc, device=hidden.device)
        ent = torch.empty(n if with_entropy else 0, dtype=acc, device=hidden.device)
        for s in range(0, n, chunk):
            if fused:
                c_lse, c_target, c_ent = logit_stats(hidden[s : s + chunk] @ weight.t(), targets[s : s + chunk],
                                                     temperature, with_entropy)
                lse[s : s + chunk] = c_lse
                logp[s : s + chunk] = c_target - c_lse
                if with_entropy:
                    ent[s : s + chunk] = c_ent
                continue
            z = _chunk_logits(hidden[s : s + chunk], weight, temperature)
            c_lse = torch.logsumexp(z, dim=-1)
            lse[s : s + chunk] = c_lse
            logp[s : s + chunk] = z.gather(1, targets[s : s + chunk, None]).squeeze(1) - c_lse
            if with_entropy:
                # H = lse - sum p z, with p = exp(z - lse) formed in place of z's copy.
                p = torch.exp(z - c_lse[:, None])
                ent[s : s + chunk] = c_lse - (p * z).sum(-1)
        ctx.save_for_backward(hidden, weight, targets, lse, ent)
        ctx.temperature, ctx.chunk, ctx.fused = temperature, chunk, fused
        if not entropy_grad:
            ctx.mark_non_differentiable(ent)
        ctx.set_materialize_grads(False)  # an output the loss does not use gets None, not zeros
        return logp, ent

    @staticmethod
    def backward(ctx, grad_logp, grad_ent):
        hidden, weight, targets, lse, ent = ctx.saved_tensors
        t, chunk = ctx.temperature, ctx.chunk
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=_acc_dtype(weight), device=weight.device) if need_w else None
        if grad_logp is None:
            grad_logp = torch.zeros_like(lse)
        for s in range(0, hidden.shape[0], chunk):
            h = hidden[s : s + chunk]
            if grad_ent is not None:
                # Entropy bonus: dL/dz = g_logp * (onehot - p) - g_H * p * (log p + H).
                z = _chunk_logits(h, weight, t)
                logp_all = z - lse[s : s + chunk, None]
                p = logp_all.exp()
                dz = -p * grad_logp[s : s + chunk, None]
                dz.scatter_add_(1, targets[s : s + chunk, None], grad_logp[s : s + chunk, None])
                dz -= grad_ent[s : s + chunk, None] * p * (logp_all + ent[s : s + chunk, None])
                dz = (dz / t).to(weight.dtype)
            elif ctx.fused:
                dz = logit_grad(h @ weight.t(), lse[s : s + chunk], targets[s : s + chunk], grad_logp[s : s + chunk],
                                t, weight.dtype)
            else:
                dz = _chunk_logits(h, weight, t)
                dz.sub_(lse[s : s + chunk, None]).exp_()  # p = softmax(z), in place
                dz.neg_().scatter_add_(1, targets[s : s + chunk, None], torch.ones_like(dz[:, :1]))  # onehot - p
                dz.mul_(grad_logp[s : s + chunk, None] / t)
                dz = dz.to(weight.dtype)
            if need_h:
                grad_h[s : s + chunk] = dz @ weight
            if need_w:
                grad_w += dz.t() @ h  # one GEMM per chunk in the weight's dtype, summed in fp32
        return grad_h, (grad_w.to(weight.dtype) if need_w else None), None, None, None, None, None, None


def sequence_logprobs(
    model, input_ids: Tensor, attention_mask: Tensor, mask: Tensor, temperature: float = 1.0,
    chunk: int = 4096, with_entropy: bool = False, entropy_grad: bool = False,
) -> tuple[Tensor, Tensor | None, Tensor]:
    """Per-token logprobs of a causal LM at the positions ``mask`` selects, without [B, L, V] logits.

    Runs the trunk (``model.model``) once and `chunked_logprobs` over the LM head for the selected
    positions only.

    Args:
        model: a transformers causal LM with ``.model`` (trunk) and a bias-free ``.lm_head``.
        input_ids: ``[B, L]`` int64.
        attention_mask: ``[B, L]`` int64 (1 on real tokens).
        mask: ``[B, L]`` float32; position ``t >= 1`` with ``mask > 0`` gets
            ``log p(input_ids[:, t] | input_ids[:, :t])`` (predicted at ``t - 1``).
        temperature, chunk, with_entropy, entropy_grad: as `chunked_logprobs`.

    Returns:
        ``(logp [B, L] fp32, entropy [B, L] fp32 or None, hidden [B, L, H])``, 0 where not selected;
        aligned like `app.trainer.grpo.token_logprobs`. ``hidden`` is the trunk output (for a
        critic-free caller it only keeps every layer in the autograd graph).

    Raises:
        ValueError: the LM head has a bias, or shapes disagree.
    """
    if getattr(model.lm_head, "bias", None) is not None:
        raise ValueError("lm_head has a bias; chunked logprobs support bias-free LM heads only")
    if mask.shape != input_ids.shape:
        raise ValueError(f"mask {tuple(mask.shape)} must match input_ids {tuple(input_ids.shape)}")
    hidden = model.model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
    sel = mask[:, 1:] > 0
    h = hidden[:, :-1][sel]
    weight = model.lm_head.weight
    logp, ent = chunked_logprobs(h.to(weight.dtype), weight, input_ids[:, 1:][sel], temperature, chunk,
                                 with_entropy, entropy_grad=entropy_grad)
    out = torch.zeros(input_ids.shape, dtype=torch.float32, device=hidden.device)
    out = torch.cat([out[:, :1], out[:, 1:].masked_scatter(sel, logp)], dim=1)
    ent_out = None
    if ent is not None:
        ent_out = torch.zeros(input_ids.shape, dtype=torch.float32, device=hidden.device)
        ent_out = torch.cat([ent_out[:, :1], ent_out[:, 1:].masked_scatter(sel, ent.float())], dim=1)
    return out, ent_out, hidden
