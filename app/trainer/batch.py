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

import warnings
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from app.buffer.records import check_group
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
        routed_experts: with routing replay, ``[B, L, n_moe_layers, K]`` int16 (wider for ids
            beyond uint8, `_routed_experts`): the experts the engine routed each token to in
            each MoE layer (position t: the token at t), -1 where there are none (padding, and
            the last token, which the engine never fed through the model); None without replay.
        mini_batch: ``[B]`` int64, the mini-batch of the row's group (`split_mini_batches`); None:
            every row in mini-batch 0.
        old_logprobs: ``[B, L]`` float32, the clip's old policy where the mask is 1
            (app/trainer/step.py sets it before a batch's first optimizer step); None: the current
            policy, detached (ratio 1).
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
    mini_batch: Tensor | None = None
    old_logprobs: Tensor | None = None

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
        # a sample or a header of one (app/buffer/encoding.py SampleHeader: no ids, its length), or
        # app/bench/train_step.py's duck-typed sample (ids, no length)
        lengths = torch.tensor([s.completion_len if hasattr(s, "completion_len") else len(s.completion_ids)
                                for s in samples])
        rewards = rewards + soft_overlong_penalty(lengths, *soft_overlong)
    return rewards


def collate_groups(
    groups: list, pad_id: int = 0, scale_by_std: bool = True, max_len: int | None = None,
    moe_layers: list[int] | None = None, mask_truncated: bool = False,
    soft_overlong: tuple[int, int, float] | None = None, mini_batches: list[int] | None = None,
) -> TrainBatch:
    """Collate whole groups (``app.buffer.records.Group``) into one padded `TrainBatch`.

    Advantages are computed per group here, over all of the group's samples
    (`app.trainer.grpo.group_advantages`), so a group must never be split across calls.
    With ``mask_truncated`` (DAPO's overlong filtering, Yu et al. 2025 §3.4; TRL
    ``mask_truncated_completions``) the completion mask of a sample cut at max_new_tokens
    (``finish_reason == "length"``) is all zeros: no gradient, no place in any denominator; its
    reward still counts in its group's advantages, as in DAPO and TRL.

    Args:
        groups: `app.buffer.records.Group`s; each sample has ``sample_id``, ``prompt_ids``,
            ``completion_ids``, ``logprobs`` (one per completion token; lists, or the arrays of
            a decoded payload), ``reward``, ``policy_version`` and optionally ``loss_mask`` (one
            0/1 per completion token). May be empty (a rank with no groups this step).
        pad_id: token id used for padding (masked out everywhere).
        scale_by_std: divide advantages by the group's reward std (see `group_advantages`).
        max_len: if set, a row longer than this is an error (protects memory).
        moe_layers: with routing replay, the decoder-layer indices of the MoE layers: each
            sample's ``routed_experts`` (app.buffer.records, ``[P + C - 1, n_moe, K]``) is
            collated into `TrainBatch.routed_experts`.
        mask_truncated: mask truncated samples out of the loss (see above).
        soft_overlong: DAPO's soft overlong penalty on the rewards (`sample_rewards`).
        mini_batches: each group's mini-batch (`split_mini_batches`), one per group; None: all 0.

    Returns:
        A `TrainBatch` with ``B = total samples``; with no groups, ``B = 0`` and ``L = 1``.

    Raises:
        ValueError: a group has no samples; a sample has no prompt tokens, a logprob count or a
            loss_mask length that differs from its completion length, a loss_mask value other
            than 0 or 1, a non-finite reward or logprob; a row is longer than ``max_len``; or,
            with ``moe_layers``, a sample has no routed experts or ones of the wrong shape
            (`check_group`). The message names the sample id.
    """
    if mini_batches is not None and len(mini_batches) != len(groups):
        raise ValueError(f"{len(mini_batches)} mini-batch indices for {len(groups)} groups")
    rows: list[tuple] = []
    for g_index, group in enumerate(groups):
        check_group(group, moe_layers)
        for s in group.samples:
            n = len(s.prompt_ids) + len(s.completion_ids)
            if max_len is not None and n > max_len:
                raise ValueError(f"sample {s.sample_id!r}: {n} tokens > max_len {max_len}")
            rows.append((g_index, s))

    # Built in numpy (a row is one slice assignment, from lists or from a decoded payload's
    # arrays alike), handed to torch without a copy at the end.
    B = len(rows)
    L = max([len(s.prompt_ids) + len(s.completion_ids) for _, s in rows], default=1)
    input_ids = np.full((B, L), pad_id, dtype=np.int64)
    attention_mask = np.zeros((B, L), dtype=np.int64)
    completion_mask = np.zeros((B, L), dtype=np.float32)
    rollout_logprobs = np.zeros((B, L), dtype=np.float32)
    for i, (_, s) in enumerate(rows):
        p, c = len(s.prompt_ids), len(s.completion_ids)
        input_ids[i, :p] = s.prompt_ids
        input_ids[i, p : p + c] = s.completion_ids
        attention_mask[i, : p + c] = 1
        loss_mask = getattr(s, "loss_mask", None)
        mask = np.ones(c, dtype=np.float32) if loss_mask is None else np.asarray(loss_mask, dtype=np.float32)
        if mask_truncated and s.finish_reason == "length":
            mask = np.zeros(c, dtype=np.float32)
        completion_mask[i, p : p + c] = mask
        if c:
            rollout_logprobs[i, p : p + c] = np.asarray(s.logprobs, dtype=np.float32) * mask
    rewards = sample_rewards([s for _, s in rows], soft_overlong)
    group_ids = torch.tensor([g for g, _ in rows], dtype=torch.int64)
    routed = _routed_experts([s for _, s in rows], L, moe_layers) if moe_layers is not None else None
    return TrainBatch(
        input_ids=torch.from_numpy(input_ids),
        attention_mask=torch.from_numpy(attention_mask),
        completion_mask=torch.from_numpy(completion_mask),
        rollout_logprobs=torch.from_numpy(rollout_logprobs),
        advantages=group_advantages(rewards, group_ids, scale_by_std),
        rewards=rewards,
        group_ids=group_ids,
        policy_versions=torch.tensor([int(s.policy_version) for _, s in rows], dtype=torch.int64),
        sample_ids=[s.sample_id for _, s in rows],
        routed_experts=routed,
        mini_batch=None if mini_batches is None else torch.tensor([mini_batches[g] for g, _ in rows], dtype=torch.int64),
    )


def _routed_experts(samples: list, length: int, moe_layers: list[int]) -> Tensor | None:
    """[B, length, n_moe, K] of the samples' engine routing (-1 where none), None for no samples;
    each sample's ``routed_experts`` is ``[P + C - 1, n_moe, K]`` (checked by `Group.check`).
    int16 for uint8 ids (DeepSeek-V3's 256 experts), int32 for wider: the MoE layers take any
    integer dtype and widen on the device (app/model/moe.py), and a 16 x 8704-token group's
    routing is 259 MB of int16 on the host instead of 517 MB of int64."""
    if not samples:
        return None
    arrays = [np.asarray(s.routed_experts) for s in samples]
    k = int(arrays[0].shape[2])
    dtype = torch.int16 if all(a.dtype == np.uint8 for a in arrays) else torch.int32 if all(
        a.dtype.itemsize <= 2 and a.dtype.kind == "u" for a in arrays) else torch.int64
    out = torch.full((len(samples), length, len(moe_layers), k), -1, dtype=dtype)
    with warnings.catch_warnings():  # a decoded payload's arrays are read-only; they are only read here
        warnings.simplefilter("ignore", UserWarning)
        for i, (s, ids) in enumerate(zip(samples, arrays)):
            if ids.shape[2] != k:
                raise ValueError(f"sample {s.sample_id!r}: routed_experts with K={ids.shape[2]}, sample 0 has K={k}")
            out[i, : ids.shape[0]] = torch.from_numpy(ids)
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

    def tokens(g) -> int:  # a Group or a GroupHeader (app/buffer/encoding.py)
        return g.num_tokens

    order = sorted(range(len(groups)), key=lambda i: -tokens(groups[i]))
    load = [0] * n_ranks
    assigned: list[list[int]] = [[] for _ in range(n_ranks)]
    for i in order:
        r = min(range(n_ranks), key=lambda k: (load[k], len(assigned[k])))
        assigned[r].append(i)
        load[r] += tokens(groups[i])
    return [[groups[i] for i in sorted(idx)] for idx in assigned]


def split_mini_batches(groups: list, n_ranks: int, mini_batch_groups: int) -> tuple[list[list], list[list[int]]]:
    """Cut a step's groups, in the order given, into mini-batches of ``mini_batch_groups`` (the last
    may be smaller), as verl's actor cuts its batch (``DataProto.split(ppo_mini_batch_size)``, no
    shuffle), and share each mini-batch's groups among the ranks (`split_groups`). Which groups
    form a mini-batch does not depend on the number of ranks; with one mini-batch this is
    `split_groups`.

    Returns:
        ``(parts, minis)``: ``n_ranks`` lists of groups (mini-batch by mini-batch) and, per rank,
        each group's mini-batch index.

    Raises:
        ValueError: ``n_ranks < 1`` or ``mini_batch_groups < 1``.
    """
    if n_ranks < 1 or mini_batch_groups < 1:
        raise ValueError(f"n_ranks and mini_batch_groups must be >= 1, got {n_ranks} and {mini_batch_groups}")
    parts: list[list] = [[] for _ in range(n_ranks)]
    minis: list[list[int]] = [[] for _ in range(n_ranks)]
    for j, start in enumerate(range(0, len(groups), mini_batch_groups)):
        for r, share in enumerate(split_groups(groups[start : start + mini_batch_groups], n_ranks)):
            parts[r] += share
            minis[r] += [j] * len(share)
    return parts, minis


def select_rows(batch: TrainBatch, rows: Tensor, length: int) -> TrainBatch:
    """The sub-batch of ``rows`` (int64 ``[b]`` indices) cut to the first ``length`` positions
    (rows are right-padded, so a cut at the longest selected row drops only padding).
    ``group_ids`` keep their batch-wide values; advantages were computed over whole groups."""
    token = ("input_ids", "attention_mask", "completion_mask", "rollout_logprobs", "routed_experts", "old_logprobs")
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
