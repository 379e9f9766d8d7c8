"""The RL objectives (issue 29): equal rewards give exactly zero advantages, PPO whitening is stable
and reduces on the trainer's device, and the config refuses group size 1 and names a renamed field."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from app.config import RunConfig
from app.trainer.batch import collate_groups
from app.trainer.grpo import group_advantages
from app.trainer.ppo import whiten
from helpers import fake_groups
from trl_oracle import grpo_config

# ------------------------------------------------------------------------------------------
# Fix 1: equal rewards give exactly zero advantages


@pytest.mark.parametrize("value", [0.6, 0.1, 0.3, 3.3, 12.3, 11.7])
@pytest.mark.parametrize("size", [8, 7, 3])
@pytest.mark.parametrize("scale_by_std", [True, False])
def test_equal_rewards_give_exactly_zero_advantages(value, size, scale_by_std):
    """Partial-credit rewards (float32 values that are not dyadic) used to leave a one-signed residue
    that the std division scaled up: 8 x 0.6 gave +0.056 on every sample, 8 x 12.3 gave -0.47."""
    rewards = torch.cat([torch.full((size,), value), torch.tensor([0.0, 1.0, 0.5, 0.25])])
    groups = torch.tensor([0] * size + [1] * 4)
    adv = group_advantages(rewards, groups, scale_by_std=scale_by_std)
    assert adv[:size].abs().max().item() == 0.0
    # The group with signal is unchanged: DeepSeekMath's formula in float64, written out.
    r = torch.tensor([0.0, 1.0, 0.5, 0.25], dtype=torch.float64)
    want = r - r.mean()
    if scale_by_std:
        want = want / (r.std(unbiased=True) + 1e-6)
    torch.testing.assert_close(adv[size:], want.float(), atol=1e-6, rtol=1e-6)


# ------------------------------------------------------------------------------------------
# Fix 2: PPO whitening, numerically stable and on the trainer's device


@pytest.mark.parametrize("offset", [1e3, 1e4, 1e5])
def test_whitening_is_stable_far_from_zero(offset):
    """The one-pass float32 variance gave std 0.35 or 98 instead of 1 once |mean| / std > ~1e3."""
    g = torch.Generator().manual_seed(0)
    x = offset + torch.randn(4, 64, generator=g)
    mask = (torch.rand(4, 64, generator=g) > 0.2).float()
    w = whiten(x, mask).double()
    n = mask.sum()
    mean = (w * mask).sum() / n
    std = (((w - mean) ** 2 * mask).sum() / n).sqrt()
    assert abs(mean.item()) < 1e-4 and std.item() == pytest.approx(1.0, abs=1e-4)
    # Against the float64 reference: the whitened values themselves.
    x64 = x.double()
    m64 = (x64 * mask).sum() / n
    v64 = (((x64 - m64) ** 2) * mask).sum() / n
    torch.testing.assert_close(w, (x64 - m64) / (v64 + 1e-8).sqrt() * mask, atol=1e-4, rtol=0)


def test_whitening_all_reduces_on_the_trainers_device(monkeypatch):
    """Under a process group the whitening's sums are reduced on the device passed in (the trainer's:
    NCCL refuses CPU tensors), though the advantages were computed on the CPU."""

    class Seen(Exception):
        pass

    devices = []

    def all_reduce(t, op=None):
        devices.append(t.device)
        raise Seen

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda: 2)
    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    with pytest.raises(Seen):
        whiten(torch.randn(2, 3), torch.ones(2, 3), device="meta")
    assert devices == [torch.device("meta")]


def test_the_ppo_step_passes_its_device_to_the_whitening(monkeypatch):
    """app/trainer/step.py hands train_step's device down to `whiten` (the CPU values pass)."""
    from app.model.config import tiny_config
    from app.model.parallel import EPContext
    from app.model.policy import build_policy
    from app.trainer import ppo as ppo_module
    from app.trainer.critic import Critic, CriticParts
    from app.trainer.step import train_step

    seen = []
    real = ppo_module.whiten

    def spy(x, mask, *a, device=None, **k):
        seen.append(device)
        return real(x, mask, *a, **k)

    monkeypatch.setattr(ppo_module, "whiten", spy)
    cfg = RunConfig.model_validate({"trainer": {"algorithm": "ppo"}})
    config = tiny_config(cfg.model.preset)
    model = build_policy(config, cfg.router, EPContext.local())
    critic = CriticParts(Critic(build_policy(config, cfg.router, EPContext.local()).model, config.hidden_size),
                         optimizer=torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.0))
    batch = collate_groups(fake_groups(2, binary_reward=False))
    train_step(cfg, model, torch.optim.SGD(model.parameters(), lr=0.0), batch, pad_id=0, device="cpu",
               critic=critic)
    assert seen == ["cpu"]


# ------------------------------------------------------------------------------------------
# Fixes 3 and 4: the config refuses group size 1 (GRPO) and names the renamed field


def test_group_size_one_is_refused_for_grpo(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("rollout:\n  group_size: 1\n")
    with pytest.raises(ValueError, match=r"(?s)run.yaml.*rollout.group_size=1: GRPO needs at least 2"):
        RunConfig.load(path)
    # PPO's advantages come from its critic: one completion per prompt is fine there.
    assert RunConfig.model_validate({"rollout": {"group_size": 1}, "trainer": {"algorithm": "ppo"}})
    # TRL refuses it too.
    with pytest.raises(ValueError, match="at least 2 generations"):
        grpo_config(num_generations=1)


def test_the_old_truncated_reward_name_gets_one_clear_error(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("rollout:\n  truncated_reward: -1.0\n")
    with pytest.raises(ValueError, match=r"(?s)run.yaml.*truncated_reward was renamed rollout.overlong_reward"):
        RunConfig.load(path)
    assert RunConfig.model_validate({"rollout": {"overlong_reward": -1.0}}).rollout.overlong_reward == -1.0
