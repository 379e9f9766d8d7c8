"""The client and the built-in engine against SGLang 0.5.23's own definitions (tests/sglang_oracle.py):

- every request the client sends and every response the built-in engine returns decode with
  ``sglang.api.v1.api_types`` (the server's JSON contract), captured on the wire;
- the update / pause / continue bodies use only fields of SGLang's ``io_struct`` request types,
  and the pause modes are SGLang's;
- the installed wheel is the version images/rollout.Dockerfile pins.
"""

from __future__ import annotations

import asyncio
import re
from importlib.metadata import version
from pathlib import Path

import pytest

from app.model.tokenizer import BOS_ID
from app.engine import scheduler as engine_server
from app.engine.load import load_checkpoint
from app.engine.scheduler import Engine
from app.engine.server import create_app
from app.rollout import engine_client
from app.rollout.engine_client import EngineClient
from helpers import Recorder, tiny_moe_checkpoint
from sglang_oracle import api_types, io_struct_fields, literal_values

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return tiny_moe_checkpoint(tmp_path_factory.mktemp("proto") / "m", seed=0, max_position_embeddings=64)


def exchange(ckpt: Path, capture_routing: bool = False):
    """Run the client's calls against an in-process built-in engine; returns the recorded calls."""
    engine = Engine(load_checkpoint(ckpt), weight_version="0", max_batch=16, capture_routing=capture_routing)
    recorder = Recorder(create_app(engine, health_timeout_s=0.5))

    async def go():
        await engine.start()
        try:
            async with EngineClient("http://engine", transport=recorder, retries=0) as c:
                await c.generate([BOS_ID, 5, 6], max_new_tokens=4, return_routed_experts=capture_routing)
                await c.generate([[BOS_ID, 7], [BOS_ID, 8, 9]], n=2, max_new_tokens=3, stop_token_ids=[3], top_p=0.9)
                await c.generate("12+7=", max_new_tokens=2, temperature=0.5)
                await c.model_info()
                await c.pause_generation("retract")
                ok, _ = await c.update_weights_from_disk(str(ckpt), 1)
                assert ok
                await c.continue_generation()
                for mode in ("abort", "in_place"):
                    await c.pause_generation(mode)
                    await c.continue_generation()
                await c.flush_cache()
                assert await c.weight_version() == 1
                await c._http.get("/server_info")
        finally:
            await engine.stop()
        return recorder.calls

    return asyncio.run(go())


@pytest.fixture(scope="module")
def calls(ckpt):
    return exchange(ckpt)


def test_installed_sglang_is_the_version_the_rollout_image_pins():
    tag = re.search(r"^FROM lmsysorg/sglang:v([0-9.]+)-", (ROOT / "images" / "rollout.Dockerfile").read_text(), re.M)
    assert tag, "images/rollout.Dockerfile: no lmsysorg/sglang:v<version>-... base"
    assert version("sglang") == tag.group(1)


def test_generate_requests_and_responses_follow_sglang_api_types(calls):
    t = api_types()
    generates = [c for c in calls if c[0] == "/generate"]
    assert len(generates) == 3
    for _, sent, status, got in generates:
        assert status == 200
        req = t.GenerateRequest.from_json_value(sent)  # SamplingParams rejects unknown keys
        assert req.sampling_params is not None and req.return_logprob is True
        for item in got if isinstance(got, list) else [got]:
            resp = t.GenerateResponse.from_json_value(item)
            meta = resp.meta_info
            assert isinstance(meta.weight_version, str)
            assert meta.completion_tokens == len(resp.output_ids) == len(meta.output_token_logprobs)
            assert [e.token_id for e in meta.output_token_logprobs] == list(resp.output_ids)
            assert isinstance(meta.finish_reason, (t.FinishStop, t.FinishLength))
    # one input with n == 1 is one object; a batch (2 inputs x n 2) a list of 4, input-major
    assert isinstance(generates[0][3], dict) and len(generates[1][3]) == 4


def test_the_contract_rejects_what_sglang_rejects():
    """The oracle can fail: an integer weight_version, an unknown sampling parameter."""
    t = api_types()
    with pytest.raises(t.JsonContractError):
        t.GenerateMetaInfo.from_json_value({"weight_version": 3})
    with pytest.raises(t.JsonContractError):
        t.GenerateRequest.from_json_value({"input_ids": [1, 2], "sampling_params": {"max_tokens": 3}})
    with pytest.raises(t.JsonContractError):
        t.GetModelInfoResponse.from_json_value({"weight_version": 1})


def test_model_info_follows_sglang_api_types(calls):
    t = api_types()
    infos = [c for c in calls if c[0] == "/model_info"]
    assert len(infos) == 2  # model_info() and weight_version() both read /model_info, not /get_model_info
    assert not [c for c in calls if c[0] == "/get_model_info"]
    for _, _, status, got in infos:
        assert status == 200
        info = t.GetModelInfoResponse.from_json_value(got)
        assert info.is_generation and isinstance(info.weight_version, str)
    assert t.GetModelInfoResponse.from_json_value(infos[-1][3]).weight_version == "1"


def test_server_info_decodes_with_sglang_api_types(calls):
    (got,) = [got for p, _, status, got in calls if p == "/server_info" and status == 200]
    api_types().GetServerInfoResponse.from_json_value(got)  # no field of SGLang's with another type


def _body_fields(calls, path: str) -> list[dict]:
    bodies = [sent for p, sent, _, _ in calls if p == path]
    assert bodies, path
    return bodies


def test_update_pause_continue_bodies_use_sglang_io_struct_fields(calls):
    update = io_struct_fields("UpdateWeightFromDiskReqInput")
    for body in _body_fields(calls, "/update_weights_from_disk"):
        assert set(body) <= set(update), set(body) - set(update)
        assert update["weight_version"] == "Optional[str]" and isinstance(body["weight_version"], str)
        assert update["model_path"] == "str" and isinstance(body["model_path"], str)
    pause = io_struct_fields("PauseGenerationReqInput")
    modes = literal_values(pause["mode"])
    assert sorted(b["mode"] for b in _body_fields(calls, "/pause_generation")) == sorted(modes)
    for body in _body_fields(calls, "/pause_generation"):
        assert set(body) <= set(pause)
    for body in _body_fields(calls, "/continue_generation"):
        assert set(body) <= set(io_struct_fields("ContinueGenerationReqInput"))
    # one definition of the modes each side accepts, equal to SGLang's
    assert tuple(modes) == engine_client.PAUSE_MODES == engine_server.PAUSE_MODES


def test_update_answer_has_sglang_output_fields(calls):
    out = set(io_struct_fields("UpdateWeightFromDiskReqOutput")) - set(io_struct_fields("BaseReq"))
    (answer,) = [got for p, _, status, got in calls if p == "/update_weights_from_disk" and status == 200]
    assert set(answer) == out == {"success", "message", "num_paused_requests"}


def test_routed_experts_request_field_and_answer_follow_sglang(ckpt):
    """return_routed_experts is a GenerateReqInput field (the API types ignore it); the answer
    is base64 of int32 ids [prompt + completion - 1, layers, top_k]."""
    assert io_struct_fields("GenerateReqInput")["return_routed_experts"] == "bool"
    (call,) = [c for c in exchange(ckpt, capture_routing=True) if c[0] == "/generate" and c[1].get("return_routed_experts")]
    _, sent, _, got = call
    assert sent["return_routed_experts"] is True
    resp = api_types().GenerateResponse.from_json_value(got)
    ids = engine_client.decode_routed_experts(got["meta_info"]["routed_experts"])
    assert ids.size == (resp.meta_info.prompt_tokens + resp.meta_info.completion_tokens - 1) * 2 * 2  # 2 layers, top-2
    assert ids.min() >= 0 and ids.max() < 4  # 4 experts
