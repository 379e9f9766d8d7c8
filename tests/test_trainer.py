"""The trainer loop: rejected groups are counted, GRPO raises a toy reward, a short 2-rank gloo run
against a real redis-server and a file:// store, and the non-finite-loss stop (the sharded
layouts against the single-process step: tests/test_sharded_trainer.py)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from app.buffer.redis_server import free_port
from app.config import RunConfig
from helpers import fake_groups, fake_producer, single_rank_env, toy_rollout

ROOT = Path(__file__).resolve().parents[1]


def test_usable_rejects_and_counts_bad_groups():
    from app.trainer.intake import usable
    from app.trainer.state import TrainState

    state = TrainState(version=3)
    good, stale, errored, broken = fake_groups(4)
    for smp in stale.samples:
        smp.policy_version = 1  # staleness 2 > max_staleness 1
    for smp in errored.samples:
        smp.finish_reason, smp.completion_ids, smp.logprobs = "error", [], []
    broken.samples[0].logprobs = broken.samples[0].logprobs + [-1.0]
    for smp in good.samples + errored.samples + broken.samples:
        smp.policy_version = 2
    kept = [g for g in (good, stale, errored, broken) if usable(g, state, 1, 0)]
    assert kept == [good]
    assert (state.overstale, state.error_groups, state.malformed) == (1, 1, 1)


# ------------------------------------------------------------------------------------------
# The loss has the right sign: GRPO steps raise the reward of a toy task


def test_grpo_steps_raise_reward_on_toy_task(monkeypatch):
    """Reward = fraction of completion tokens equal to one target token; sampling from the
    policy itself (so rollout logprobs match), 4 groups of 8 per step, one core."""
    from app.model.config import tiny_config
    from app.model.parallel import init_ep
    from app.model.policy import build_policy
    from app.trainer.batch import collate_groups
    from app.trainer.step import train_step
    from app.trainer.parallel import init_distributed

    single_rank_env(monkeypatch)
    torch.manual_seed(0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny tensors: more threads only contend on the shared cores
    cfg = RunConfig.model_validate({"trainer": {"lr": 3e-3}})
    init_distributed(timeout_s=60)
    try:
        model = build_policy(tiny_config("tiny-qwen3-moe"), cfg.router, init_ep(cfg.trainer.parallel), seed=0)
        opt = torch.optim.AdamW(model.parameters(), lr=cfg.trainer.lr)
        gen = torch.Generator().manual_seed(0)
        target, G, n_new = 50, 8, 6

        rewards = []
        for step in range(30):
            groups = [toy_rollout(model, gen, f"s{step}-p{k}", [1, 5 + k], G, n_new, target) for k in range(4)]
            rewards.append(sum(s.reward for g in groups for s in g.samples) / (4 * G))
            applied, stats = train_step(cfg, model, opt, collate_groups(groups), pad_id=0)
            assert applied and stats["tis"] == pytest.approx(1.0, abs=1e-3)  # on-policy samples
        first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
        assert first < 0.1 and last > first + 0.3, rewards
    finally:
        dist.destroy_process_group()
        torch.set_num_threads(threads)


# ------------------------------------------------------------------------------------------
# A short 2-rank run against a real redis-server and a file:// store


@pytest.mark.slow
def test_two_rank_run_publishes_versions(tmp_path, redis_server):
    from app.buffer import ExperienceBuffer
    from app.storage import open_store
    from app.storage.policy import download_policy, latest_policy_version

    run_id = "trainer-test"
    steps = 3
    cfg = RunConfig.model_validate({
        "run_id": run_id, "store_url": f"file://{tmp_path}/store",
        "model": {"preset": "tiny-qwen3-moe"},
        "buffer": {"redis_url": redis_server, "max_staleness": 1},
        "rollout": {"group_size": 4},
        "trainer": {"parallel": {"ep": 2}, "steps": steps, "groups_per_step": 3, "lr": 1e-3, "publish_every": 1,
                    "keep_versions": 2, "batch_timeout_s": 120},
    })
    cfg_path = tmp_path / "run.yaml"
    cfg.save(cfg_path)
    stop = threading.Event()
    producer = threading.Thread(target=fake_producer, args=(redis_server, run_id, stop, 4), daemon=True)
    producer.start()
    run_dir = tmp_path / "run"
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
             "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
             "-m", "app.cli", "train", "--config", str(cfg_path), "--run-dir", str(run_dir)],
            cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"},
            capture_output=True, text=True, timeout=300,
        )
    finally:
        stop.set()
        producer.join(timeout=10)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]

    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == list(range(1, steps + 1))
    assert [r["policy_version"] for r in lines] == list(range(1, steps + 1))
    for r in lines:
        assert r["applied"] and math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"])
        assert r["groups"] == 3 and r["samples"] == 12
        assert r["staleness_max"] <= 1
        assert r["tokens"] == sum(1 + k for k in range(4)) * 3

    store = open_store(cfg.store_url)
    assert latest_policy_version(store, run_id) == steps
    buf = ExperienceBuffer(redis_server, run_id)
    version, uri = buf.current_policy()
    assert version == steps and uri
    # keep_versions=2: v0..v1 pruned, v2 and v3 kept; both load in stock transformers.
    from transformers import AutoModelForCausalLM, AutoTokenizer

    weights = []
    for v in (steps - 1, steps):
        d = download_policy(store, run_id, v, tmp_path / f"dl-v{v}")
        model = AutoModelForCausalLM.from_pretrained(d)
        AutoTokenizer.from_pretrained(d)
        weights.append(model.model.embed_tokens.weight.detach())
    assert not torch.equal(weights[0], weights[1]), "training did not change the weights"
    with pytest.raises(Exception):
        download_policy(store, run_id, 0, tmp_path / "dl-v0")


# ------------------------------------------------------------------------------------------
# Non-finite losses: skipped and counted, then a clear stop


def test_nan_losses_skip_then_stop(tmp_path, redis_server, monkeypatch):
    from app.model import logprobs
    from app.trainer.trainer import Trainer

    run_id = "nan-test"
    cfg = RunConfig.model_validate({
        "run_id": run_id, "store_url": f"file://{tmp_path}/store",
        "buffer": {"redis_url": redis_server}, "rollout": {"group_size": 2},
        "trainer": {"steps": 10, "groups_per_step": 1, "max_bad_steps": 3, "batch_timeout_s": 60},
    })
    real = logprobs.chunked_logprobs

    def nan_logprobs(*a, **k):
        logp, ent = real(*a, **k)
        return logp * float("nan"), ent

    monkeypatch.setattr(logprobs, "chunked_logprobs", nan_logprobs)
    single_rank_env(monkeypatch)
    stop = threading.Event()
    producer = threading.Thread(target=fake_producer, args=(redis_server, run_id, stop, 2), daemon=True)
    producer.start()
    try:
        with pytest.raises(RuntimeError, match=r"3 steps in a row.*max_bad_steps=3"):
            Trainer(cfg, tmp_path / "run").train()
    finally:
        stop.set()
        producer.join(timeout=10)
        if dist.is_initialized():
            dist.destroy_process_group()
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["applied"] for r in lines] == [False, False, False]
    assert lines[-1]["bad_steps"] == 3


def test_unreachable_redis_fails_fast_on_both_ranks(tmp_path):
    """Bad input: one clear line naming the URL, exit code 1, no rank left hanging."""
    port = free_port()  # nothing listens there
    cfg = RunConfig.model_validate({
        "run_id": "no-redis", "store_url": f"file://{tmp_path}/store",
        "buffer": {"redis_url": f"redis://127.0.0.1:{port}/0"}, "trainer": {"parallel": {"ep": 2}},
    })
    cfg.save(tmp_path / "run.yaml")
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
         "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
         "-m", "app.cli", "train", "--config", str(tmp_path / "run.yaml"),
         "--run-dir", str(tmp_path / "run")],
        cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
        timeout=120,
    )
    assert proc.returncode != 0
    err = proc.stderr
    assert f"moerl train (rank 0): cannot reach Redis at redis://127.0.0.1:{port}/0" in err, err[-3000:]
    assert "moerl train (rank 1): rank 0 failed" in err, err[-3000:]
    assert not (tmp_path / "store").exists() or not any((tmp_path / "store").rglob("*.safetensors"))


def test_next_version_decides_push_store_and_announce():
    """Every publish_every-th step and the last publish one more version; with network weight sync
    each is pushed and only every store_every-th (and the last) is stored and announced."""
    from app.trainer.publish import NextVersion, first_version, next_version

    assert first_version(None) == 0 and first_version(4) == 5
    cfg = RunConfig.model_validate({"trainer": {"steps": 9, "publish_every": 2},
                                    "weight_sync": {"mode": "network", "store_every": 3}})
    version, seen = 0, []
    for step in range(1, 10):
        d = next_version(cfg, step, version)
        assert d.announce == d.store and d.publish == (d.version == version + 1)
        if d.publish:
            seen.append((step, d.version, d.push, d.store))
        version = d.version
    assert seen == [(2, 1, True, False), (4, 2, True, False), (6, 3, True, True), (8, 4, True, False),
                    (9, 5, True, True)]
    store = RunConfig.model_validate({"trainer": {"steps": 3, "publish_every": 2}})
    stored = NextVersion(1, publish=True, store=True, announce=True)
    assert [next_version(store, s, 0) for s in (1, 2, 3)] == [NextVersion(0), stored, stored]
