"""PPO pieces: GAE against a hand-computed example, value clipping, whitening, the per-token
policy loss, the critic's alignment and its checkpoint round trip."""

from __future__ import annotations

import io

import pytest
import torch

from app.config import RunConfig
from app.trainer.grpo import grpo_loss
from app.trainer.ppo import gae, ppo_policy_loss, ppo_targets, token_rewards, value_loss, whiten


def two_rows():
    """Row 0: prompt at 0-1, completion at 2-4, reward 1. Row 1: prompt at 0, completion at
    1-2, then padding at 3-4 (whose values are garbage that must not leak in), reward 0.5."""
    mask = torch.tensor([[0, 0, 1, 1, 1], [0, 1, 1, 0, 0]], dtype=torch.float32)
    values = torch.tensor([[7.0, 7.0, 0.5, 0.6, 0.7], [7.0, 0.2, 0.4, 9.0, 9.0]])
    rewards = torch.tensor([1.0, 0.5])
    return rewards, values, mask


def test_token_rewards_sit_on_the_last_completion_token():
    rewards, _, mask = two_rows()
    r = token_rewards(rewards, mask)
    assert r.tolist() == [[0, 0, 0, 0, 1.0], [0, 0, 0.5, 0, 0]]
    empty = token_rewards(torch.tensor([3.0]), torch.zeros(1, 4))
    assert empty.abs().sum() == 0


def test_gae_matches_hand_computed_example():
    rewards, values, mask = two_rows()
    adv, ret = gae(token_rewards(rewards, mask), values, mask, gamma=0.9, lam=0.8)
    # Row 0, backwards: d4 = 1 - .7 = .3, A4 = .3; d3 = .9*.7 - .6 = .03, A3 = .03 + .72*.3 = .246;
    # d2 = .9*.6 - .5 = .04, A2 = .04 + .72*.246 = .21712. Returns R = A + V.
    # Row 1: A2 = .5 - .4 = .1 (position 3 is terminal); A1 = .9*.4 - .2 + .72*.1 = .232.
    want_adv = torch.tensor([[0, 0, 0.21712, 0.246, 0.3], [0, 0.232, 0.1, 0, 0]])
    want_ret = torch.tensor([[0, 0, 0.71712, 0.846, 1.0], [0, 0.432, 0.5, 0, 0]])
    torch.testing.assert_close(adv, want_adv)
    torch.testing.assert_close(ret, want_ret)


def test_gae_with_gamma_and_lambda_one_is_return_minus_value():
    rewards, values, mask = two_rows()
    adv, ret = gae(token_rewards(rewards, mask), values, mask, gamma=1.0, lam=1.0)
    torch.testing.assert_close(adv, (rewards[:, None] - values) * mask)
    torch.testing.assert_close(ret, rewards[:, None] * mask)


def test_gae_rejects_bad_input():
    rewards, values, mask = two_rows()
    with pytest.raises(ValueError, match="gamma"):
        gae(token_rewards(rewards, mask), values, mask, gamma=1.5)
    with pytest.raises(ValueError, match="values"):
        gae(token_rewards(rewards, mask), values[:, :3], mask)


def test_value_loss_clipping():
    mask = torch.ones(1, 3)
    old = torch.tensor([[0.5, 0.5, 0.5]])
    returns = torch.tensor([[1.0, 0.0, 1.0]])
    values = torch.tensor([[0.9, 1.0, 0.6]], requires_grad=True)
    out = value_loss(values, old, returns, mask, clip_eps=0.2)
    # token 0: moved .4 toward R; clipped to .7: (.7-1)^2 = .09 > (.9-1)^2 = .01 -> clipped branch
    # token 1: moved .5 away from R: (1-0)^2 = 1 > (.7-0)^2 = .49 -> unclipped branch
    # token 2: inside the clip range: both terms (.6-1)^2 = .16
    per_token = torch.tensor([0.09, 1.0, 0.16]) * 0.5
    assert out.loss.item() == pytest.approx(per_token.mean().item())
    assert out.sums["vf_clipped"].item() == 1.0
    out.loss.backward()
    g = values.grad[0]
    assert g[0] == 0.0  # the clipped branch has no gradient w.r.t. V
    assert g[1] == pytest.approx((1.0 - 0.0) / 3)  # d/dV 0.5 (V - R)^2 / n
    assert g[2] == pytest.approx((0.6 - 1.0) / 3)

    unclipped = value_loss(values.detach(), old, returns, mask, clip_eps=None)
    assert unclipped.loss.item() == pytest.approx(0.5 * (0.01 + 1.0 + 0.16) / 3)
    with pytest.raises(ValueError, match="clip_eps"):
        value_loss(values, old, returns, mask, clip_eps=0.0)


def test_whiten_uses_masked_tokens_only():
    x = torch.tensor([[1.0, 2.0, 3.0, 100.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    w = whiten(x, mask)
    assert w[0, 3] == 0
    assert w[0, :3].mean().item() == pytest.approx(0.0, abs=1e-6)
    assert w[0, :3].pow(2).mean().item() == pytest.approx(1.0, abs=1e-5)  # biased variance 1


def test_ppo_policy_loss_equals_grpo_loss_for_row_constant_advantages():
    torch.manual_seed(0)
    B, L = 3, 6
    mask = torch.zeros(B, L)
    mask[:, 2:] = 1
    mask[2, 5] = 0
    old = torch.randn(B, L) - 2
    logp = (old + 0.3 * torch.randn(B, L)).requires_grad_()
    rollout = old + 0.1 * torch.randn(B, L)
    adv_rows = torch.tensor([1.0, -0.5, 2.0])
    kw = dict(clip_eps_low=0.2, clip_eps_high=0.28, loss_agg="token-mean", rollout_logprobs=rollout, tis_cap=2.0)
    ref = grpo_loss(logp, old, adv_rows, mask, **kw)
    got = ppo_policy_loss(logp, old, adv_rows[:, None].expand(B, L).contiguous(), mask, **kw)
    assert got.loss.item() == pytest.approx(ref.loss.item(), rel=1e-6)
    for k in ref.sums:
        assert got.sums[k].item() == pytest.approx(ref.sums[k].item(), rel=1e-6), k
    with pytest.raises(ValueError, match="token-mean"):
        ppo_policy_loss(logp, old, adv_rows[:, None].expand(B, L), mask, loss_agg="seq-mean")


def test_ppo_targets_whiten_over_the_batch():
    rewards, values, mask = two_rows()
    t = ppo_targets(rewards, values, mask, gamma=1.0, lam=0.95)
    assert (t.values * (1 - mask)).abs().sum() == 0  # garbage off the mask is dropped
    n = mask.sum()
    assert (t.advantages.sum() / n).item() == pytest.approx(0.0, abs=1e-6)
    raw = ppo_targets(rewards, values, mask, gamma=1.0, lam=0.95, whiten_advantages=False)
    torch.testing.assert_close(raw.returns, t.returns)


# ------------------------------------------------------------------------------------------
# The critic


def _tiny_critic(seed_cfg: dict | None = None):
    from app.model.parallel import EPContext
    from app.trainer.critic import build_critic

    cfg = RunConfig.model_validate(seed_cfg or {})
    return build_critic(cfg, EPContext.local())


def test_critic_values_are_aligned_and_causal():
    critic = _tiny_critic()
    torch.nn.init.normal_(critic.value_head.weight, std=0.5)
    ids = torch.tensor([[1, 10, 11, 12, 13]])
    v = critic(ids, torch.ones_like(ids))
    assert v.shape == (1, 5) and v.dtype == torch.float32 and v[0, 0] == 0
    # V at position t sees tokens < t only: changing token 4 leaves every value unchanged.
    v2 = critic(torch.tensor([[1, 10, 11, 12, 50]]), torch.ones_like(ids))
    torch.testing.assert_close(v, v2)
    v3 = critic(torch.tensor([[1, 10, 11, 50, 13]]), torch.ones_like(ids))
    assert abs(v3[0, 4] - v[0, 4]) > 1e-3
    torch.testing.assert_close(v3[0, :4], v[0, :4])


def test_critic_starts_at_zero_and_copies_the_policy_trunk():
    from app.model.config import tiny_config
    from app.model.parallel import EPContext
    from app.model.policy import build_policy

    cfg = RunConfig()
    critic = _tiny_critic()
    policy = build_policy(tiny_config(cfg.model.preset), cfg.router, EPContext.local(), seed=cfg.task.seed)
    assert critic(torch.tensor([[1, 5, 6]])).abs().sum() == 0
    trunk = dict(critic.trunk.named_parameters())
    for name, p in policy.model.named_parameters():
        assert torch.equal(trunk[name], p), name
    assert not any("lm_head" in n for n, _ in critic.named_parameters())


def test_critic_checkpoint_round_trip(tmp_path):
    from app.trainer.critic import critic_payload, restore_critic

    torch.manual_seed(0)
    ids = torch.tensor([[1, 10, 11, 12, 13], [1, 20, 21, 0, 0]])
    attn = (ids != 0).long()
    mask = torch.tensor([[0, 0, 1, 1, 1], [0, 0, 1, 0, 0]], dtype=torch.float32)
    returns = torch.tensor([[0, 0, 0.5, 0.8, 1.0], [0, 0, 0.3, 0, 0]])

    def step(critic, opt):
        v = critic(ids, attn)
        loss = value_loss(v, v.detach(), returns, mask, clip_eps=None).loss
        opt.zero_grad()
        loss.backward()
        opt.step()

    critic = _tiny_critic()
    opt = torch.optim.AdamW(critic.parameters(), lr=1e-2)
    for _ in range(3):
        step(critic, opt)
    path = tmp_path / "rank0.pt"
    torch.save({"extra": {"critic": critic_payload(critic, opt)}}, path)  # as in the training state
    before = critic(ids, attn).detach()
    assert before.abs().sum() > 0

    fresh = _tiny_critic()
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    restore_critic(fresh, fresh_opt, torch.load(io.BytesIO(path.read_bytes()), weights_only=False)["extra"]["critic"])
    torch.testing.assert_close(fresh(ids, attn).detach(), before, rtol=0, atol=0)
    # The optimizer state came back too: one more step gives identical weights.
    step(critic, opt)
    step(fresh, fresh_opt)
    torch.testing.assert_close(fresh(ids, attn).detach(), critic(ids, attn).detach(), rtol=0, atol=0)

    with pytest.raises(ValueError, match="no critic"):
        restore_critic(fresh, fresh_opt, {})
