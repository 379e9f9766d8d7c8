"""The flush around a weight update (issue 26 item 7), against SGLang 0.5.23's own code:

- SGLang refuses ``/flush_cache`` unless ``Scheduler.is_fully_idle(ignore_waiting=paused)``;
  the built-in engine refuses exactly when SGLang's ``is_fully_idle``, compiled from the wheel
  and run on the same state, says it is not idle;
- a disk update whose own flush is refused fails after the weights changed (SGLang's
  ``flush_cache_after_weight_update``), so the worker flushes first, after the pause, retried
  as Miles does, and sends the update with ``flush_cache`` false: a request held by an in_place
  pause (a health probe caught mid-flight) puts the update off with the weights untouched,
  instead of changing them behind a reported failure.
"""

from __future__ import annotations

import ast
import asyncio
import enum
from types import SimpleNamespace

import httpx
import pytest

from app.rollout.engine_client import EngineClient
from app.engine.load import load_checkpoint
from app.engine.sampler import SamplingParams
from app.engine.scheduler import Engine
from app.engine.server import create_app
from app.rollout.worker import RolloutWorker
from helpers import tiny_moe_checkpoint
from sglang_oracle import _function_node, wheel_function
from test_worker import make_config

SCHEDULER = "srt/managers/scheduler.py"
LONG = SamplingParams(max_new_tokens=60, temperature=1.0, ignore_eos=True)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("flush")
    return (tiny_moe_checkpoint(root / "a", seed=0, max_position_embeddings=128),
            tiny_moe_checkpoint(root / "b", seed=1, max_position_embeddings=128))


class _Mode(enum.Enum):  # the members is_fully_idle compares against (disaggregation/utils.py)
    NULL = "null"
    PREFILL = "prefill"
    DECODE = "decode"


def sglang_idle(engine: Engine):
    """SGLang's ``Scheduler.is_fully_idle`` run on a scheduler state holding the built-in
    engine's live rows (running_batch) and waiting line (waiting_queue)."""
    fn = wheel_function(SCHEDULER, "Scheduler.is_fully_idle", {"DisaggregationMode": _Mode})
    waiting = [SimpleNamespace(kv=SimpleNamespace(holds_kv=False)) for x in engine.waiting if not x.future.done()]
    state = SimpleNamespace(
        running_batch=SimpleNamespace(is_empty=lambda: not len(engine.batch)), chunked_req=None,
        dllm_manager=SimpleNamespace(any_staging_reqs=lambda: False), last_batch=None, enable_overlap=False,
        _pp_microbatches_drained=lambda: True, waiting_queue=waiting, _engine_paused=engine.paused,
        disaggregation_mode=_Mode.NULL, grammar_manager=SimpleNamespace(grammar_queue=[]), enable_hisparse=False,
        enable_hierarchical_cache=False, enable_lmcache=False)
    return lambda ignore_waiting: fn(state, ignore_waiting=ignore_waiting)


def test_sglang_flushes_only_when_fully_idle_ignoring_the_queue_while_paused():
    node = _function_node(SCHEDULER, "Scheduler.flush_cache")
    guard = node.body[1] if isinstance(node.body[0], ast.Expr) else node.body[0]  # after the docstring
    assert isinstance(guard, ast.If)
    assert ast.unparse(guard.test) == "self.is_fully_idle(ignore_waiting=self._engine_paused)"


def test_the_built_in_engine_refuses_a_flush_when_sglang_would(ckpts):
    async def go():
        engine = Engine(load_checkpoint(ckpts[0]), weight_version="0", max_batch=4)
        await engine.start()
        seen = []
        try:
            def check(label):
                idle = sglang_idle(engine)
                seen.append((label, engine.flush_cache(), idle(engine.paused)))

            check("idle")
            live = asyncio.ensure_future(engine.submit([[1, 5, 6]], [LONG]))
            while engine.live_rows == 0:
                await asyncio.sleep(0.005)
            check("generating")
            await engine.pause("in_place")
            queued = asyncio.ensure_future(engine.submit([[1, 7]], [LONG]))
            await asyncio.sleep(0.05)
            check("in_place, a row held")
            engine.resume()
            await engine.pause("retract")
            check("retract, rows queued")
            engine.resume()
            await asyncio.gather(live, queued)
            check("idle again")
            return seen
        finally:
            await engine.stop()

    seen = asyncio.run(go())
    for label, ours, sglang in seen:
        assert ours == sglang, label
    assert [ours for _, ours, _ in seen] == [True, False, False, True, True]


class OneVersion:
    """The buffer of a run whose current policy is v1."""

    def current_policy(self):
        return (1, "file:///unused/policy/v1")


def test_a_held_request_puts_the_update_off_instead_of_failing_it_after_the_load(tmp_path, ckpts):
    """Pause in_place with another client's request live (a /health_generate probe, say): the
    worker's flush is refused, nothing is loaded, the engine keeps v0 and its weights; once the
    request is done the next poll loads v1. Before, the update itself flushed, failed after the
    swap, and left v1's weights serving as v0."""
    cfg = make_config(tmp_path, "redis://127.0.0.1:1/0", "http://engine", pause_mode="in_place",
                      flush_timeout_s=0.3)

    class Worker(RolloutWorker):  # the engine's weights load from here instead of the store
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.weights.download = lambda version: ckpts[1]

    async def go():
        engine = Engine(load_checkpoint(ckpts[0]), weight_version="0", max_batch=4)
        app = create_app(engine, health_timeout_s=0.5)
        await engine.start()
        try:
            async with EngineClient("http://engine", transport=httpx.ASGITransport(app=app), retries=0) as client:
                worker = Worker(cfg, OneVersion(), client, "w-flush", score_fn=lambda t, c: 1.0)
                other = asyncio.ensure_future(engine.submit([[1, 5, 6]], [LONG]))
                while engine.live_rows == 0:
                    await asyncio.sleep(0.005)
                await worker.sync_policy()
                first = (engine.stats.weight_loads, engine.weight_version, worker.stats.weight_update_failures,
                         worker.stats.flushes_refused, worker.engine_version)
                await other
                await worker.sync_policy()
                second = (engine.stats.weight_loads, engine.weight_version, worker.engine_version)
                return first, second, worker.stats
        finally:
            await engine.stop()

    first, second, stats = asyncio.run(go())
    assert first == (0, "0", 0, 1, 0)  # nothing loaded behind the engine's back, no failure counted
    assert second == (1, "1", 1)
    assert stats.weight_updates == 1 and stats.weight_update_failures == 0
