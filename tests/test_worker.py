"""The rollout worker against a real engine process and a real redis-server.

- SIGTERM drain of a `moerl rollout` process: exit 0, every task either published (once) or
  back in the queue, nothing left leased;
- a drain whose grace period runs out releases the unfinished tasks;
- reward functions that raise or hang: the group fails, is never published, and its task is
  requeued (tests/test_episodes.py, with the warm-up before the first lease);
- engine errors: the task goes back to the queue after the client's retries;
- a newly announced policy version: downloaded, loaded by the engine (pause -> update ->
  continue), samples stamped with it.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis

from app.buffer import ExperienceBuffer, Task
from app.buffer.redis_server import free_port
from app.config import RunConfig
from app.model.tokenizer import BOS_ID
from app.rollout.engine_client import EngineClient, EngineError, wait_until_healthy
from app.rollout.scoring import score_with_timeout
from app.rollout.worker import RolloutWorker
from helpers import engine_argv, scrape, tiny_moe_checkpoint

ROOT = Path(__file__).resolve().parents[1]
G = 4

STUB_REWARDS = '''
def score(task, completion):
    """Test stub: 1.0 for completions of even length."""
    return float(len(completion) % 2 == 0)
'''


def make_checkpoint(out: Path, seed: int) -> Path:
    """A tiny random Qwen3-MoE (see `helpers.tiny_moe_checkpoint`), 128 positions."""
    return tiny_moe_checkpoint(out, seed, max_position_embeddings=128)


def stop_process(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("wckpts")
    return make_checkpoint(root / "a", seed=0), make_checkpoint(root / "b", seed=1)


@pytest.fixture(scope="module")
def engine(ckpts, tmp_path_factory):
    port = free_port()
    log_path = tmp_path_factory.mktemp("wengine") / "engine.log"
    argv = engine_argv(ckpts[0], port, "--weight-version", "0")
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(argv, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_healthy(url, timeout_s=90)
        yield url
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                stop_process(proc)


def make_config(tmp_path: Path, redis_url: str, engine_url: str, **rollout) -> RunConfig:
    cfg = RunConfig(run_id="wtest", store_url=f"file://{tmp_path / 'store'}")
    cfg.buffer.redis_url = redis_url
    cfg.buffer.lease_ms = 30_000
    cfg.rollout.engine_url = engine_url
    cfg.rollout.group_size = G
    cfg.rollout.max_new_tokens = 24
    cfg.rollout.policy_cache_dir = str(tmp_path / "cache")
    cfg.rollout.policy_poll_s = 0.2
    for k, v in rollout.items():
        setattr(cfg.rollout, k, v)
    return cfg


def make_tasks(n: int) -> list[Task]:
    return [Task(task_id=f"train-{i:04d}", prompt_ids=[BOS_ID, 20 + i % 50, 30], prompt=f"p{i}",
                 answer="{}", group_size=G) for i in range(n)]


def drain_buffer(buf: ExperienceBuffer) -> tuple[dict[str, list], list[str]]:
    """Everything in the buffer: published groups by task id, and the task ids still queued."""
    groups: dict[str, list] = {}
    while True:
        batch = buf.take_batch(64, trainer_version=0, timeout_s=0)
        if not batch:
            break
        for g in batch:
            groups.setdefault(g.task_id, []).append(g)
    queued = [t.task_id for t in buf.lease("auditor", count=1000, block_ms=0)]
    return groups, queued


def test_score_with_timeout_counts_raise_and_hang():
    task = make_tasks(1)[0]

    def raises(t, c):
        raise RuntimeError("bad verifier")

    def hangs(t, c):
        time.sleep(30)
        return 1.0

    async def go():
        return await asyncio.gather(
            score_with_timeout(lambda t, c: 0.5, task, "x", 1.0),
            score_with_timeout(raises, task, "x", 1.0),
            score_with_timeout(hangs, task, "x", 0.2),
            score_with_timeout(lambda t, c: float("nan"), task, "x", 1.0),
        )

    assert asyncio.run(go()) == [(0.5, None), (0.0, "error"), (0.0, "timeout"), (0.0, "error")]


def test_sigterm_drain_loses_no_task(tmp_path, redis_server, engine):
    """A real `moerl rollout` process, SIGTERM mid-run: exit 0; every task published or queued."""
    (tmp_path / "stub_rewards.py").write_text(STUB_REWARDS)
    cfg = make_config(tmp_path, redis_server, engine, reward_fn="stub_rewards:score",
                      max_new_tokens=48, inflight_sequences=3 * G, drain_grace_s=30.0)
    cfg_path = tmp_path / "run.yaml"
    cfg.save(cfg_path)
    tasks = make_tasks(40)
    buf = ExperienceBuffer.from_config(cfg)
    assert buf.put_tasks(tasks) == len(tasks)

    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{ROOT}", "PYTHONUNBUFFERED": "1"}
    log_path = tmp_path / "worker.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "app.cli", "rollout", "--config", str(cfg_path), "--engine-url", engine,
             "--worker-id", "w0"], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while buf.stats()["finished"] < 2 or buf.stats()["leased"] == 0:
            assert proc.poll() is None, log_path.read_text()[-3000:]
            assert time.monotonic() < deadline, f"worker made no progress:\n{log_path.read_text()[-3000:]}"
            time.sleep(0.05)
        leased_at_signal = buf.stats()["leased"]
        os.killpg(proc.pid, signal.SIGTERM)
        code = proc.wait(cfg.rollout.drain_grace_s + 30)
    finally:
        stop_process(proc)
    out = log_path.read_text()
    assert code == 0, out[-3000:]
    assert leased_at_signal > 0  # the signal found groups in flight
    stats = json.loads(out.strip().splitlines()[-1])
    assert stats["worker_id"] == "w0"

    assert buf.stats()["leased"] == 0, "the drain left tasks leased"
    groups, queued = drain_buffer(buf)
    assert set(groups) | set(queued) == {t.task_id for t in tasks}  # nothing lost
    assert not set(groups) & set(queued)
    assert all(len(gs) == 1 for gs in groups.values())  # nothing published twice
    assert len(groups) == stats["groups_published"] >= 2
    for (g,) in groups.values():
        assert [s.index for s in g.samples] == list(range(G))
        for s in g.samples:
            assert s.policy_version == 0 and s.sample_id == f"wtest/{g.task_id}/{s.index}/0"
            assert len(s.logprobs) == len(s.completion_ids) >= 1
            assert all(lp <= 0 for lp in s.logprobs)
            assert s.finish_reason in ("stop", "length")
            assert s.reward in (0.0, 1.0)


class SlowClient(EngineClient):
    """Generation that never finishes in time (a hung engine)."""

    async def generate(self, *args, **kwargs):
        await asyncio.sleep(3600)


class FailingClient(EngineClient):
    """Every /generate fails after the retries."""

    calls = 0

    async def generate(self, *args, **kwargs):
        FailingClient.calls += 1
        raise EngineError("POST /generate failed: HTTP 500")


def run_until(make_worker, done):
    """Run the worker `make_worker()` builds (inside the event loop) until `done(worker.stats)`,
    then ask it to stop; returns its stats once it has drained (10 s at most)."""

    async def go():
        worker = make_worker()
        runner = asyncio.create_task(worker.run())
        while not done(worker.stats):
            await asyncio.sleep(0.05)
        worker.request_stop()
        return await asyncio.wait_for(runner, 10)

    return asyncio.run(go())


def test_drain_past_grace_releases_unfinished_tasks(tmp_path, redis_server, engine):
    cfg = make_config(tmp_path, redis_server, engine, drain_grace_s=0.5, inflight_sequences=2 * G)
    buf = ExperienceBuffer.from_config(cfg)
    buf.put_tasks(make_tasks(3))

    stats = run_until(lambda: RolloutWorker(cfg, buf, SlowClient(engine), "w1", score_fn=lambda t, c: 1.0),
                      lambda st: st.tasks_leased >= 2)
    assert stats.tasks_released == 2 and stats.groups_published == 0
    s = buf.stats()
    assert s["leased"] == 0 and s["queued"] == 3


def test_engine_errors_send_the_task_back(tmp_path, redis_server, engine):
    cfg = make_config(tmp_path, redis_server, engine, inflight_sequences=1 * G)
    buf = ExperienceBuffer.from_config(cfg)
    buf.put_tasks(make_tasks(1))

    stats = run_until(lambda: RolloutWorker(cfg, buf, FailingClient(engine), "w2", score_fn=lambda t, c: 1.0),
                      lambda st: st.engine_errors >= 1)
    assert stats.engine_errors >= 1 and stats.tasks_released >= 1 and stats.groups_published == 0
    s = buf.stats()
    assert s["leased"] == 0 and s["queued"] == 1 and s["finished"] == 0


def test_new_policy_version_is_loaded_and_stamped(tmp_path, redis_server, engine, ckpts):
    from app.storage import open_store, publish_policy

    cfg = make_config(tmp_path, redis_server, engine)
    buf = ExperienceBuffer.from_config(cfg)
    store = open_store(cfg.store_url)
    uri = publish_policy(store, cfg.run_id, 1, ckpts[1])
    buf.announce_policy(1, uri)
    buf.put_tasks(make_tasks(2))

    async def go():
        async with EngineClient(engine) as client:
            try:
                worker = RolloutWorker(cfg, buf, client, "w4", score_fn=lambda t, c: 1.0, max_groups=2)
                stats = await worker.run()
                info = await client.model_info()
                return stats, info
            finally:
                await client.update_weights_from_disk(str(ckpts[0]), 0)  # module engine back to A

    stats, info = asyncio.run(go())
    assert stats.weight_updates == 1 and stats.weight_update_failures == 0
    assert info["weight_version"] == "1"
    assert Path(info["model_path"]) == (tmp_path / "cache" / "w4" / "v1").resolve()
    groups, _ = drain_buffer(buf)
    assert len(groups) == 2
    assert all(s.policy_version == 1 for gs in groups.values() for g in gs for s in g.samples)


def test_worker_serves_its_counters_and_weight_update_seconds(tmp_path, monkeypatch, redis_server, engine, ckpts):
    """`run_worker(metrics_port=...)`: /metrics (read with prometheus_client's parser) carries the
    worker's published groups and one weight-update duration; SIGTERM drains and closes the port."""
    from app.rollout.worker import run_worker
    from app.storage import open_store, publish_policy

    (tmp_path / "stub_rewards.py").write_text(STUB_REWARDS)
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = make_config(tmp_path, redis_server, engine, reward_fn="stub_rewards:score")
    buf = ExperienceBuffer.from_config(cfg)
    buf.announce_policy(1, publish_policy(open_store(cfg.store_url), cfg.run_id, 1, ckpts[1]))
    buf.put_tasks(make_tasks(200))
    port = free_port()
    run = (("run_id", cfg.run_id),)
    published = ("moerl_rollout_events_total", (("event", "groups_published"), *run))

    def scrape_or_none():
        try:
            return scrape(port)
        except OSError:
            return None  # not listening yet

    async def go():
        runner = asyncio.create_task(run_worker(cfg, engine, "w-metrics", metrics_port=port, metrics_every_s=0.1))
        deadline = time.monotonic() + 120
        while True:
            assert not runner.done(), runner.result()
            assert time.monotonic() < deadline, "no groups on /metrics"
            m = await asyncio.to_thread(scrape_or_none)
            if m and m.get(published, 0) >= 2:
                break
            await asyncio.sleep(0.1)
        os.kill(os.getpid(), signal.SIGTERM)  # the worker's own handler: drain, then return
        return m, await asyncio.wait_for(runner, 60)

    try:
        m, stats = asyncio.run(go())
    finally:
        async def back_to_a():
            async with EngineClient(engine) as client:
                await client.update_weights_from_disk(str(ckpts[0]), 0)
        asyncio.run(back_to_a())
    assert 2 <= m[published] <= stats.groups_published
    assert m[("moerl_rollout_events_total", (("event", "weight_updates"), *run))] == stats.weight_updates == 1
    assert m[("moerl_rollout_weight_update_seconds_count", run)] == 1
    assert m[("moerl_rollout_weight_update_seconds_sum", run)] > 0
    with pytest.raises(OSError):
        scrape(port)  # the endpoint went away with the worker


def test_task_the_engine_refuses_is_consumed_not_recycled(tmp_path, redis_server, engine):
    """A prompt longer than the context gets HTTP 400 on every worker: published as an all-error
    group with reward 0 instead of going back to the queue forever."""
    # Truncated completions scored like the others, so every good sample earns the scorer's 1.0.
    cfg = make_config(tmp_path, redis_server, engine, overlong_reward=None)
    buf = ExperienceBuffer.from_config(cfg)
    long_task = Task(task_id="train-long", prompt_ids=[BOS_ID] + [40] * 119, prompt="x" * 119,
                     answer="{}", group_size=G)  # 120 + max_new_tokens 24 > 128 positions
    buf.put_tasks([long_task] + make_tasks(1))

    async def go():
        async with EngineClient(engine) as client:
            return await RolloutWorker(cfg, buf, client, "w5", score_fn=lambda t, c: 1.0, max_groups=2).run()

    stats = asyncio.run(go())
    assert stats.rejected_tasks == 1 and stats.groups_published == 2 and stats.tasks_released == 0
    groups, queued = drain_buffer(buf)
    assert queued == []
    (bad,) = groups["train-long"]
    assert all(s.finish_reason == "error" and s.reward == 0.0 and s.completion_ids == [] for s in bad.samples)
    (good,) = groups["train-0000"]
    assert all(s.finish_reason in ("stop", "length") and s.reward == 1.0 for s in good.samples)


def test_unloadable_policy_keeps_the_engine_serving_and_is_retried(tmp_path, redis_server, engine):
    """A version announced but missing from the store: no update, counted, retried at each poll;
    generation goes on with the engine's current version."""
    cfg = make_config(tmp_path, redis_server, engine, policy_poll_s=0.01, inflight_sequences=1 * G)
    buf = ExperienceBuffer.from_config(cfg)
    buf.announce_policy(7, "file:///nowhere/policy/v7")
    buf.put_tasks(make_tasks(4))

    async def go():
        async with EngineClient(engine) as client:
            stats = await RolloutWorker(cfg, buf, client, "w6", score_fn=lambda t, c: 1.0, max_groups=4).run()
            return stats, await client.weight_version()

    stats, version = asyncio.run(go())
    assert stats.weight_updates == 0 and stats.weight_update_failures >= 2  # retried
    assert version == 0 and stats.groups_published == 4
    groups, _ = drain_buffer(buf)
    assert all(s.policy_version == 0 for gs in groups.values() for g in gs for s in g.samples)


def start_engine_process(model_path: Path, port: int, log_path: Path, *extra: str) -> subprocess.Popen:
    argv = engine_argv(model_path, port, "--weight-version", "0", *extra)
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(argv, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    wait_until_healthy(f"http://127.0.0.1:{port}", timeout_s=90)
    return proc


def test_engine_restart_reloads_the_current_policy_before_taking_work(tmp_path, local_redis, ckpts):
    """SIGKILL the engine mid-run and start a fresh one (back at its base weights, version 0):
    the worker releases what failed, waits for health, has the new engine load the current
    policy (v1), and only then generates again. Every sample is stamped v1; no task is lost."""
    from app.storage import open_store, publish_policy

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cfg = make_config(tmp_path, local_redis.url, url, inflight_sequences=2 * G, engine_retries=1,
                      retry_backoff_s=0.05, max_new_tokens=48, request_timeout_s=20)
    buf = ExperienceBuffer.from_config(cfg)
    buf.announce_policy(1, publish_policy(open_store(cfg.store_url), cfg.run_id, 1, ckpts[1]))
    tasks = make_tasks(8)
    buf.put_tasks(tasks)
    procs = [start_engine_process(ckpts[0], port, tmp_path / "engine.log")]

    async def go():
        async with EngineClient(url, timeout_s=20, retries=1, backoff_s=0.05) as client:
            worker = RolloutWorker(cfg, buf, client, "w7", score_fn=lambda t, c: 1.0, max_groups=len(tasks))
            runner = asyncio.create_task(worker.run())
            while worker.stats.groups_published < 2:
                await asyncio.sleep(0.02)
            os.killpg(procs[0].pid, signal.SIGKILL)
            procs[0].wait(10)
            await asyncio.sleep(1.0)  # the worker sees errors while the engine is down
            procs.append(await asyncio.to_thread(start_engine_process, ckpts[0], port, tmp_path / "engine.log"))
            return await asyncio.wait_for(runner, 120)

    try:
        stats = asyncio.run(go())
    finally:
        for p in procs:
            stop_process(p)
    assert stats.engine_errors >= 1 and stats.tasks_released >= 1  # the kill hit requests in flight
    assert stats.weight_updates == 2  # once at start, once after the restart
    groups, queued = drain_buffer(buf)
    assert queued == [] and set(groups) == {t.task_id for t in tasks}
    assert all(len(gs) == 1 for gs in groups.values())
    assert all(s.policy_version == 1 for gs in groups.values() for g in gs for s in g.samples)


def test_worker_rides_through_a_redis_restart(tmp_path, local_redis, engine):
    cfg = make_config(tmp_path, local_redis.url, engine, inflight_sequences=1 * G)
    buf = ExperienceBuffer.from_config(cfg)
    tasks = make_tasks(6)
    buf.put_tasks(tasks)

    async def go():
        async with EngineClient(engine) as client:
            worker = RolloutWorker(cfg, buf, client, "w8", score_fn=lambda t, c: 1.0, max_groups=len(tasks))
            runner = asyncio.create_task(worker.run())
            while worker.stats.groups_published < 2:
                await asyncio.sleep(0.02)
            await asyncio.to_thread(local_redis.restart)
            return await asyncio.wait_for(runner, 120)

    stats = asyncio.run(go())
    groups, queued = drain_buffer(buf)
    assert queued == [] and set(groups) == {t.task_id for t in tasks}
    assert all(len(gs) == 1 for gs in groups.values())
    assert stats.groups_published + stats.duplicate_groups >= len(tasks)


@pytest.mark.parametrize("overlong_reward", [0.0, None])
def test_truncated_completions_get_the_configured_reward(tmp_path, redis_server, engine, overlong_reward):
    # A random tiny model rarely emits <eos> within 3 tokens: most completions are cut ("length").
    cfg = make_config(tmp_path, redis_server, engine, max_new_tokens=3, overlong_reward=overlong_reward)
    buf = ExperienceBuffer.from_config(cfg)
    buf.put_tasks(make_tasks(2))

    async def go():
        async with EngineClient(engine) as client:
            return await RolloutWorker(cfg, buf, client, "w-trunc", score_fn=lambda t, c: 1.0,
                                       max_groups=2).run()

    asyncio.run(go())
    groups, _ = drain_buffer(buf)
    samples = [s for gs in groups.values() for g in gs for s in g.samples]
    cut = [s for s in samples if s.finish_reason == "length"]
    assert cut, "expected some completions cut at max_new_tokens"
    assert all(s.reward == (1.0 if overlong_reward is None else 0.0) for s in cut)
    assert all(s.reward == 1.0 for s in samples if s.finish_reason == "stop")


class UnansweredUpdates(EngineClient):
    """An engine whose weight updates never answer in time; it reports v1 from poll `loaded_after` on."""

    def __init__(self, url: str, loaded_after: int | None):
        super().__init__(url)
        self.loaded_after, self.polls, self.updates = loaded_after, 0, 0

    async def weight_version(self):
        self.polls += 1
        return 1 if self.loaded_after is not None and self.polls >= self.loaded_after else 0

    async def update_weights_from_disk(self, model_path, weight_version=None, *, timeout_s=None, **body):
        self.updates += 1
        raise EngineError("POST /update_weights_from_disk failed: ReadTimeout", None, timed_out=True)

    async def pause_generation(self, mode="abort"):
        pass

    async def flush_cache(self):
        return True

    async def continue_generation(self):
        pass


class AnnouncedV1:
    def current_policy(self):
        return (1, "file:///unused/policy/v1")


@pytest.mark.parametrize("loaded_after", [3, None])
def test_an_unanswered_update_is_not_resent_before_the_engine_reports_its_version(tmp_path, loaded_after):
    """SGLang goes on loading after the client gave up and reloads on every call: the worker asks
    the engine's version and sends the update again only weight_update_timeout_s later."""
    cfg = make_config(tmp_path, "redis://127.0.0.1:1/0", "http://engine", weight_update_timeout_s=0.5)

    class Worker(RolloutWorker):  # the engine's weights load from here instead of the store
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.weights.download = lambda version: tmp_path / f"v{version}"

    async def go():
        client = UnansweredUpdates("http://engine", loaded_after)
        worker = Worker(cfg, AnnouncedV1(), client, "w-timeout", score_fn=lambda t, c: 1.0)
        await worker.sync_policy()  # poll 1: v0 -> update sent, no answer
        await worker.sync_policy()  # poll 2: still v0, the load may still run: nothing sent
        sent_before_deadline = client.updates
        await worker.sync_policy()  # poll 3: v1 when the load went through
        await asyncio.sleep(0.6)  # past weight_update_timeout_s
        await worker.sync_policy()
        return sent_before_deadline, client.updates, worker.stats, worker.engine_version

    sent_before, sent, stats, version = asyncio.run(go())
    assert sent_before == 1
    if loaded_after is not None:
        assert sent == 1 and stats.weight_updates == 1 and version == 1  # never sent twice
    else:
        assert sent == 2 and stats.weight_updates == 0  # resent only once the deadline had passed


def test_engine_group_lost_mid_request_returns_leases_and_publishes_no_partial_group(tmp_path, local_redis, ckpts):
    """A multi-node engine loses a node (Spot): LeaderWorkerSet recreates the whole group, so the
    leader's SGLang dies mid-request and its worker gets SIGTERM. Here the built-in engine is
    SIGKILLed while requests are in flight and the worker is stopped: every lease comes back,
    and only complete groups (G samples, each a whole completion) were published."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cfg = make_config(tmp_path, local_redis.url, url, inflight_sequences=3 * G, engine_retries=0,
                      retry_backoff_s=0.05, max_new_tokens=64, request_timeout_s=10, drain_grace_s=5)
    buf = ExperienceBuffer.from_config(cfg)
    tasks = make_tasks(6)
    buf.put_tasks(tasks)
    proc = start_engine_process(ckpts[0], port, tmp_path / "engine.log")

    async def go():
        async with EngineClient(url, timeout_s=10, retries=0) as client:
            worker = RolloutWorker(cfg, buf, client, "leader-0", score_fn=lambda t, c: 1.0)
            runner = asyncio.create_task(worker.run())
            deadline = time.monotonic() + 60
            while (await client._http.get("/server_info")).json()["running"] == 0:
                assert time.monotonic() < deadline, "no request reached the engine"
                await asyncio.sleep(0.01)
            os.killpg(proc.pid, signal.SIGKILL)  # the group is gone mid-request
            worker.request_stop()  # and the leader pod is deleted: SIGTERM
            return await asyncio.wait_for(runner, 60)

    try:
        stats = asyncio.run(go())
    finally:
        stop_process(proc)
    assert stats.engine_errors >= 1 and stats.tasks_released >= 1
    assert buf.stats()["leased"] == 0  # every lease returned, none left to expire
    groups, queued = drain_buffer(buf)
    assert queued and set(groups) | set(queued) == {t.task_id for t in tasks} and not set(groups) & set(queued)
    for (g,) in groups.values():  # whatever was published is whole
        assert [s.index for s in g.samples] == list(range(G))
        assert all(s.completion_ids and s.finish_reason in ("stop", "length") for s in g.samples)


class RefusingBuffer(ExperienceBuffer):
    """Redis answers the publish of one task's group with an error, as it does when the rollout ACL
    user may not run a command of the publish script (redis-py's own NoPermissionError)."""

    refused = "train-0000"

    def publish(self, task, samples):
        if task.task_id == self.refused:
            raise redis.exceptions.NoPermissionError("this user has no permissions to run the 'pttl' command")
        return super().publish(task, samples)


@pytest.mark.timeout(120)  # before: the worker retried the refused group forever and published nothing more
def test_a_group_redis_refuses_fails_its_task_and_the_worker_goes_on(tmp_path, redis_server, engine):
    cfg = make_config(tmp_path, redis_server, engine, inflight_sequences=1 * G, publish_every_groups=1)
    cfg.buffer.max_failures = 2
    buf = RefusingBuffer.from_config(cfg)
    buf.put_tasks(make_tasks(3))

    stats = run_until(lambda: RolloutWorker(cfg, buf, EngineClient(engine), "w9", score_fn=lambda t, c: 1.0),
                      lambda st: st.groups_published >= 2 and st.tasks_dropped >= 1)
    assert stats.groups_failed >= 2 and stats.tasks_dropped == 1  # refused twice, then dropped
    groups, queued = drain_buffer(buf)
    assert set(groups) == {"train-0001", "train-0002"} and queued == []
    assert any(r.startswith("buffer refused the group: ") for r in buf.health().failures)
