"""The built-in engine as a real process: batched /generate with logprobs that a recomputation
through the model reproduces, weight reload that the outputs follow, bad input, pause/continue.

A tiny random Qwen3-MoE checkpoint (+ the character tokenizer) is built in code and saved with
save_pretrained, the same HF layout the trainer publishes.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM

from app.buffer.redis_server import free_port
from app.model.tokenizer import BOS_ID, EOS_ID, PAD_ID, VOCAB_SIZE, load_tokenizer
from app.rollout.engine_client import EngineClient, EngineError, wait_until_healthy
from app.engine.sampler import DecodeBatch, SamplingParams, generate
from helpers import engine_argv, tiny_moe_checkpoint

ROOT = Path(__file__).resolve().parents[1]


def make_checkpoint(out: Path, seed: int) -> Path:
    """A tiny random Qwen3-MoE (see `helpers.tiny_moe_checkpoint`), 64 positions."""
    return tiny_moe_checkpoint(out, seed, max_position_embeddings=64)


def start_engine(model_path: Path, port: int, log_path: Path, *extra: str) -> subprocess.Popen:
    argv = engine_argv(model_path, port, *extra)
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(argv, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        wait_until_healthy(f"http://127.0.0.1:{port}", timeout_s=90)
    except TimeoutError:
        stop_process(proc)
        raise AssertionError(f"engine did not start:\n{log_path.read_text()[-3000:]}")
    return proc


def stop_process(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(5)


def recompute_logprobs(model, prompt: list[int], completion: list[int], temperature: float) -> torch.Tensor:
    """log_softmax(logits / T) at each completion token, from one unpadded forward pass."""
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
    logp = torch.log_softmax(logits / temperature, dim=-1)
    return logp.gather(-1, torch.tensor(completion)[:, None]).squeeze(-1)


def greedy_reference(model, prompt: list[int], steps: int) -> list[int]:
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(steps):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpts")
    return make_checkpoint(root / "a", seed=0), make_checkpoint(root / "b", seed=1)


@pytest.fixture(scope="module")
def engine(ckpts, tmp_path_factory):
    port = free_port()
    log = tmp_path_factory.mktemp("engine") / "engine.log"
    proc = start_engine(ckpts[0], port, log, "--max-batch", "32", "--weight-version", "0",
                        "--health-check-timeout", "2")
    yield f"http://127.0.0.1:{port}"
    stop_process(proc)


def run(coro):
    return asyncio.run(coro)


def test_sampler_left_padding_matches_unpadded_forward(ckpts):
    """In-process: rows of different lengths in one batch give the logprobs of a lone forward."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(str(ckpts[0])).eval()
    prompts = [[BOS_ID, 20, 21, 22, 23, 24, 25], [BOS_ID, 30], [BOS_ID, 40, 41]]
    params = [SamplingParams(max_new_tokens=9, temperature=1.3, ignore_eos=True),
              SamplingParams(max_new_tokens=4, temperature=0.7, top_p=0.8),
              SamplingParams(max_new_tokens=6, temperature=0.0)]
    outs = generate(model, prompts, params, pad_id=PAD_ID, eos_ids=[EOS_ID],
                    generator=torch.Generator().manual_seed(0))
    assert len(outs[0].token_ids) == 9 and outs[0].finish_reason == "length"
    for p, sp, o in zip(prompts, params, outs):
        assert 1 <= len(o.token_ids) <= sp.max_new_tokens
        ref = recompute_logprobs(model, p, o.token_ids, sp.temperature or 1.0)
        torch.testing.assert_close(torch.tensor(o.logprobs), ref, atol=1e-4, rtol=0)
    assert outs[2].token_ids == greedy_reference(model, prompts[2], len(outs[2].token_ids))


def test_rows_joining_a_running_batch_match_unpadded_forward(ckpts):
    """Continuous batching: rows added between decode steps (prompts longer, then shorter, than
    the batch's cache) get exactly the logprobs of a lone forward; greedy rows the argmax path."""
    model = AutoModelForCausalLM.from_pretrained(str(ckpts[0])).eval()
    batch = DecodeBatch(model, pad_id=PAD_ID, eos_ids=[EOS_ID], generator=torch.Generator().manual_seed(3))
    rows = {
        "a": ([BOS_ID, 20, 21, 22], SamplingParams(max_new_tokens=12, temperature=1.0, ignore_eos=True)),
        "b": ([BOS_ID, 30], SamplingParams(max_new_tokens=3, temperature=0.9, ignore_eos=True)),
        "c": ([BOS_ID] + list(range(40, 55)), SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True)),
        "d": ([BOS_ID, 60], SamplingParams(max_new_tokens=8, temperature=1.2, ignore_eos=True)),
        "e": ([BOS_ID, 70, 71], SamplingParams(max_new_tokens=1, temperature=1.0)),
        "f": ([BOS_ID, 80, 81], SamplingParams(max_new_tokens=5, temperature=1.0, ignore_eos=True)),
    }
    done = dict(batch.add([rows[k][0] for k in "ab"], [rows[k][1] for k in "ab"], ["a", "b"]))
    for _ in range(4):  # "b" finishes and leaves; "a" runs on
        done.update(batch.step())
    assert "b" in done and len(batch) == 1
    done.update(batch.add([rows[k][0] for k in "cde"], [rows[k][1] for k in "cde"], ["c", "d", "e"]))
    assert "e" in done  # max_new_tokens=1 finishes at prefill
    for _ in range(2):
        done.update(batch.step())
    done.update(batch.add([rows["f"][0]], [rows["f"][1]], ["f"]))  # shorter than the batch's cache
    while len(batch):
        done.update(batch.step())
    assert set(done) == set(rows)
    for key, (prompt, sp) in rows.items():
        out = done[key]
        assert len(out.token_ids) == sp.max_new_tokens or out.finish_reason == "stop"
        ref = recompute_logprobs(model, prompt, out.token_ids, sp.temperature or 1.0)
        torch.testing.assert_close(torch.tensor(out.logprobs), ref, atol=1e-4, rtol=0)
    assert done["c"].token_ids == greedy_reference(model, rows["c"][0], 6)


def test_batched_generate_logprobs_match_model(engine, ckpts):
    tok = load_tokenizer(ckpts[0])
    model = AutoModelForCausalLM.from_pretrained(str(ckpts[0])).eval()
    prompts = [[BOS_ID, 5, 6, 7, 8], [BOS_ID, 9], [BOS_ID, 50, 51, 52]]

    async def go():
        async with EngineClient(engine, timeout_s=60) as c:
            # One batch request (3 prompts x n=2) and four single requests, all at once.
            batch = c.generate(prompts, n=2, max_new_tokens=12, temperature=1.0)
            singles = [c.generate([BOS_ID, 60 + i], max_new_tokens=6, temperature=0.8) for i in range(4)]
            return await asyncio.gather(batch, *singles)

    batch, *singles = run(go())
    assert len(batch) == 6 and all(len(s) == 1 for s in singles)
    for k, out in enumerate(batch):
        prompt = prompts[k // 2]  # input-major order, like SGLang
        assert out.weight_version == 0
        assert 1 <= len(out.token_ids) <= 12 and len(out.logprobs) == len(out.token_ids)
        assert out.finish_reason == ("stop" if out.token_ids[-1] == EOS_ID else "length")
        assert out.text == tok.decode(out.token_ids, skip_special_tokens=True)
        ref = recompute_logprobs(model, prompt, out.token_ids, 1.0)
        torch.testing.assert_close(torch.tensor(out.logprobs), ref, atol=1e-4, rtol=0)
    for i, (out,) in enumerate(singles):
        ref = recompute_logprobs(model, [BOS_ID, 60 + i], out.token_ids, 0.8)
        torch.testing.assert_close(torch.tensor(out.logprobs), ref, atol=1e-4, rtol=0)

    info = httpx.get(f"{engine}/server_info").json()
    assert info["max_batch_seen"] > 1, info  # concurrent sequences ran together


def test_single_request_answers_an_object_and_text_input(engine):
    r = httpx.post(f"{engine}/generate", json={
        "text": "12+7=", "sampling_params": {"max_new_tokens": 3, "temperature": 0}, "return_logprob": True})
    assert r.status_code == 200
    body = r.json()
    assert isinstance(body, dict)
    meta = body["meta_info"]
    assert meta["prompt_tokens"] == 6  # <bos> + 5 characters
    assert [x[1] for x in meta["output_token_logprobs"]] == body["output_ids"]
    assert meta["weight_version"] == "0"


@pytest.mark.parametrize("body, field", [
    ({"input_ids": [1, VOCAB_SIZE + 5]}, "vocabulary"),
    ({"input_ids": [1, 2], "sampling_params": {"top_p": 0}}, "sampling_params.top_p"),
    ({"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 0}}, "sampling_params.max_new_tokens"),
    ({"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 100}}, "context length"),
    ({"input_ids": [[1, 2], [1]], "sampling_params": [{}]}, "sampling_params has 1 entries"),
    ({"sampling_params": {}}, "input_ids or text"),
    ({"input_ids": [1, 2], "sampling_params": {"temprature": 1}}, "temprature"),
])
def test_bad_generate_input_is_one_clear_400(engine, body, field):
    r = httpx.post(f"{engine}/generate", json=body)
    assert r.status_code == 400
    assert field in r.json()["error"]["message"]


def test_update_weights_outputs_follow_new_weights(engine, ckpts, tmp_path):
    model_b = AutoModelForCausalLM.from_pretrained(str(ckpts[1])).eval()
    model_a = AutoModelForCausalLM.from_pretrained(str(ckpts[0])).eval()
    prompt = [BOS_ID, 11, 12, 13]
    steps = 10

    async def greedy(c):
        (out,) = await c.generate(prompt, max_new_tokens=steps, temperature=0.0)
        return out

    async def go():
        async with EngineClient(engine, timeout_s=60, retries=0) as c:
            before = await greedy(c)
            ok, msg = await c.update_weights_from_disk(str(ckpts[1]), 1)
            after = await greedy(c)
            version = await c.weight_version()
            loads = httpx.get(f"{engine}/server_info").json()["weight_loads"]
            again = await c.update_weights_from_disk(str(ckpts[1]), 1)  # SGLang reloads every time
            loads_again = httpx.get(f"{engine}/server_info").json()["weight_loads"]
            bad = await c.update_weights_from_disk(str(tmp_path / "missing"), 2)
            after_bad = await greedy(c)
            version_after_bad = await c.weight_version()
            # Put A back (version 0 is forced by path change) for the other tests.
            restore = await c.update_weights_from_disk(str(ckpts[0]), 0)
            return before, ok, msg, after, version, loads, again, loads_again, bad, after_bad, version_after_bad, restore

    (before, ok, msg, after, version, loads, again, loads_again, bad, after_bad,
     version_after_bad, restore) = run(go())
    n_before, n_after = len(before.token_ids), len(after.token_ids)
    assert before.token_ids == greedy_reference(model_a, prompt, n_before)
    assert before.weight_version == 0
    assert ok, msg
    assert version == 1 and after.weight_version == 1
    assert after.token_ids == greedy_reference(model_b, prompt, n_after)
    torch.testing.assert_close(torch.tensor(after.logprobs),
                               recompute_logprobs(model_b, prompt, after.token_ids, 1.0), atol=1e-4, rtol=0)
    assert after.token_ids != before.token_ids  # the two random models disagree on this prompt
    assert again[0] and loads_again == loads + 1  # same version twice: loaded twice, as SGLang does
    assert bad[0] is False and "missing" in bad[1]
    assert version_after_bad == 1 and after_bad.token_ids == after.token_ids  # old weights still serve
    assert restore[0]


def test_pause_holds_requests_until_continue(engine):
    async def go():
        async with EngineClient(engine, timeout_s=60) as c:
            await c.pause_generation("retract")
            # As SGLang: generation waits while paused, so health answers 503 after its wait.
            assert not await c.health_generate(timeout_s=10)
            pending = asyncio.create_task(c.generate([BOS_ID, 7], max_new_tokens=3))
            await asyncio.sleep(1.0)
            held = not pending.done()
            await c.continue_generation()
            out = await asyncio.wait_for(pending, 30)
            return held, out

    held, out = run(go())
    assert held
    assert len(out) == 1 and out[0].token_ids


def test_client_gives_up_on_unreachable_engine():
    url = f"http://127.0.0.1:{free_port()}"

    async def go():
        async with EngineClient(url, timeout_s=2, retries=2, backoff_s=0.01) as c:
            return await c.generate([1, 2], max_new_tokens=2)

    with pytest.raises(EngineError, match=url):
        run(go())


def test_engine_cli_rejects_a_missing_model_dir(tmp_path):
    r = subprocess.run([sys.executable, "-m", "app.cli", "engine", "--model-path", str(tmp_path / "nope"),
                        "--port", str(free_port())], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode != 0
    assert "config.json" in r.stderr


def test_continuous_batching_with_deepseek_v3_mla_cache():
    """The cache merge/crop also holds for DeepSeek-V3's MLA attention (other key/value dims)."""
    from app.model.config import tiny_config

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("tiny-deepseek-v3")).eval()
    rows = {
        "a": ([BOS_ID, 20, 21, 22], SamplingParams(max_new_tokens=8, ignore_eos=True)),
        "b": ([BOS_ID] + list(range(40, 52)), SamplingParams(max_new_tokens=5, temperature=0.7, ignore_eos=True)),
        "c": ([BOS_ID, 5], SamplingParams(max_new_tokens=4, ignore_eos=True)),
    }
    batch = DecodeBatch(model, pad_id=PAD_ID, eos_ids=[EOS_ID], generator=torch.Generator().manual_seed(0))
    done = dict(batch.add([rows["a"][0]], [rows["a"][1]], ["a"]))
    done.update(batch.step())
    done.update(batch.add([rows["b"][0]], [rows["b"][1]], ["b"]))  # longer than the cache
    done.update(batch.step())
    done.update(batch.add([rows["c"][0]], [rows["c"][1]], ["c"]))  # shorter than the cache
    while len(batch):
        done.update(batch.step())
    for key, (prompt, sp) in rows.items():
        ref = recompute_logprobs(model, prompt, done[key].token_ids, sp.temperature)
        torch.testing.assert_close(torch.tensor(done[key].logprobs), ref, atol=1e-4, rtol=0)
