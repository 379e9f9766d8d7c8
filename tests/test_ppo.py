"""PPO pieces: GAE against a hand-computed example, value clipping, whitening, the per-token
policy loss, the critic's alignment and its checkpoint round trip (the sharded PPO step against
the single-process one: tests/test_sharded_trainer.py)."""

from __future__ import annotations

import math

import pytest
import torch

from app.buffer.redis_server import free_port
from app.config import RunConfig
from app.trainer.grpo import grpo_loss
from app.trainer.ppo import gae, ppo_policy_loss, ppo_targets, token_rewards, value_loss, whiten
from helpers import fake_producer, single_rank_env, toy_rollout


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
    assert out.sums["vf_clip_frac"].item() == 1.0
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
    """The default critic, unsharded: a zero value head on a copy of the preset policy's trunk."""
    from app.model.config import tiny_config
    from app.model.parallel import EPContext
    from app.model.policy import build_policy
    from app.trainer.critic import Critic

    cfg = RunConfig.model_validate(seed_cfg or {})
    config = tiny_config(cfg.model.preset)
    return Critic(build_policy(config, cfg.router, EPContext.local(), seed=cfg.task.seed).model, config.hidden_size)


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
    """The critic and its AdamW state go through the training state (DCP) and come back exactly."""
    from app.storage import open_store
    from app.trainer.state import latest_state, load_state, save_state

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
    store = open_store(f"file://{tmp_path}/store")
    save_state(store, "r", 3, {"critic": (critic, opt)}, {"train_state": {}}, lineage=[], work_dir=tmp_path / "w")
    before = critic(ids, attn).detach()
    assert before.abs().sum() > 0

    fresh = _tiny_critic()
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    load_state(store, "r", latest_state(store, "r"), {"critic": (fresh, fresh_opt)})
    torch.testing.assert_close(fresh(ids, attn).detach(), before, rtol=0, atol=0)
    # The optimizer state came back too: one more step gives identical weights.
    step(critic, opt)
    step(fresh, fresh_opt)
    torch.testing.assert_close(fresh(ids, attn).detach(), critic(ids, attn).detach(), rtol=0, atol=0)

    with pytest.raises(ValueError, match="another trainer.algorithm"):
        load_state(store, "r", latest_state(store, "r"), {"policy": (fresh, fresh_opt)})


# ------------------------------------------------------------------------------------------
# PPO through the trainer's step: the loss has the right sign


def test_ppo_steps_raise_reward_on_toy_task(monkeypatch):
    """Reward = fraction of completion tokens equal to one target token; samples from the policy
    itself, 4 groups of 8 per step, the critic trained in the same step."""
    import torch.distributed as dist

    from app.model.config import tiny_config
    from app.model.parallel import init_ep
    from app.model.policy import build_policy
    from app.trainer.batch import collate_groups
    from app.trainer.critic import CriticParts
    from app.trainer.step import train_step
    from app.trainer.parallel import init_distributed

    single_rank_env(monkeypatch)
    torch.manual_seed(0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    cfg = RunConfig.model_validate({"trainer": {"algorithm": "ppo", "lr": 3e-3}})
    init_distributed(timeout_s=60)
    try:
        ep = init_ep(cfg.trainer.parallel)
        model = build_policy(tiny_config("tiny-qwen3-moe"), cfg.router, ep, seed=0)
        critic_module = _tiny_critic({"trainer": {"algorithm": "ppo"}})
        critic = CriticParts(critic_module, torch.optim.AdamW(critic_module.parameters(), lr=cfg.trainer.lr))
        opt = torch.optim.AdamW(model.parameters(), lr=cfg.trainer.lr)
        gen = torch.Generator().manual_seed(0)
        target, G, n_new = 50, 8, 6

        rewards, value_errors = [], []
        for step in range(30):
            groups = [toy_rollout(model, gen, f"s{step}-p{k}", [1, 5 + k], G, n_new, target) for k in range(4)]
            rewards.append(sum(s.reward for g in groups for s in g.samples) / (4 * G))
            applied, stats = train_step(cfg, model, opt, collate_groups(groups), pad_id=0, critic=critic)
            assert applied and stats["tis"] == pytest.approx(1.0, abs=1e-3)
            assert math.isfinite(stats["vf_loss"]) and math.isfinite(stats["critic_grad_norm"])
            value_errors.append(stats["value_error"])
        first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
        assert first < 0.1 and last > first + 0.3, rewards
        # the critic learns: its values move off the zero start (the value head got gradient)
        assert critic.module.value_head.weight.abs().sum() > 0
    finally:
        dist.destroy_process_group()
        torch.set_num_threads(threads)


# ------------------------------------------------------------------------------------------
# A short 2-rank PPO run (EP=2, gloo) against redis and a file:// store, then a resume


@pytest.mark.slow
def test_ppo_two_rank_run_saves_and_resumes_the_critic(tmp_path, redis_server):
    import json
    import os
    import subprocess
    import sys
    import threading
    from pathlib import Path

    from app.storage import open_store
    from app.trainer.state import latest_state, step_prefix

    root = Path(__file__).resolve().parents[1]
    run_id = "ppo-test"
    cfg = RunConfig.model_validate({
        "run_id": run_id, "store_url": f"file://{tmp_path}/store",
        "model": {"preset": "tiny-qwen3-moe"},
        "buffer": {"redis_url": redis_server, "max_staleness": 1, "capacity_groups": 8},
        "rollout": {"group_size": 4},
        "trainer": {"parallel": {"ep": 2}, "algorithm": "ppo", "steps": 2, "groups_per_step": 2, "lr": 1e-3, "critic_lr": 1e-2,
                    "lr_warmup_steps": 0, "batch_timeout_s": 120, "save_every": 1},
    })
    cfg_path = tmp_path / "run.yaml"
    run_dir = tmp_path / "run"

    def train(steps: int, *resume: str) -> None:
        cfg.trainer.steps = steps
        cfg.save(cfg_path)
        proc = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
             "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
             "-m", "app.cli", "train", "--config", str(cfg_path), "--run-dir", str(run_dir), *resume],
            cwd=root, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=300,
        )
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]

    stop = threading.Event()
    producer = threading.Thread(target=fake_producer, args=(redis_server, run_id, stop, 4), daemon=True)
    producer.start()
    try:
        train(2)
        store = open_store(cfg.store_url)
        manifest = latest_state(store, run_id)
        assert manifest["step"] == 2 and manifest["modules"] == ["critic", "policy"]
        # Read the saved state back the way torch's own converter (format_utils.dcp_to_torch_save)
        # does, through the store reader (its .metadata is weights-only, not DCP's plain pickle).
        from torch.distributed.checkpoint.format_utils import _EmptyStateDictLoadPlanner
        from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

        from app.trainer.state import StoreReader

        saved: dict = {}
        _load_state_dict(saved, storage_reader=StoreReader(store, step_prefix(run_id, 2) + "dcp/"),
                         planner=_EmptyStateDictLoadPlanner(), no_dist=True)
        assert saved["critic"]["model"]["value_head.weight"].abs().sum() > 0  # trained away from zero
        assert saved["critic"]["optim"]["state"], "critic optimizer state not saved"
        train(3, "--resume")
    finally:
        stop.set()
        producer.join(timeout=10)
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == [1, 2, 3]
    for r in lines:
        assert r["applied"] and all(math.isfinite(r[k]) for k in ("loss", "vf_loss", "critic_grad_norm"))
        assert r["tokens"] == sum(1 + k for k in range(4)) * 2
    assert lines[0]["value"] == 0.0  # the zero-initialised value head
    # The resumed run starts from the saved critic, not from a fresh (all-zero) one.
    assert lines[2]["value"] != 0.0


def test_critic_from_a_separate_hf_model_by_path(tmp_path, monkeypatch):
    """A dense critic checkpoint (not one of the MoE families) is loaded whole and then sharded."""
    import torch.distributed as dist
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from app.model.parallel import EPContext
    from app.trainer.models import build_critic_parts
    from app.trainer.parallel import init_distributed
    from helpers import sharded_trainer

    dense = Qwen3ForCausalLM(Qwen3Config(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1, head_dim=16))
    dense.save_pretrained(tmp_path / "dense")
    cfg = RunConfig.model_validate({"trainer": {"algorithm": "ppo", "critic_path": str(tmp_path / "dense")}})
    single_rank_env(monkeypatch)
    init_distributed(timeout_s=60)
    try:
        _, mesh, _ = sharded_trainer(RunConfig())
        critic = build_critic_parts(cfg, None, EPContext.local(), mesh, torch.device("cpu")).module
        assert critic.value_head.in_features == 32  # the critic model's width, not the policy's (64)
        torch.testing.assert_close(critic.trunk.embed_tokens.weight.full_tensor(), dense.model.embed_tokens.weight)
        assert critic(torch.tensor([[1, 5, 6, 7]])).shape == (1, 4)
        cfg.trainer.critic_path = str(tmp_path / "missing")
        with pytest.raises(FileNotFoundError, match="trainer.critic_path"):
            build_critic_parts(cfg, None, EPContext.local(), mesh, torch.device("cpu"))
    finally:
        dist.destroy_process_group()
