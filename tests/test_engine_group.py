"""Multi-node engines (issue 26 item 1): every pod of the group holds a version before the update.

SGLang loads /update_weights_from_disk(model_path) on every rank, each node from its own disk.
Two fetchers stand for the two pods of a LeaderWorkerSet group, each with a disk of its own
(``rollout.policy_cache_dir`` on its node), against a real redis-server and a file:// store;
the worker drives the built-in engine as the group's leader. The worker asks for the update only
once both pods report the version, at the path they both hold it under; until then the engine
serves what it has and no failure is counted. The leader's fetcher keeps the probes' pause
marker in step with the pause the worker records.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import httpx
import pytest

from app.buffer import ExperienceBuffer
from app.rollout.engine_client import EngineClient
from app.engine.load import load_checkpoint
from app.engine.scheduler import Engine
from app.engine.server import create_app
from app.rollout.group import EngineGroup, Fetcher, group_cache_dir
from app.rollout.worker import RolloutWorker
from app.storage import open_store, publish_policy
from helpers import tiny_moe_checkpoint
from test_worker import make_config

ENGINE = "moerl-rollout-0.moerl-rollout.moerl"  # LWS_LEADER_ADDRESS of group 0


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("group")
    return (tiny_moe_checkpoint(root / "a", seed=0, max_position_embeddings=128),
            tiny_moe_checkpoint(root / "b", seed=1, max_position_embeddings=128))


def node_config(base, node: str):
    """The run config as the pod on ``node`` reads it: the same, with that node's disk."""
    cfg = base.model_copy(deep=True)
    cfg.rollout.policy_cache_dir = str(Path(base.rollout.policy_cache_dir).parent / node)
    return cfg


def test_the_update_waits_until_every_pod_of_the_group_holds_the_version(tmp_path, redis_server, ckpts):
    cfg = make_config(tmp_path, redis_server, "http://engine")
    leader_cfg, follower_cfg = node_config(cfg, "node0"), node_config(cfg, "node1")
    buf = ExperienceBuffer.from_config(cfg)
    store = open_store(cfg.store_url)
    buf.announce_policy(1, publish_policy(store, cfg.run_id, 1, ckpts[1]))
    fetchers = [Fetcher(leader_cfg, buf, EngineGroup.of(buf, ENGINE, 2), 0, tmp_path / "marker", store),
                Fetcher(follower_cfg, buf, EngineGroup.of(buf, ENGINE, 2), 1, None, store)]

    async def go():
        engine = Engine(load_checkpoint(ckpts[0]), weight_version="0", max_batch=4)
        app = create_app(engine, health_timeout_s=0.5)
        await engine.start()
        seen = {}
        try:
            async with EngineClient("http://engine", transport=httpx.ASGITransport(app=app), retries=0) as client:
                worker = RolloutWorker(leader_cfg, buf, client, "moerl-rollout-worker-0", score_fn=lambda t, c: 1.0,
                                       group=EngineGroup.of(buf, ENGINE, 2))
                await worker.sync_policy()  # no pod holds v1
                seen["none"] = (engine.weight_version, engine.stats.weight_loads)
                fetchers[0].fetch_current()
                await worker.sync_policy()  # the leader's node has it, the other does not
                seen["leader only"] = (engine.weight_version, engine.stats.weight_loads)
                fetchers[1].fetch_current()
                await worker.sync_policy()
                seen["both"] = (engine.weight_version, engine.stats.weight_loads)
                info = await client.model_info()
                return seen, worker.stats, info
        finally:
            await engine.stop()

    seen, stats, info = asyncio.run(go())
    assert seen["none"] == ("0", 0) and seen["leader only"] == ("0", 0)
    assert seen["both"] == ("1", 1)
    assert stats.weight_updates == 1 and stats.weight_update_failures == 0
    # the path the engine was given is the one each pod holds the version under, on its own disk
    path = Path(info["model_path"])
    assert path == group_cache_dir(leader_cfg.rollout.policy_cache_dir, ENGINE) / "v1"
    for f in fetchers:
        held = group_cache_dir(f.cfg.rollout.policy_cache_dir, ENGINE) / "v1"
        assert held.relative_to(Path(f.cfg.rollout.policy_cache_dir)) == path.relative_to(
            Path(leader_cfg.rollout.policy_cache_dir))
        assert (held / "config.json").is_file()


def test_a_pod_that_stops_reporting_counts_as_missing(redis_server, monkeypatch):
    import app.rollout.group as group_mod

    cfg = make_config(Path("/tmp"), redis_server, "http://engine")
    buf = ExperienceBuffer.from_config(cfg)
    group = EngineGroup.of(buf, ENGINE, 2)
    monkeypatch.setattr(group_mod, "HELD_TTL_S", 0.3)
    group.report(0, [3, 4])
    group.report(1, [4])
    assert group.missing(4) == [] and group.missing(3) == [1]
    time.sleep(0.5)
    group.report(0, [4])
    assert group.missing(4) == [1]  # pod 1 silent past the expiry: not counted as holding it


def test_the_leaders_fetcher_keeps_the_probes_marker_with_the_workers_pause(tmp_path, redis_server):
    cfg = make_config(tmp_path, redis_server, "http://engine")
    buf = ExperienceBuffer.from_config(cfg)
    marker = tmp_path / "state" / "engine-paused"
    fetcher = Fetcher(cfg, buf, EngineGroup.of(buf, ENGINE, 2), 0, marker, open_store(cfg.store_url))

    class Client:
        url = "http://engine"

    worker = RolloutWorker(cfg, buf, Client(), "w0", score_fn=lambda t, c: 1.0, group=EngineGroup.of(buf, ENGINE, 2))
    worker.weights.mark_paused(60.0)
    fetcher.mirror_pause()
    until = float(marker.read_text())
    assert time.time() + 55 < until <= time.time() + 60
    worker.weights.mark_paused(None)
    fetcher.mirror_pause()
    assert not marker.exists()
