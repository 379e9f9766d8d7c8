"""The RL objectives (issue 29): exact zero advantages for equal rewards, stable PPO whitening on the
trainer's device, the config's refusals, and GSPO, Dr. GRPO, the importance-sampling modes, dual-clip
and the entropy bonus checked against TRL's own `GRPOTrainer._compute_loss` (tests/trl_oracle.py),
directly and through `train_step` with micro-batches; DAPO's dynamic sampling, overlong filtering and
soft overlong penalty against the paper's formulas and through the training loop."""

from __future__ import annotations

import json
import math
import threading

import pytest
import torch
import torch.distributed as dist
import yaml

from app.buffer.records import Group, Sample, Task
from app.config import RunConfig
from app.trainer.batch import collate_groups
from app.trainer.grpo import grpo_loss, group_advantages, rollout_is_weights, soft_overlong_penalty
from app.trainer.ppo import whiten
from helpers import fake_groups, single_rank_env
from trl_oracle import full_logprobs, grpo_config, groups_near, inputs_of, to_completion, trl_loss

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
        want = want / (r.std(unbiased=True) + 1e-4)
    torch.testing.assert_close(adv[size:], want.float(), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("value", [0.1, 0.6, 1.0, 12.3, 100.0])
@pytest.mark.parametrize("k", [1, 4, 7])
def test_near_ties_give_advantages_near_zero_as_trls(value, k):
    """Rewards 1 ulp apart (rounding in a reward function) gave advantages up to 1.8 with the std's
    old eps of 1e-6: the residue became a full training signal. TRL's 1e-4 keeps them near 0."""
    from trl.trainer.utils import nanstd

    a = torch.tensor(value, dtype=torch.float32)
    b = torch.nextafter(a, torch.tensor(math.inf))
    rewards = torch.stack([a] * k + [b] * (8 - k) + [torch.tensor(0.0), torch.tensor(1.0)] * 4)
    groups = torch.tensor([0] * 8 + [1] * 8)
    adv = group_advantages(rewards, groups)
    # TRL 1.16 GRPOTrainer._generate_and_score_completions (scale_rewards="group"), written out.
    grouped = rewards.view(-1, 8)
    trl = (grouped - grouped.nanmean(1, keepdim=True)) / (nanstd(grouped, dim=1).unsqueeze(1) + 1e-4)
    ulp = float(b - a)
    assert adv[:8].abs().max() < 0.1
    # TRL's float32 mean leaves a residue of an ulp or two; ours is exact (float64): they differ by
    # a few ulp over (std + eps).
    assert (adv[:8] - trl.flatten()[:8]).abs().max() <= 4 * ulp / 1e-4
    torch.testing.assert_close(adv[8:], trl.flatten()[8:], atol=1e-6, rtol=1e-6)  # a real spread: as TRL


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


@pytest.mark.parametrize("trainer, message", [
    ({"algorithm": "ppo", "ratio_level": "sequence"}, "GSPO"),
    ({"algorithm": "ppo", "rollout_is": "sequence_mask"}, "token-level"),
    ({"algorithm": "ppo", "dynamic_sampling": True}, "GRPO only"),
    ({"dynamic_sampling": True, "dynamic_sampling_max_skipped": 100}, "capacity_groups"),
    ({"rollout_is_min": 3.0, "tis_cap": 2.0}, "rollout_is_min"),
    ({"dual_clip": 1.0}, "dual_clip"),
    ({"overlong_buffer_tokens": 64}, "overlong_buffer_tokens"),
])
def test_objective_options_refuse_what_they_cannot_mean(trainer, message):
    with pytest.raises(ValueError, match=message):
        RunConfig.model_validate({"trainer": trainer})


def test_objective_names_record_the_aggregation():
    """The name says how the loss is aggregated (token-mean, seq-mean or the constant normaliser) and
    whether advantages are divided by the std: "grpo" alone was token-mean and seq-mean alike."""
    def name(**t):
        return RunConfig.model_validate({"trainer": t}).trainer.objective()

    assert name() == "grpo+agg=token-mean"
    assert name(loss_agg="seq-mean") == "grpo+agg=seq-mean"
    assert name(loss_agg="seq-mean-token-sum-norm") == "grpo+agg=seq-mean-token-sum-norm"
    assert name(scale_by_std=False) == "grpo+agg=token-mean+no_std"
    assert name(ratio_level="sequence") == "gspo+agg=token-mean"
    assert name(loss_agg="seq-mean-token-sum-norm", scale_by_std=False) == "dr_grpo+agg=seq-mean-token-sum-norm"
    assert name(ratio_level="sequence", loss_agg="seq-mean-token-sum-norm", scale_by_std=False) == \
        "gspo+dr_grpo+agg=seq-mean-token-sum-norm"
    assert name(algorithm="ppo", dual_clip=3.0) == "ppo+agg=token-mean+dual_clip"
    assert name(rollout_is="sequence_mask", entropy_coef=0.01, overlong_filter=True) == \
        "grpo+agg=token-mean+is=sequence_mask+entropy_bonus+overlong_filter"
    assert name(groups_per_step=8, ppo_mini_batch_size=2, ppo_epochs=3) == "grpo+agg=token-mean+mini_batches=4+epochs=3"
    assert name(use_rollout_log_probs=True, tis_cap=None) == "grpo+agg=token-mean+old=engine"


@pytest.mark.parametrize("trainer, message", [
    # tis_cap null turns the importance weights off: their mode and lower bound would do nothing
    ({"tis_cap": None, "rollout_is": "token_mask"}, r"trainer.tis_cap is null .*trainer.rollout_is=token_mask would"),
    ({"tis_cap": None, "rollout_is_min": 0.5}, r"trainer.tis_cap is null .*trainer.rollout_is_min=0.5 would"),
    # 0 groups skipped at most is no filter at all
    ({"dynamic_sampling": True, "dynamic_sampling_max_skipped": 0}, r"dynamic_sampling_max_skipped: .*0 skips no group"),
    ({"groups_per_step": 8, "ppo_mini_batch_size": 3}, r"ppo_mini_batch_size=3 must divide trainer.groups_per_step=8"),
    ({"use_rollout_log_probs": True}, r"use_rollout_log_probs: .* set trainer.tis_cap: null"),
])
def test_settings_that_would_do_nothing_are_refused_in_one_line(tmp_path, trainer, message):
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump({"trainer": trainer}))
    with pytest.raises(ValueError, match=message) as e:
        RunConfig.load(path)
    assert "\n" not in str(e.value) and str(path) in str(e.value)


# ------------------------------------------------------------------------------------------
# The loss against TRL's GRPOTrainer._compute_loss, directly (old policy != current, engine != old)


def _rows(seed: int = 0):
    """Row-aligned tensors of 6 sequences (prompt of 2, completions of 2-7 tokens)."""
    g = torch.Generator().manual_seed(seed)
    B, L = 6, 9
    mask = torch.zeros(B, L)
    for b, n in enumerate([7, 5, 2, 6, 3, 7]):
        mask[b, 2 : 2 + n] = 1.0
    old = (torch.randn(B, L, generator=g) * 0.5 - 2.0) * mask
    logp = (old + torch.randn(B, L, generator=g) * 0.25) * mask
    rollout = (old + torch.randn(B, L, generator=g) * 0.3) * mask
    ref = (old + torch.randn(B, L, generator=g) * 0.2) * mask
    ent = torch.rand(B, L, generator=g) * 3 * mask
    adv = torch.tensor([1.2, -0.7, 0.3, -1.5, 0.9, -0.2])
    return dict(logp=logp, old=old, rollout=rollout, ref=ref, ent=ent, adv=adv, mask=mask)


def _trl_is_ratio(old_c, sampling_c, mask_c, mode, cap, cap_min):
    """TRL 1.16's importance_sampling_ratio (GRPOTrainer._generate_and_score_completions), written out:
    exp((old - sampling) * mask) per token, or exp of its sum per sequence ([B, 1]); *_truncate
    clamps it to [cap_min, cap], *_mask sets it to 0 outside."""
    d = (old_c - sampling_c) * mask_c
    if mode.startswith("sequence"):
        d = d.sum(-1, keepdim=True)
    r = torch.exp(d)
    if mode.endswith("truncate"):
        return torch.clamp(r, min=cap_min, max=cap)
    lo = cap_min if cap_min is not None else -math.inf
    return r.masked_fill((r < lo) | (r > cap), 0.0)


# name -> (our grpo_loss options, TRL GRPOConfig options)
LOSS_MODES = {
    "grpo-token-mean": ({}, dict(loss_type="bnpo")),
    "grpo-seq-mean": ({"loss_agg": "seq-mean"}, dict(loss_type="grpo")),
    "gspo-seq-mean": ({"ratio_level": "sequence", "loss_agg": "seq-mean"},
                      dict(loss_type="grpo", importance_sampling_level="sequence")),
    "gspo-token-mean": ({"ratio_level": "sequence"}, dict(loss_type="bnpo", importance_sampling_level="sequence")),
    "dr_grpo": ({"loss_agg": "seq-mean-token-sum-norm", "norm_tokens": 12},
                dict(loss_type="dr_grpo", max_completion_length=12)),
    "dual-clip": ({"dual_clip": 1.3}, dict(loss_type="bnpo", delta=1.3)),
    "entropy-bonus": ({"entropy_coef": 0.05}, dict(loss_type="bnpo", entropy_coef=0.05)),
    "kl": ({"kl_coef": 0.05}, dict(loss_type="bnpo", beta=0.05, use_bias_correction_kl=False)),
    "is-token_truncate": ({"tis_cap": 1.2, "rollout_is_min": 0.9}, dict(vllm_importance_sampling_mode="token_truncate")),
    "is-token_mask": ({"tis_cap": 1.2, "rollout_is": "token_mask", "rollout_is_min": 0.8},
                      dict(vllm_importance_sampling_mode="token_mask")),
    "is-sequence_truncate": ({"tis_cap": 1.5, "rollout_is": "sequence_truncate"},
                             dict(vllm_importance_sampling_mode="sequence_truncate")),
    "is-sequence_mask": ({"tis_cap": 1.5, "rollout_is": "sequence_mask", "rollout_is_min": 0.6},
                         dict(vllm_importance_sampling_mode="sequence_mask")),
    "gspo+dr_grpo+is-sequence_mask+dual-clip+entropy": (
        {"ratio_level": "sequence", "loss_agg": "seq-mean-token-sum-norm", "norm_tokens": 12, "tis_cap": 1.5,
         "rollout_is": "sequence_mask", "rollout_is_min": 0.6, "dual_clip": 1.3, "entropy_coef": 0.05},
        dict(loss_type="dr_grpo", max_completion_length=12, importance_sampling_level="sequence",
             vllm_importance_sampling_mode="sequence_mask", delta=1.3, entropy_coef=0.05)),
}


@pytest.mark.parametrize("name", list(LOSS_MODES))
def test_loss_and_gradient_equal_trls(name):
    ours, theirs = LOSS_MODES[name]
    t = _rows()
    is_mode = "vllm_importance_sampling_mode" in theirs
    if is_mode:  # TRL: clip_max and clip_min of the vLLM importance-sampling ratio
        theirs = theirs | dict(loss_type=theirs.get("loss_type", "bnpo"), use_vllm=True,
                               vllm_importance_sampling_correction=True,
                               vllm_importance_sampling_clip_max=ours["tis_cap"],
                               vllm_importance_sampling_clip_min=ours.get("rollout_is_min"))
    args = grpo_config(**theirs)

    logp = t["logp"].clone().requires_grad_(True)
    ent = t["ent"].clone().requires_grad_(True)
    kw = dict(ours)
    kw.setdefault("tis_cap", None)
    out = grpo_loss(logp, t["old"], t["adv"], t["mask"], rollout_logprobs=t["rollout"], ref_logprobs=t["ref"],
                    entropy=ent, **kw)
    g_ours = torch.autograd.grad(out.loss, (logp, ent), allow_unused=True)

    logp2 = t["logp"].clone().requires_grad_(True)
    ent2 = t["ent"].clone().requires_grad_(True)
    logp_c, mask_c = to_completion(logp2, t["mask"])
    ent_c, _ = to_completion(ent2, t["mask"])
    old_c, _ = to_completion(t["old"], t["mask"])
    more = {"old_per_token_logps": old_c, "ref_per_token_logps": to_completion(t["ref"], t["mask"])[0]}
    if is_mode:
        more["importance_sampling_ratio"] = _trl_is_ratio(old_c, to_completion(t["rollout"], t["mask"])[0], mask_c,
                                                          theirs["vllm_importance_sampling_mode"], ours["tis_cap"],
                                                          ours.get("rollout_is_min"))
    ref_loss = trl_loss(args, logp_c, inputs_of(mask_c, t["adv"], **more), entropies=ent_c)
    g_trl = torch.autograd.grad(ref_loss, (logp2, ent2), allow_unused=True)

    assert out.loss.item() == pytest.approx(ref_loss.item(), rel=1e-6, abs=1e-7)
    for a, b in zip(g_ours, g_trl):
        a = torch.zeros_like(t["mask"]) if a is None else a
        b = torch.zeros_like(t["mask"]) if b is None else b
        torch.testing.assert_close(a * t["mask"], b * t["mask"], atol=1e-7, rtol=1e-5)
    assert float(torch.cat([g.flatten() for g in g_ours if g is not None]).abs().max()) > 0
    if name == "dual-clip":
        assert out.sums["dual_clipped"] > 0  # the bound binds somewhere in this example
    if "mask" in name:
        assert 0 < out.sums["is_masked"] < out.sums["tokens"]  # some tokens dropped, not all


def test_rollout_is_weights_by_hand():
    old = torch.log(torch.tensor([[3.0, 0.5, 1.0], [1.2, 1.1, 1.0]]))
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    rollout = torch.zeros(2, 3)
    w, dropped = rollout_is_weights(old, rollout, mask, "token_mask", cap=2.0, cap_min=0.6)
    torch.testing.assert_close(w * mask, torch.tensor([[0.0, 0.0, 0.0], [1.2, 1.1, 1.0]]))
    assert (dropped * mask).sum() == 2
    w, _ = rollout_is_weights(old, rollout, mask, "sequence_truncate", cap=2.0)
    torch.testing.assert_close(w, torch.tensor([[1.5, 1.5, 1.5], [1.32, 1.32, 1.32]]))  # 3 * 0.5, 1.2 * 1.1
    w, dropped = rollout_is_weights(old, rollout, mask, "sequence_mask", cap=1.4)
    torch.testing.assert_close(w, torch.tensor([[0.0, 0.0, 0.0], [1.32, 1.32, 1.32]]))
    assert dropped[0].tolist() == [1.0, 1.0, 1.0] and dropped[1].sum() == 0


# ------------------------------------------------------------------------------------------
# DAPO's soft overlong penalty and overlong filtering


def test_soft_overlong_penalty_is_dapos_formula():
    L_max, L_cache = 20, 8
    lengths = torch.arange(0, 25)

    def dapo(n):  # Yu et al. 2025, eq. 13
        if n <= L_max - L_cache:
            return 0.0
        if n <= L_max:
            return ((L_max - L_cache) - n) / L_cache
        return -1.0

    got = soft_overlong_penalty(lengths, L_max, L_cache, factor=1.0)
    torch.testing.assert_close(got, torch.tensor([dapo(int(n)) for n in lengths], dtype=torch.float32))
    assert soft_overlong_penalty(torch.tensor([20]), L_max, L_cache, factor=0.5).item() == -0.5
    with pytest.raises(ValueError, match="buffer_tokens"):
        soft_overlong_penalty(lengths, L_max, 0)


def _group(task, rewards, lengths, finish=None, prompt=(1, 5)):
    finish = finish or ["stop"] * len(rewards)
    return Group(task_id=task, attempt=0, samples=[
        Sample(sample_id=f"r/{task}/{i}/0", task_id=task, index=i, attempt=0, prompt_ids=list(prompt),
               completion_ids=[7] * n, logprobs=[-1.0] * n, reward=r, policy_version=0, finish_reason=f)
        for i, (r, n, f) in enumerate(zip(rewards, lengths, finish))])


def test_collate_masks_truncated_samples_and_shapes_rewards():
    g = _group("t", [1.0, 0.0, 1.0, 0.0], [3, 8, 5, 8], ["stop", "length", "stop", "length"])
    plain = collate_groups([g])
    filtered = collate_groups([g], mask_truncated=True)
    assert filtered.completion_mask[[1, 3]].sum() == 0  # cut at max_new_tokens: out of the loss
    torch.testing.assert_close(filtered.completion_mask[[0, 2]], plain.completion_mask[[0, 2]])
    torch.testing.assert_close(filtered.advantages, plain.advantages)  # still in the group's statistics
    shaped = collate_groups([g], soft_overlong=(8, 4, 1.0))
    torch.testing.assert_close(shaped.rewards, torch.tensor([1.0, -1.0, 1.0 - 0.25, -1.0]))
    torch.testing.assert_close(shaped.advantages, group_advantages(shaped.rewards, shaped.group_ids))


# ------------------------------------------------------------------------------------------
# Through train_step (micro-batches): the update equals TRL's gradient on the same model


def _policy(seed: int = 0):
    from app.model.config import tiny_config
    from app.model.parallel import EPContext
    from app.model.policy import build_policy

    cfg = RunConfig()
    return build_policy(tiny_config(cfg.model.preset), cfg.router, EPContext.local(), seed=seed)


# name -> (trainer options, TRL GRPOConfig options)
STEP_MODES = {
    "gspo": ({"ratio_level": "sequence", "tis_cap": None}, dict(loss_type="bnpo", importance_sampling_level="sequence")),
    "dr_grpo": ({"loss_agg": "seq-mean-token-sum-norm", "scale_by_std": False, "tis_cap": None},
                dict(loss_type="dr_grpo")),
    "sequence_mask": ({"rollout_is": "sequence_mask", "tis_cap": 1.3, "rollout_is_min": 0.8},
                      dict(vllm_importance_sampling_mode="sequence_mask", use_vllm=True,
                           vllm_importance_sampling_correction=True, vllm_importance_sampling_clip_max=1.3,
                           vllm_importance_sampling_clip_min=0.8)),
    "token_mask": ({"rollout_is": "token_mask", "tis_cap": 1.1, "rollout_is_min": 0.9},
                   dict(vllm_importance_sampling_mode="token_mask", use_vllm=True,
                        vllm_importance_sampling_correction=True, vllm_importance_sampling_clip_max=1.1,
                        vllm_importance_sampling_clip_min=0.9)),
    "entropy_bonus": ({"entropy_coef": 0.02, "tis_cap": None}, dict(loss_type="bnpo", entropy_coef=0.02)),
    "overlong_filter": ({"overlong_filter": True, "tis_cap": None}, dict(loss_type="bnpo", mask_truncated_completions=True)),
    # Dr. GRPO's constant normaliser counts the masked rows too (TRL: the batch size; verl: every row).
    "dr_grpo+overlong_filter": ({"loss_agg": "seq-mean-token-sum-norm", "scale_by_std": False, "tis_cap": None,
                                 "overlong_filter": True}, dict(loss_type="dr_grpo", mask_truncated_completions=True)),
}
TRUNCATED = {"overlong_filter": (0, 3, 6, 9), "dr_grpo+overlong_filter": (1, 6)}  # rows cut, of 12


@pytest.mark.parametrize("name", list(STEP_MODES))
def test_train_step_update_equals_trls_gradient(name):
    from app.trainer.step import train_step

    ours, theirs = STEP_MODES[name]
    max_tokens = 6  # fake_groups: completions of 1-5 tokens
    cfg = RunConfig.model_validate({
        "rollout": {"temperature": 0.9, "max_new_tokens": max_tokens},
        "trainer": {"grad_clip": 1e9, "lr_warmup_steps": 0, "micro_batch_tokens": 24, "log_entropy": True, **ours}})
    t = cfg.trainer
    model = _policy()
    groups = groups_near(model, 3, seed=7, temperature=0.9, truncated=TRUNCATED.get(name, ()))
    batch = collate_groups(groups, scale_by_std=t.scale_by_std, mask_truncated=t.overlong_filter)

    # TRL: one call over the whole batch, logprobs and entropies from the full logits. Its
    # mask_truncated_completions multiplies the completion mask by "not truncated" (TRL 1.16
    # _generate_and_score_completions); the old policy is the current one (ratio 1).
    trl_model = _policy()
    full = collate_groups(groups, scale_by_std=t.scale_by_std)
    logp, ent = full_logprobs(trl_model, full, 0.9)
    logp_c, mask_c = to_completion(logp, full.completion_mask)
    ent_c, _ = to_completion(ent, full.completion_mask)
    if theirs.get("mask_truncated_completions"):
        truncated = torch.tensor([s.finish_reason == "length" for g in groups for s in g.samples])
        mask_c = mask_c * (~truncated).float()[:, None]
    more = {}
    if theirs.get("vllm_importance_sampling_correction"):
        sampling_c, _ = to_completion(full.rollout_logprobs, full.completion_mask)
        more["importance_sampling_ratio"] = _trl_is_ratio(logp_c.detach(), sampling_c, mask_c,
                                                          theirs["vllm_importance_sampling_mode"], ours["tis_cap"],
                                                          ours["rollout_is_min"])
        theirs = theirs | dict(loss_type="bnpo")
    args = grpo_config(**(theirs | dict(max_completion_length=max_tokens, temperature=0.9)))
    ref_loss = trl_loss(args, logp_c, inputs_of(mask_c, full.advantages, **more), entropies=ent_c)
    ref_loss.backward()
    trl_grad = {k: p.grad.clone() for k, p in trl_model.named_parameters() if p.grad is not None}

    before = {k: p.detach().clone() for k, p in model.named_parameters()}
    applied, stats = train_step(cfg, model, torch.optim.SGD(model.parameters(), lr=1.0), batch, pad_id=0)
    assert applied and stats["micro_batches"] >= 3
    delta = {k: before[k] - p.detach() for k, p in model.named_parameters()}
    assert set(trl_grad) <= set(delta)
    scale = max(float(g.abs().max()) for g in trl_grad.values())
    assert scale > 0
    for k, g in trl_grad.items():
        torch.testing.assert_close(delta[k], g, atol=2e-6 * max(scale, 1.0), rtol=1e-4, msg=lambda m, k=k: f"{k}: {m}")
    if "mask" in name:
        assert 0 < stats["is_masked_frac"] < 1, stats
    assert stats["loss"] == pytest.approx(ref_loss.item(), rel=1e-5, abs=1e-7)
    if name == "dr_grpo+overlong_filter":
        # verl (core_algos.agg_loss "seq-mean-token-sum-norm", a micro-batch of one row, scaled by
        # 1 / gradient accumulation over the 12 rows): at ratio 1 the loss is -sum(A * mask) / (12 * 6).
        kept = batch.completion_mask
        assert batch.input_ids.shape[0] == 12 and int((kept.sum(-1) == 0).sum()) == 2
        verl = -(batch.advantages[:, None] * kept).sum() / (12 * max_tokens)
        assert stats["loss"] == pytest.approx(verl.item(), rel=1e-5, abs=1e-7)


def test_entropy_gradient_of_the_chunked_lm_head_equals_autograd():
    from app.model.logprobs import chunked_logprobs

    torch.manual_seed(0)
    n, h, v = 23, 8, 30
    hidden = torch.randn(n, h, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(v, h, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, v, (n,))
    g1, g2 = torch.randn(n, dtype=torch.float64), torch.randn(n, dtype=torch.float64)
    logp, ent = chunked_logprobs(hidden, weight, targets, 0.7, chunk=4, with_entropy=True, entropy_grad=True)
    z = hidden @ weight.T / 0.7
    ref_lp = torch.log_softmax(z, -1)
    ref_ent = -(ref_lp.exp() * ref_lp).sum(-1)
    torch.testing.assert_close(ent, ref_ent, atol=1e-12, rtol=0)
    ref = (ref_lp.gather(1, targets[:, None]).squeeze(1) * g1).sum() + (ref_ent * g2).sum()
    got = torch.autograd.grad((logp * g1).sum() + (ent * g2).sum(), (hidden, weight), retain_graph=True)
    want = torch.autograd.grad(ref, (hidden, weight), retain_graph=True)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=0)
    got = torch.autograd.grad((ent * g2).sum(), (hidden, weight))  # entropy alone: logp unused
    want = torch.autograd.grad((ref_ent * g2).sum(), (hidden, weight))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=0)
    # Without entropy_grad the entropy stays detached.
    _, ent = chunked_logprobs(hidden, weight, targets, 0.7, chunk=4, with_entropy=True)
    assert not ent.requires_grad


# ------------------------------------------------------------------------------------------
# DAPO's dynamic sampling: the filter, the buffer, the loop


def test_signal_filter_skips_flat_groups_up_to_its_cap():
    from app.trainer.sampling import SignalFilter, has_signal

    flat = _group("flat", [0.6] * 4, [3] * 4)
    sig = _group("sig", [0.6, 0.6, 0.6, 0.7], [3] * 4)
    assert not has_signal(flat) and has_signal(sig)
    # The soft overlong penalty is part of the trained reward: equal scores at different lengths differ.
    assert has_signal(_group("len", [1.0] * 4, [2, 2, 2, 8]), soft_overlong=(8, 4, 1.0))
    f = SignalFilter(max_skipped=2)
    skipped: list = []
    assert [f.admit(g, skipped) for g in (flat, sig, flat, flat, flat)] == [False, True, False, True, True]
    assert skipped == [["flat", 0, "no_signal"]] * 2
    assert f.meta() == {"no_signal_skipped": 2, "no_signal_admitted": 2}


def _publish(buf, run_id: str, task_id: str, rewards: list[float], version: int = 0) -> None:
    buf.put_tasks([Task(task_id=task_id, prompt_ids=[1, 5, 9], prompt="", answer="{}", group_size=len(rewards))])
    (task,) = buf.lease("test", count=1, block_ms=1000)
    assert buf.publish(task, [
        Sample(sample_id=task.sample_id(run_id, k), task_id=task.task_id, index=k, attempt=task.attempt,
               prompt_ids=task.prompt_ids, completion_ids=[10 + k] * (1 + k), logprobs=[-4.6] * (1 + k),
               reward=r, policy_version=version, finish_reason="stop")
        for k, r in enumerate(rewards)])


def test_take_groups_fills_the_batch_with_signal_and_the_buffer_consumes_the_rest(redis_server):
    from app.buffer import ExperienceBuffer
    from app.trainer.intake import take_groups
    from app.trainer.sampling import SignalFilter

    run_id = "ds"
    cfg = RunConfig.model_validate({"run_id": run_id, "buffer": {"redis_url": redis_server, "capacity_groups": 64},
                                    "rollout": {"group_size": 4},
                                    "trainer": {"groups_per_step": 2, "dynamic_sampling": True,
                                                "dynamic_sampling_max_skipped": 3, "batch_timeout_s": 30}})
    buf = ExperienceBuffer(redis_server, run_id, capacity_groups=64, max_staleness=1, autocommit=False)
    for i, rewards in enumerate([[1, 1, 1, 1], [0, 1, 0, 1], [0.5] * 4, [0.2, 0.2, 0.3, 0.2],
                                 [0, 0, 0, 0], [1] * 4, [0] * 4, [1] * 4, [1, 0, 0, 0]]):
        _publish(buf, run_id, f"t{i}", [float(r) for r in rewards])
    skipped: list = []
    f = SignalFilter.of(cfg)
    groups, _ = take_groups(buf, cfg, 0, lambda: False, lambda g: f.admit(g, skipped))
    assert [g.task_id for g in groups] == ["t1", "t3"]
    assert [s[0] for s in skipped] == ["t0", "t2"]
    # Next step: three flat groups in a row reach the cap; the fourth fills the batch (no starvation).
    skipped, f = [], SignalFilter.of(cfg)
    groups, _ = take_groups(buf, cfg, 0, lambda: False, lambda g: f.admit(g, skipped))
    assert [g.task_id for g in groups] == ["t7", "t8"] and [s[0] for s in skipped] == ["t4", "t5", "t6"]
    assert f.meta() == {"no_signal_skipped": 3, "no_signal_admitted": 1}
    stats = buf.stats()
    assert stats["taken"] == 9 and stats["ready"] == 9  # every group taken, held until the commit
    buf.commit()
    stats = buf.stats()
    assert stats["consumed"] == 9 and stats["ready"] == 0


def test_a_zero_token_completion_with_dynamic_sampling_and_the_soft_overlong_penalty(redis_server):
    """Rank 0 measures a header's signal with the soft overlong penalty of each completion's length:
    a 0-token completion (an engine error beside real completions) raised AttributeError there, on
    every step and after every resume (a header has the length, not the ids)."""
    from app.buffer import ExperienceBuffer
    from app.trainer.batch import sample_rewards
    from app.trainer.intake import take_groups
    from app.trainer.sampling import SignalFilter

    run_id = "zero-len"
    cfg = RunConfig.model_validate({"run_id": run_id, "buffer": {"redis_url": redis_server},
                                    "rollout": {"group_size": 4, "max_new_tokens": 8},
                                    "trainer": {"groups_per_step": 1, "dynamic_sampling": True,
                                                "overlong_buffer_tokens": 4, "batch_timeout_s": 30}})
    buf = ExperienceBuffer(redis_server, run_id, capacity_groups=64, max_staleness=1, autocommit=False)
    # Equal scores: the flat group's lengths all lie before the penalty's ramp (max 8 - buffer 4),
    # the other's 8-token completion is penalised -1.
    for task_id, lengths in (("flat", [0, 1, 2, 3]), ("ramp", [0, 2, 8, 3])):
        buf.put_tasks([Task(task_id=task_id, prompt_ids=[1, 5, 9], prompt="", answer="{}", group_size=4)])
        (task,) = buf.lease("test", count=1, block_ms=1000)
        assert buf.publish(task, [
            Sample(sample_id=task.sample_id(run_id, k), task_id=task_id, index=k, attempt=0, prompt_ids=[1, 5, 9],
                   completion_ids=[7] * n, logprobs=[-1.0] * n, reward=1.0, policy_version=0,
                   finish_reason="error" if n == 0 else "length" if n == 8 else "stop")
            for k, n in enumerate(lengths)])
    skipped: list = []
    f = SignalFilter.of(cfg)
    headers, _ = take_groups(buf, cfg, 0, lambda: False, lambda g: f.admit(g, skipped))
    assert [h.task_id for h in headers] == ["ramp"] and skipped == [["flat", 0, "no_signal"]]
    groups, bad = buf.read_groups(headers)
    assert not bad
    batch = collate_groups(groups, soft_overlong=cfg.soft_overlong())
    torch.testing.assert_close(batch.rewards, torch.tensor([1.0, 1.0, 0.0, 1.0]))
    torch.testing.assert_close(sample_rewards(headers[0].samples, cfg.soft_overlong()), batch.rewards)


def _flat_and_signal_producer(url: str, run_id: str, stop: threading.Event) -> None:
    """A fake rollout worker: every other group's rewards are all equal (no signal)."""
    from app.buffer import ExperienceBuffer

    buf = ExperienceBuffer(url, run_id, capacity_groups=64, max_staleness=1)
    i = 0
    while not stop.is_set():
        if not buf.wait_for_capacity(timeout_s=0.2):
            continue
        current = buf.current_policy()
        _publish(buf, run_id, f"p{i}", [0.5] * 4 if i % 2 else [0.0, 1.0, 0.5, 0.25], current[0] if current else 0)
        i += 1


def test_the_loop_trains_on_groups_with_signal_and_records_the_rest(tmp_path, redis_server, monkeypatch):
    from app.trainer.trainer import Trainer

    run_id = "ds-loop"
    cfg = RunConfig.model_validate({
        "run_id": run_id, "store_url": f"file://{tmp_path}/store",
        "buffer": {"redis_url": redis_server, "capacity_groups": 64},
        "rollout": {"group_size": 4, "max_new_tokens": 4},
        "trainer": {"steps": 2, "groups_per_step": 2, "batch_timeout_s": 60, "dynamic_sampling": True,
                    "ratio_level": "sequence", "overlong_filter": True},
    })
    single_rank_env(monkeypatch)
    stop = threading.Event()
    producer = threading.Thread(target=_flat_and_signal_producer, args=(redis_server, run_id, stop), daemon=True)
    producer.start()
    try:
        Trainer(cfg, tmp_path / "run").train()
    finally:
        stop.set()
        producer.join(timeout=10)
        if dist.is_initialized():
            dist.destroy_process_group()
    metrics = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [m["objective"] for m in metrics] == ["gspo+agg=token-mean+dynamic_sampling+overlong_filter"] * 2
    assert all(m["groups"] == 2 and m["no_signal_skipped"] >= 1 for m in metrics), metrics
    trained = [json.loads(x) for x in (tmp_path / "run" / "trained.jsonl").read_text().splitlines()]
    for line in trained:
        for g in line["groups"]:
            assert int(g["task_id"][1:]) % 2 == 0  # only groups with signal were trained on
        assert line["skipped"] and all(r == "no_signal" for _, _, r in line["skipped"])


def test_bench_loop_refuses_an_objective_its_trl_leg_would_not_run(tmp_path):
    from app.bench.loop import grpo_args

    cfg = RunConfig.model_validate({"trainer": {"ratio_level": "sequence"}})
    with pytest.raises(ValueError, match="objective=gspo"):
        grpo_args(cfg, tmp_path, 1)
    cfg = RunConfig.model_validate({"trainer": {"ppo_epochs": 2}})  # its TRL leg takes one step a batch
    with pytest.raises(ValueError, match="epochs=2"):
        grpo_args(cfg, tmp_path, 1)
    assert grpo_args(RunConfig(), tmp_path, 1).num_iterations == 1  # the default recipe runs
