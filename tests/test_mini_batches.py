"""Mini-batches and epochs per rollout batch (issue 41), so the clip can bind: ``trainer.ppo_mini_batch_size``
and ``ppo_epochs`` (verl's names) against TRL's own reuse of one generation batch (``num_iterations``,
``steps_per_generation``; tests/trl_oracle.py) to float32 rounding, the engine's logprobs as the old
policy (``use_rollout_log_probs``) against TRL's loss with them, the old-logprob pass run once per batch,
two gloo ranks (FSDP2 x EP) against one process for GRPO and PPO, and the loop's counters across a resume."""

from __future__ import annotations

import json
import threading
from unittest import mock

import pytest
import torch
import torch.distributed as dist

from app.config import RunConfig
from app.trainer.batch import collate_groups, split_groups, split_mini_batches
from app.trainer.step import train_step
from helpers import assert_params_match, fake_groups, fake_producer, full_params, join_world, sharded_trainer, \
    single_rank_env, spawn
from trl_oracle import full_logprobs, grpo_config, groups_near, inputs_of, to_completion, trl_generation_steps, \
    trl_loss

T = 0.9
MAX_TOKENS = 6  # fake_groups: completions of 1-5 tokens


def _policy():
    from app.model.config import tiny_config
    from app.model.parallel import EPContext
    from app.model.policy import build_policy

    cfg = RunConfig()
    return build_policy(tiny_config(cfg.model.preset), cfg.router, EPContext.local(), seed=0)


def _cfg(**trainer) -> RunConfig:
    return RunConfig.model_validate({
        "rollout": {"temperature": T, "max_new_tokens": MAX_TOKENS},
        "trainer": {"grad_clip": 1e9, "lr_warmup_steps": 0, "micro_batch_tokens": 24, "log_entropy": False,
                    "tis_cap": None, "groups_per_step": 3, **trainer}})


def test_split_mini_batches_cuts_in_order_and_shares_each_over_the_ranks():
    groups = fake_groups(6)
    parts, minis = split_mini_batches(groups, 1, 2)
    assert [g.task_id for g in parts[0]] == [f"t{i}" for i in range(6)] and minis[0] == [0, 0, 1, 1, 2, 2]
    parts, minis = split_mini_batches(groups, 2, 2)
    # Every mini-batch (t0 t1 | t2 t3 | t4 t5) is shared by both ranks; the same groups as on one rank.
    for r in (0, 1):
        assert minis[r] == [0, 1, 2] and [int(g.task_id[1:]) // 2 for g in parts[r]] == [0, 1, 2]
    assert sorted(g.task_id for p in parts for g in p) == [f"t{i}" for i in range(6)]
    one_mini = split_mini_batches(groups, 3, 6)  # one mini-batch: split_groups itself
    assert one_mini[0] == split_groups(groups, 3) and one_mini[1] == [[0, 0], [0, 0], [0, 0]]
    batch = collate_groups(parts[1], mini_batches=minis[1])
    assert batch.mini_batch.tolist() == [m for g, m in zip(parts[1], minis[1]) for _ in g.samples]


# name -> (trainer options, TRL GRPOConfig options). 3 groups of 4 rows; TRL's slices are
# per_device_train_batch_size rows.
TRL_MODES = {
    # One mini-batch, three epochs: TRL's num_iterations.
    "epochs": ({"ppo_epochs": 3}, dict(num_iterations=3, steps_per_generation=1, per_device_train_batch_size=12)),
    # A mini-batch per group, two epochs: TRL's steps_per_generation x num_iterations; truncated IS
    # against the engine with the old logprobs of the first pass (TRL computes both at generation);
    # dual-clip is TRL's delta (above 1 + epsilon_high, where the two agree).
    "mini_batches+epochs+tis+dual_clip": (
        {"ppo_mini_batch_size": 1, "ppo_epochs": 2, "tis_cap": 1.2, "dual_clip": 1.3},
        dict(num_iterations=2, steps_per_generation=3, per_device_train_batch_size=4, use_vllm=True,
             vllm_importance_sampling_correction=True, vllm_importance_sampling_mode="token_truncate",
             vllm_importance_sampling_clip_max=1.2, delta=1.3)),
    "gspo+mini_batches": ({"ppo_mini_batch_size": 1, "ppo_epochs": 2, "ratio_level": "sequence"},
                          dict(num_iterations=2, steps_per_generation=3, per_device_train_batch_size=4,
                               importance_sampling_level="sequence")),
}


@pytest.mark.parametrize("name", list(TRL_MODES))
def test_mini_batches_and_epochs_equal_trls_reuse_of_a_generation_batch(name):
    ours, theirs = TRL_MODES[name]
    cfg = _cfg(**ours)
    model = _policy()
    groups = groups_near(model, 3, seed=3, temperature=T)  # a seed where the dual-clip binds too
    parts, minis = split_mini_batches(groups, 1, cfg.trainer.mini_batch_groups())
    batch = collate_groups(parts[0], mini_batches=minis[0])
    applied, stats = train_step(cfg, model, torch.optim.SGD(model.parameters(), lr=0.1), batch, pad_id=0)
    steps = stats["mini_batch_stats"]
    assert applied and stats["optimizer_steps"] == len(steps) == theirs["num_iterations"] * theirs["steps_per_generation"]

    # TRL: the old logprobs (and the importance ratio against the engine) of the whole batch at
    # generation, then its own _prepare_inputs and _compute_loss for every optimizer step. TRL
    # shuffles the rows before it cuts them into slices; verl's mini-batches (and ours) are whole
    # groups in order, so the shuffle is the identity here.
    trl_model = _policy()
    full = collate_groups(groups)
    with torch.no_grad():
        old, _ = full_logprobs(trl_model, full, T)
    old_c, mask_c = to_completion(old, full.completion_mask)
    more = {}
    if theirs.get("vllm_importance_sampling_correction"):
        sampling_c, _ = to_completion(full.rollout_logprobs, full.completion_mask)
        more["importance_sampling_ratio"] = torch.exp((old_c - sampling_c) * mask_c).clamp(max=1.2)
    generation = inputs_of(mask_c, full.advantages, old_per_token_logps=old_c, rows=torch.arange(12), **more)

    def logps_of_rows(rows):
        logp, _ = full_logprobs(trl_model, full, T)
        return to_completion(logp, full.completion_mask)[0][rows]

    args = grpo_config(**theirs, max_completion_length=MAX_TOKENS, temperature=T)
    with mock.patch("trl.trainer.grpo_trainer.shuffle_sequence_dict", lambda d: d):
        losses = trl_generation_steps(args, generation, logps_of_rows, torch.optim.SGD(trl_model.parameters(), lr=0.1))

    assert [s["loss"] for s in steps] == pytest.approx(losses, rel=1e-5, abs=1e-6)  # float32, after 5 steps
    got, want = dict(model.named_parameters()), dict(trl_model.named_parameters())
    for k, p in want.items():
        torch.testing.assert_close(got[k].detach(), p.detach(), atol=1e-6, rtol=1e-5, msg=lambda m, k=k: f"{k}: {m}")
    # The first step is on-policy (ratio 1, nothing clipped); later ones are off-policy and clipped.
    assert steps[0]["clip_frac"] == 0 and steps[0]["ratio_max"] == pytest.approx(1.0, abs=1e-5)
    assert max(s["clip_frac"] for s in steps[1:]) > 0.1 and stats["clip_frac"] > 0
    if "dual_clip" in name:
        assert stats["dual_clip_frac"] > 0
    assert [(s["epoch"], s["mini_batch"]) for s in steps] == [
        (e, j) for e in range(theirs["num_iterations"]) for j in range(theirs["steps_per_generation"])]


def test_the_engines_logprobs_as_the_old_policy_clip_from_the_first_step():
    """use_rollout_log_probs (verl's name; AReaL without recompute): one optimizer step whose clip is
    against the engine's logprobs, TRL's loss with them as old_per_token_logps."""
    cfg = _cfg(use_rollout_log_probs=True)
    model = _policy()
    groups = groups_near(model, 3, seed=7, temperature=T)
    before = {k: p.detach().clone() for k, p in model.named_parameters()}
    applied, stats = train_step(cfg, model, torch.optim.SGD(model.parameters(), lr=1.0), collate_groups(groups),
                                pad_id=0)
    assert applied and stats["optimizer_steps"] == 1 and stats["clip_frac"] > 0  # on-policy it would be 0

    trl_model = _policy()
    full = collate_groups(groups)
    logp, _ = full_logprobs(trl_model, full, T)
    logp_c, mask_c = to_completion(logp, full.completion_mask)
    rollout_c, _ = to_completion(full.rollout_logprobs, full.completion_mask)
    args = grpo_config(max_completion_length=MAX_TOKENS, temperature=T)
    loss = trl_loss(args, logp_c, inputs_of(mask_c, full.advantages, old_per_token_logps=rollout_c))
    loss.backward()
    assert stats["loss"] == pytest.approx(loss.item(), rel=1e-5)
    for k, p in trl_model.named_parameters():
        if p.grad is not None:
            delta = before[k] - dict(model.named_parameters())[k].detach()
            torch.testing.assert_close(delta, p.grad, atol=1e-6, rtol=1e-4, msg=lambda m, k=k: f"{k}: {m}")


@pytest.mark.parametrize("trainer, passes", [({}, (0, 1)), ({"ppo_epochs": 2}, (1, 2)),
                                             ({"ppo_mini_batch_size": 1, "ppo_epochs": 2}, (1, 6)),
                                             ({"ppo_epochs": 2, "use_rollout_log_probs": True}, (0, 2))])
def test_the_old_logprobs_take_one_pass_and_only_when_needed(trainer, passes):
    """The old-logprob pass (no gradient) runs once per batch before its first step; not with one
    step a batch (the ratio is 1 then) nor with the engine's logprobs. With no token budget, a pass
    is one forward (one micro-batch): ``passes`` = (gradient-free, training) forwards."""
    cfg = _cfg(micro_batch_tokens=None, **trainer)
    model = _policy()
    parts, minis = split_mini_batches(fake_groups(3), 1, cfg.trainer.mini_batch_groups())
    calls = []
    real = type(model).sequence_logprobs

    def counted(self, *a, **k):
        calls.append(torch.is_grad_enabled())
        return real(self, *a, **k)

    with mock.patch.object(type(model), "sequence_logprobs", counted):
        applied, _ = train_step(cfg, model, torch.optim.SGD(model.parameters(), lr=0.01),
                                collate_groups(parts[0], mini_batches=minis[0]), pad_id=0)
    assert applied and (calls.count(False), calls.count(True)) == passes


def test_with_routing_replay_the_old_logprobs_route_as_the_steps_do():
    """The old-logprob pass replays the engine's experts as the training forwards do: at lr 0 every
    step's ratio is 1. Replayed experts are drawn at random, so the model's own routing would give
    other logprobs (the replay is counted as a mismatch)."""
    import numpy as np

    from app.model.config import moe_layer_ids, tiny_config

    cfg = _cfg(ppo_mini_batch_size=1, ppo_epochs=2)
    cfg.rollout.routing_replay = True
    model = _policy()
    config = tiny_config(cfg.model.preset)
    layers, E, K = moe_layer_ids(config), config.num_experts, config.num_experts_per_tok
    rng = np.random.default_rng(0)
    groups = fake_groups(3)
    for g in groups:
        for smp in g.samples:
            fed = len(smp.prompt_ids) + len(smp.completion_ids) - 1
            smp.routed_experts = np.stack([rng.permutation(E)[:K] for _ in range(fed * len(layers))]).reshape(
                fed, len(layers), K).astype(np.uint8)
    parts, minis = split_mini_batches(groups, 1, 1)
    batch = collate_groups(parts[0], moe_layers=layers, mini_batches=minis[0])
    applied, stats = train_step(cfg, model, torch.optim.SGD(model.parameters(), lr=0.0), batch, pad_id=0)
    assert applied and stats["routing_replay_mismatch"] > 0.3
    for s in stats["mini_batch_stats"]:
        assert s["approx_kl"] == pytest.approx(0.0, abs=1e-9) and s["ratio_max"] == pytest.approx(1.0, abs=1e-5), s


# ------------------------------------------------------------------------------------------
# Two gloo ranks (FSDP2 x EP 2) against one process; on a CUDA machine both share its GPU over a
# device-strict cuda:gloo group (MOERL_SHARED_GPU=1, as tests/test_ranks.py; scripts/gpu_ranks.sh)

CUDA = torch.cuda.is_available()


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if CUDA else torch.device("cpu")


BASE = {"rollout": {"temperature": T}, "trainer": {"grad_clip": 1e9, "tis_cap": 2.0, "lr_warmup_steps": 0,
                                                   "groups_per_step": 4, "ppo_mini_batch_size": 2, "ppo_epochs": 2,
                                                   "micro_batch_tokens": 24, "log_entropy": False}}
RANK_MODES = {
    "grpo": {"dual_clip": 1.5},
    "ppo": {"algorithm": "ppo", "gae_lambda": 0.9, "value_clip": 0.05},
}


def _rank_cfg(name: str, ep: int) -> RunConfig:
    trainer = {**BASE["trainer"], **RANK_MODES[name], "parallel": {"ep": ep}}
    return RunConfig.model_validate({**BASE, "trainer": trainer})


def _rank_step(cfg, model, critic, rank: int, world: int) -> dict:
    groups = fake_groups(4, binary_reward=cfg.trainer.algorithm == "grpo")
    parts, minis = split_mini_batches(groups, world, cfg.trainer.mini_batch_groups())
    batch = collate_groups(parts[rank], mini_batches=minis[rank])
    if critic is not None:
        critic.optimizer = torch.optim.SGD(critic.module.parameters(), lr=0.1)
    applied, stats = train_step(cfg, model, torch.optim.SGD(model.parameters(), lr=0.1), batch, pad_id=0,
                                device=_device(), critic=critic)
    after = full_params(model) | ({f"critic.{k}": v for k, v in full_params(critic.module).items()} if critic else {})
    return {"applied": applied, "stats": stats, "after": {k: v.float().cpu() for k, v in after.items()}}


def _ranks_worker(rank: int, world: int, port: int, out: str) -> None:
    import os

    os.environ["MOERL_SHARED_GPU"] = "1"  # without CUDA: plain gloo
    join_world(rank, world, port)
    from app.trainer.models import build_critic_parts

    results = {}
    for name in RANK_MODES:
        cfg = _rank_cfg(name, 2)
        model, mesh, ep = sharded_trainer(cfg, _device())
        critic = build_critic_parts(cfg, None, ep, mesh, _device()) if name == "ppo" else None
        results[name] = _rank_step(cfg, model, critic, rank, world)
    if rank == 0:
        torch.save(results, out)
    dist.barrier()
    dist.destroy_process_group()


def _one_process(name: str) -> dict:
    from app.model.config import tiny_config
    from app.model.parallel import EPContext
    from app.model.policy import build_policy
    from app.trainer.critic import Critic, CriticParts

    cfg = _rank_cfg(name, 1)
    config = tiny_config(cfg.model.preset)
    model = build_policy(config, cfg.router, EPContext.local(), seed=cfg.task.seed).to(_device())
    critic = None
    if name == "ppo":
        trunk = build_policy(config, cfg.router, EPContext.local(), seed=cfg.task.seed).model
        critic = CriticParts(Critic(trunk, config.hidden_size).to(_device()), optimizer=None)
    return _rank_step(cfg, model, critic, 0, 1)


def test_two_ranks_take_the_same_mini_batch_steps_as_one_process(tmp_path):
    spawn(_ranks_worker, 2, str(tmp_path / "out.pt"))
    got_all = torch.load(tmp_path / "out.pt")
    for name in RANK_MODES:
        got, ref = got_all[name], _one_process(name)
        assert got["applied"] and ref["applied"] and ref["stats"]["optimizer_steps"] == 4
        for key in ("loss", "grad_norm", "tokens", "clip_frac", "approx_kl", "ratio_max"):
            assert got["stats"][key] == pytest.approx(ref["stats"][key], rel=1e-4, abs=1e-6), (name, key)
        for g, r in zip(got["stats"]["mini_batch_stats"], ref["stats"]["mini_batch_stats"]):
            assert g["loss"] == pytest.approx(r["loss"], rel=1e-4, abs=1e-6), (name, g, r)
        assert ref["stats"]["clip_frac"] > 0, name  # the clip binds in the later steps
        if name == "ppo":
            assert ref["stats"]["vf_clip_frac"] > 0  # and so does the value clip
        assert_params_match(got["after"], ref["after"], atol=2e-6, rtol=1e-4)


# ------------------------------------------------------------------------------------------
# The loop: metrics and the state's counters across a resume


def test_the_loop_counts_optimizer_steps_and_resumes_the_count(tmp_path, redis_server, monkeypatch):
    from app.storage import open_store
    from app.trainer.trainer import Trainer
    from app.trainer.state import latest_state

    run_id = "mini"
    cfg = RunConfig.model_validate({
        "run_id": run_id, "store_url": f"file://{tmp_path}/store",
        "buffer": {"redis_url": redis_server, "capacity_groups": 8, "max_staleness": 4},
        "rollout": {"group_size": 4},
        "trainer": {"steps": 2, "groups_per_step": 2, "ppo_mini_batch_size": 1, "ppo_epochs": 2,
                    "batch_timeout_s": 60, "log_entropy": False, "lr": 1e-3},
    })
    single_rank_env(monkeypatch)
    stop = threading.Event()
    producer = threading.Thread(target=fake_producer, args=(redis_server, run_id, stop, 4), daemon=True)
    producer.start()
    try:
        Trainer(cfg, tmp_path / "run").train()
        dist.destroy_process_group()
        cfg.trainer.steps = 3
        state = Trainer(cfg, tmp_path / "run", resume=True).train()
    finally:
        stop.set()
        producer.join(timeout=10)
        if dist.is_initialized():
            dist.destroy_process_group()
    assert (state.step, state.optimizer_steps, state.resumed_from) == (3, 12, 2)
    assert latest_state(open_store(cfg.store_url), run_id)["train_state"]["optimizer_steps"] == 12
    metrics = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [m["optimizer_steps_total"] for m in metrics] == [4, 8, 12]
    assert all(m["objective"] == "grpo+agg=token-mean+mini_batches=2+epochs=2" for m in metrics)
    for m in metrics:
        assert m["optimizer_steps"] == 4
        assert [(s["epoch"], s["mini_batch"]) for s in m["mini_batch_stats"]] == [(0, 0), (0, 1), (1, 0), (1, 1)]
        assert m["mini_batch_stats"][0]["approx_kl"] == pytest.approx(0.0, abs=1e-6)  # on-policy first step
        assert m["mini_batch_stats"][-1]["approx_kl"] > 0  # off-policy by then
