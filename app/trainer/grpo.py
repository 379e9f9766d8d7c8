"""GRPO losses and statistics: pure functions on padded token tensors.

Conventions shared by every function here (and by app/trainer/batch.py):
  * token tensors are ``[B, L]``, aligned with ``input_ids``: position ``t`` holds the value for
    token ``input_ids[:, t]`` (its log-probability is predicted by the logits at ``t - 1``);
  * ``mask`` is the completion mask ``[B, L]`` (1.0 on completion tokens, 0.0 on prompt and
    padding), float32;
  * log-probabilities are float32 natural logs.

Sources:
  * group-relative advantages: Shao et al. 2024, "DeepSeekMath" (arXiv:2402.03300), §4.1.2;
    dropping the std division: Liu et al. 2025, "Understanding R1-Zero-Like Training: A Critical
    Perspective" (Dr. GRPO, arXiv:2503.20783);
  * clipped surrogate: Schulman et al. 2017, "Proximal Policy Optimization" (arXiv:1707.06347),
    with separate low/high clip ranges from Yu et al. 2025, "DAPO" (arXiv:2503.14476), §3.1;
  * k3 KL estimator: J. Schulman 2020, "Approximating KL divergence"
    (http://joschu.net/blog/kl-approx.html);
  * truncated importance sampling against the engine's logprobs: Yao et al. 2025, "Your efficient
    RL framework secretly brings you off-policy RL training" (fengyao.notion.site/off-policy-rl);
    its sequence-level and masked variants: Liu, Li et al. 2025, "When Speed Kills Stability:
    Demystifying RL Collapse from the Training-Inference Mismatch" (the modes of TRL's
    ``vllm_importance_sampling_mode`` and verl's ``rollout_is``);
  * sequence-level ratio and clipping: Zheng et al. 2025, "Group Sequence Policy Optimization"
    (GSPO, arXiv:2507.18071), eq. 5-7;
  * Dr. GRPO's constant normaliser: Liu et al. 2025 (arXiv:2503.20783), eq. 3 (TRL's
    ``loss_type="dr_grpo"``, verl's ``seq-mean-token-sum-norm``);
  * dual-clip for negative advantages: Ye et al. 2020, "Mastering Complex Control in MOBA Games
    with Deep Reinforcement Learning" (arXiv:1912.09729), eq. 5;
  * the soft overlong penalty: Yu et al. 2025 (DAPO), §3.4, eq. 13;
  * the entropy bonus: the mean token entropy subtracted from the loss (TRL's ``entropy_coef``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

# exp() of a log-ratio beyond this overflows float32 long before it means anything; clamp it.
_MAX_LOG_RATIO = 20.0

LOSS_AGGS = ("token-mean", "seq-mean", "seq-mean-token-sum-norm")
RATIO_LEVELS = ("token", "sequence")
IS_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")


def group_advantages(
    rewards: Tensor, group_ids: Tensor, scale_by_std: bool = True, eps: float = 1e-4
) -> Tensor:
    """Group-normalized advantages, one per completion (GRPO outcome supervision).

    ``A_i = (r_i - mean(r_group)) / (std(r_group) + eps)`` (DeepSeekMath §4.1.2), or
    ``A_i = r_i - mean(r_group)`` when ``scale_by_std`` is False (Dr. GRPO, which removes the
    std division because it up-weights groups whose rewards barely differ). The std is the
    unbiased (N-1) sample std, as in TRL and verl; a group of one sample gets advantage 0.

    A group whose rewards are all equal gets advantages of exactly 0: in float arithmetic its
    centred rewards are a rounding residue of one sign for the whole group (eight rewards of 0.6
    leave +-6e-8), which the division by ``std + eps`` would scale up to a training signal. The
    mean and std are computed in float64 for the same reason.

    Args:
        rewards: ``[B]`` float32, one scalar reward per completion.
        group_ids: ``[B]`` int64 in ``[0, n_groups)``; completions of one prompt share an id.
        scale_by_std: divide by the group's reward std.
        eps: added to the std, TRL's 1e-4 (``GRPOTrainer._generate_and_score_completions``): a
            group whose rewards differ by rounding (1 ulp apart) keeps advantages near 0 where
            verl's 1e-6 would scale the residue up to a training signal (above 1).

    Returns:
        ``[B]`` float32 advantages.

    Raises:
        ValueError: ``rewards`` and ``group_ids`` are not 1-D of the same length, ``group_ids``
            is not an integer tensor or has negative ids, or a reward is not finite.
    """
    if rewards.dim() != 1 or group_ids.shape != rewards.shape:
        raise ValueError(
            f"rewards {tuple(rewards.shape)} and group_ids {tuple(group_ids.shape)} must be 1-D "
            "tensors of the same length"
        )
    if group_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"group_ids must be an integer tensor, got {group_ids.dtype}")
    if rewards.numel() == 0:
        return rewards.float().clone()
    if int(group_ids.min()) < 0:
        raise ValueError("group_ids must be >= 0")
    if not torch.isfinite(rewards).all():
        raise ValueError("rewards contain NaN or inf")
    r = rewards.double()
    group_ids = group_ids.long()
    n_groups = int(group_ids.max()) + 1
    zeros = r.new_zeros(n_groups)
    count = zeros.index_add(0, group_ids, torch.ones_like(r))
    mean = zeros.index_add(0, group_ids, r) / count.clamp(min=1)
    lo = torch.full_like(zeros, math.inf).scatter_reduce(0, group_ids, r, "amin")
    hi = torch.full_like(zeros, -math.inf).scatter_reduce(0, group_ids, r, "amax")
    flat = (lo == hi)[group_ids]
    centered = torch.where(flat, torch.zeros_like(r), r - mean[group_ids])
    if not scale_by_std:
        return centered.float()
    sq = zeros.index_add(0, group_ids, centered.square())
    std = (sq / (count - 1).clamp(min=1)).sqrt()
    return (centered / (std[group_ids] + eps)).float()


def soft_overlong_penalty(lengths: Tensor, max_tokens: int, buffer_tokens: int, factor: float = 1.0) -> Tensor:
    """DAPO's soft overlong punishment (Yu et al. 2025, §3.4, eq. 13), added to each reward.

    ``0`` for ``len <= max - buffer``; ``factor * ((max - buffer) - len) / buffer`` inside the last
    ``buffer`` tokens (a ramp from 0 to ``-factor``); ``-factor`` beyond ``max``.

    Args:
        lengths: ``[B]`` completion lengths in tokens (the policy's tokens).
        max_tokens: ``L_max``, the generation limit (``rollout.max_new_tokens``).
        buffer_tokens: ``L_cache``, the soft punishment interval, ``1 <= buffer <= max``.
        factor: the penalty at ``L_max`` (DAPO: 1.0).

    Returns:
        ``[B]`` float32, each <= 0.

    Raises:
        ValueError: ``buffer_tokens`` outside ``[1, max_tokens]``.
    """
    if not 1 <= buffer_tokens <= max_tokens:
        raise ValueError(f"buffer_tokens must lie in [1, max_tokens={max_tokens}], got {buffer_tokens}")
    expected = max_tokens - buffer_tokens
    over = (expected - lengths.double()) / buffer_tokens
    return (over.clamp(min=-1.0, max=0.0) * factor).float()


def token_logprobs(logits: Tensor, input_ids: Tensor, temperature: float = 1.0) -> Tensor:
    """Log-probabilities of the given tokens: ``log_softmax(logits / temperature)`` at each token.

    The engine samples from ``softmax(logits / temperature)`` and reports the logprob of the
    sampled token the same way, so trainer and rollout logprobs are comparable.

    Args:
        logits: ``[B, L, V]`` (any float dtype; computed in float32).
        input_ids: ``[B, L]`` int64.
        temperature: sampling temperature, > 0.

    Returns:
        ``[B, L]`` float32; position 0 is 0.0 (no prediction for the first token), position
        ``t >= 1`` is ``log p(input_ids[:, t] | input_ids[:, :t])``.

    Raises:
        ValueError: shapes disagree or temperature <= 0.
    """
    if logits.dim() != 3 or logits.shape[:2] != input_ids.shape:
        raise ValueError(
            f"logits {tuple(logits.shape)} must be [B, L, V] with [B, L] = input_ids "
            f"{tuple(input_ids.shape)}"
        )
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    scaled = logits[:, :-1].float() / temperature
    # gather - logsumexp avoids materializing a second [B, L, V] log_softmax tensor.
    picked = scaled.gather(-1, input_ids[:, 1:, None]).squeeze(-1)
    out = picked - torch.logsumexp(scaled, dim=-1)
    return torch.nn.functional.pad(out, (1, 0), value=0.0)


@torch.no_grad()
def token_entropy(logits: Tensor, temperature: float = 1.0) -> Tensor:
    """Entropy of the sampling distribution at each position, aligned like `token_logprobs`.

    ``H_t = -sum_v p_v log p_v`` with ``p = softmax(logits[:, t-1] / temperature)``. No gradient;
    for monitoring only (it costs one extra pass over ``[B, L, V]``).

    Returns:
        ``[B, L]`` float32; position 0 is 0.0.
    """
    logp = torch.log_softmax(logits[:, :-1].float() / temperature, dim=-1)
    ent = -(logp.exp() * logp).sum(-1)
    return torch.nn.functional.pad(ent, (1, 0), value=0.0)


def tis_weights(old_logprobs: Tensor, rollout_logprobs: Tensor, cap: float | None) -> Tensor | None:
    """Truncated importance-sampling weights ``min(exp(old - rollout), cap)``, detached: the
    ``token_truncate`` mode of `rollout_is_weights` over every position.

    The engine (sampler) and the trainer compute slightly different probabilities for the same
    weights (kernels, precision) and, in asynchronous RL, for different weights; weighting each
    token's loss by the truncated ratio corrects the gradient towards the trainer's policy
    (Yao et al. 2025).

    Args:
        old_logprobs: ``[B, L]`` float32, the trainer's logprobs under the weights that the
            loss treats as "old" (here: the current weights, detached).
        rollout_logprobs: ``[B, L]`` float32, the engine's logprobs of the same tokens.
        cap: the truncation C; None disables the correction (returns None).

    Returns:
        ``[B, L]`` float32 or None.
    """
    if cap is None:
        return None
    return rollout_is_weights(old_logprobs, rollout_logprobs, torch.ones_like(rollout_logprobs), "token_truncate", cap)[0]


def rollout_is_weights(
    old_logprobs: Tensor, rollout_logprobs: Tensor, mask: Tensor, mode: str = "token_truncate",
    cap: float = 2.0, cap_min: float | None = None,
) -> tuple[Tensor, Tensor]:
    """Importance-sampling weights of the trainer's policy against the engine's, detached.

    The ratio is ``exp(old - rollout)`` per token (``token_*``) or, for the whole completion,
    ``exp(sum_t (old_t - rollout_t))`` (``sequence_*``: the product of the token ratios, the
    unbiased sequence-level weight), its log clamped to +-20. ``*_truncate`` clamps it to
    ``[cap_min, cap]`` (truncated IS; ``token_truncate`` with no ``cap_min`` is Yao et al.'s
    TIS); ``*_mask`` keeps it where it lies in ``[cap_min, cap]`` and sets it to 0 elsewhere
    (masked IS: a token or a whole completion whose engine/trainer ratio leaves the band gets
    no gradient). These are TRL's ``vllm_importance_sampling_mode`` values (TRL 1.16
    ``GRPOTrainer._generate_and_score_completions``) and verl's ``rollout_is`` token/sequence
    levels.

    Args:
        old_logprobs: ``[B, L]`` float32, the trainer's logprobs (the "old" policy of the loss).
        rollout_logprobs: ``[B, L]`` float32, the engine's logprobs of the same tokens.
        mask: ``[B, L]`` float32 completion mask (the sequence sums run over it).
        mode: one of `IS_MODES`.
        cap: upper bound C_max, > 0.
        cap_min: lower bound C_min or None (no lower bound).

    Returns:
        ``(weights [B, L], dropped [B, L])`` float32: the weights (a sequence's weight repeated on
        its tokens), and 1.0 where a ``*_mask`` mode zeroed the weight.

    Raises:
        ValueError: unknown ``mode`` or shapes differ.
    """
    if mode not in IS_MODES:
        raise ValueError(f"rollout_is mode must be one of {IS_MODES}, got {mode!r}")
    if not old_logprobs.shape == rollout_logprobs.shape == mask.shape:
        raise ValueError(f"old_logprobs {tuple(old_logprobs.shape)}, rollout_logprobs "
                         f"{tuple(rollout_logprobs.shape)} and mask {tuple(mask.shape)} must be the same [B, L]")
    d = (old_logprobs.detach().float() - rollout_logprobs.float()) * mask
    if mode.startswith("sequence"):
        d = d.sum(-1, keepdim=True)
    w = d.clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO).exp()
    if mode.endswith("truncate"):
        w = w.clamp(min=cap_min, max=cap)
        dropped = torch.zeros_like(w)
    else:
        out = (w > cap) | (w < cap_min if cap_min is not None else torch.zeros_like(w, dtype=torch.bool))
        w = w.masked_fill(out, 0.0)
        dropped = out.float()
    return w.expand_as(mask), dropped.expand_as(mask)


def kl_k3(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """Per-token k3 estimator of KL(pi_theta || pi_ref) for tokens sampled from pi_theta.

    ``k3 = exp(ref - logp) - (ref - logp) - 1`` (Schulman 2020): unbiased, always >= 0, low
    variance. The log-ratio is clamped to +-20 so exp() cannot overflow.

    Args:
        logprobs: ``[B, L]`` float32 under the policy being trained (with gradient).
        ref_logprobs: ``[B, L]`` float32 under the reference policy.

    Returns:
        ``[B, L]`` float32.
    """
    log_ratio = (ref_logprobs - logprobs).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    return log_ratio.exp() - log_ratio - 1.0


def aggregate(
    per_token: Tensor, mask: Tensor, loss_agg: str, denominator: float | Tensor | None = None,
    norm_tokens: int | None = None,
) -> Tensor:
    """Reduce a per-token loss ``[B, L]`` to a scalar.

    * ``token-mean`` (default; DAPO §3.3): ``sum(loss * mask) / n_tokens`` — every token
      weighs the same, so long completions are not down-weighted.
    * ``seq-mean`` (the original GRPO objective, DeepSeekMath eq. 3): the mean over sequences
      of each sequence's token mean.
    * ``seq-mean-token-sum-norm`` (Dr. GRPO, Liu et al. 2025, eq. 3): ``sum(loss * mask) /
      (n_sequences * norm_tokens)`` with a constant ``norm_tokens`` (the most tokens a completion
      may have), so neither the length of a completion nor the batch's token count scales its
      gradient. TRL ``loss_type="dr_grpo"`` (``max_completion_length``), verl
      ``seq-mean-token-sum-norm``.

    ``denominator`` replaces the local count (tokens for token-mean, sequences for the other two)
    by a global one: with data split over ranks, each rank divides by the global count so that
    summing the ranks' gradients gives the full-batch gradient.

    Raises:
        ValueError: unknown ``loss_agg``, shapes differ, or ``seq-mean-token-sum-norm`` without a
            positive ``norm_tokens``.
    """
    if per_token.shape != mask.shape:
        raise ValueError(f"loss {tuple(per_token.shape)} and mask {tuple(mask.shape)} differ")
    if loss_agg == "token-mean":
        total = (per_token * mask).sum()
        n = mask.sum() if denominator is None else denominator
    elif loss_agg == "seq-mean":
        seq = (per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1)
        total = seq.sum()
        n = mask.shape[0] if denominator is None else denominator
    elif loss_agg == "seq-mean-token-sum-norm":
        if norm_tokens is None or norm_tokens < 1:
            raise ValueError(f"loss_agg 'seq-mean-token-sum-norm' needs norm_tokens >= 1, got {norm_tokens}")
        total = (per_token * mask).sum()
        n = (mask.shape[0] if denominator is None else denominator) * norm_tokens
    else:
        raise ValueError(f"loss_agg must be one of {LOSS_AGGS}, got {loss_agg!r}")
    if isinstance(n, Tensor):
        return total / n.clamp(min=1)
    return total / max(float(n), 1.0)


@dataclass
class LossOutput:
    """What `grpo_loss` returns.

    ``loss`` is the scalar to back-propagate. ``sums`` holds masked per-token sums (``"tokens"``
    is the token count) that can be all-reduced over ranks and then divided by the global
    token count (`finish_stats`); ``maxima`` holds per-token maxima (all-reduce with MAX).
    """

    loss: Tensor
    sums: dict[str, Tensor]
    maxima: dict[str, Tensor]


def grpo_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    clip_eps_low: float = 0.2,
    clip_eps_high: float = 0.28,
    loss_agg: str = "token-mean",
    denominator: float | Tensor | None = None,
    rollout_logprobs: Tensor | None = None,
    tis_cap: float | None = None,
    ref_logprobs: Tensor | None = None,
    kl_coef: float = 0.0,
    ratio_level: str = "token",
    rollout_is: str = "token_truncate",
    rollout_is_min: float | None = None,
    dual_clip: float | None = None,
    entropy: Tensor | None = None,
    entropy_coef: float = 0.0,
    token_denominator: float | Tensor | None = None,
    norm_tokens: int | None = None,
) -> LossOutput:
    """The GRPO policy loss: clipped surrogate (token or sequence ratio), optional dual-clip,
    importance weights against the engine, k3 KL penalty and entropy bonus.

    Per token (advantage ``A`` of the token's sequence):
    ``l = -min(rho * A, clip(rho, 1 - eps_low, 1 + eps_high) * A) * w + kl_coef * k3``, reduced
    by `aggregate`, minus ``entropy_coef`` x the token mean of the entropy. PPO clipping
    (Schulman et al. 2017) with DAPO's clip-higher (Yu et al. 2025); the ratio ``rho`` is
    ``exp(logp - old)`` per token, or with ``ratio_level="sequence"`` (GSPO, Zheng et al. 2025,
    eq. 7) the geometric mean over the sequence's tokens ``exp(mean_t (logp_t - old_t))``, one
    ratio (and one clipping decision) per sequence — TRL ``importance_sampling_level``. With
    ``dual_clip = c > 1`` the loss of a token with ``A < 0`` is also bounded by ``-c * A`` (Ye et
    al. 2020), so a ratio far above 1 cannot push a bad sample's probability down without limit
    (TRL's two-sided ``delta`` computes the same). ``w`` is `rollout_is_weights` (``tis_cap`` is
    its C_max) or 1; ``k3`` is `kl_k3` (Schulman 2020).

    Args:
        logprobs: ``[B, L]`` float32, current policy, with gradient.
        old_logprobs: ``[B, L]`` float32, behaviour policy of the update (detached here).
        advantages: ``[B]`` float32, one per sequence.
        mask: ``[B, L]`` float32 completion mask.
        clip_eps_low, clip_eps_high: clip range ``[1 - low, 1 + high]`` of the ratio.
        loss_agg: one of `LOSS_AGGS`.
        denominator: global token (token-mean) or sequence count; see `aggregate`.
        rollout_logprobs: ``[B, L]`` float32 engine logprobs; needed when ``tis_cap`` is set.
        tis_cap: C_max of the importance weights; None disables the correction.
        ref_logprobs: ``[B, L]`` float32 reference-policy logprobs; needed when ``kl_coef > 0``.
        kl_coef: weight of the k3 KL penalty.
        ratio_level: ``"token"`` or ``"sequence"`` (GSPO).
        rollout_is: the weights' mode, one of `IS_MODES`.
        rollout_is_min: C_min of the importance weights, or None.
        dual_clip: the dual-clip bound c (> 1), or None.
        entropy: ``[B, L]`` float32 token entropies with gradient; needed when ``entropy_coef > 0``.
        entropy_coef: weight of the entropy bonus (>= 0).
        token_denominator: global completion-token count for the entropy mean (None: local).
        norm_tokens: the constant of ``seq-mean-token-sum-norm``.

    Returns:
        `LossOutput` with sums of: ``tokens``, ``pg_loss`` (unweighted by the importance weights),
        ``clipped`` (tokens where the clipped branch is taken), ``ratio``, ``approx_kl`` (k3 of
        KL(old || current), per token), ``mismatch_kl`` (k3 of KL(engine || old), when rollout
        logprobs are given), ``tis``, ``tis_truncated`` (tokens at the cap) and ``is_masked``
        (tokens whose weight a mask mode zeroed), ``dual_clipped``, ``kl_ref``; and maxima of
        ``ratio`` and ``tis``.

    Raises:
        ValueError: shapes disagree, ``clip_eps_*`` negative, an unknown ``ratio_level``, a
            ``dual_clip`` <= 1, or TIS / KL / the entropy bonus requested without the tensors
            they need.
    """
    if not (logprobs.shape == old_logprobs.shape == mask.shape) or logprobs.dim() != 2:
        raise ValueError(
            f"logprobs {tuple(logprobs.shape)}, old_logprobs {tuple(old_logprobs.shape)} and "
            f"mask {tuple(mask.shape)} must all be the same [B, L]"
        )
    if advantages.shape != logprobs.shape[:1]:
        raise ValueError(f"advantages {tuple(advantages.shape)} must be [B={logprobs.shape[0]}]")
    if clip_eps_low < 0 or clip_eps_high < 0:
        raise ValueError(f"clip_eps_low/high must be >= 0, got {clip_eps_low}, {clip_eps_high}")
    if ratio_level not in RATIO_LEVELS:
        raise ValueError(f"ratio_level must be one of {RATIO_LEVELS}, got {ratio_level!r}")
    if dual_clip is not None and dual_clip <= 1.0:
        raise ValueError(f"dual_clip must be > 1, got {dual_clip}")
    if tis_cap is not None and rollout_logprobs is None:
        raise ValueError("tis_cap is set but rollout_logprobs is None")
    if kl_coef > 0 and ref_logprobs is None:
        raise ValueError("kl_coef > 0 but ref_logprobs is None")
    if entropy_coef > 0 and (entropy is None or entropy.shape != mask.shape):
        raise ValueError(f"entropy_coef > 0 needs entropy [B, L] = {tuple(mask.shape)}, got "
                         f"{None if entropy is None else tuple(entropy.shape)}")

    mask = mask.float()
    old = old_logprobs.detach()
    token_log_ratio = (logprobs - old).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    if ratio_level == "sequence":
        seq = ((logprobs - old) * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1)
        log_ratio = seq.clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO).expand_as(logprobs)
    else:
        log_ratio = token_log_ratio
    ratio = log_ratio.exp()
    adv = advantages.float()[:, None]
    unclipped = -ratio * adv
    clipped = -ratio.clamp(1.0 - clip_eps_low, 1.0 + clip_eps_high) * adv
    pg = torch.maximum(unclipped, clipped)
    dual = None
    if dual_clip is not None:
        bound = -dual_clip * adv  # > 0 where A < 0
        dual = (adv < 0) & (pg > bound)
        pg = torch.where(adv < 0, torch.minimum(pg, bound), pg)

    per_token = pg
    w = dropped = None
    if tis_cap is not None:
        w, dropped = rollout_is_weights(old, rollout_logprobs, mask, rollout_is, tis_cap, rollout_is_min)
        per_token = per_token * w
    kl_ref = None
    if kl_coef > 0:
        kl_ref = kl_k3(logprobs, ref_logprobs.detach())
        per_token = per_token + kl_coef * kl_ref
    loss = aggregate(per_token, mask, loss_agg, denominator, norm_tokens)
    if entropy_coef > 0:
        n = mask.sum() if token_denominator is None else token_denominator
        n = n.clamp(min=1) if isinstance(n, Tensor) else max(float(n), 1.0)
        loss = loss - entropy_coef * (entropy.float() * mask).sum() / n

    with torch.no_grad():
        d = token_log_ratio.detach()

        def msum(x: Tensor) -> Tensor:
            return (x * mask).sum()

        def mmax(x: Tensor) -> Tensor:
            return torch.where(mask > 0, x, torch.full_like(x, float("-inf"))).max()

        sums = {
            "tokens": mask.sum(),
            "pg_loss": msum(pg.detach()),
            "clipped": msum((clipped > unclipped).float()),
            "ratio": msum(ratio.detach()),
            # k3 of KL(old || current): tokens were sampled from old, r = current / old.
            "approx_kl": msum(d.exp() - d - 1.0),
        }
        maxima = {"ratio": mmax(ratio.detach())}
        if rollout_logprobs is not None:
            # k3 of KL(engine || trainer) on the engine's samples: the train/inference mismatch.
            m = (old - rollout_logprobs).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
            sums["mismatch_kl"] = msum(m.exp() - m - 1.0)
        if w is not None:
            sums["tis"] = msum(w)
            sums["tis_truncated"] = msum((w >= tis_cap).float())
            sums["is_masked"] = msum(dropped)
            maxima["tis"] = mmax(w)
        if dual is not None:
            sums["dual_clipped"] = msum(dual.float())
        if kl_ref is not None:
            sums["kl_ref"] = msum(kl_ref.detach())
    return LossOutput(loss=loss, sums=sums, maxima=maxima)


def finish_stats(sums: dict[str, Tensor], maxima: dict[str, Tensor]) -> dict[str, float]:
    """Turn (already all-reduced) token sums into per-token means and plain floats.

    Every key of ``sums`` except ``tokens`` is divided by ``sums["tokens"]``; ``clipped``
    becomes ``clip_frac``, ``tis_truncated`` ``tis_trunc_frac``, ``is_masked`` ``is_masked_frac``
    and ``dual_clipped`` ``dual_clip_frac``; maxima get a ``_max`` suffix. ``tokens`` is kept as
    a count.
    """
    n = max(float(sums["tokens"]), 1.0)
    rename = {"clipped": "clip_frac", "tis_truncated": "tis_trunc_frac", "is_masked": "is_masked_frac",
              "dual_clipped": "dual_clip_frac"}
    out = {"tokens": float(sums["tokens"])}
    for k, v in sums.items():
        if k != "tokens":
            out[rename.get(k, k)] = float(v) / n
    for k, v in maxima.items():
        out[f"{k}_max"] = float(v)
    return out
