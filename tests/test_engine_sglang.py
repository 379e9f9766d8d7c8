"""The built-in engine where the worker depends on it behaving like SGLang 0.5.23 (in-process,
through its ASGI app): pause modes abort / retract / in_place, weight updates while paused and
while generating, /health_generate answering 503 while paused (after the wait), /health with
SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION, /get_model_info as a deprecated alias, the routed
experts against a recomputation, and the pause-aware probe (app/rollout/probe.py).
"""

from __future__ import annotations

import asyncio
import logging
import time

import httpx
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from app.model.tokenizer import BOS_ID
from app.rollout import probe
from app.rollout.engine_client import EngineClient, decode_routed_experts
from app.engine.load import load_checkpoint
from app.engine.receive import NOT_FLUSHED
from app.engine.scheduler import Engine
from app.engine.server import create_app
from app.engine.sampler import RoutingCapture, SamplingParams
from helpers import tiny_moe_checkpoint
from sglang_oracle import function_calls

LONG = SamplingParams(max_new_tokens=40, temperature=1.0, ignore_eos=True)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("sgl")
    return (tiny_moe_checkpoint(root / "a", seed=0, max_position_embeddings=128),
            tiny_moe_checkpoint(root / "b", seed=1, max_position_embeddings=128))


def with_engine(ckpt, body, **kwargs):
    """Run ``await body(engine, client)`` against a started in-process engine."""
    health = kwargs.pop("health_timeout_s", 0.5)
    engine = Engine(load_checkpoint(ckpt), weight_version="0", max_batch=16, **kwargs)
    app = create_app(engine, health_timeout_s=health)

    async def go():
        await engine.start()
        try:
            async with EngineClient("http://engine", transport=httpx.ASGITransport(app=app), retries=0) as c:
                return await body(engine, c)
        finally:
            await engine.stop()

    return asyncio.run(go())


async def until(pred, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not pred():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.01)


def test_pause_abort_ends_live_sequences_and_holds_new_ones(ckpts):
    """SGLang 0.5.23's pause in mode abort: abort_all (the running request takes one more decode
    step and answers abort), and the tokenizer manager holds every request that arrives while
    paused before it reaches the scheduler (``generate_request`` waits on ``is_pause``), so a
    second pause's abort_all passes it by and it runs after /continue_generation."""
    short = SamplingParams(max_new_tokens=3, temperature=1.0, ignore_eos=True)

    async def body(engine, c):
        live = asyncio.create_task(engine.submit([[BOS_ID, 5]], [LONG]))
        await until(lambda: engine.stats.steps >= 3)
        await c.pause_generation("abort")
        ((done, _),) = await live
        arrived = asyncio.create_task(engine.submit([[BOS_ID, 6]], [short]))  # arrives while paused
        await until(lambda: len(engine.held) == 1)
        await c.pause_generation("abort")  # a second abort_all: not in the scheduler, not aborted
        await asyncio.sleep(0.05)
        held = not arrived.done()
        await c.continue_generation()
        ((after, _),) = await arrived
        return done, held, after, engine.stats.aborted

    done, held, after, aborted = with_engine(ckpts[0], body)
    assert done.finish_reason == "abort" and 1 <= len(done.token_ids) < LONG.max_new_tokens
    assert held and after.finish_reason == "length" and len(after.token_ids) == 3
    assert aborted == 1
    assert "abort_request" in function_calls("srt/managers/tokenizer_manager.py", "TokenizerManager.pause_generation")
    assert "wait_for" in function_calls("srt/managers/tokenizer_manager.py", "TokenizerManager.generate_request")


def test_pause_retract_requeues_and_finishes_after_continue(ckpts):
    async def body(engine, c):
        task = asyncio.create_task(engine.submit([[BOS_ID, 5, 6]], [LONG]))
        await until(lambda: engine.stats.steps >= 5)
        await c.pause_generation("retract")
        steps = engine.stats.steps
        await asyncio.sleep(0.2)
        held = (engine.stats.steps == steps, engine.live_rows, len(engine.waiting), task.done())
        await c.continue_generation()
        (out, _), = await task
        return held, out, engine.stats.retracted

    (no_steps, live, waiting, finished), out, retracted = with_engine(ckpts[0], body)
    assert no_steps and live == 0 and waiting == 1 and not finished  # out of the batch, first in the queue
    assert retracted == 1
    # the sequence went on where it stopped: all its tokens, one logprob each
    assert out.finish_reason == "length" and len(out.token_ids) == len(out.logprobs) == LONG.max_new_tokens


def test_pause_in_place_holds_rows_and_continues_them(ckpts):
    async def body(engine, c):
        task = asyncio.create_task(engine.submit([[BOS_ID, 5]], [LONG]))
        await until(lambda: engine.stats.steps >= 3)
        await c.pause_generation("in_place")
        steps = engine.stats.steps
        await asyncio.sleep(0.2)
        held = (engine.stats.steps == steps, engine.live_rows, task.done())
        healthy = await c.health_generate(timeout_s=5)  # SGLang: paused means no progress: 503
        await c.continue_generation()
        (out, _), = await task
        return held, healthy, out, await c.health_generate(timeout_s=5)

    (no_steps, live, finished), healthy_paused, out, healthy_after = with_engine(ckpts[0], body)
    assert no_steps and live == 1 and not finished
    assert not healthy_paused and healthy_after
    assert len(out.token_ids) == LONG.max_new_tokens


def test_every_update_reloads_and_a_paused_engine_swaps_at_once(ckpts):
    async def body(engine, c):
        ok1, _ = await c.update_weights_from_disk(str(ckpts[1]), 1)
        ok2, _ = await c.update_weights_from_disk(str(ckpts[1]), 1)  # same version again: reloaded
        loads = engine.stats.weight_loads
        # not paused: the live row finishes on the old weights before the swap
        task = asyncio.create_task(engine.submit([[BOS_ID, 5]], [LONG]))
        await until(lambda: engine.stats.steps >= 2)
        ok3, _ = await c.update_weights_from_disk(str(ckpts[0]), 2)
        (out, version), = await task
        # paused (in_place, a row held): the swap does not wait for the row
        held = asyncio.create_task(engine.submit([[BOS_ID, 6]], [LONG]))
        await until(lambda: engine.live_rows == 1)
        await c.pause_generation("in_place")
        # SGLang's default flush after the load is refused while the row is held: the call
        # fails with the new weights in and the version not taken
        flushed = await c.update_weights_from_disk(str(ckpts[0]), 9)
        version_after_refusal = engine.weight_version
        t0 = time.monotonic()
        ok4, _ = await c.update_weights_from_disk(str(ckpts[1]), 3, flush_cache=False)
        swap_s = time.monotonic() - t0
        still_live = not held.done()
        await c.continue_generation()
        (_, held_version), = await held
        return (ok1, ok2, loads, ok3, out, version, ok4, swap_s, still_live, held_version, flushed,
                version_after_refusal)

    (ok1, ok2, loads, ok3, out, version, ok4, swap_s, still_live, held_version, flushed,
     version_after_refusal) = with_engine(ckpts[0], body)
    assert ok1 and ok2 and loads == 2
    assert ok3 and len(out.token_ids) == LONG.max_new_tokens and version == "1"  # finished before the swap
    assert flushed == (False, NOT_FLUSHED) and version_after_refusal == "2"
    assert ok4 and still_live and held_version == "3" and swap_s < 30


def test_a_weight_version_that_is_not_a_string_is_refused(ckpts):
    async def body(engine, c):
        r = await c._http.post("/update_weights_from_disk", json={"model_path": str(ckpts[1]), "weight_version": 1})
        return r.status_code, r.json(), engine.weight_version

    status, answer, version = with_engine(ckpts[0], body)
    assert status == 400 and "weight_version must be a string" in answer["message"] and version == "0"


def test_health_endpoint_without_generation(ckpts, monkeypatch):
    async def body(engine, c):
        await c.pause_generation("abort")
        r1 = await c._http.get("/health")
        r2 = await c._http.get("/health_generate")
        await c.continue_generation()
        return r1.status_code, r2.status_code

    monkeypatch.setenv("SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION", "false")
    assert with_engine(ckpts[0], body) == (200, 503)
    monkeypatch.setenv("SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION", "true")
    assert with_engine(ckpts[0], body) == (503, 503)  # SGLang's default: /health generates too


def test_get_model_info_is_a_deprecated_alias(ckpts, caplog):
    async def body(engine, c):
        return (await c._http.get("/get_model_info")).json(), (await c._http.get("/model_info")).json()

    with caplog.at_level(logging.WARNING, logger="moerl.engine"):
        old, new = with_engine(ckpts[0], body)
    assert old == new and new["weight_version"] == "0"
    assert sum("deprecated" in r.getMessage() for r in caplog.records) == 1


def test_routed_experts_are_what_the_model_routes(ckpts):
    """The engine's routed experts (batched, KV-cached decoding) equal the routers' choices in one
    plain forward over prompt + completion[:-1], for every layer and token."""
    prompts = [[BOS_ID, 20, 21, 22, 23], [BOS_ID, 30]]

    async def body(engine, c):
        return await c.generate(prompts, n=2, max_new_tokens=6, temperature=0.0, return_routed_experts=True)

    outs = with_engine(ckpts[0], body, capture_routing=True)
    model = AutoModelForCausalLM.from_pretrained(str(ckpts[0])).eval()
    capture = RoutingCapture(model)
    for k, out in enumerate(outs):
        prompt = prompts[k // 2]
        fed = prompt + out.token_ids[:-1]
        with torch.no_grad():
            model(torch.tensor([fed]))
        want = capture.take(1, len(fed))[0].numpy()  # [P + C - 1, layers, top_k]
        got = out.routed_experts.reshape(len(fed), capture.num_layers, capture.top_k)
        assert np.array_equal(np.sort(got, -1), np.sort(want, -1))


def test_routed_experts_only_when_asked_and_enabled(ckpts):
    async def body(engine, c):
        return (await c.generate([BOS_ID, 5], max_new_tokens=2))[0].routed_experts, \
            (await c.generate([BOS_ID, 5], max_new_tokens=2, return_routed_experts=True))[0].routed_experts

    assert with_engine(ckpts[0], body, capture_routing=True)[0] is None
    assert with_engine(ckpts[0], body)[1] is None  # server started without --enable-return-routed-experts


def test_decode_routed_experts_refuses_a_bad_payload():
    from app.rollout.engine_client import EngineError

    with pytest.raises(EngineError, match="base64"):
        decode_routed_experts("not base64!")
    with pytest.raises(EngineError, match="int32"):
        decode_routed_experts("AAA=")  # 2 bytes


def test_probe_passes_a_paused_engine_only_while_the_marker_holds(ckpts, tmp_path):
    """A paused engine fails /health_generate (as SGLang); the probe passes it while the worker's
    marker is in the future, and fails it again once the marker has expired."""
    import threading

    import uvicorn

    from app.buffer.redis_server import free_port

    port = free_port()
    engine = Engine(load_checkpoint(ckpts[0]), weight_version="0")
    server = uvicorn.Server(uvicorn.Config(create_app(engine, health_timeout_s=0.5), host="127.0.0.1", port=port,
                                           log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url, marker = f"http://127.0.0.1:{port}", tmp_path / "engine-paused"
    try:
        deadline = time.monotonic() + 30
        while not probe.healthy(url, None, 5):
            assert time.monotonic() < deadline
            time.sleep(0.1)
        assert httpx.post(f"{url}/pause_generation", json={"mode": "retract"}, timeout=10).status_code == 200
        assert not probe.healthy(url, None, 5)
        marker.write_text(f"{time.time() + 60}\n")
        assert probe.healthy(url, marker, 5) and probe.main(["--url", url, "--marker", str(marker)]) == 0
        marker.write_text(f"{time.time() - 1}\n")  # the worker died holding it: the deadline passed
        assert not probe.healthy(url, marker, 5) and probe.main(["--url", url, "--marker", str(marker)]) == 1
        httpx.post(f"{url}/continue_generation", json={}, timeout=10)
        assert probe.healthy(url, None, 5)
    finally:
        server.should_exit = True
        thread.join(10)


def test_a_weight_update_is_sent_once_and_a_timeout_says_so():
    """The client never resends /update_weights_from_disk (SGLang reloads on every call): one
    call, even with retries configured, and a timed-out one is marked as such; a refused
    connection is not a timeout."""
    import threading

    import uvicorn
    from fastapi import FastAPI

    from app.buffer.redis_server import free_port
    from app.rollout.engine_client import EngineError

    calls = []
    app = FastAPI()

    @app.post("/update_weights_from_disk")
    async def slow_update():
        calls.append(time.monotonic())
        await asyncio.sleep(2.0)  # a long load
        return {"success": True, "message": "", "num_paused_requests": 0}

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()

    async def go():
        while not server.started:
            await asyncio.sleep(0.05)
        async with EngineClient(f"http://127.0.0.1:{port}", retries=3, backoff_s=0.01) as c:
            with pytest.raises(EngineError) as slow:
                await c.update_weights_from_disk("/m", 1, timeout_s=0.3)
        async with EngineClient(f"http://127.0.0.1:{free_port()}", retries=0) as dead:
            with pytest.raises(EngineError) as refused:
                await dead.update_weights_from_disk("/m", 1, timeout_s=0.3)
        return slow.value, refused.value

    try:
        slow, refused = asyncio.run(go())
    finally:
        server.should_exit = True
        thread.join(10)
    assert len(calls) == 1 and slow.timed_out and slow.status is None
    assert not refused.timed_out


@pytest.mark.parametrize("reported, expected", [("7", 7), (7, 7), (" 3 ", 3), ("default", None), (True, None),
                                                 (None, None)])
def test_weight_version_is_read_as_sglang_reports_it_or_as_an_integer(reported, expected):
    """SGLang reports ``weight_version`` as a string ("default" until one is set); an integer is
    read too, and anything that is not a version is None, never a version 0 or 1. Both routes
    that carry it: /model_info and /generate's meta_info."""
    import json

    def reply(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/model_info":
            return httpx.Response(200, json={"model_path": "/m", "weight_version": reported})
        assert request.url.path == "/generate", request.url.path
        body = json.loads(request.content)
        return httpx.Response(200, json={"text": "a", "output_ids": [5], "meta_info": {
            "finish_reason": {"type": "length", "length": 1}, "weight_version": reported,
            "output_token_logprobs": [[-0.5, 5, None]]}, "input_ids": body["input_ids"]})

    async def go():
        async with EngineClient("http://engine", transport=httpx.MockTransport(reply), retries=0) as c:
            out = await c.generate([BOS_ID, 5], max_new_tokens=1, return_logprob=True)
            return await c.weight_version(), out

    version, out = asyncio.run(go())
    assert version == expected
    assert [o.weight_version for o in out] == [expected]
