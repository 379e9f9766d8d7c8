"""PPO with a learned critic: token rewards, GAE, advantage whitening, clipped value loss.

Pure functions on padded token tensors with the conventions of app/trainer/grpo.py: token
tensors are ``[B, L]`` aligned with ``input_ids`` (position ``t`` holds the value for token
``input_ids[:, t]``, predicted from positions ``< t``); ``mask`` is the float32 completion mask.

The LLM as an MDP (as in OpenRLHF and verl): the state before completion token ``t`` is the
prompt plus the tokens before it, the action is token ``t``, and the episode ends after the last
completion token. The outcome reward of the whole completion is given at its last token; every
other token gets 0 (any KL penalty stays in the policy loss, as for GRPO). ``values[:, t]`` is the
critic's estimate V(s_t) of the state in which token ``t`` is chosen.

Sources:
  * generalized advantage estimation: Schulman, Moritz, Levine, Jordan, Abbeel 2016,
    "High-Dimensional Continuous Control Using Generalized Advantage Estimation"
    (arXiv:1506.02438), eq. 16: ``A_t = sum_l (gamma lambda)^l delta_{t+l}``,
    ``delta_t = r_t + gamma V(s_{t+1}) - V(s_t)``;
  * clipped surrogate and the squared-error value loss: Schulman, Wolski, Dhariwal, Radford,
    Klimov 2017, "Proximal Policy Optimization Algorithms" (arXiv:1707.06347), eq. 7 and 9; the
    clipped value loss ``max((V - R)^2, (V_old + clip(V - V_old, -eps, eps) - R)^2)`` and the
    advantage whitening are those of the authors' implementation (openai/baselines ``ppo2``).

The "old" values are the critic's before the batch's first optimizer step (app/trainer/step.py): with
one optimizer step per batch they are its current ones, so the value clip, like the policy ratio
clip, binds only from a batch's second step (``trainer.ppo_epochs`` > 1 or several mini-batches).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from app.model.parallel import collective_device
from app.trainer.grpo import LossOutput, grpo_loss


def token_rewards(rewards: Tensor, mask: Tensor) -> Tensor:
    """Place each sequence's outcome reward on its last completion token.

    Args:
        rewards: ``[B]`` float32, one scalar per completion.
        mask: ``[B, L]`` float32 completion mask.

    Returns:
        ``[B, L]`` float32: ``rewards[b]`` at the last position where ``mask[b] > 0``, 0
        elsewhere (a row with an empty mask gets no reward).

    Raises:
        ValueError: shapes disagree.
    """
    if mask.dim() != 2 or rewards.shape != mask.shape[:1]:
        raise ValueError(f"rewards {tuple(rewards.shape)} must be [B] of mask {tuple(mask.shape)} [B, L]")
    L = mask.shape[1]
    positions = torch.arange(L, device=mask.device).expand_as(mask)
    last = torch.where(mask > 0, positions, torch.full_like(positions, -1)).max(dim=1).values  # [B]
    out = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)
    has = last >= 0
    out[has.nonzero().squeeze(1), last[has]] = rewards[has].float()
    return out


@torch.no_grad()
def gae(rewards: Tensor, values: Tensor, mask: Tensor, gamma: float = 1.0, lam: float = 0.95) -> tuple[Tensor, Tensor]:
    """Generalized advantage estimates and value targets over each row's completion tokens.

    Backwards over positions (Schulman et al. 2016, eq. 16, the recursive form):
    ``delta_t = r_t + gamma * V_{t+1} * m_{t+1} - V_t`` and
    ``A_t = delta_t + gamma * lambda * m_{t+1} * A_{t+1}``, where ``m`` is the completion mask:
    the position after the last completion token is terminal (its value and advantage count
    as 0). Returns (value targets) are ``R_t = A_t + V_t``. Completion tokens must be
    contiguous in each row (prompt, then completion, then padding), as `collate_groups` makes them.

    Args:
        rewards: ``[B, L]`` float32 token rewards (`token_rewards`).
        values: ``[B, L]`` float32 critic values (detached here).
        mask: ``[B, L]`` float32 completion mask.
        gamma: discount in [0, 1].
        lam: GAE lambda in [0, 1] (0: one-step TD; 1: Monte-Carlo return minus V).

    Returns:
        ``(advantages, returns)``, each ``[B, L]`` float32, 0 outside the mask.

    Raises:
        ValueError: shapes disagree or gamma / lam outside [0, 1].
    """
    if not (rewards.shape == values.shape == mask.shape) or rewards.dim() != 2:
        raise ValueError(
            f"rewards {tuple(rewards.shape)}, values {tuple(values.shape)} and mask {tuple(mask.shape)} "
            "must all be the same [B, L]"
        )
    if not (0.0 <= gamma <= 1.0 and 0.0 <= lam <= 1.0):
        raise ValueError(f"gamma and lam must lie in [0, 1], got gamma={gamma}, lam={lam}")
    rewards, values, mask = rewards.float(), values.detach().float(), mask.float()
    B, L = mask.shape
    advantages = torch.zeros_like(values)
    next_adv = torch.zeros(B, dtype=torch.float32, device=values.device)
    next_value = torch.zeros_like(next_adv)
    next_mask = torch.zeros_like(next_adv)
    for t in reversed(range(L)):
        delta = rewards[:, t] + gamma * next_value * next_mask - values[:, t]
        adv = delta + gamma * lam * next_mask * next_adv
        advantages[:, t] = adv
        next_adv, next_value, next_mask = adv, values[:, t], mask[:, t]
    advantages = advantages * mask
    returns = (advantages + values) * mask
    return advantages, returns


def whiten(x: Tensor, mask: Tensor, eps: float = 1e-8, distributed: bool = True,
           device: torch.device | str | None = None) -> Tensor:
    """Advantage whitening: ``(x - mean) / sqrt(var + eps)`` over the masked tokens of the WHOLE
    batch, 0 outside the mask (the advantage normalisation of the PPO authors' implementation,
    openai/baselines ppo2, used with Schulman et al. 2017; verl and OpenRLHF do the same).

    Two passes in float64: the mean first, then the mean squared deviation from it. The one-pass
    ``E[x^2] - E[x]^2`` in float32 cancels catastrophically once ``|mean| / std`` passes ~1e3
    (advantages of a large constant reward with a young critic), giving a std far from the truth.

    With a process group of several ranks (each holding part of the batch) the mean and the
    (biased) variance are of every rank's tokens: the sums are all-reduced (twice), so this is a
    collective that every rank must call, also with an empty mask. The all-reduced tensors live
    on ``device`` (the trainer's; an NCCL group refuses CPU tensors), which defaults to ``x``'s.

    Args:
        x: ``[B, L]`` float32.
        mask: ``[B, L]`` float32 completion mask.
        eps: added to the variance.
        distributed: all-reduce over the default process group when it has > 1 rank.
        device: where the all-reduced moments live; None: the group's collective device
            (`app.model.parallel.collective_device`), or ``x.device`` without a group.

    Returns:
        ``[B, L]`` float32, on ``x``'s device.
    """
    if x.shape != mask.shape:
        raise ValueError(f"x {tuple(x.shape)} and mask {tuple(mask.shape)} differ")
    reduce = distributed and dist.is_initialized() and dist.get_world_size() > 1
    if device is not None:
        dev = torch.device(device)
    else:  # NCCL refuses host tensors: reduce on the group's device

        dev = collective_device() if reduce else x.device
    x, mask = x.detach().double(), mask.double()

    def total(t: Tensor) -> Tensor:
        t = t.to(dev)
        if reduce:
            dist.all_reduce(t, op=dist.ReduceOp.SUM)
        return t.to(x.device)

    first = total(torch.stack([mask.sum(), (x * mask).sum()]))
    n = first[0].clamp(min=1.0)
    mean = first[1] / n
    var = total(((x - mean).square() * mask).sum().reshape(1))[0] / n
    return ((x - mean) * torch.rsqrt(var + eps) * mask).float()


def value_loss(
    values: Tensor,
    old_values: Tensor,
    returns: Tensor,
    mask: Tensor,
    clip_eps: float | None = 0.2,
    denominator: float | Tensor | None = None,
) -> LossOutput:
    """The clipped value loss of PPO (token-mean).

    Per token: ``0.5 * max((V - R)^2, (V_old + clip(V - V_old, -eps, eps) - R)^2)``; with
    ``clip_eps=None`` just ``0.5 * (V - R)^2``. Clipping keeps the critic from moving more than
    ``eps`` from the values the advantages were computed with (baselines ppo2; Schulman et al. 2017).
    The sum over masked tokens is divided by ``denominator`` (the global completion-token count
    when the batch is split over ranks) or by the local token count.

    Args:
        values: ``[B, L]`` float32, current critic values, with gradient.
        old_values: ``[B, L]`` float32, values the returns were computed with (detached here).
        returns: ``[B, L]`` float32 value targets (`gae`).
        mask: ``[B, L]`` float32 completion mask.
        clip_eps: clip range of the value change, > 0, or None for no clipping.
        denominator: see above.

    Returns:
        `LossOutput` with sums of ``tokens``, ``vf_loss``, ``vf_clip_frac`` (tokens where the
        clipped term is the larger), ``value``, ``return``, ``value_error`` ((V - R)^2) — divide
        by ``tokens`` (`grpo.finish_stats`) for means.

    Raises:
        ValueError: shapes disagree or ``clip_eps <= 0``.
    """
    if not (values.shape == old_values.shape == returns.shape == mask.shape):
        raise ValueError(
            f"values {tuple(values.shape)}, old_values {tuple(old_values.shape)}, returns "
            f"{tuple(returns.shape)} and mask {tuple(mask.shape)} must all be the same [B, L]"
        )
    if clip_eps is not None and clip_eps <= 0:
        raise ValueError(f"clip_eps must be > 0 or None, got {clip_eps}")
    mask = mask.float()
    values = values.float()
    old = old_values.detach().float()
    returns = returns.detach().float()
    unclipped = (values - returns).square()
    if clip_eps is None:
        per_token = 0.5 * unclipped
        clipped_frac = torch.zeros_like(unclipped)
    else:
        v_clip = old + (values - old).clamp(-clip_eps, clip_eps)
        clipped = (v_clip - returns).square()
        per_token = 0.5 * torch.maximum(unclipped, clipped)
        clipped_frac = (clipped > unclipped).float()
    total = (per_token * mask).sum()
    n = mask.sum() if denominator is None else denominator
    loss = total / n.clamp(min=1) if isinstance(n, Tensor) else total / max(float(n), 1.0)
    with torch.no_grad():
        sums = {
            "tokens": mask.sum(),
            "vf_loss": (per_token.detach() * mask).sum(),
            "vf_clip_frac": (clipped_frac * mask).sum(),
            "value": (values.detach() * mask).sum(),
            "return": (returns * mask).sum(),
            "value_error": (unclipped.detach() * mask).sum(),
        }
    return LossOutput(loss=loss, sums=sums, maxima={})


def ppo_policy_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    **kwargs,
) -> LossOutput:
    """The clipped policy loss of GRPO (`grpo.grpo_loss`: DAPO clip ranges, TIS, k3 KL) with
    one advantage per TOKEN, as PPO's GAE gives.

    `grpo_loss` takes one advantage per row; every quantity in it is per token, so each token is
    passed as a row of its own (``[B, L] -> [B * L, 1]``) and the loss, sums and maxima are
    exactly those of the per-token formula. Only ``loss_agg="token-mean"`` keeps its meaning
    under that view (a row is no longer a sequence), so ``seq-mean`` is refused.

    Args:
        logprobs, old_logprobs, mask: ``[B, L]`` as for `grpo_loss`.
        advantages: ``[B, L]`` float32 per-token advantages (whitened GAE).
        kwargs: the keyword arguments of `grpo_loss`; ``rollout_logprobs`` / ``ref_logprobs`` /
            ``entropy`` ``[B, L]`` when given.

    Raises:
        ValueError: ``advantages`` is not ``[B, L]``, ``loss_agg`` is not token-mean,
            ``ratio_level`` or ``rollout_is`` is sequence-level, or any error of `grpo_loss`.
    """
    if advantages.shape != logprobs.shape or logprobs.dim() != 2:
        raise ValueError(f"advantages {tuple(advantages.shape)} must be [B, L] like logprobs {tuple(logprobs.shape)}")
    if kwargs.get("loss_agg", "token-mean") != "token-mean":
        raise ValueError(f"PPO needs trainer.loss_agg='token-mean', got {kwargs['loss_agg']!r}")
    # A row of the per-token view is one token: a sequence-level ratio or weight would silently
    # become a token-level one.
    if kwargs.get("ratio_level", "token") != "token":
        raise ValueError(f"PPO needs trainer.ratio_level='token', got {kwargs['ratio_level']!r}")
    if str(kwargs.get("rollout_is", "token_truncate")).startswith("sequence"):
        raise ValueError(f"PPO needs a token-level trainer.rollout_is, got {kwargs['rollout_is']!r}")

    def rows(x: Tensor | None) -> Tensor | None:
        return None if x is None else x.reshape(-1, 1)

    for key in ("rollout_logprobs", "ref_logprobs", "entropy"):
        kwargs[key] = rows(kwargs.get(key))
    return grpo_loss(rows(logprobs), rows(old_logprobs), advantages.reshape(-1), rows(mask), **kwargs)


@dataclass
class PPOTargets:
    """What a PPO step derives from one batch before its losses (all ``[B, L]`` float32, 0 off the mask).

    Attributes:
        values: critic values at rollout time (the "old" values of the value loss; detached).
        returns: GAE value targets.
        advantages: whitened GAE advantages (whole-batch statistics).
    """

    values: Tensor
    returns: Tensor
    advantages: Tensor


def ppo_targets(rewards: Tensor, values: Tensor, mask: Tensor, gamma: float, lam: float,
                whiten_advantages: bool = True, device: torch.device | str | None = None) -> PPOTargets:
    """Token rewards -> GAE -> (optionally) whitened advantages, for one batch. Collective when
    whitening under a process group of several ranks (see `whiten`).

    Args:
        rewards: ``[B]`` float32 outcome rewards.
        values: ``[B, L]`` critic values (detached here).
        mask: ``[B, L]`` float32 completion mask.
        gamma, lam: see `gae`.
        whiten_advantages: normalise the advantages over the whole batch.
        device: the trainer's device, where the whitening's all-reduce runs (None: the tensors').
    """
    values = values.detach().float() * mask
    advantages, returns = gae(token_rewards(rewards, mask), values, mask, gamma, lam)
    if whiten_advantages:
        advantages = whiten(advantages, mask, device=device)
    return PPOTargets(values=values, returns=returns, advantages=advantages)
