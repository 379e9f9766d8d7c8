"""How a step's batch reaches the trainer's ranks (app/trainer/intake.py), against a real
redis-server: a malformed payload is dead-lettered and the step goes on, on one rank and on two
(the ranks agree); the next step's groups are taken during the step, for the version it will
train at, and stay in Redis until the save that covers them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch.distributed as dist

from app.buffer import ExperienceBuffer, Sample, Task
from app.config import RunConfig
from helpers import fake_producer, single_rank_env

ROOT = Path(__file__).resolve().parents[1]
RUN = "intake"


def publish(buf: ExperienceBuffer, task_id: str, version: int, g: int = 2) -> None:
    buf.put_tasks([Task(task_id, [1, 2, 3], "p", "{}", g)])
    (task,) = [t for t in buf.lease("w", count=10, block_ms=0) if t.task_id == task_id]
    assert buf.publish(task, [Sample(task.sample_id(buf.run_id, i), task_id, i, 0, [1, 2, 3], [4 + i, 5], [-1.0, -2.0],
                                     float(i % 2), version, "stop") for i in range(g)])


def corrupt_newest_payload(buf: ExperienceBuffer) -> str:
    """Overwrite the payload of the newest samples entry with bytes that are not one."""
    ((entry, fields),) = buf.r.xrevrange(buf.keys["samples"], count=1)
    buf.raw.set(fields["blob"], b"\x00" * 64)
    return entry


@pytest.fixture
def one_rank(monkeypatch):
    from app.trainer.parallel import init_distributed

    single_rank_env(monkeypatch)
    init_distributed(timeout_s=60)
    yield
    dist.destroy_process_group()


def make_intake(url: str, **trainer):
    from app.trainer.intake import BatchIntake

    cfg = RunConfig.model_validate({"run_id": RUN, "buffer": {"redis_url": url, "max_staleness": 1},
                                    "rollout": {"group_size": 2},
                                    "trainer": {"groups_per_step": 2, "batch_timeout_s": 20, **trainer}})
    buf = ExperienceBuffer.from_config(cfg, autocommit=False)
    return BatchIntake(cfg, buf, rank=0, world=1, pad_id=0, moe_layers=None, num_experts=8), buf


def test_a_malformed_payload_is_dead_lettered_and_the_step_goes_on(redis_server, one_rank):
    """A good header over a payload that is not one (written by whoever can write to Redis): the
    rank that reads it reports it, rank 0 dead-letters it and counts it malformed, and the step
    trains the group beside it instead of raising on every take."""
    from app.trainer.state import TrainState

    intake, buf = make_intake(redis_server, steps=1)
    publish(buf, "bad", version=0)
    bad_entry = corrupt_newest_payload(buf)
    publish(buf, "good", version=0)
    state = TrainState()
    batch = intake.next(state, set(), lambda: False)
    intake.close()
    assert [h.task_id for h in batch.groups] == ["good"]
    assert batch.train.input_ids.shape[0] == 2 and batch.train.sample_ids == [f"{RUN}/good/0/0", f"{RUN}/good/1/0"]
    assert batch.skipped == [["bad", 0, "malformed"]] and state.malformed == 1
    assert batch.meta["groups"] == 1 and batch.meta["samples"] == 2
    assert buf.stats()["dead_lettered"] == 1
    (dead,) = buf.dead_letters()
    assert dead["entry"] == bad_entry and "safetensors" in dead["reason"]
    assert buf.commit(upto=batch.commit_point) == 1  # the good one; the bad one left with its dead letter


def test_the_next_batch_is_taken_during_the_step_and_committed_only_after_its_own_save(redis_server, one_rank):
    """Step 1 trains at v1 and publishes (publish_every 1), so step 2 trains at v2: its groups are
    taken while step 1 runs and checked against v2 (a v0 group is stale there, though not at v1).
    The save after step 1 commits step 1's groups only; a trainer killed during step 2 reads the
    prefetched ones again."""
    from app.trainer.state import TrainState

    intake, buf = make_intake(redis_server, steps=3, publish_every=1)
    publish(buf, "s1-a", version=1)
    publish(buf, "s1-b", version=0)  # staleness 1 at v1: trained in step 1
    state = TrainState(version=1)
    first = intake.next(state, set(), lambda: False)
    assert [h.task_id for h in first.groups] == ["s1-a", "s1-b"]
    publish(buf, "s2-stale", version=0)  # 2 - 0 > max_staleness at step 2
    publish(buf, "s2-a", version=1)
    publish(buf, "s2-b", version=2)
    # the loop: train step 1, publish v2, save, commit what step 1 took
    state.step, state.version = 1, 2
    assert buf.commit(upto=first.commit_point) == 2
    second = intake.next(state, {"s1-a/0", "s1-b/0"}, lambda: False)
    assert [h.task_id for h in second.groups] == ["s2-a", "s2-b"]
    assert buf.stats()["dropped_stale"] == 1
    intake.close()
    # killed before the save after step 2: a new trainer reads step 2's groups again
    again = ExperienceBuffer(redis_server, RUN, autocommit=False)
    assert [h.task_id for h in again.take_headers(4, trainer_version=2, timeout_s=0.2)] == ["s2-a", "s2-b"]


def test_the_next_batch_skips_a_republished_copy_of_the_batch_in_flight(redis_server, one_rank):
    """A group of the batch in flight published again (after a Redis failure lost the seen set)
    is a duplicate for the prefetch, though the lineage has not recorded it as trained yet."""
    from app.trainer.state import TrainState

    intake, buf = make_intake(redis_server, steps=3, publish_every=5)
    publish(buf, "a", version=0)
    publish(buf, "b", version=0)
    state = TrainState()
    first = intake.next(state, set(), lambda: False)
    buf.r.delete(buf.keys["seen"], buf.keys["issued"])  # Redis lost them
    publish(buf, "a", version=0)
    publish(buf, "c", version=0)
    publish(buf, "d", version=0)
    state.step = 1
    second = intake.next(state, set(), lambda: False)  # "a/0" not yet in the lineage's set
    intake.close()
    assert [h.task_id for h in first.groups] == ["a", "b"]
    assert [h.task_id for h in second.groups] == ["c", "d"]
    assert second.skipped == [["a", 0, "duplicate"]] and state.duplicates == 1


@pytest.mark.slow
def test_two_ranks_agree_on_a_malformed_payload_and_train_on(tmp_path, redis_server):
    """Two trainer ranks each read their own groups; the first step's first group has a payload
    that is not one. Whichever rank it was assigned to reports it, both drop it, rank 0
    dead-letters it, and the run trains its steps; the lineage never holds the bad group."""
    run_id = "intake-2r"
    cfg = RunConfig.model_validate({
        "run_id": run_id, "store_url": f"file://{tmp_path}/store", "model": {"preset": "tiny-qwen3-moe"},
        "buffer": {"redis_url": redis_server, "max_staleness": 1}, "rollout": {"group_size": 4},
        "trainer": {"parallel": {"ep": 2}, "steps": 2, "groups_per_step": 2, "lr": 1e-3, "batch_timeout_s": 120},
    })
    cfg.save(tmp_path / "run.yaml")
    buf = ExperienceBuffer(redis_server, run_id)
    publish(buf, "bad", version=0, g=4)
    corrupt_newest_payload(buf)
    stop = threading.Event()
    producer = threading.Thread(target=fake_producer, args=(redis_server, run_id, stop, 4), daemon=True)
    producer.start()
    from app.buffer.redis_server import free_port

    try:
        proc = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
             "--master-port", str(free_port()), "-m", "app.cli", "train", "--config", str(tmp_path / "run.yaml"),
             "--run-dir", str(tmp_path / "run")],
            cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=300)
    finally:
        stop.set()
        producer.join(timeout=10)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == [1, 2]
    assert lines[0]["malformed_groups"] == 1 and lines[0]["groups"] == 1 and lines[1]["groups"] == 2
    assert lines[-1]["buffer"]["dead_lettered"] == 1
    trained = [json.loads(x) for x in (tmp_path / "run" / "trained.jsonl").read_text().splitlines()]
    assert ["bad", 0, "malformed"] in trained[0]["skipped"]
    assert all(g["task_id"] != "bad" for r in trained for g in r["groups"])


def test_a_prefetch_times_out_from_when_the_loop_waits_not_from_the_step_start(redis_server, one_rank):
    """trainer.batch_timeout_s bounds the loop's wait: a prefetch that began with the step has
    as long again once the step is over, and then fails like a plain take (one clear error)."""
    import time

    from app.trainer.state import TrainState

    intake, buf = make_intake(redis_server, steps=3, batch_timeout_s=1.5)
    publish(buf, "a", version=0)
    publish(buf, "b", version=0)
    state = TrainState()
    intake.next(state, set(), lambda: False)  # the prefetch of step 2 starts here
    time.sleep(2.0)  # a step longer than the timeout
    publish(buf, "c", version=0)
    publish(buf, "d", version=0)
    state.step = 1
    second = intake.next(state, {"a/0", "b/0"}, lambda: False)
    assert [h.task_id for h in second.groups] == ["c", "d"] and second.wait_s < 1.5
    state.step = 2
    with pytest.raises(Exception, match="fewer than 2 GRPO groups arrived within trainer.batch_timeout_s=1.5s"):
        intake.next(state, {"a/0", "b/0", "c/0", "d/0"}, lambda: False)
    intake.close()
