"""SGLang's router (PyPI sglang-router 0.3.2, the real Rust binary) in front of built-in engines
(app/rollout/router.py): its command parsed by the router's own argument code, `moerl run`'s
wiring (`EmbeddedLoop.start_router`: an API key and a control-plane key, no engines at start),
the keys as the binary enforces them (the workers' clients send them), engines registered by
their workers (one that comes up long after the router's startup timeout is routed to, and is
gone once removed), routing replay's fields lost on the way through, and the version contract
when a request can land on any engine: each sample carries the version of the engine that served
it, and a request aborted by another worker's weight update is sent again instead of losing its
task."""

from __future__ import annotations

import asyncio
import sys
import time
import tomllib
from pathlib import Path

import httpx
import pytest

from app.buffer import ExperienceBuffer
from app.config import RolloutConfig, RunConfig
from app.local.embedded import EmbeddedLoop
from app.rollout.engine_client import EngineClient, GenOutput
from app.names import ROUTER_API_KEY_ENV, ROUTER_CONTROL_KEY_ENV
from app.rollout.router import CONTROL_KEY_ID, RouterRegistration, router_command
from app.rollout.worker import EngineMisconfigured, RolloutWorker, router_clients
from test_worker import G, drain_buffer, make_checkpoint, make_config, make_tasks

launch_router = pytest.importorskip("sglang_router.launch_router")  # the `router` extra (Makefile installs it)
ROOT = Path(__file__).resolve().parents[1]


def test_router_command_parses_with_the_routers_own_arguments():
    cmd = router_command(port=30000, host="0.0.0.0", policy="cache_aware", prometheus_port=29000,
                         api_key="$(SGLANG_API_KEY)", control_key="$(SGLANG_ROUTER_CONTROL_KEY)")
    assert cmd[1:3] == ["-m", "sglang_router.launch_router"]
    args = launch_router.parse_router_args(cmd[3:])
    assert args.worker_urls == []  # the workers register their engines
    assert (args.host, args.port, args.policy, args.prometheus_port) == ("0.0.0.0", 30000, "cache_aware", 29000)
    assert args.api_key == "$(SGLANG_API_KEY)" and not args.pd_disaggregation and not args.service_discovery
    assert args.control_plane_api_keys == [(CONTROL_KEY_ID, "rollout-workers", "$(SGLANG_ROUTER_CONTROL_KEY)", "admin")]
    static = launch_router.parse_router_args(router_command(["http://e0:30000", "http://e1:30000"], port=1)[3:])
    assert static.worker_urls == ["http://e0:30000", "http://e1:30000"] and static.control_plane_api_keys == []
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


async def registered(router_url: str, control_key: str, engines: list[str], timeout_s: float = 60.0) -> None:
    """Register ``engines`` as their workers do, and wait until the router counts each healthy."""
    regs = [RouterRegistration(router_url, url, control_key) for url in engines]
    try:
        for reg in regs:
            assert await reg.ensure()
        deadline = time.monotonic() + timeout_s
        async with httpx.AsyncClient(timeout=10) as c:
            while True:
                workers = (await c.get(router_url + "/workers", headers={"Authorization": f"Bearer {control_key}"})).json()
                healthy = {w["url"] for w in workers["workers"] if w["is_healthy"]}
                if healthy >= set(engines):
                    return
                assert time.monotonic() < deadline, workers
                await asyncio.sleep(0.2)
    finally:
        for reg in regs:
            await reg.aclose()


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    """Two built-in engines and the real router in front of them, started as `moerl run` does,
    each engine registered as its worker registers it."""
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
        asyncio.run(registered(loop.router_url(), loop.router_keys[ROUTER_CONTROL_KEY_ENV],
                               [loop.engine_url(i) for i in range(2)]))
        yield loop, ckpt_a, ckpt_b
    finally:
        loop.close()


def router_client(loop: EmbeddedLoop) -> EngineClient:
    """A client of the fleet's router holding its API key, as a worker's."""
    return EngineClient(loop.router_url(), api_key=loop.router_keys[ROUTER_API_KEY_ENV])


def served(loop: EmbeddedLoop) -> list[int]:
    return [httpx.get(loop.engine_url(i) + "/server_info", timeout=10).json()["sequences"] for i in range(2)]


@pytest.mark.slow
def test_the_router_asks_for_its_keys_and_the_workers_clients_send_them(fleet, monkeypatch):
    """sglang-router 0.3.2 with --api-key and --control-plane-api-keys: /generate without its API
    key is 401, and so is the control-plane key there; /workers and /flush_cache take only the
    control-plane key. The worker's router clients (`router_clients`, as `run_worker` builds them
    from its environment) send the right one to each."""
    loop, _, _ = fleet
    url, keys = loop.router_url(), loop.router_keys
    api, control = keys[ROUTER_API_KEY_ENV], keys[ROUTER_CONTROL_KEY_ENV]
    body = {"input_ids": [1, 20, 21], "sampling_params": {"max_new_tokens": 2}}
    bearer = lambda k: {"Authorization": f"Bearer {k}"}  # noqa: E731
    assert httpx.post(url + "/generate", json=body, timeout=30).status_code == 401
    assert httpx.post(url + "/generate", json=body, headers=bearer(control), timeout=30).status_code == 401
    assert httpx.post(url + "/generate", json=body, headers=bearer(api), timeout=30).status_code == 200
    for method, path in (("GET", "/workers"), ("POST", "/flush_cache")):
        assert httpx.request(method, url + path, headers=bearer(api), timeout=30).status_code == 401
    assert httpx.get(url + "/workers", headers=bearer(control), timeout=30).status_code == 200

    cfg = make_config(loop.run_dir, "redis://127.0.0.1:1", loop.engine_url(0), router=True, pause_mode="abort")
    monkeypatch.setenv(ROUTER_API_KEY_ENV, api)
    monkeypatch.setenv(ROUTER_CONTROL_KEY_ENV, control)

    async def go():
        gen, reg = router_clients(cfg, url, loop.engine_url(0))
        try:
            outs = await gen.generate([1, 20, 21], n=2, max_new_tokens=3)
            return outs, await reg.listed()
        finally:
            await gen.aclose()
            await reg.aclose()

    outs, listed = asyncio.run(go())
    assert len(outs) == 2 and all(len(o.token_ids) == 3 for o in outs) and listed is not None
    monkeypatch.delenv(ROUTER_CONTROL_KEY_ENV)
    with pytest.raises(ValueError, match="MOERL_ROUTER_CONTROL_KEY is empty"):
        router_clients(cfg, url, loop.engine_url(0))


@pytest.mark.slow
def test_a_late_engine_is_registered_routed_to_and_removed(tmp_path):
    """The router started with a 1 s --worker-startup-timeout-secs and no engines; an engine that
    comes up seconds later is registered by its worker's `RouterRegistration`, and /generate
    through the router reaches it; removed (the drain), the router has none to send to. The
    engine carries an admin key and no API key, as the cluster renders one behind the router
    (the router sends no key on). Routing replay's fields do not survive the router: the same
    request straight to the engine gets ``meta_info.routed_experts``, through the router not."""
    from app.buffer.redis_server import free_port
    from app.local.procs import Supervisor, moerl_argv

    ckpt = make_checkpoint(tmp_path / "ck", seed=0)
    api, control, admin = "k-router", "k-control", "k-admin"
    port, engine_port = free_port(), free_port()
    sup = Supervisor(tmp_path / "logs")
    try:
        sup.start("router", [*router_command(port=port, prometheus_port=free_port(), api_key=api, control_key=control,
                                             python=sys.executable), "--worker-startup-timeout-secs", "1"], {})
        url, engine = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{engine_port}"
        wait_until(lambda: httpx.get(url + "/liveness", timeout=2).status_code == 200)
        time.sleep(2.0)  # past the router's startup timeout
        sup.start("engine", moerl_argv("engine", "--model-path", str(ckpt), "--port", str(engine_port), "--threads",
                                       "1", "--enable-return-routed-experts", "--admin-api-key", admin), {})
        wait_until(lambda: httpx.get(engine + "/health_generate", timeout=10).status_code == 200, timeout_s=120)
        asyncio.run(registered(url, control, [engine]))
        body = {"input_ids": [1, 20, 21, 22], "sampling_params": {"max_new_tokens": 3},
                "return_routed_experts": True, "routed_experts_start_len": 2}
        routed = httpx.post(url + "/generate", json=body, headers={"Authorization": f"Bearer {api}"}, timeout=60)
        direct = httpx.post(engine + "/generate", json=body, timeout=60)
        refused = httpx.post(engine + "/flush_cache", timeout=10)  # the admin routes want the admin key

        async def drain():
            reg = RouterRegistration(url, engine, control)
            try:
                return await reg.remove(), await reg.listed()
            finally:
                await reg.aclose()

        removed, listed = asyncio.run(drain())
        time.sleep(1.0)
        after = httpx.post(url + "/generate", json=body, headers={"Authorization": f"Bearer {api}"}, timeout=60)
    finally:
        sup.stop_all()
    assert routed.status_code == 200 and len(routed.json()["output_ids"]) == 3, routed.text
    assert "routed_experts" in direct.json()["meta_info"] and "routed_experts" not in routed.json()["meta_info"]
    assert refused.status_code == 401
    assert removed and listed is None and after.status_code == 503
    with pytest.raises(ValueError, match="rollout.routing_replay: not supported with rollout.router"):
        RunConfig.model_validate({"rollout": {"routing_replay": True, "router": True, "pause_mode": "abort"}})


def wait_until(cond, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if cond():
                return
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, "not reached"
        time.sleep(0.2)


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
                router_client(loop) as router:
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
                router_client(loop) as router:
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
def test_bench_rollout_compares_pinned_lanes_with_the_router(tmp_path, fleet, monkeypatch):
    """`moerl bench rollout --router-url`: both layouts in one run, the same lanes and waits; the
    figures the command promises (p50/p99, samples/s, per-engine idle) and both engines served."""
    from typer.testing import CliRunner

    from app.bench.cli import cli
    from test_bench import only_result, positive
    from test_bench_rollout import run_config

    loop, _, _ = fleet
    monkeypatch.setenv(ROUTER_API_KEY_ENV, loop.router_keys[ROUTER_API_KEY_ENV])  # the router's --api-key
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
