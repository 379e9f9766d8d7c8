"""Multi-turn episodes in the rollout worker (app/rollout/episodes.py) against OpenEnv servers,
a real redis-server and, for one test, the real built-in engine.

- a multi-turn group: turns and observations in order, loss mask 0 exactly on the observation
  tokens, engine logprobs on generated tokens only, the oldest version of its turns; and it
  trains (one trainer step of the tiny policy on the published group);
- a failed episode (the environment raises) is never published: the task is requeued with its
  failures counted, then dropped after buffer.max_failures, counted;
- an env server SIGKILLed in the middle of an episode: the group fails, the task goes back to
  the queue and is played again once the server is back; published once, nothing lost;
- a failed reward call fails the single-turn group too, and the reward function is warmed
  before the first lease.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch
import torch.distributed as dist

from app.buffer import ExperienceBuffer, Task
from app.buffer.redis_server import free_port
from app.config import RunConfig
from app.envs.tasks import make_splits, make_tasks
from app.model.tokenizer import EOS_ID, build_tokenizer
from app.rollout.engine_client import EngineClient, GenOutput, wait_until_healthy
from app.rollout.worker import RolloutWorker
from helpers import EnvServer, engine_argv, single_rank_env, tiny_moe_checkpoint

ROOT = Path(__file__).resolve().parents[1]
G = 4
TOK = build_tokenizer()


def run_config(tmp_path: Path, redis_url: str, env_url: str, **env) -> RunConfig:
    cfg = RunConfig(run_id="eptest", store_url=f"file://{tmp_path / 'store'}")
    cfg.buffer.redis_url = redis_url
    cfg.buffer.lease_ms = 30_000
    cfg.rollout.group_size = G
    cfg.rollout.max_new_tokens = 6
    cfg.rollout.overlong_reward = None  # every turn goes to the environment
    cfg.rollout.policy_cache_dir = str(tmp_path / "cache")
    cfg.rollout.retry_backoff_s = 0.05
    cfg.env.name = "spell-retry"
    cfg.env.url = env_url
    cfg.env.attempts = 2
    cfg.env.max_turns = 2
    cfg.task.train_size, cfg.task.eval_size = 20, 5
    for k, v in env.items():
        setattr(cfg.env, k, v)
    return cfg


def tasks(cfg: RunConfig, n: int) -> list[Task]:
    train, _ = make_splits(cfg.task)
    return make_tasks(train[:n], TOK, cfg.rollout.group_size)


class StubEngine:
    """An engine client that always answers ``zzz<eos>`` (a wrong spelling) at version 3, and
    can hold the first turn of the first request until ``release`` is set."""

    url = "stub://engine"

    def __init__(self, hold: bool = False):
        self.calls = 0
        self.held = threading.Event()
        self.release = threading.Event()
        if not hold:
            self.release.set()

    async def generate(self, ids, n=1, **kw):
        self.calls += 1
        if self.calls == 1 and not self.release.is_set():
            self.held.set()
            await asyncio.to_thread(self.release.wait, 60)
        turn = TOK("zzz", add_special_tokens=False)["input_ids"] + [EOS_ID]
        return [GenOutput(token_ids=turn, logprobs=[-0.5] * len(turn), text="zzz", finish_reason="stop",
                          weight_version=3)] * n

    async def weight_version(self):
        return 3

    async def health_generate(self, timeout_s=30.0):
        return True


@pytest.fixture(scope="module")
def retry_server():
    cfg = RunConfig()
    cfg.env.name = "spell-retry"
    cfg.env.attempts = 2
    server = EnvServer(cfg)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    ckpt = tiny_moe_checkpoint(tmp_path_factory.mktemp("epckpt") / "m", seed=0, max_position_embeddings=128)
    port = free_port()
    log = open(tmp_path_factory.mktemp("epengine") / "engine.log", "wb")
    proc = subprocess.Popen(engine_argv(ckpt, port, "--weight-version", "0"), cwd=ROOT, stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_healthy(url, timeout_s=90)
        yield url
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)
        log.close()


def published(buf: ExperienceBuffer) -> list:
    return buf.take_batch(64, trainer_version=0, timeout_s=0)


def test_multi_turn_group_is_masked_and_trains(tmp_path, redis_server, retry_server, engine, monkeypatch):
    cfg = run_config(tmp_path, redis_server, retry_server.url)
    cfg.rollout.engine_url = engine
    buf = ExperienceBuffer.from_config(cfg)
    buf.put_tasks(tasks(cfg, 1))

    async def go():
        async with EngineClient(engine) as client:
            return await RolloutWorker(cfg, buf, client, "w-mt", max_groups=1).run()

    stats = asyncio.run(go())
    assert stats.groups_published == 1 and stats.groups_failed == 0
    (group,) = published(buf)
    multi = 0
    for s in group.samples:
        assert len(s.loss_mask) == len(s.completion_ids) == len(s.logprobs)
        env = [i for i, m in enumerate(s.loss_mask) if m == 0]
        assert all(s.logprobs[i] == 0.0 for i in env) and all(s.logprobs[i] < 0 for i, m in enumerate(s.loss_mask) if m)
        assert s.policy_version == 0 and 0.0 <= s.reward <= 1.0
        if env:  # a wrong first answer: the feedback sits between the two turns
            multi += 1
            text = TOK.decode([s.completion_ids[i] for i in env])
            assert text.startswith("#") and text.endswith("=") and set(text[1:-1]) <= {"+", "-"}
            assert env == list(range(env[0], env[-1] + 1))  # one contiguous observation ...
            assert env[0] > 0 and env[-1] + 1 < len(s.loss_mask)  # ... between two generated turns
    assert multi >= 1  # the random policy's answers are wrong: it gets feedback and a retry

    # The group trains: one GRPO step of the tiny policy on it.
    from app.model.config import tiny_config
    from app.model.parallel import init_ep
    from app.model.policy import build_policy
    from app.trainer.batch import collate_groups
    from app.trainer.step import train_step
    from app.trainer.parallel import init_distributed

    single_rank_env(monkeypatch)
    group.samples[0].reward = 1.0  # a spread of rewards, so the step has advantages to follow
    group.samples[1].reward = 0.0
    init_distributed(timeout_s=60)
    try:
        model = build_policy(tiny_config("tiny-qwen3-moe"), cfg.router, init_ep(cfg.trainer.parallel), seed=0)
        before = [p.detach().clone() for p in model.parameters()]
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        batch = collate_groups([group])
        applied, stats = train_step(cfg, model, opt, batch, pad_id=0)
        assert applied and stats["tokens"] == sum(sum(s.loss_mask) for s in group.samples)
        assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))
    finally:
        dist.destroy_process_group()


def test_failed_episode_is_never_trained_and_dropped_after_max_failures(tmp_path, redis_server, retry_server):
    cfg = run_config(tmp_path, redis_server, retry_server.url)
    cfg.buffer.max_failures = 2
    buf = ExperienceBuffer.from_config(cfg)
    good, bad = tasks(cfg, 2)
    bad.answer = "not json"  # the environment's reset raises: every episode of it fails
    buf.put_tasks([good, bad])

    async def go():
        worker = RolloutWorker(cfg, buf, StubEngine(), "w-fail")

        async def stop_when_done():
            while buf.stats()["failed_dropped"] < 1 or buf.stats()["finished"] < 1:
                await asyncio.sleep(0.1)
            worker.request_stop()

        stopper = asyncio.ensure_future(stop_when_done())
        stats = await asyncio.wait_for(worker.run(), 60)
        await stopper
        return stats

    stats = asyncio.run(go())
    s = buf.stats()
    assert stats.groups_failed == 2 and stats.tasks_dropped == 1
    assert (s["failed_requeued"], s["failed_dropped"], s["finished"]) == (1, 1, 1)
    assert buf.dropped_tasks() == {f"{bad.task_id}/0"}
    groups = published(buf)
    assert [g.task_id for g in groups] == [good.task_id]  # the failed task left nothing to train
    assert s["queued"] == 0 and s["leased"] == 0


def test_env_server_killed_mid_episode_loses_nothing(tmp_path, redis_server):
    port = free_port()
    cfg = run_config(tmp_path, redis_server, f"http://127.0.0.1:{port}")
    cfg_path = tmp_path / "run.yaml"
    cfg.save(cfg_path)
    argv = [sys.executable, "-m", "app.cli", "env", "--config", str(cfg_path), "--port", str(port)]

    def start():
        p = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                             start_new_session=True)
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"{cfg.env.url}/health", timeout=2).status_code == 200:
                    return p
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline and p.poll() is None, "moerl env did not start"
            time.sleep(0.2)

    procs = [start()]
    buf = ExperienceBuffer.from_config(cfg)
    (task,) = tasks(cfg, 1)
    buf.put_tasks([task])
    engine = StubEngine(hold=True)

    def pod_killer():
        assert engine.held.wait(60)  # an episode is open on the server, waiting for its first turn
        os.killpg(procs[0].pid, signal.SIGKILL)
        procs[0].wait(10)
        engine.release.set()  # the turn comes back; the episode's next call finds no server
        time.sleep(1.0)
        procs.append(start())  # the Deployment starts a new pod

    killer = threading.Thread(target=pod_killer, daemon=True)
    killer.start()
    try:
        async def go():
            return await RolloutWorker(cfg, buf, engine, "w-kill", max_groups=1).run()

        stats = asyncio.run(asyncio.wait_for(go(), 120))
        killer.join(30)
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(10)
    s = buf.stats()
    assert stats.groups_failed == 1 and stats.groups_published == 1
    assert (s["failed_requeued"], s["failed_dropped"], s["finished"], s["duplicates"]) == (1, 0, 1, 0)
    (group,) = published(buf)
    ids = [x.sample_id for x in group.samples]
    assert group.task_id == task.task_id and len(set(ids)) == G  # once, whole
    assert all(x.policy_version == 3 for x in group.samples)
    assert s["queued"] == 0 and s["leased"] == 0  # nothing left behind, nothing lost


def test_failed_reward_fails_the_group_and_warm_up_comes_first(tmp_path, redis_server, engine):
    cfg = run_config(tmp_path, redis_server, "http://unused:1")
    cfg.env.name = None
    cfg.rollout.engine_url = engine
    cfg.rollout.reward_timeout_s = 0.3
    cfg.buffer.max_failures = 1
    order = []

    class Buffer(ExperienceBuffer):
        def lease(self, *a, **k):
            order.append("lease")
            return super().lease(*a, **k)

    buf = Buffer.from_config(cfg)
    buf.put_tasks([Task(task_id="t0", prompt_ids=[1, 20, 30], prompt="p", answer="{}", group_size=G),
                   Task(task_id="t1", prompt_ids=[1, 21, 30], prompt="p", answer="{}", group_size=G)])

    def score(task, completion):
        if task.task_id == "t0":
            raise ValueError("malformed answer")
        time.sleep(2)  # past reward_timeout_s
        return 1.0

    def warm(task_cfg):
        time.sleep(1.0)  # slower than reward_timeout_s: it must not count against it
        order.append("warm")

    score.warm = warm

    async def go():
        async with EngineClient(engine) as client:
            worker = RolloutWorker(cfg, buf, client, "w-rew", score_fn=score)

            async def stop_when_done():
                while buf.stats()["failed_dropped"] < 2:
                    await asyncio.sleep(0.1)
                worker.request_stop()

            stopper = asyncio.ensure_future(stop_when_done())
            stats = await asyncio.wait_for(worker.run(), 60)
            await stopper
            return stats

    stats = asyncio.run(go())
    assert order[0] == "warm" and order.count("warm") == 1
    assert stats.reward_errors == G and stats.reward_timeouts == G and stats.groups_failed == 2
    assert stats.groups_published == 0 and published(buf) == []  # a failed reward is never a reward of 0
    assert buf.dropped_tasks() == {"t0/0", "t1/0"}


def test_episode_keeps_the_oldest_version_of_its_turns(tmp_path, redis_server, retry_server):
    """Turns generated at versions 5 then 4 (an engine restarted on an older version): the sample
    carries 4, the version staleness is measured from (docs/ARCHITECTURE.md, "Policy version and staleness")."""
    from app.envs.chat import TextRenderer
    from app.rollout.episodes import EpisodeRunner

    cfg = run_config(tmp_path, redis_server, retry_server.url)
    versions = iter([5, 4])
    turn = TOK("zzz", add_special_tokens=False)["input_ids"] + [EOS_ID]

    async def generate(ids):
        return GenOutput(token_ids=turn, logprobs=[-0.5] * len(turn), text="zzz", finish_reason="stop",
                         weight_version=next(versions))

    (task,) = tasks(cfg, 1)
    runner = EpisodeRunner(cfg, TextRenderer(TOK), generate, lambda: 0)
    sample = asyncio.run(runner.episode(task, 0))
    assert sample.policy_version == 4 and sample.finish_reason == "stop"
    assert sample.loss_mask.count(1) == 2 * len(turn)  # two turns, the feedback between them
