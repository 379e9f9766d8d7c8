"""`moerl reward`: batching of concurrent requests (same rewards as one at a time), clear 4xx
errors on malformed requests, the verifier mode, the workers' RemoteReward, and the reward model
made from the task's labelled examples."""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import torch

from app.config import RunConfig

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def rm_dir(tmp_path_factory) -> Path:
    """A tiny random Qwen3-MoE sequence-classification checkpoint (one label) with our tokenizer."""
    from transformers import Qwen3MoeForSequenceClassification

    from app.model.tokenizer import PAD_ID, save_tokenizer
    from app.model.config import tiny_config

    out = tmp_path_factory.mktemp("rm")
    config = tiny_config("tiny-qwen3-moe", num_labels=1, pad_token_id=PAD_ID)
    config.architectures = ["Qwen3MoeForSequenceClassification"]
    torch.manual_seed(0)
    model = Qwen3MoeForSequenceClassification(config)
    torch.nn.init.normal_(model.score.weight, std=1.0)  # rewards that differ between sequences
    model.save_pretrained(out)
    save_tokenizer(out)
    return out


@pytest.fixture(scope="module")
def scorer(rm_dir):
    from app.envs.reward_server import ModelScorer

    return ModelScorer(rm_dir, max_length=32)


def client_for(app) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://rm")


def test_concurrent_requests_are_batched_and_match_single_scoring(scorer):
    from app.envs.reward_server import make_app

    seqs = [[1] + list(range(10, 10 + n)) for n in (1, 5, 2, 9, 3, 7, 4, 6)]  # different lengths
    alone = [scorer([s])[0] for s in seqs]  # unpadded, one at a time
    assert len(set(round(x, 5) for x in alone)) > 1
    app = make_app(scorer, max_batch=64, max_wait_ms=300)

    async def go():
        async with client_for(app) as c:
            rs = await asyncio.gather(*(c.post("/score", json={"input_ids": [s]}) for s in seqs))
            return rs, (await c.get("/stats")).json()

    responses, stats = asyncio.run(go())
    assert all(r.status_code == 200 for r in responses), [r.text for r in responses]
    got = [r.json()["rewards"][0] for r in responses]
    assert got == pytest.approx(alone, abs=1e-5)  # right padding does not change a reward
    assert stats["requests"] == 8 and stats["sequences"] == 8
    assert stats["batches"] < 8 and stats["largest_batch"] > 1, stats


def test_large_request_is_split_into_max_batch_chunks(scorer):
    from app.envs.reward_server import make_app

    seqs = [[1, 10 + i, 20 + i] for i in range(5)]
    app = make_app(scorer, max_batch=2, max_wait_ms=0)

    async def go():
        async with client_for(app) as c:
            r = await c.post("/score", json={"input_ids": seqs})
            return r, (await c.get("/stats")).json()

    r, stats = asyncio.run(go())
    assert r.status_code == 200 and len(r.json()["rewards"]) == 5
    assert r.json()["rewards"] == pytest.approx([scorer([s])[0] for s in seqs], abs=1e-5)
    assert stats["batches"] == 3 and stats["largest_batch"] == 2


def test_text_and_token_ids_give_the_same_reward(scorer):
    from app.envs.reward_server import make_app
    from app.model.tokenizer import build_tokenizer

    ids = build_tokenizer()("hello=olleh")["input_ids"]
    app = make_app(scorer, max_wait_ms=0)

    async def go():
        async with client_for(app) as c:
            a = await c.post("/score", json={"text": ["hello=olleh"]})
            b = await c.post("/score", json={"input_ids": [ids]})
            h = await c.get("/health")
            return a, b, h

    a, b, h = asyncio.run(go())
    assert a.json()["rewards"] == pytest.approx(b.json()["rewards"])
    assert h.json()["mode"] == "model"


@pytest.mark.parametrize("body,status,needle", [
    (b"not json", 422, "JSON"),
    ({}, 422, "exactly one of input_ids or text"),
    ({"input_ids": [[1, 5]], "text": ["a"]}, 422, "exactly one"),
    ({"input_ids": []}, 422, "input_ids"),
    ({"input_ids": [[1, "x"]]}, 422, "input_ids.0.1"),
    ({"input_ids": [[1, 5]], "extra": 1}, 422, "extra"),
    ({"input_ids": [[1, 5000]]}, 400, "input_ids[0]: token id 5000 outside the vocabulary"),
    ({"input_ids": [[1, -1]]}, 400, "outside the vocabulary"),
    ({"input_ids": [[1, 5], []]}, 400, "input_ids[1]: empty sequence"),
    ({"input_ids": [[1] + [5] * 40]}, 400, "> max length 32"),
    ({"input_ids": [[1, 0, 5]]}, 400, "pad id"),
    ({"text": ["a"], "answer": ["{}"]}, 400, "answer"),
])
def test_malformed_requests_get_a_clear_4xx(scorer, body, status, needle):
    from app.envs.reward_server import make_app

    app = make_app(scorer, max_wait_ms=0)

    async def go():
        async with client_for(app) as c:
            if isinstance(body, bytes):
                return await c.post("/score", content=body, headers={"content-type": "application/json"})
            return await c.post("/score", json=body)

    r = asyncio.run(go())
    assert r.status_code == status, r.text
    assert needle in r.json()["error"], r.json()


def test_verifier_mode_needs_answers():
    from app.envs.reward_server import VerifierScorer, make_app
    from app.envs.tasks import make_splits

    cfg = RunConfig.model_validate({"task": {"train_size": 5, "eval_size": 2}})
    train, _ = make_splits(cfg.task)
    p = train[0]
    app = make_app(VerifierScorer(), max_wait_ms=0)

    async def go():
        async with client_for(app) as c:
            good = await c.post("/score", json={"text": [p.answer, "zzz"], "answer": [p.spec, p.spec]})
            bad = await c.post("/score", json={"text": [p.answer]})
            ids = await c.post("/score", json={"input_ids": [[1, 5]], "answer": [p.spec]})
            notjson = await c.post("/score", json={"text": ["a", "b"], "answer": [p.spec, "not json"]})
            source = await c.post("/score", json={"text": ["a"], "answer": ['{"source": "nope"}']})
            return good, bad, ids, notjson, source

    good, bad, ids, notjson, source = asyncio.run(go())
    assert notjson.status_code == 400 and "answer[1]: not a JSON answer spec" in notjson.json()["error"]
    assert source.status_code == 400 and "answer[0]: 'source'" in source.json()["error"]
    assert good.status_code == 200 and good.json()["rewards"][0] == 1.0 and good.json()["rewards"][1] < 1.0
    assert bad.status_code == 400 and "one answer per text" in bad.json()["error"]
    assert ids.status_code == 400 and "scores text" in ids.json()["error"]


# ------------------------------------------------------------------------------------------
# The served process, as the charts start it, and the rollout workers' reward function


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_moerl_reward_serves_the_config_model_to_remote_reward(tmp_path, rm_dir, scorer):
    from app.buffer.records import Task
    from app.envs.reward_model import RemoteReward
    from app.rollout.scoring import score_fn_for

    port = free_port()
    cfg = RunConfig.model_validate({"task": {"reward_model": str(rm_dir)},
                                    "rollout": {"reward_url": f"http://127.0.0.1:{port}"}})
    cfg.save(tmp_path / "run.yaml")
    proc = subprocess.Popen(
        [sys.executable, "-m", "app.cli", "reward", "--config", str(tmp_path / "run.yaml"),
         "--host", "127.0.0.1", "--port", str(port), "--threads", "1", "--max-length", "32"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, proc.stdout.read()
            try:
                if httpx.get(f"{cfg.rollout.reward_url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "reward server did not come up"
            time.sleep(0.3)
        fn = score_fn_for(cfg)
        assert isinstance(fn, RemoteReward)
        task = Task(task_id="t", prompt_ids=[1], prompt="hello=", answer="{}", group_size=1)
        ids = scorer.tokenizer("hello=olleh")["input_ids"]
        assert fn(task, "olleh") == pytest.approx(scorer([ids])[0], abs=1e-5)
        fn.close()
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_mode_picks_or_refuses_the_scorer(rm_dir):
    from app.envs.reward_server import ModelScorer, VerifierScorer, make_scorer

    with_rm = RunConfig.model_validate({"task": {"reward_model": str(rm_dir)}})
    assert isinstance(make_scorer(with_rm), ModelScorer)
    assert isinstance(make_scorer(with_rm, mode="verifier"), VerifierScorer)
    assert isinstance(make_scorer(RunConfig()), VerifierScorer)
    with pytest.raises(ValueError, match="names no task.reward_model"):
        make_scorer(RunConfig(), mode="model")
    with pytest.raises(ValueError, match="--mode"):
        make_scorer(RunConfig(), mode="gpu")


def test_score_fn_for_uses_the_verifier_without_a_reward_model():
    from app.rollout.scoring import score_fn_for
    from app.envs.rewards import score

    assert score_fn_for(RunConfig()) is score


def test_bad_reward_model_path_is_one_clear_error(tmp_path):
    cfg = RunConfig.model_validate({"task": {"reward_model": str(tmp_path / "nope")}})
    cfg.save(tmp_path / "run.yaml")
    proc = subprocess.run([sys.executable, "-m", "app.cli", "reward", "--config", str(tmp_path / "run.yaml")],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "task.reward_model" in proc.stderr and "no config.json" in proc.stderr
    assert "Traceback" not in proc.stderr


# ------------------------------------------------------------------------------------------
# A reward model from the task's labelled examples


def test_labelled_examples_are_scored_by_the_verifier():
    from app.envs.reward_model import labelled_examples
    from app.envs.tasks import make_splits

    cfg = RunConfig.model_validate({"task": {"train_size": 20, "eval_size": 2}})
    train, _ = make_splits(cfg.task)
    ex = labelled_examples(train, per_prompt=3, seed=0)
    assert len(ex) == 4 * len(train)
    assert all(ex[4 * i] == (p.text + p.answer, 1.0) for i, p in enumerate(train))
    corrupted = [y for k, (_, y) in enumerate(ex) if k % 4]
    assert min(corrupted) < 1.0 and 0 <= min(corrupted) and max(corrupted) <= 1.0
    assert len(set(corrupted)) > 3  # dense labels, not just 0/1


@pytest.mark.slow
def test_fitted_reward_model_ranks_reference_answers_first(tmp_path):
    """A short fit from a briefly warmed-up policy, checked on held-out prompts: its MSE beats
    the best constant predictor (the labels' variance) and the untrained head by far, and the
    reference answer outscores its corruptions clearly more often than before the fit."""
    from app.envs.reward_model import fit_reward_model
    from app.envs.warmup import run_warmup

    cfg = RunConfig.model_validate({"task": {"train_size": 1500, "eval_size": 40, "warmup_steps": 60}})
    run_warmup(cfg, tmp_path / "base", log=lambda *_: None)
    summary = fit_reward_model(cfg, tmp_path / "base", tmp_path / "rm", steps=200, log=None)
    before, after = summary["heldout_before"], summary["heldout"]
    assert after["mse"] < 0.85 * after["label_var"] and after["mse"] < 0.3 * before["mse"], summary
    assert after["ranking_accuracy"] > max(0.65, before["ranking_accuracy"] + 0.15), summary
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(tmp_path / "rm")
    assert model.config.num_labels == 1 and model.config.pad_token_id == 0
    assert json.loads((tmp_path / "rm" / "reward_model.json").read_text())["steps"] == 200
    with pytest.raises(FileExistsError):
        fit_reward_model(cfg, tmp_path / "base", tmp_path / "rm", steps=1, log=None)
