"""Routing replay, engine -> worker -> sample (issue 14 part 6, rollout side): with
``rollout.routing_replay`` the worker asks the engine for the routed experts (SGLang's
``return_routed_experts``, served with ``--enable-return-routed-experts``) and every published
sample carries them (``Sample.routed_experts``: [P + C - 1, MoE layers, top_k], narrowest dtype;
the buffer stores them as raw bytes, app/buffer/encoding.py)."""

from __future__ import annotations

import asyncio
import contextlib
import json

import numpy as np
import pytest

from app.buffer import ExperienceBuffer
from app.buffer.records import Group, Sample, decode_routed_experts, encode_routed_experts, routed_experts_of_moe_layers
from app.config import RunConfig
from app.rollout.engine_client import EngineClient
from app.rollout.worker import EngineMisconfigured, RolloutWorker
from test_worker import G, drain_buffer, make_config, make_tasks, start_engine_process, stop_process


@pytest.mark.parametrize("top,dtype", [(255, "uint8"), (256, "uint16"), (70000, "int32")])
def test_routed_experts_are_stored_in_the_narrowest_dtype_and_round_trip(top, dtype):
    ids = np.random.default_rng(0).integers(0, top + 1, size=(7, 3, 2))
    ids[0, 0, 0] = top
    stored = encode_routed_experts(ids)
    assert stored["dtype"] == dtype and stored["shape"] == [7, 3, 2]
    back = decode_routed_experts(json.loads(json.dumps(stored)))
    assert back.dtype == np.int64 and np.array_equal(back, ids)


@pytest.mark.parametrize("bad,field", [
    (np.zeros((3, 2)), "[T, L, K]"), (np.full((1, 1, 1), -1), "negative"), (np.zeros((2, 2, 2)) + 0.5, "integer"),
])
def test_bad_routed_experts_are_refused(bad, field):
    with pytest.raises(ValueError, match=field.replace("[", r"\[").replace("]", r"\]")):
        encode_routed_experts(bad)


def test_decode_refuses_data_that_does_not_fill_the_shape():
    stored = encode_routed_experts(np.zeros((2, 2, 2), dtype=np.int64))
    stored["shape"] = [3, 2, 2]
    with pytest.raises(ValueError, match="do not fill"):
        decode_routed_experts(stored)


def test_samples_with_routed_experts_cross_json_and_the_buffer():
    ids = np.arange(12).reshape(3, 2, 2)
    s = Sample(sample_id="r1/t/0/0", task_id="t", index=0, attempt=0, prompt_ids=[1, 2], completion_ids=[3, 4],
               logprobs=[-1.0, -2.0], reward=1.0, policy_version=0, finish_reason="stop", routed_experts=ids)
    back = Group.from_json(Group(task_id="t", attempt=0, samples=[s]).to_json()).samples[0]
    assert np.array_equal(back.routed_experts, ids)
    old = {k: v for k, v in s.to_dict().items() if k != "routed_experts"}  # records written before the field
    assert Sample.from_dict(old).routed_experts is None


def test_the_buffer_keeps_the_moe_layers_routing_as_one_byte_per_id(redis_server):
    """The engine reports every layer; a sample keeps the MoE layers' rows in the narrowest dtype,
    and the buffer's payload holds exactly those bytes (uint8 for ids < 256)."""
    from app.buffer.records import Task

    engine = np.random.default_rng(0).integers(0, 256, size=(3, 5, 2))  # [P + C - 1, layers, K]
    moe = routed_experts_of_moe_layers(engine, [1, 2, 4])
    assert moe.dtype == np.uint8 and np.array_equal(moe, engine[:, [1, 2, 4]])
    buf = ExperienceBuffer(redis_server, "r1")
    buf.put_tasks([Task("t", [1, 2], "p", "{}", 1)])
    (task,) = buf.lease("w", block_ms=0)
    s = Sample(sample_id=task.sample_id("r1", 0), task_id="t", index=0, attempt=0, prompt_ids=[1, 2],
               completion_ids=[3, 4], logprobs=[-1.0, -2.0], reward=1.0, policy_version=0, finish_reason="stop",
               routed_experts=moe)
    assert buf.publish(task, [s])
    (h,) = buf.take_headers(1, trainer_version=0, timeout_s=1.0)
    assert h.routed == (3, 2, "uint8")
    (g,), bad = buf.read_groups([h])
    assert bad == [] and g.samples[0].routed_experts.dtype == np.uint8
    assert np.array_equal(g.samples[0].routed_experts, moe)
    payload = buf.raw.get(h.blob)
    assert moe.tobytes() in payload  # raw bytes, 18 of them
    with pytest.raises(ValueError, match="MoE layer 5"):
        routed_experts_of_moe_layers(engine, [5])


def test_router_routing_replay_is_an_alias_of_rollout_routing_replay():
    assert RunConfig.model_validate({"router": {"routing_replay": True}}).rollout.routing_replay is True
    assert RunConfig().rollout.routing_replay is False


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    from test_worker import make_checkpoint

    return (make_checkpoint(tmp_path_factory.mktemp("rr") / "a", seed=0),)


def test_worker_stores_the_engines_routed_experts_with_every_sample(tmp_path, redis_server, ckpts):
    from app.buffer.redis_server import free_port

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = start_engine_process(ckpts[0], port, tmp_path / "engine.log", "--enable-return-routed-experts")
    cfg = make_config(tmp_path, redis_server, url, routing_replay=True)
    cfg.model.path = str(ckpts[0])  # where the worker reads layers and top_k
    buf = ExperienceBuffer.from_config(cfg)
    buf.put_tasks(make_tasks(2))

    async def go():
        async with EngineClient(url) as client:
            return await RolloutWorker(cfg, buf, client, "w-rr", score_fn=lambda t, c: 1.0, max_groups=2).run()

    try:
        stats = asyncio.run(go())
    finally:
        stop_process(proc)
    assert stats.groups_published == 2
    groups, _ = drain_buffer(buf)
    samples = [s for gs in groups.values() for g in gs for s in g.samples]
    assert len(samples) == 2 * G
    for s in samples:
        ids = s.routed_experts
        # every token the engine fed through the model: prompt + completion - 1; 2 (MoE) layers, top-2 of 4 experts
        assert ids.shape == (len(s.prompt_ids) + len(s.completion_ids) - 1, 2, 2)
        assert ids.dtype == np.uint8 and ids.min() >= 0 and ids.max() < 4
        assert all(len(set(row)) == 2 for row in ids.reshape(-1, 2).tolist())  # two distinct experts per token


def test_worker_stops_when_the_engine_returns_no_routed_experts(tmp_path, redis_server, ckpts):
    """routing_replay against an engine started without the flag: no sample without routing is
    published; the worker stops (its tasks go back) with the flag named."""
    from app.buffer.redis_server import free_port

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = start_engine_process(ckpts[0], port, tmp_path / "engine.log")
    cfg = make_config(tmp_path, redis_server, url, routing_replay=True)
    buf = ExperienceBuffer.from_config(cfg)
    buf.put_tasks(make_tasks(2))

    async def go():
        async with EngineClient(url) as client:
            worker = RolloutWorker(cfg, buf, client, "w-rr-bad", score_fn=lambda t, c: 1.0)
            stats = await asyncio.wait_for(worker.run(), 60)
            return stats, worker.fatal

    try:
        stats, fatal = asyncio.run(go())
    finally:
        stop_process(proc)
    assert isinstance(fatal, EngineMisconfigured) and "--enable-return-routed-experts" in str(fatal)
    assert stats.groups_published == 0 and buf.stats()["leased"] == 0 and buf.stats()["queued"] == 2


def test_trainer_replays_the_engines_routing_and_reports_mismatches(tmp_path, redis_server, ckpts, monkeypatch):
    """Trainer side (issue 14 part 6): samples from the built-in engine carry its routing; the
    trainer's step routes every MoE layer by it (the same weights: its own router agrees on
    every token), and a replay of other experts is followed (the loss changes) and counted."""
    import torch
    import torch.distributed as dist

    from app.buffer.redis_server import free_port
    from app.model.checkpoint import load_policy
    from app.model.config import moe_layer_ids
    from app.model.parallel import EPContext
    from app.trainer.batch import collate_groups
    from app.trainer.step import train_step
    from app.trainer.parallel import init_distributed
    from helpers import single_rank_env

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = start_engine_process(ckpts[0], port, tmp_path / "engine.log", "--enable-return-routed-experts")
    cfg = make_config(tmp_path, redis_server, url, routing_replay=True)
    cfg.model.path = str(ckpts[0])
    buf = ExperienceBuffer.from_config(cfg)
    buf.put_tasks(make_tasks(2))

    async def go():
        async with EngineClient(url) as client:
            return await RolloutWorker(cfg, buf, client, "w-rr-train", score_fn=lambda t, c: float(len(c) % 2),
                                       max_groups=2).run()

    try:
        asyncio.run(go())
    finally:
        stop_process(proc)
    groups = [g for gs in drain_buffer(buf)[0].values() for g in gs]
    single_rank_env(monkeypatch)
    init_distributed(timeout_s=60)
    try:
        cfg.trainer.grad_clip = 1e9
        model = load_policy(ckpts[0], cfg.router, EPContext.local())
        layers = moe_layer_ids(model.config)
        batch = collate_groups(groups, moe_layers=layers)
        assert batch.routed_experts.shape[2:] == (len(layers), model.config.num_experts_per_tok)

        def step(b):
            _, stats = train_step(cfg, model, torch.optim.SGD(model.parameters(), lr=0.0), b, pad_id=0)
            return stats

        same = step(batch)
        assert same["routing_replay_mismatch"] == 0.0  # one set of weights: the engine's routing is the trainer's
        shifted = collate_groups(groups, moe_layers=layers)
        valid = shifted.routed_experts >= 0
        shifted.routed_experts[valid] = (shifted.routed_experts[valid] + 1) % model.config.num_experts
        other = step(shifted)
        assert other["routing_replay_mismatch"] > 0.5

        def logp(b, replay):
            from app.model.policy import routing_replay

            with torch.no_grad(), routing_replay(model, b.routed_experts.unbind(2)) if replay else contextlib.nullcontext():
                return model.sequence_logprobs(b.input_ids, b.attention_mask, b.completion_mask)[0]

        # replaying the engine's routing is the trainer's own routing; replaying other experts is followed
        torch.testing.assert_close(logp(batch, True), logp(batch, False), rtol=0, atol=1e-6)
        assert (logp(shifted, True) - logp(batch, False)).abs().max() > 1e-6
    finally:
        dist.destroy_process_group()
    # a group whose samples lack the routing cannot be collated for replay (it is skipped, not trained)
    for s in groups[0].samples:
        s.routed_experts = None
    with pytest.raises(ValueError, match="no routed_experts"):
        collate_groups(groups[:1], moe_layers=layers)
