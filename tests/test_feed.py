"""The prompt source and held-out evaluator (app/feed.py) against a real redis-server, a file
store, and (for the evaluation) the built-in engine as a process.

- a feeder killed and started again queues every task id at most once and refills exactly
  what is missing; epochs get new ids;
- `run_feed` waits for v0, keeps the queue topped up, and stops on the trainer's done marker;
- a JSONL task given as an s3:// URL is read through app.storage (moto);
- held-out evaluation through `moerl engine`: the version is loaded into the engine and the
  record names the version the engine reports; each version is measured once.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from app.buffer import ExperienceBuffer
from app.buffer.records import Task
from app.config import RunConfig
from app.feed import TaskFeeder, resolve_task, run_feed
from app.ledger import read_issued
from app.storage import mark_done, open_store, read_done


def _tasks(n: int) -> list[Task]:
    return [Task(task_id=f"train-{i:06d}", prompt_ids=[1, 5 + i], prompt=f"p{i}=", answer="{}", group_size=2)
            for i in range(n)]


def _stream_ids(buf: ExperienceBuffer) -> list[str]:
    return [json.loads(f["task"])["task_id"] for _, f in buf.r.xrange(buf.keys["tasks"])]


def test_restarted_feeder_queues_nothing_twice_and_refills_what_is_missing(redis_server, tmp_path):
    open_buf = lambda: ExperienceBuffer(redis_server, "feedtest")  # noqa: E731
    ledger = tmp_path / "issued.jsonl"
    first = TaskFeeder(_tasks(10), open_buf, low_water=4, ledger=ledger)
    assert first.top_up() == 8
    assert first.top_up() == 0  # 8 wait: nothing to add
    with open_buf() as buf:
        leased = buf.lease("w0", count=6)  # 2 left waiting, below low water
        assert len(leased) == 6
        first.close()  # the feeder's pod is killed here; a new one starts from scratch
        second = TaskFeeder(_tasks(10), open_buf, low_water=4, ledger=ledger)
        assert second.top_up() == 6  # walks past the 8 queued ids, adds the 6 missing
        ids = _stream_ids(buf)
        assert len(ids) == len(set(ids)) == 14
        # epoch 0 has 10 tasks: the 11th to 14th are epoch 1's first four
        assert sorted(i for i in ids if i.startswith("e1-")) == [f"e1-train-{i:06d}" for i in range(4)]
        assert buf.stats()["queued"] == 8
    assert read_issued(ledger) == set(ids)  # the ledger holds every queued id (and no other)
    second.close()


def _fake_version(tmp_path: Path) -> Path:
    """A directory publish_policy accepts: config, one tensor file, the character tokenizer."""
    from safetensors.torch import save_file
    import torch

    from app.model.tokenizer import save_tokenizer

    d = tmp_path / "fake-policy"
    d.mkdir()
    (d / "config.json").write_text("{}")
    save_file({"w": torch.zeros(1)}, str(d / "model.safetensors"))
    save_tokenizer(d)
    return d


def test_run_feed_waits_for_v0_feeds_and_stops_on_the_done_marker(redis_server, tmp_path):
    from app.storage.policy import publish_policy

    cfg = RunConfig(run_id="feedrun", store_url=f"file://{tmp_path / 'store'}")
    cfg.buffer.redis_url = redis_server
    cfg.task.train_size, cfg.task.eval_size = 30, 5
    cfg.trainer.groups_per_step = 2  # low water 8
    cfg.feed.poll_s = 0.1
    store = open_store(cfg.store_url)
    result: dict = {}
    thread = threading.Thread(target=lambda: result.update(run_feed(cfg, tmp_path / "feed")), daemon=True)
    thread.start()
    time.sleep(1.0)
    with ExperienceBuffer.from_config(cfg) as buf:
        assert buf.stats()["issued"] == 0  # no policy yet: no tokenizer, nothing queued
        publish_policy(store, cfg.run_id, 0, _fake_version(tmp_path))
        deadline = time.monotonic() + 60
        while buf.stats()["queued"] < 16 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert buf.stats()["queued"] == 16
        buf.lease("w0", count=10)
        while buf.stats()["queued"] < 16 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert buf.stats()["queued"] == 16  # topped up again
        assert thread.is_alive()
        mark_done(store, cfg.run_id, step=3, policy_version=3)
        thread.join(timeout=30)
        assert not thread.is_alive(), "the feeder did not stop on the trainer's done marker"
        assert result["done"] is True and result["queued"] == 26
        assert buf.stats()["issued"] == 26
    assert read_done(store, cfg.run_id)["policy_version"] == 3


def test_done_marker_rejects_a_foreign_object(tmp_path):
    store = open_store(f"file://{tmp_path}")
    assert read_done(store, "r1") is None
    store.put_bytes("r1/trainer/done.json", b"not json")
    with pytest.raises(ValueError, match="r1/trainer/done.json"):
        read_done(store, "r1")


def test_jsonl_task_from_s3_is_read_through_the_store(moto_s3, tmp_path, monkeypatch):
    import boto3

    from app.envs.tasks import make_splits

    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", moto_s3)
    boto3.client("s3", endpoint_url=moto_s3).create_bucket(Bucket="feed-jsonl")
    rows = "".join(json.dumps({"prompt": f"{i}+{i}=", "answer": str(2 * i)}) + "\n" for i in range(12))
    store = open_store("s3://feed-jsonl/runs")
    store.put_bytes("datasets/sums.jsonl", rows.encode())
    task = RunConfig().task.model_copy(update={"source": "jsonl", "jsonl_path": "s3://feed-jsonl/runs/datasets/sums.jsonl",
                                               "eval_size": 2, "train_size": 10})
    local = resolve_task(task, tmp_path)
    assert Path(local.jsonl_path).is_file() and local.jsonl_path.startswith(str(tmp_path))
    train, heldout = make_splits(local)
    assert (len(train), len(heldout)) == (10, 2)
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        resolve_task(task.model_copy(update={"jsonl_path": "s3://feed-jsonl/runs/nope.jsonl"}), tmp_path)


@pytest.mark.slow
def test_held_out_evaluation_through_the_builtin_engine(tmp_path):
    """The measured version is loaded into the engine first (v2 while the engine started on
    the base weights as v0), and the record carries the version the engine reports."""
    import asyncio

    from app.buffer.redis_server import free_port
    from app.local.chaos import make_base_policy
    from app.envs.tasks import make_splits
    from app.feed import HeldOutEval
    from app.storage.policy import publish_policy

    cfg = RunConfig(run_id="evalrun", store_url=f"file://{tmp_path / 'store'}")
    cfg.task.train_size, cfg.task.eval_size = 20, 6
    cfg.rollout.max_new_tokens = 4
    cfg.feed.eval_every, cfg.feed.eval_samples = 2, 2
    base = make_base_policy(cfg, tmp_path / "base")
    store = open_store(cfg.store_url)
    publish_policy(store, cfg.run_id, 0, base)
    publish_policy(store, cfg.run_id, 2, base)
    port = free_port()
    engine = subprocess.Popen([sys.executable, "-m", "app.cli", "engine", "--model-path", str(base),
                               "--port", str(port), "--threads", "1"], stdout=subprocess.DEVNULL,
                              stderr=subprocess.STDOUT)
    try:
        from app.rollout.engine_client import wait_until_healthy

        url = f"http://127.0.0.1:{port}"
        wait_until_healthy(url, timeout_s=120)
        _, heldout = make_splits(cfg.task)
        ev = HeldOutEval(cfg, heldout, url, store, tmp_path / "cache", tmp_path / "heldout.jsonl")
        assert ev.due(0) and ev.due(1) and ev.engine_ready()  # nothing measured yet: the first is due
        rec = asyncio.run(ev.measure(2))
        assert rec["version"] == 2 and rec["engine_version"] == 2
        assert rec["n"] == 6 and rec["samples"] == 2
        assert 0.0 <= rec["mean_reward"] <= 1.0 and 0.0 <= rec["greedy"] <= 1.0
        assert not ev.due(2, final=True)  # measured once
        assert not ev.due(3) and ev.due(4) and ev.due(3, final=True)  # every 2 versions after v2
        lines = [json.loads(x) for x in (tmp_path / "heldout.jsonl").read_text().splitlines()]
        assert [x["version"] for x in lines] == [2]
        # v2 turns out to be the trainer's last (measured before the done marker was read):
        # the same figures again, marked final, once; an unmeasured version writes nothing.
        ev.mark_final(3)
        ev.mark_final(2)
        ev.mark_final(2)
        lines = [json.loads(x) for x in (tmp_path / "heldout.jsonl").read_text().splitlines()]
        assert [(x["version"], x["final"]) for x in lines] == [(2, False), (2, True)]
        assert lines[1]["mean_reward"] == rec["mean_reward"] and ev.measured == {2}
    finally:
        engine.terminate()
        engine.wait(timeout=30)
