"""SGLang's router (PyPI sglang-router 0.3.2, the real Rust binary) in front of built-in engines
(app/rollout/router.py): its command parsed by the router's own argument code, `moerl run`'s
wiring (`EmbeddedLoop.start_router`), and the version contract when a request can land on any
engine: each sample carries the version of the engine that served it, and a request aborted by
another worker's weight update is sent again instead of losing its task."""

from __future__ import annotations

import asyncio
import tomllib
from pathlib import Path

import httpx
import pytest

from app.buffer import ExperienceBuffer
from app.config import RolloutConfig, RunConfig
from app.local.embedded import EmbeddedLoop
from app.rollout.engine_client import EngineClient, GenOutput
from app.rollout.router import router_command
from app.rollout.worker import EngineMisconfigured, RolloutWorker
from test_worker import G, drain_buffer, make_checkpoint, make_config, make_tasks

launch_router = pytest.importorskip("sglang_router.launch_router")  # the `router` extra (Makefile installs it)
ROOT = Path(__file__).resolve().parents[1]


def test_router_command_parses_with_the_routers_own_arguments():
    cmd = router_command(["http://e0:30000", "http://e1:30000"], port=30000, host="0.0.0.0", policy="cache_aware",
                         prometheus_port=29000, api_key="$(SGLANG_API_KEY)")
    assert cmd[1:3] == ["-m", "sglang_router.launch_router"]
    args = launch_router.parse_router_args(cmd[3:])
    assert args.worker_urls == ["http://e0:30000", "http://e1:30000"]
    assert (args.host, args.port, args.policy, args.prometheus_port) == ("0.0.0.0", 30000, "cache_aware", 29000)
    assert args.api_key == "$(SGLANG_API_KEY)" and not args.pd_disaggregation and not args.service_discovery
    # every policy the config allows is one the router accepts
    for policy in RolloutConfig.model_fields["router_policy"].annotation.__args__:
        assert launch_router.parse_router_args(router_command(["http://e:1"], port=1, policy=policy)[3:]).policy == policy


def test_router_version_is_the_rollout_images():
    pinned = tomllib.loads((ROOT / "images/versions.toml").read_text())["sglang_router"]["value"]
    from importlib.metadata import version

    assert version("sglang-router") == pinned
    assert f'"sglang-router=={pinned}"' in (ROOT / "pyproject.toml").read_text()


def test_router_needs_the_abort_pause():
    with pytest.raises(ValueError, match="rollout.pause_mode must be abort with rollout.router"):
        RolloutConfig(router=True)
    with pytest.raises(ValueError, match="'retract', the default: set rollout.pause_mode: abort"):
        RolloutConfig(router=True)  # the user wrote no pause_mode: the message says where retract came from
    with pytest.raises(ValueError, match=r"\(got 'in_place'\): a paused"):
        RolloutConfig(router=True, pause_mode="in_place")
    assert RolloutConfig(router=True, pause_mode="abort").router


class _NoVersion:
    url = "http://router"

    async def generate(self, prompt, **kw):
        return [GenOutput([5], [-1.0], "x", "stop", None, 3)] * kw.get("n", 1)


def test_a_routed_answer_without_a_version_is_refused(tmp_path):
    cfg = make_config(tmp_path, "redis://127.0.0.1:1", "http://127.0.0.1:1", router=True, pause_mode="abort")
    own = EngineClient("http://127.0.0.1:1")
    worker = RolloutWorker(cfg, object(), own, "w", score_fn=lambda t, c: 1.0, gen_client=_NoVersion())
    with pytest.raises(EngineMisconfigured, match="weight_version"):
        asyncio.run(worker._generate(make_tasks(1)[0]))
    # the worker's own engine's version never stands in for the serving engine's
    worker.weights.version = 7
    with pytest.raises(EngineMisconfigured):
        asyncio.run(worker._generate(make_tasks(1)[0]))


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    """Two built-in engines and the real router in front of them, started as `moerl run` does."""
    root = tmp_path_factory.mktemp("router")
    ckpt_a, ckpt_b = make_checkpoint(root / "a", seed=0), make_checkpoint(root / "b", seed=1)
    cfg = RunConfig()
    cfg.rollout.router, cfg.rollout.pause_mode, cfg.rollout.router_policy = True, "abort", "round_robin"
    loop = EmbeddedLoop(cfg, root / "run", workers=2)
    try:
        for i in range(2):
            loop.start_engine(i, ckpt_a)
        for i in range(2):
            loop.wait_engine(i)
        loop.start_router()
        yield loop, ckpt_a, ckpt_b
    finally:
        loop.close()


def served(loop: EmbeddedLoop) -> list[int]:
    return [httpx.get(loop.engine_url(i) + "/server_info", timeout=10).json()["sequences"] for i in range(2)]


@pytest.mark.slow
def test_samples_carry_the_version_of_the_engine_that_served_them(tmp_path, redis_server, fleet):
    loop, ckpt_a, ckpt_b = fleet
    cfg = make_config(tmp_path, redis_server, loop.engine_url(1), router=True, pause_mode="abort",
                      inflight_sequences=G, policy_poll_s=3600)
    buf = ExperienceBuffer.from_config(cfg)
    buf.put_tasks(make_tasks(6))
    before = served(loop)

    async def go():
        async with EngineClient(loop.engine_url(0)) as e0, EngineClient(loop.engine_url(1)) as own, \
                EngineClient(loop.router_url()) as router:
            ok, message = await e0.update_weights_from_disk(str(ckpt_b), 1)  # engine 0 now serves v1
            assert ok, message
            try:
                worker = RolloutWorker(cfg, buf, own, "w-routed", score_fn=lambda t, c: 1.0, max_groups=6,
                                       gen_client=router)
                return await worker.run(), await own.weight_version()
            finally:
                await e0.update_weights_from_disk(str(ckpt_a), 0)

    stats, own_version = asyncio.run(go())
    assert stats.groups_published == 6 and own_version == 0
    after = served(loop)
    assert all(a > b for a, b in zip(after, before)), (before, after)  # the router used both engines
    groups, _ = drain_buffer(buf)
    versions = {s.policy_version for gs in groups.values() for g in gs for s in g.samples}
    assert versions == {0, 1}  # v1 only from engine 0: the answer's version, not the own engine's
    for gs in groups.values():
        assert len({s.policy_version for s in gs[0].samples}) == 1  # a group is one request, one engine


@pytest.mark.slow
def test_a_request_aborted_by_another_workers_update_is_sent_again(tmp_path, redis_server, fleet):
    loop, _, _ = fleet
    cfg = make_config(tmp_path, redis_server, loop.engine_url(1), router=True, pause_mode="abort",
                      inflight_sequences=2 * G, max_new_tokens=120, policy_poll_s=3600)
    buf = ExperienceBuffer.from_config(cfg)
    buf.put_tasks(make_tasks(2))

    async def go():
        async with EngineClient(loop.engine_url(0)) as e0, EngineClient(loop.engine_url(1)) as e1, \
                EngineClient(loop.router_url()) as router:
            worker = RolloutWorker(cfg, buf, e1, "w-aborted", score_fn=lambda t, c: 1.0, max_groups=2,
                                   gen_client=router)
            runner = asyncio.create_task(worker.run())
            # Both engines busy with this worker's groups: pause them as their owners would for an update.
            while [(await e.server_info())["running"] > 0 for e in (e0, e1)] != [True, True]:
                assert not runner.done(), runner
                await asyncio.sleep(0.01)
            for e in (e0, e1):
                await e.pause_generation("abort")
            for e in (e0, e1):
                await e.continue_generation()
            return await asyncio.wait_for(runner, 120)

    stats = asyncio.run(go())
    assert stats.requests_resent >= 1 and stats.groups_published == 2, stats
    assert stats.tasks_released == 0 and stats.engine_errors == 0, stats
    groups, queued = drain_buffer(buf)
    assert len(groups) == 2 and not queued
    assert all(s.finish_reason in ("stop", "length") for gs in groups.values() for s in gs[0].samples)


@pytest.mark.slow
def test_bench_rollout_compares_pinned_lanes_with_the_router(tmp_path, fleet):
    """`moerl bench rollout --router-url`: both layouts in one run, the same lanes and waits; the
    figures the command promises (p50/p99, samples/s, per-engine idle) and both engines served."""
    from typer.testing import CliRunner

    from app.bench.cli import cli
    from test_bench import only_result, positive
    from test_bench_rollout import run_config

    loop, _, _ = fleet
    urls = [loop.engine_url(0), loop.engine_url(1)]
    before = served(loop)
    r = CliRunner().invoke(cli, ["rollout", "--url", urls[0], "--url", urls[1], "--router-url", loop.router_url(),
                                 "--seconds", "1.5", "--concurrency", "2", "--env-wait-s", "0.05", "--env-wait-s", "0",
                                 "--repeats", "2", "--config", run_config(tmp_path), "--out-dir", str(tmp_path / "out")],
                           catch_exceptions=False)
    assert r.exit_code == 0, r.output
    assert "ratio router p99 / pinned p99" in r.output
    doc = only_result(tmp_path / "out", "rollout")
    pinned, routed = doc["figures"]
    assert pinned["name"].startswith("pinned") and routed["name"] == "router"
    for f in (pinned, routed):
        assert f["errors"] == 0 and f["sequences"] == 4 * f["requests"] and positive(f["samples_per_s"])
        assert 0 < f["latency_p50_s"] <= f["latency_p99_s"]
        assert len(f["engine_idle_fractions"]) == 2 and all(0 <= x <= 1 for x in f["engine_idle_fractions"])
        assert len(f["per_repeat_samples_per_s"]) == 2
    assert positive(doc["ratios"]["router samples/s / pinned samples/s"])
    assert doc["shape"]["env_wait_s"] == [0.05, 0.0] and doc["shape"]["router_url"] == loop.router_url()
    after = served(loop)
    assert sum(after) - sum(before) >= pinned["sequences"] + routed["sequences"]


@pytest.mark.parametrize("args,flag", [
    (["--router-url", "ftp://r"], "--router-url"),
    (["--router-url", "http://127.0.0.1:1", "--env-wait-s", "1", "--env-wait-s", "1", "--env-wait-s", "1"], "--env-wait-s"),
    (["--router-url", "http://127.0.0.1:1", "--env-wait-s", "-1"], "--env-wait-s"),
    (["--router-url", "http://127.0.0.1:1", "--repeats", "0"], "--repeats"),
])
def test_bad_layout_flags_give_one_error(tmp_path, args, flag):
    from typer.testing import CliRunner

    from app.bench.cli import cli
    from test_bench_rollout import run_config

    r = CliRunner().invoke(cli, ["rollout", "--url", "http://127.0.0.1:1", "--url", "http://127.0.0.1:2", *args,
                                 "--config", run_config(tmp_path), "--out-dir", str(tmp_path / "out")])
    assert r.exit_code == 2 and flag in r.output, r.output


def test_moerl_run_refuses_the_router_without_its_package(monkeypatch):
    import importlib.util

    from app.local.run import check_inputs

    cfg = RunConfig()
    cfg.rollout.router, cfg.rollout.pause_mode = True, "abort"
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "sglang_router" else real(name, *a))
    with pytest.raises(ValueError, match="rollout.router is on but sglang-router is not installed"):
        check_inputs(cfg)


def test_the_partial_rollout_ab_refuses_a_router(tmp_path):
    from typer.testing import CliRunner

    from app.bench.cli import cli
    from test_bench_rollout import run_config

    r = CliRunner().invoke(cli, ["rollout", "--partial-ab", "--router-url", "http://127.0.0.1:1",
                                 "--config", run_config(tmp_path), "--out-dir", str(tmp_path / "out")])
    assert r.exit_code == 2 and "--router-url" in r.output, r.output
    assert not (tmp_path / "out").exists()
