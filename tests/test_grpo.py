"""GRPO losses and batch collation against hand-computed examples."""

from __future__ import annotations

import math

import pytest
import torch

from app.buffer.records import Group, Sample
from app.trainer.batch import collate_groups, split_groups
from app.trainer.grpo import (
    aggregate,
    finish_stats,
    group_advantages,
    grpo_loss,
    kl_k3,
    tis_weights,
    token_logprobs,
)


def test_group_advantages_by_hand():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 2.0])
    groups = torch.tensor([0, 0, 0, 0, 1, 1, 1, 2])
    # Group 0: mean 0.5, unbiased std sqrt(4 * 0.25 / 3) = 0.57735 -> +-0.5 / (0.57735 + 1e-4).
    adv = group_advantages(rewards, groups, scale_by_std=True)
    a = 0.5 / (math.sqrt(1.0 / 3.0) + 1e-4)
    expected = torch.tensor([a, -a, -a, a, 0.0, 0.0, 0.0, 0.0])
    torch.testing.assert_close(adv, expected, atol=1e-5, rtol=0)
    # Dr. GRPO: no std division.
    adv = group_advantages(rewards, groups, scale_by_std=False)
    torch.testing.assert_close(adv, torch.tensor([0.5, -0.5, -0.5, 0.5, 0, 0, 0, 0.0]))


def test_group_advantages_bad_input():
    with pytest.raises(ValueError, match="same length"):
        group_advantages(torch.zeros(3), torch.zeros(2, dtype=torch.int64))
    with pytest.raises(ValueError, match="NaN"):
        group_advantages(torch.tensor([1.0, float("nan")]), torch.tensor([0, 0]))


def test_token_logprobs_by_hand():
    # probs at position 0 (predicting token 1): [0.25, 0.5, 0.25]; at position 1: uniform.
    logits = torch.log(torch.tensor([[[1.0, 2.0, 1.0], [1.0, 1.0, 1.0], [5.0, 1.0, 1.0]]]))
    ids = torch.tensor([[2, 1, 0]])
    lp = token_logprobs(logits, ids)
    torch.testing.assert_close(lp, torch.tensor([[0.0, math.log(0.5), math.log(1 / 3)]]))
    # Temperature 2 halves the logits: probs ∝ sqrt([1, 2, 1]).
    lp = token_logprobs(logits, ids, temperature=2.0)
    p1 = math.sqrt(2) / (2 + math.sqrt(2))
    torch.testing.assert_close(lp[0, 1], torch.tensor(math.log(p1)))


def test_clipping_each_branch_by_hand():
    # Four tokens, one per case; clip range [0.8, 1.28].
    ratio = torch.tensor([[1.5, 0.5, 0.5, 1.5]])
    old = torch.zeros(1, 4)
    logp = torch.log(ratio).requires_grad_(True)
    mask = torch.ones(1, 4)
    # Advantages are per sequence, so use 4 rows of one token each instead.
    logp4 = logp.reshape(4, 1)
    out = grpo_loss(
        logp4, old.reshape(4, 1), torch.tensor([1.0, 1.0, -1.0, -1.0]), mask.reshape(4, 1),
        clip_eps_low=0.2, clip_eps_high=0.28,
    )
    # Per token: -min(1.5, 1.28) = -1.28 (clipped); -min(0.5, 0.8) = -0.5;
    # -min(-0.5, -0.8) = 0.8 (clipped); -min(-1.5, -1.28) = 1.5.
    expected = (-1.28 - 0.5 + 0.8 + 1.5) / 4
    torch.testing.assert_close(out.loss, torch.tensor(expected))
    out.loss.backward()
    # d/dlogp of -ratio*A/4 is -ratio*A/4 where unclipped, 0 where clipped.
    torch.testing.assert_close(logp.grad, torch.tensor([[0.0, -0.5 / 4, 0.0, 1.5 / 4]]))
    stats = finish_stats(out.sums, out.maxima)
    assert stats["clip_frac"] == pytest.approx(0.5)
    assert stats["ratio"] == pytest.approx(1.0)
    assert stats["ratio_max"] == pytest.approx(1.5)
    # k3 of KL(old||new) per token: r - 1 - log r.
    k3 = [r - 1 - math.log(r) for r in (1.5, 0.5, 0.5, 1.5)]
    assert stats["approx_kl"] == pytest.approx(sum(k3) / 4, rel=1e-5)


def test_aggregation_token_vs_seq_mean():
    per_token = torch.tensor([[1.0, 2.0, 3.0, 9.0], [4.0, 9.0, 9.0, 9.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 0.0, 0.0, 0.0]])
    assert float(aggregate(per_token, mask, "token-mean")) == pytest.approx((1 + 2 + 3 + 4) / 4)
    assert float(aggregate(per_token, mask, "seq-mean")) == pytest.approx((2.0 + 4.0) / 2)
    assert float(aggregate(per_token, mask, "token-mean", denominator=10)) == pytest.approx(1.0)
    with pytest.raises(ValueError, match="loss_agg"):
        aggregate(per_token, mask, "sum")


@pytest.mark.parametrize("loss_agg", ["token-mean", "seq-mean"])
def test_global_denominator_makes_rank_sum_equal_full_batch(loss_agg):
    """Two 'ranks' dividing by the global count sum to the full-batch loss and gradient."""
    g = torch.Generator().manual_seed(0)
    B, L = 6, 5
    logp = (torch.randn(B, L, generator=g) * 0.1 - 1.0).requires_grad_(True)
    old = logp.detach() + torch.randn(B, L, generator=g) * 0.2
    rollout = old + torch.randn(B, L, generator=g) * 0.3
    adv = torch.randn(B, generator=g)
    mask = (torch.rand(B, L, generator=g) > 0.3).float()
    mask[:, 0] = 1.0
    kw = dict(loss_agg=loss_agg, rollout_logprobs=rollout, tis_cap=2.0)
    full = grpo_loss(logp, old, adv, mask, **kw).loss
    (g_full,) = torch.autograd.grad(full, logp)
    denom = mask.sum() if loss_agg == "token-mean" else B
    parts = [slice(0, 2), slice(2, B)]
    total = sum(
        grpo_loss(logp[s], old[s], adv[s], mask[s], denominator=denom,
                  **{**kw, "rollout_logprobs": rollout[s]}).loss
        for s in parts
    )
    (g_parts,) = torch.autograd.grad(total, logp)
    torch.testing.assert_close(total, full)
    torch.testing.assert_close(g_parts, g_full)


def test_tis_weights_truncate_and_scale_the_loss():
    old = torch.tensor([[math.log(3.0), math.log(0.5)]])
    rollout = torch.zeros(1, 2)
    torch.testing.assert_close(tis_weights(old, rollout, cap=2.0), torch.tensor([[2.0, 0.5]]))
    assert tis_weights(old, rollout, cap=None) is None
    # With old == current (ratio 1), each token's loss is -A * w.
    logp = old.clone().reshape(2, 1).requires_grad_(True)
    out = grpo_loss(
        logp, old.reshape(2, 1), torch.tensor([1.0, 1.0]), torch.ones(2, 1),
        rollout_logprobs=rollout.reshape(2, 1), tis_cap=2.0,
    )
    torch.testing.assert_close(out.loss, torch.tensor(-(2.0 + 0.5) / 2))
    stats = finish_stats(out.sums, out.maxima)
    assert stats["tis_trunc_frac"] == pytest.approx(0.5)
    assert stats["tis_max"] == pytest.approx(2.0)
    # Mismatch k3 of KL(engine || trainer): w - 1 - log w for the untruncated ratios 3 and 0.5.
    expected = ((3 - 1 - math.log(3)) + (0.5 - 1 - math.log(0.5))) / 2
    assert stats["mismatch_kl"] == pytest.approx(expected, rel=1e-5)
    with pytest.raises(ValueError, match="rollout_logprobs"):
        grpo_loss(logp, old.reshape(2, 1), torch.ones(2), torch.ones(2, 1), tis_cap=2.0)


def test_k3_kl_by_hand_and_penalty():
    logp = torch.tensor([[0.0, 0.0]], requires_grad=True)
    ref = torch.tensor([[math.log(2.0), 0.0]])
    k3 = kl_k3(logp, ref)
    torch.testing.assert_close(k3, torch.tensor([[2.0 - math.log(2.0) - 1.0, 0.0]]))
    assert (kl_k3(torch.randn(3, 4), torch.randn(3, 4)) >= 0).all()
    # Penalty adds kl_coef * mean k3 to a zero-advantage loss.
    out = grpo_loss(logp, logp.detach(), torch.zeros(1), torch.ones(1, 2),
                    ref_logprobs=ref, kl_coef=0.1)
    torch.testing.assert_close(out.loss, 0.1 * k3.mean())
    with pytest.raises(ValueError, match="ref_logprobs"):
        grpo_loss(logp, logp.detach(), torch.zeros(1), torch.ones(1, 2), kl_coef=0.1)


def _sample(task, i, prompt, completion, reward, version=0, logprobs=None):
    return Sample(
        sample_id=f"r/{task}/{i}/0", task_id=task, index=i, attempt=0,
        prompt_ids=prompt, completion_ids=completion,
        logprobs=logprobs if logprobs is not None else [-0.5 - j for j in range(len(completion))],
        reward=reward, policy_version=version, finish_reason="stop",
    )


def _group(task, rewards, prompt=(5, 6), lengths=None, version=0):
    lengths = lengths or [2] * len(rewards)
    return Group(task_id=task, attempt=0, samples=[
        _sample(task, i, list(prompt), [10 + j for j in range(n)], r, version)
        for i, (r, n) in enumerate(zip(rewards, lengths))
    ])


def test_collate_pads_and_aligns():
    groups = [_group("a", [1.0, 0.0], lengths=[1, 3]), _group("b", [0.0, 0.0], prompt=(7,), version=2)]
    b = collate_groups(groups, pad_id=0)
    assert b.input_ids.shape == (4, 5) and b.input_ids.dtype == torch.int64
    assert b.input_ids[0].tolist() == [5, 6, 10, 0, 0]
    assert b.input_ids[1].tolist() == [5, 6, 10, 11, 12]
    assert b.attention_mask[0].tolist() == [1, 1, 1, 0, 0]
    assert b.completion_mask[1].tolist() == [0, 0, 1, 1, 1]
    assert b.completion_mask[2].tolist() == [0, 1, 1, 0, 0]
    # Rollout logprob of completion token j sits at len(prompt) + j.
    assert b.rollout_logprobs[1].tolist() == [0.0, 0.0, -0.5, -1.5, -2.5]
    assert b.rollout_logprobs.dtype == torch.float32
    a = 0.5 / (math.sqrt(0.5) + 1e-4)  # group of two, unbiased std sqrt(0.5), TRL's eps
    torch.testing.assert_close(b.advantages, torch.tensor([a, -a, 0.0, 0.0]), atol=1e-5, rtol=0)
    assert b.group_ids.tolist() == [0, 0, 1, 1]
    assert b.policy_versions.tolist() == [0, 0, 2, 2]
    assert b.num_tokens == 1 + 3 + 2 + 2
    empty = collate_groups([])
    assert empty.input_ids.shape == (0, 1) and empty.num_tokens == 0


def test_collate_bad_sample_names_it():
    g = _group("a", [1.0, 0.0])
    g.samples[1].logprobs = [-1.0]
    with pytest.raises(ValueError, match="r/a/1/0.*1 logprobs for 2"):
        collate_groups([g])
    g = _group("a", [1.0, float("inf")])
    with pytest.raises(ValueError, match="r/a/1/0.*not finite"):
        collate_groups([g])


def test_split_groups_keeps_groups_whole_and_balances_tokens():
    groups = [_group(f"t{i}", [1.0, 0.0], lengths=[n, n]) for i, n in enumerate([8, 1, 1, 6, 2])]
    parts = split_groups(groups, 2)
    assert sorted(g.task_id for p in parts for g in p) == sorted(g.task_id for g in groups)
    loads = [sum(len(s.prompt_ids) + len(s.completion_ids) for g in p for s in g.samples) for p in parts]
    # Group tokens 20, 6, 6, 16, 8; greedy largest-first: r0 20, r1 16, r1 +8, r0 +6, r1 +6.
    assert sorted(loads) == [26, 30]
    assert split_groups(groups[:1], 3)[1:] == [[], []]
