"""Collate whole GRPO groups into padded training tensors, and split them over trainer ranks.

Each row is one sample: ``prompt_ids + completion_ids``, right-padded to the longest row (right
padding keeps position ids ``0..n-1`` for every row, as the engine saw them). Token tensors are
aligned with ``input_ids`` (see app/trainer/grpo.py): the rollout logprob of completion token
``completion_ids[j]`` sits at position ``len(prompt_ids) + j``.

Multi-turn samples (app/rollout/episodes.py) carry a token-level ``loss_mask``: the completion
mask is 1.0 only where the policy generated the token, so environment tokens get no gradient,
no importance weight and no place in the token-mean denominator (every loss in
app/trainer/grpo.py and ppo.py weights tokens by this mask), and their rollout logprob is 0.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from app.trainer.grpo import group_advantages, soft_overlong_penalty


@dataclass
class TrainBatch:
    """One rank's share of a training step.

    Attributes:
        input_ids: ``[B, L]`` int64, prompt + completion, right-padded with ``pad_id``.
        attention_mask: ``[B, L]`` int64, 1 on real tokens.
        completion_mask: ``[B, L]`` float32, 1.0 on the completion tokens the policy generated
            (a sample's ``loss_mask``; all of them without one), 0.0 on prompt, environment and
            padding tokens.
        rollout_logprobs: ``[B, L]`` float32, the engine's logprobs where the mask is 1, 0 elsewhere.
        advantages: ``[B]`` float32, group-normalized (computed over the whole group).
        rewards: ``[B]`` float32.
        group_ids: ``[B]`` int64, index of the row's group within this batch.
        policy_versions: ``[B]`` int64, the weight version that generated each sample.
        sample_ids: the samples' deterministic ids, in row order.
        routed_experts: with routing replay, ``[B, L, n_moe_layers, K]`` int64: the experts the
            engine routed each token to in each MoE layer (position t: the token at t), -1 where
            there are none (padding, and the last token, which the engine never fed through the
            model); None without replay.
    """

    input_ids: Tensor
    attention_mask: Tensor
    completion_mask: Tensor
    rollout_logprobs: Tensor
    advantages: Tensor
    rewards: Tensor
    group_ids: Tensor
    policy_versions: Tensor
    sample_ids: list[str]
    routed_experts: Tensor | None = None

    @property
    def num_tokens(self) -> int:
        """Completion tokens in this batch (the token-mean denominator before all-reduce)."""
        return int(self.completion_mask.sum())

    def to(self, device: torch.device | str) -> "TrainBatch":
        """A copy with every tensor on ``device``."""
        fields = {k: v.to(device) if isinstance(v, Tensor) else v for k, v in vars(self).items()}
        return TrainBatch(**fields)


def sample_rewards(samples: list, soft_overlong: tuple[int, int, float] | None = None) -> Tensor:
    """The rewards the trainer trains on, ``[n]`` float32: each sample's reward plus, with
    ``soft_overlong = (max_tokens, buffer_tokens, factor)`` (`RunConfig.soft_overlong`), DAPO's
    soft overlong penalty of its completion length (`app.trainer.grpo.soft_overlong_penalty`)."""
    rewards = torch.tensor([float(s.reward) for s in samples], dtype=torch.float32)
    if soft_overlong is not None and samples:
        lengths = torch.tensor([len(s.completion_ids) for s in samples])
        rewards = rewards + soft_overlong_penalty(lengths, *soft_overlong)
    return rewards


def collate_groups(
    groups: list, pad_id: int = 0, scale_by_std: bool = True, max_len: int | None = None,
    moe_layers: list[int] | None = None, mask_truncated: bool = False,
    soft_overlong: tuple[int, int, float] | None = None,
) -> TrainBatch:
    """Collate whole groups (``app.buffer.records.Group``) into one padded `TrainBatch`.

    Advantages are computed per group here, over all of the group's samples
    (`app.trainer.grpo.group_advantages`), so a group must never be split across calls.
    With ``mask_truncated`` (DAPO's overlong filtering, Yu et al. 2025 §3.4; TRL
    ``mask_truncated_completions``) the completion mask of a sample cut at max_new_tokens
    (``finish_reason == "length"``) is all zeros: no gradient, no place in any denominator; its
    reward still counts in its group's advantages, as in DAPO and TRL.

    Args:
        groups: groups with ``.samples``; each sample has ``sample_id``, ``prompt_ids``,
            ``completion_ids``, ``logprobs`` (one per completion token), ``reward``,
            ``policy_version`` and optionally ``loss_mask`` (one 0/1 per completion token).
            May be empty (a rank with no groups this step).
        pad_id: token id used for padding (masked out everywhere).
        scale_by_std: divide advantages by the group's reward std (see `group_advantages`).
        max_len: if set, a row longer than this is an error (protects memory).
        moe_layers: with routing replay, the decoder-layer indices of the MoE layers: each
            sample's ``routed_experts`` (app.buffer.records: ``[P + C - 1, len(moe_layers), K]``
            as workers store them, or ``[P + C - 1, num_layers, K]`` in older samples) is
            collated into `TrainBatch.routed_experts`.
        mask_truncated: mask truncated samples out of the loss (see above).
        soft_overlong: DAPO's soft overlong penalty on the rewards (`sample_rewards`).

    Returns:
        A `TrainBatch` with ``B = total samples``; with no groups, ``B = 0`` and ``L = 1``.

    Raises:
        ValueError: a group has no samples; a sample has no prompt tokens, a logprob count or a
            loss_mask length that differs from its completion length, a loss_mask value other
            than 0 or 1, a non-finite reward or logprob; a row is longer than ``max_len``; or,
            with ``moe_layers``, a sample has no routed experts or ones of the wrong shape. The
            message names the sample id.
    """
    rows: list[tuple] = []
    for g_index, group in enumerate(groups):
        if not group.samples:
            raise ValueError(f"group {group.task_id!r} has no samples")
        for s in group.samples:
            if not s.prompt_ids:
                raise ValueError(f"sample {s.sample_id!r}: empty prompt_ids")
            if len(s.logprobs) != len(s.completion_ids):
                raise ValueError(
                    f"sample {s.sample_id!r}: {len(s.logprobs)} logprobs for "
                    f"{len(s.completion_ids)} completion tokens"
                )
            if not math.isfinite(s.reward):
                raise ValueError(f"sample {s.sample_id!r}: reward {s.reward} is not finite")
            if not all(math.isfinite(x) for x in s.logprobs):
                raise ValueError(f"sample {s.sample_id!r}: non-finite rollout logprob")
            loss_mask = getattr(s, "loss_mask", None)
            if loss_mask is not None:
                if len(loss_mask) != len(s.completion_ids):
                    raise ValueError(f"sample {s.sample_id!r}: loss_mask has {len(loss_mask)} values for "
                                     f"{len(s.completion_ids)} completion tokens")
                if any(m not in (0, 1) for m in loss_mask):
                    raise ValueError(f"sample {s.sample_id!r}: loss_mask values must be 0 or 1")
            n = len(s.prompt_ids) + len(s.completion_ids)
            if max_len is not None and n > max_len:
                raise ValueError(f"sample {s.sample_id!r}: {n} tokens > max_len {max_len}")
            rows.append((g_index, s))

    B = len(rows)
    L = max([len(s.prompt_ids) + len(s.completion_ids) for _, s in rows], default=1)
    input_ids = torch.full((B, L), pad_id, dtype=torch.int64)
    attention_mask = torch.zeros((B, L), dtype=torch.int64)
    completion_mask = torch.zeros((B, L), dtype=torch.float32)
    rollout_logprobs = torch.zeros((B, L), dtype=torch.float32)
    for i, (_, s) in enumerate(rows):
        p, c = len(s.prompt_ids), len(s.completion_ids)
        input_ids[i, : p + c] = torch.tensor(list(s.prompt_ids) + list(s.completion_ids))
        attention_mask[i, : p + c] = 1
        loss_mask = getattr(s, "loss_mask", None)
        mask = torch.ones(c) if loss_mask is None else torch.tensor(loss_mask, dtype=torch.float32)
        if mask_truncated and s.finish_reason == "length":
            mask = torch.zeros(c)
        completion_mask[i, p : p + c] = mask
        if c:
            rollout_logprobs[i, p : p + c] = torch.tensor(s.logprobs, dtype=torch.float32) * mask
    rewards = sample_rewards([s for _, s in rows], soft_overlong)
    group_ids = torch.tensor([g for g, _ in rows], dtype=torch.int64)
    routed = _routed_experts([s for _, s in rows], L, moe_layers) if moe_layers is not None else None
    return TrainBatch(
        input_ids=input_ids,
        attention_mask=attention_mask,
        completion_mask=completion_mask,
        rollout_logprobs=rollout_logprobs,
        advantages=group_advantages(rewards, group_ids, scale_by_std),
        rewards=rewards,
        group_ids=group_ids,
        policy_versions=torch.tensor([int(s.policy_version) for _, s in rows], dtype=torch.int64),
        sample_ids=[s.sample_id for _, s in rows],
        routed_experts=routed,
    )


def _routed_experts(samples: list, length: int, moe_layers: list[int]) -> Tensor:
    """[B, length, n_moe, K] int64 of the samples' engine routing (-1 where none)."""
    from app.buffer.records import decode_routed_experts

    out = None
    for i, s in enumerate(samples):
        if getattr(s, "routed_experts", None) is None:
            raise ValueError(f"sample {s.sample_id!r}: routing replay is on but the sample has no routed_experts")
        try:
            ids = torch.from_numpy(decode_routed_experts(s.routed_experts))
        except ValueError as e:
            raise ValueError(f"sample {s.sample_id!r}: {e}") from None
        fed = len(s.prompt_ids) + len(s.completion_ids) - 1
        # The MoE layers' rows only (what workers store), or every layer's (older samples)
        every = ids.dim() == 3 and ids.shape[1] > max(moe_layers) and ids.shape[1] != len(moe_layers)
        if ids.dim() != 3 or ids.shape[0] != fed or not (every or ids.shape[1] == len(moe_layers)):
            raise ValueError(f"sample {s.sample_id!r}: routed_experts of shape {list(ids.shape)}, expected "
                             f"[{fed}, {len(moe_layers)} MoE layers (or every layer), K]")
        if out is None:
            out = torch.full((len(samples), length, len(moe_layers), ids.shape[2]), -1, dtype=torch.int64)
        out[i, :fed] = ids[:, moe_layers] if every else ids
    return out


def split_groups(groups: list, n_ranks: int) -> list[list]:
    """Assign whole groups to ``n_ranks`` ranks, balancing tokens (greedy, largest first).

    Groups are never split. A rank may get no group when there are fewer groups than ranks;
    the trainer still runs its forward then (EP collectives need every rank).

    Returns:
        ``n_ranks`` lists of groups; within a rank, groups keep their input order.

    Raises:
        ValueError: ``n_ranks < 1``.
    """
    if n_ranks < 1:
        raise ValueError(f"n_ranks must be >= 1, got {n_ranks}")

    def tokens(g) -> int:
        return sum(len(s.prompt_ids) + len(s.completion_ids) for s in g.samples)

    order = sorted(range(len(groups)), key=lambda i: -tokens(groups[i]))
    load = [0] * n_ranks
    assigned: list[list[int]] = [[] for _ in range(n_ranks)]
    for i in order:
        r = min(range(n_ranks), key=lambda k: (load[k], len(assigned[k])))
        assigned[r].append(i)
        load[r] += tokens(groups[i])
    return [[groups[i] for i in sorted(idx)] for idx in assigned]


def select_rows(batch: TrainBatch, rows: Tensor, length: int) -> TrainBatch:
    """The sub-batch of ``rows`` (int64 ``[b]`` indices) cut to the first ``length`` positions
    (rows are right-padded, so a cut at the longest selected row drops only padding).
    ``group_ids`` keep their batch-wide values; advantages were computed over whole groups."""
    token = ("input_ids", "attention_mask", "completion_mask", "rollout_logprobs", "routed_experts")
    fields = {}
    for k, v in vars(batch).items():
        if v is None:
            fields[k] = None
        elif k in token:
            fields[k] = v[rows, :length]
        elif isinstance(v, Tensor):
            fields[k] = v[rows]
        else:
            fields[k] = [v[i] for i in rows.tolist()]
    return TrainBatch(**fields)


def plan_micro_batches(batch: TrainBatch, max_tokens: int | None) -> list[tuple[Tensor, int]]:
    """Pack whole rows into micro-batches of at most ``max_tokens`` padded tokens.

    Rows are sorted by length, longest first, and cut into runs: a micro-batch whose longest row
    has ``n`` tokens takes up to ``max_tokens // n`` rows (its padded size is rows x n). A row
    longer than ``max_tokens`` gets a micro-batch of its own. Sorting by length keeps padding
    low, as verl's sequence-length balancing does (``verl/utils/seqlen_balancing.py``).

    Args:
        batch: this rank's rows.
        max_tokens: ``trainer.micro_batch_tokens``; None: one micro-batch of every row.

    Returns:
        ``[(rows [b] int64, length)]`` in processing order; empty for an empty batch.
    """
    n = batch.input_ids.shape[0]
    if n == 0:
        return []
    lengths = batch.attention_mask.sum(-1)
    if max_tokens is None:
        return [(torch.arange(n), int(lengths.max()))]
    order = torch.argsort(lengths, descending=True, stable=True)
    plan = []
    i = 0
    while i < n:
        longest = int(lengths[order[i]])
        take = max(1, max_tokens // max(longest, 1))
        plan.append((order[i : i + take], longest))
        i += take
    return plan
