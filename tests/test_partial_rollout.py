"""Partial rollout (issue 26 item 9), against SGLang 0.5.23's own types and code:

- the built-in engine's /abort_request takes SGLang's ``AbortReq`` body, answers as SGLang's
  route does (200), and ends the matching requests as SGLang's scheduler does: running ones with
  the tokens and logprobs generated so far and ``FINISH_ABORT()``'s finish_reason, waiting ones
  with the tokenizer manager's "Abort in waiting queue"; request ids follow SGLang's own
  ``GenerateReqInput._normalize_rid``, so an abort by rid prefix ends what SGLang's would;
- a weight update that arrives mid-generation with ``rollout.partial_rollout``: the worker aborts
  its requests, swaps, and resumes each on the new weights; every sample comes out once, its
  tokens the aborted prefix then the continuation, with two version segments and the oldest
  version as its policy_version;
- the version segments survive the buffer's encoding and are validated with one clear error;
  staleness is measured from a sample's oldest token (take_batch and the trainer's `usable`).
"""

from __future__ import annotations

import asyncio
import json
import uuid
from types import SimpleNamespace

import httpx
import pytest

from app.buffer import ExperienceBuffer, Task
from app.buffer.encoding import GroupHeader, decode_group, encode_group
from app.buffer.records import Group, Sample
from app.config import RunConfig
from app.engine.load import load_checkpoint
from app.engine.sampler import SamplingParams
from app.engine.scheduler import Engine
from app.engine.server import create_app
from app.model.tokenizer import BOS_ID
from app.rollout.engine_client import EngineClient
from app.rollout.worker import RolloutWorker
from helpers import Recorder, tiny_moe_checkpoint
from sglang_oracle import api_types, function_calls, function_strings, http_routes, io_struct_fields, wheel_function
from test_worker import make_config

LONG = SamplingParams(max_new_tokens=100, temperature=1.0, ignore_eos=True)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("partial")
    return (tiny_moe_checkpoint(root / "a", seed=0, max_position_embeddings=128),
            tiny_moe_checkpoint(root / "b", seed=1, max_position_embeddings=128))


async def _until(cond, timeout_s: float = 30.0) -> None:
    for _ in range(int(timeout_s / 0.002)):
        if cond():
            return
        await asyncio.sleep(0.002)
    raise TimeoutError("condition not reached")


def _sglang_abort_decision(engine: Engine):
    """SGLang 0.5.23's own ``TokenizerManager.abort_request`` (compiled from the wheel) over the
    engine's requests in flight: returns a function (rid, abort_all) -> the AbortReq it would
    send to the scheduler, or None (it sends none)."""
    sent = []

    class AbortReq:
        def __init__(self, rid, abort_all):
            self.rid, self.abort_all = rid, abort_all

    abort = wheel_function("srt/managers/tokenizer_manager.py", "TokenizerManager.abort_request", {
        "get_serving": lambda: SimpleNamespace(tokenizer_worker_num=1), "AbortReq": AbortReq,
        "logger": SimpleNamespace(warning=lambda *a, **k: None)})
    states: dict[str, SimpleNamespace] = {}

    def decide(rid: str = "", abort_all: bool = False):
        for r in engine.rids:
            states.setdefault(r, SimpleNamespace(abort_sent=False))
        me = SimpleNamespace(rid_to_state={r: states[r] for r in engine.rids}, _dispatch_to_scheduler=sent.append,
                             enable_metrics=False)
        sent.clear()
        abort(me, rid=rid, abort_all=abort_all)
        return (sent[0].rid, sent[0].abort_all) if sent else None

    return decide


def test_request_ids_and_aborts_are_sglangs(ckpts):
    """The built-in engine's rids and /abort_request against SGLang 0.5.23's own code: a request
    with n > 1 gets a fresh uuid per sample, so neither its rid nor a prefix of it aborts
    anything; a rid aborts only when it names a request in flight exactly (the wheel's
    ``TokenizerManager.abort_request`` decides the same), and then, as SGLang's scheduler
    matches, every request whose rid starts with it; a running request answers after one more
    token with FINISH_ABORT(), a waiting one with nothing and "Abort in waiting queue"; a rid in
    flight twice is refused; a request held by a pause is not aborted."""
    t = api_types()
    engine = Engine(load_checkpoint(ckpts[0]), weight_version="0", max_batch=2)
    recorder = Recorder(create_app(engine, health_timeout_s=0.5))
    decide = _sglang_abort_decision(engine)
    long = {"max_new_tokens": 40, "ignore_eos": True}

    async def go():
        await engine.start()
        try:
            async with EngineClient("http://engine", transport=recorder, retries=0) as c:
                post = lambda body: asyncio.ensure_future(c._http.post("/generate", json=body))  # noqa: E731
                # n = 2 with rid "job-a": its samples run under fresh ids; "job-a", "job-a_0" and
                # a prefix of a sample's own id end nothing.
                pair = post({"input_ids": [BOS_ID, 5, 6], "rid": "job-a", "return_logprob": True,
                             "sampling_params": {**long, "n": 2}})
                await _until(lambda: engine.live_rows == 2)
                live = set(engine.rids)
                for rid in ("job-a", "job-a_0", next(iter(live))[:8]):
                    assert decide(rid) is None
                    await c.abort_request(rid=rid)
                got_pair = (await pair).json()
                # One rid that names a request exactly: the scheduler then ends every rid it prefixes.
                batch = post({"input_ids": [[BOS_ID, 7]] * 2 + [[BOS_ID, 8]] * 9, "rid": "x",
                              "sampling_params": long})  # rids x_0 .. x_10
                await _until(lambda: engine.live_rows == 2 and len(engine.waiting) == 9)
                await c.pause_generation("in_place")  # the two running rows hold their tokens
                held = {item.rid: len(engine.batch.rows[i][3].token_ids) for i, item in enumerate(
                    sorted(engine._owners.values(), key=lambda it: it.rid))}
                assert decide("x") is None and decide("x_1") == ("x_1", False)
                await c.abort_request(rid="x")
                await c.abort_request(rid="x_1")  # running; and x_10, waiting
                await c.abort_request(rid="x_1")  # a second abort of the same rid: nothing more
                # A rid in flight is refused a second time, with SGLang's message.
                dup = await c._http.post("/generate", json={"input_ids": [BOS_ID, 9], "rid": "x_0",
                                                            "sampling_params": {"max_new_tokens": 2}})
                late = post({"input_ids": [BOS_ID, 9], "rid": "late", "sampling_params": {"max_new_tokens": 3}})
                await _until(lambda: len(engine.held) == 1)
                await c.abort_request(abort_all=True)  # every request the scheduler has; not "late"
                await c.continue_generation()
                got_batch = (await batch).json()
                got_late = (await late).json()
                with pytest.raises(ValueError):
                    await c.abort_request()  # an empty rid would match every request
        finally:
            await engine.stop()
        return got_pair, got_batch, got_late, dup, held

    got_pair, got_batch, got_late, dup, held = asyncio.run(go())
    assert http_routes()["/abort_request"]["body"] == "AbortReq"
    for path, sent, status, _ in recorder.calls:
        if path == "/abort_request":
            assert status == 200 and set(sent) <= set(io_struct_fields("AbortReq")) | set(io_struct_fields("BaseReq"))
            t.AbortRequest.from_json_value(sent)
    # n = 2: uuid4().hex ids (GenerateReqInput.regenerate_rid), untouched by the aborts.
    assert "regenerate_rid" in function_calls("srt/managers/tokenizer_manager.py",
                                              "TokenizerManager._handle_batch_request")
    assert [len(item["output_ids"]) for item in got_pair] == [40, 40]
    for item in got_pair:
        assert len(item["meta_info"]["id"]) == 32 and int(item["meta_info"]["id"], 16) >= 0
        assert item["meta_info"]["finish_reason"] == {"type": "length", "length": 40}
        t.GenerateResponse.from_json_value(item)
    # The batch's ids are SGLang's own (_normalize_rid from the wheel).
    normalize = wheel_function("srt/managers/io_struct.py", "GenerateReqInput._normalize_rid", {"uuid": uuid})
    req = SimpleNamespace(rid="x", batch_size=11)
    normalize(req, 11)
    assert [item["meta_info"]["id"] for item in got_batch] == req.rid
    by_id = {item["meta_info"]["id"]: item for item in got_batch}
    # x_1 ran: one more token after the abort, FINISH_ABORT()'s finish_reason, its logprobs.
    running = by_id["x_1"]
    assert set(function_strings("srt/managers/schedule_batch.py", "FINISH_ABORT.to_json")) >= {"abort", "message"}
    assert running["meta_info"]["finish_reason"] == {"type": "abort", "message": "Aborted", "status_code": None,
                                                     "err_type": None}
    assert len(running["output_ids"]) == held["x_1"] + 1
    assert isinstance(t.GenerateResponse.from_json_value(running).meta_info.finish_reason, t.FinishAbort)
    # x_10 waited: the tokenizer manager's own answer, nothing generated, no prompt count.
    assert "Abort in waiting queue" in function_strings("srt/managers/tokenizer_manager.py",
                                                        "TokenizerManager._handle_abort_req")
    waited = by_id["x_10"]
    assert waited["output_ids"] == [] and waited["meta_info"]["finish_reason"] == {
        "type": "abort", "message": "Abort in waiting queue"}
    assert "prompt_tokens" not in waited["meta_info"] and waited["meta_info"]["completion_tokens"] == 0
    t.GenerateResponse.from_json_value(waited)
    # abort_all ended the rest that the scheduler held; x_0 had been running, the others waiting.
    assert by_id["x_0"]["meta_info"]["finish_reason"]["message"] == "Aborted"
    assert len(by_id["x_0"]["output_ids"]) == held["x_0"] + 1
    assert all(by_id[f"x_{i}"]["meta_info"]["finish_reason"]["message"] == "Abort in waiting queue" for i in range(2, 10))
    # The duplicate rid: HTTP 400 with the message of SGLang's _init_req_state.
    assert dup.status_code == 400 and "Duplicate request ID detected: x_0" in dup.text
    assert any("Duplicate request ID detected" in x for x in function_strings(
        "srt/managers/tokenizer_manager.py", "TokenizerManager._init_req_state"))
    # Held by the pause (SGLang's tokenizer waits on is_pause): not aborted, it ran after continue.
    assert got_late["meta_info"]["finish_reason"] == {"type": "length", "length": 3}


class OneVersion:
    def current_policy(self):
        return (1, "file:///unused/policy/v1")


def test_an_update_mid_generation_resumes_every_sample_on_the_new_weights(tmp_path, ckpts):
    """Eight sequences in flight when v1 is announced: the worker aborts them, loads v1, resumes
    each; each sample is published once with all its tokens: the aborted prefix (v0) then the
    continuation (v1), two segments, policy_version 0 (the oldest)."""
    cfg = make_config(tmp_path, "redis://127.0.0.1:1/0", "http://engine", partial_rollout=True,
                      max_new_tokens=100, group_size=8)
    cfg.rollout.pause_mode = "retract"

    class Worker(RolloutWorker):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.weights.download = lambda version: ckpts[1]

    engine = Engine(load_checkpoint(ckpts[0]), weight_version="0", max_batch=8)
    recorder = Recorder(create_app(engine, health_timeout_s=0.5))
    task = Task(task_id="train-0001", prompt_ids=[BOS_ID, 21, 30], prompt="p", answer="{}", group_size=8)

    async def go():
        await engine.start()
        try:
            async with EngineClient("http://engine", transport=recorder, retries=0) as client:
                worker = Worker(cfg, OneVersion(), client, "w-partial", score_fn=lambda t, c: 1.0)
                rollout = asyncio.ensure_future(worker.rollout(task))
                await _until(lambda: engine.live_rows and any(len(r[3].token_ids) >= 3 for r in engine.batch.rows))
                await worker.sync_policy()
                samples = await rollout
                return samples, worker.stats, worker.engine_version
        finally:
            await engine.stop()

    samples, stats, version = asyncio.run(go())
    assert version == 1 and stats.weight_updates == 1 and stats.partial_aborts == 1
    # abort_all, as slime and Miles abort: SGLang 0.5.23 would match no rid of an n = 8 request.
    aborts = [sent for path, sent, _, _ in recorder.calls if path == "/abort_request"]
    assert aborts and all(sent["abort_all"] is True for sent in aborts)
    generates = [(sent, got) for path, sent, _, got in recorder.calls if path == "/generate"]
    first = generates[0][1]
    aborted = [j for j, item in enumerate(first) if item["meta_info"]["finish_reason"]["type"] == "abort"]
    assert aborted and stats.partial_resumes == len(aborted)
    resumes = generates[1:]
    assert len(resumes) == len(aborted)
    assert [s.index for s in samples] == list(range(8)) and len({s.sample_id for s in samples}) == 8
    for j, s in enumerate(samples):
        head = first[j]
        prefix = head["output_ids"]
        prefix_lps = [e[0] for e in head["meta_info"]["output_token_logprobs"]]
        if j not in aborted:
            assert s.completion_ids == prefix and s.version_segments is None and s.policy_version == 0
            continue
        (sent, got), = [(sent, got) for sent, got in resumes if sent["input_ids"] == task.prompt_ids + prefix]
        assert sent["sampling_params"]["max_new_tokens"] == 100 - len(prefix)
        assert got["meta_info"]["weight_version"] == "1"
        rest = got["output_ids"]
        assert s.completion_ids == prefix + rest  # nothing lost, nothing twice
        assert s.logprobs == pytest.approx(prefix_lps + [e[0] for e in got["meta_info"]["output_token_logprobs"]])
        if prefix:
            assert s.version_segments == [(0, 0), (len(prefix), 1)] and s.policy_version == 0
        assert s.token_versions() == [0] * len(prefix) + [1] * len(rest)
        assert s.finish_reason in ("stop", "length") and len(s.completion_ids) <= 100
    assert any(s.version_segments for s in samples)


def test_without_partial_rollout_an_abort_still_fails_the_task(tmp_path, ckpts):
    """The default path is unchanged: the update waits for the requests, and an abort the worker
    did not ask for is an engine error (the task goes back to the queue)."""
    from app.rollout.engine_client import EngineError

    cfg = make_config(tmp_path, "redis://127.0.0.1:1/0", "http://engine", max_new_tokens=100)
    engine = Engine(load_checkpoint(ckpts[0]), weight_version="0", max_batch=8)

    async def go():
        await engine.start()
        try:
            async with EngineClient("http://engine", transport=httpx.ASGITransport(app=create_app(engine)),
                                    retries=0) as client:
                worker = RolloutWorker(cfg, OneVersion(), client, "w-full", score_fn=lambda t, c: 1.0)
                task = Task(task_id="train-0002", prompt_ids=[BOS_ID, 22, 30], prompt="p", answer="{}", group_size=4)
                rollout = asyncio.ensure_future(worker.rollout(task))
                await _until(lambda: engine.live_rows > 0)
                await client.abort_request(abort_all=True)
                with pytest.raises(EngineError, match="aborted"):
                    await rollout
        finally:
            await engine.stop()

    asyncio.run(go())


def _segmented_group(run_id: str, task: Task) -> list[Sample]:
    return [Sample(task.sample_id(run_id, i), task.task_id, i, task.attempt, [1, 2, 3], [4, 5, 6, 7, 8],
                   [-0.5] * 5, float(i), 1, "length", version_segments=[(0, 1), (2, 3)] if i == 0 else None)
            for i in range(2)]


def test_version_segments_round_trip_the_encoding_compactly():
    task = Task("train-0003", [1, 2, 3], "p", "{}", 2)
    samples = _segmented_group("r", task)
    header, payload = encode_group(Group(task.task_id, 0, samples))
    meta = json.loads(header.to_json())
    assert meta["version_segments"] == [[[0, 1], [2, 3]], None]  # boundaries + versions, not one per token
    back = decode_group(GroupHeader.from_json(header.to_json()), payload, as_lists=True)
    assert [s.version_segments for s in back.samples] == [[(0, 1), (2, 3)], None]
    assert back.samples[0].token_versions() == [1, 1, 3, 3, 3]
    # A group of one version per sample writes no version_segments at all (the format as before).
    plain = [Sample(**{**s.__dict__, "version_segments": None}) for s in samples]
    assert "version_segments" not in json.loads(encode_group(Group(task.task_id, 0, plain))[0].to_json())
    assert Sample.from_dict(samples[0].to_dict()).version_segments == [(0, 1), (2, 3)]


@pytest.mark.parametrize("segments, problem", [
    ([[1, 1], [2, 3]], "begin at 0"),
    ([[0, 1], [5, 3]], "below the 5 completion tokens"),
    ([[0, 1], [2, 1]], "increase strictly"),
    ([[0, 2], [2, 3]], "policy_version is 1"),
    ([[0, "1"]], "integer pairs"),
])
def test_bad_version_segments_get_one_error_naming_the_field(segments, problem):
    task = Task("train-0004", [1, 2, 3], "p", "{}", 2)
    header, _ = encode_group(Group(task.task_id, 0, _segmented_group("r", task)))
    meta = json.loads(header.to_json())
    meta["version_segments"][0] = segments
    with pytest.raises(ValueError, match="meta.version_segments") as e:
        GroupHeader.from_json(json.dumps(meta))
    assert problem in str(e.value)


def test_staleness_is_measured_from_the_oldest_token(redis_server):
    """A sample of versions 1 then 3 is as stale as version 1: with max_staleness 2 a trainer at
    v4 drops it (it would keep it if the newest, 3, counted), a trainer at v3 takes it."""
    from app.trainer.intake import usable
    from app.trainer.state import TrainState

    cfg = RunConfig(run_id="stale")
    cfg.buffer.redis_url = redis_server
    cfg.buffer.max_staleness = 2
    cfg.buffer.stale_policy = "drop"
    buf = ExperienceBuffer.from_config(cfg)
    for n, version in ((0, 4), (1, 3)):
        task = Task(f"train-01{n}", [1, 2, 3], "p", "{}", 2)
        buf.put_tasks([task])
        (leased,) = buf.lease("w", count=1, block_ms=0)
        assert buf.publish(leased, _segmented_group("stale", leased))
        got = buf.take_batch(1, trainer_version=version, timeout_s=0)
        assert [g.task_id for g in got] == ([] if version == 4 else [task.task_id])
        header = GroupHeader.from_json(encode_group(Group(task.task_id, 0, _segmented_group("stale", leased)))[0]
                                       .to_json())
        assert usable(header, TrainState(version=version), 2, 0) is (version == 3)


def test_partial_rollout_config_is_validated():
    RunConfig.model_validate({"rollout": {"partial_rollout": True}})
    assert RunConfig().rollout.partial_rollout is False
    with pytest.raises(ValueError, match="rollout.partial_rollout.*routing_replay"):
        RunConfig.model_validate({"rollout": {"partial_rollout": True, "routing_replay": True}})
    with pytest.raises(ValueError, match="partial_rollout"):
        RunConfig.model_validate({"rollout": {"partial_rollout": "sometimes"}})
    with pytest.raises(ValueError, match="rollout.partial_rollout.*rollout.router"):
        RunConfig.model_validate({"rollout": {"partial_rollout": True, "router": True, "pause_mode": "abort"}})
