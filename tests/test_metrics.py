"""app/metrics.py: /metrics over real HTTP read back with prometheus_client's own text parser,
the metrics.jsonl follower, and the copy of a run's metrics to S3 (moto's server mode over HTTP)."""

from __future__ import annotations

import json
import threading
import time

import boto3
import pytest

from app.metrics import RunMetrics, follow, serve, upload_run_metrics
from app.storage import open_store
from helpers import scrape

RECORDS = [
    {"time": 1000.0, "step": 1, "policy_version": 1, "reward_mean": 0.25, "staleness_mean": 0.5, "staleness_max": 1,
     "samples_total": 64, "publish_s": 3.5,
     "buffer": {"queued": 40, "leased": 8, "ready": 3, "requeued": 2, "released": 1, "issued": 100}},
    {"time": 1004.0, "step": 2, "policy_version": 2, "reward_mean": 0.5, "staleness_mean": 1.25, "staleness_max": 2,
     "samples_total": 192, "publish_s": 0.0,
     "buffer": {"queued": 30, "leased": 16, "ready": 5, "requeued": 5, "released": 1, "issued": 140}},
]


@pytest.fixture
def served():
    metrics = RunMetrics("run-a")
    server = serve(metrics, 0, addr="127.0.0.1")
    yield metrics, server.server_port
    server.shutdown()


def test_metrics_endpoint_carries_the_metrics_jsonl_figures(served):
    metrics, port = served
    for r in RECORDS:
        metrics.observe_trainer_step(r)
    got = scrape(port)
    run = (("run_id", "run-a"),)
    assert got[("moerl_trainer_step", run)] == 2
    assert got[("moerl_policy_version", run)] == 2
    assert got[("moerl_reward_mean", run)] == 0.5
    assert got[("moerl_staleness", (("run_id", "run-a"), ("stat", "max")))] == 2
    assert got[("moerl_staleness", (("run_id", "run-a"), ("stat", "mean")))] == 1.25
    assert got[("moerl_trained_samples_total", run)] == 192
    assert got[("moerl_samples_per_second", run)] == pytest.approx((192 - 64) / 4.0)
    assert got[("moerl_weight_publish_seconds", run)] == 0.0
    assert got[("moerl_buffer_tasks", (("run_id", "run-a"), ("state", "queued")))] == 30
    assert got[("moerl_buffer_tasks", (("run_id", "run-a"), ("state", "leased")))] == 16
    assert got[("moerl_buffer_ready_groups", run)] == 5
    assert got[("moerl_buffer_events_total", (("event", "requeued"), ("run_id", "run-a")))] == 5
    assert got[("moerl_buffer_events_total", (("event", "released"), ("run_id", "run-a")))] == 1


def test_worker_counters_and_weight_update_histogram(served):
    metrics, port = served
    metrics.observe_worker_stats({"groups_published": 3, "weight_updates": 1, "tasks_released": 0})
    metrics.observe_worker_stats({"groups_published": 7, "weight_updates": 2, "tasks_released": 4})
    metrics.observe_weight_update(1.5)
    metrics.observe_weight_update(12.0)
    got = scrape(port)
    ev = lambda name: got[("moerl_rollout_events_total", (("event", name), ("run_id", "run-a")))]  # noqa: E731
    assert (ev("groups_published"), ev("weight_updates"), ev("tasks_released")) == (7, 2, 4)
    run = (("run_id", "run-a"),)
    assert got[("moerl_rollout_weight_update_seconds_count", run)] == 2
    assert got[("moerl_rollout_weight_update_seconds_sum", run)] == 13.5
    assert got[("moerl_rollout_weight_update_seconds_bucket", (("le", "2.0"), ("run_id", "run-a")))] == 1


def test_counters_never_go_down_after_a_restart(served):
    """A restarted worker reports totals from zero again; the counter keeps its value and grows."""
    metrics, port = served
    metrics.observe_worker_stats({"groups_published": 10})
    metrics.observe_worker_stats({"groups_published": 2})   # restarted process
    metrics.observe_worker_stats({"groups_published": 5})
    assert scrape(port)[("moerl_rollout_events_total", (("event", "groups_published"), ("run_id", "run-a")))] == 13


def test_follow_reads_appended_lines_and_waits_for_a_torn_one(tmp_path, served):
    metrics, port = served
    path = tmp_path / "metrics.jsonl"
    stop = threading.Event()
    thread = follow(path, metrics, stop, poll_s=0.02)
    try:
        with open(path, "w") as f:
            f.write(json.dumps(RECORDS[0]) + "\n")
            line = json.dumps(RECORDS[1])
            f.write(line[:20])  # torn: a writer mid-line
            f.flush()
            _wait(lambda: scrape(port).get(("moerl_trainer_step", (("run_id", "run-a"),))) == 1)
            time.sleep(0.1)
            assert scrape(port)[("moerl_trainer_step", (("run_id", "run-a"),))] == 1
            f.write(line[20:] + "\n")
            f.flush()
        _wait(lambda: scrape(port).get(("moerl_trainer_step", (("run_id", "run-a"),))) == 2)
    finally:
        stop.set()
        thread.join(5)
    assert not thread.is_alive()


def _wait(cond, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.02)


def test_upload_run_metrics_to_s3(moto_s3, tmp_path):
    s3 = boto3.client("s3", endpoint_url=moto_s3)
    bucket = "moerl-metrics-test"
    s3.create_bucket(Bucket=bucket, CreateBucketConfiguration={"LocationConstraint": "us-east-2"})
    run_dir = tmp_path / "run"
    (run_dir / "tensorboard" / "sub").mkdir(parents=True)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in RECORDS))
    (run_dir / "tensorboard" / "events.out.tfevents.1.host").write_bytes(b"\x00tb1")
    (run_dir / "tensorboard" / "sub" / "events.out.tfevents.2.host").write_bytes(b"\x00tb2")
    store = open_store(f"s3://{bucket}/runs", endpoint_url=moto_s3)
    keys = upload_run_metrics(run_dir, store, "run-a")
    assert keys == ["run-a/metrics/metrics.jsonl", "run-a/tensorboard/events.out.tfevents.1.host",
                    "run-a/tensorboard/sub/events.out.tfevents.2.host"]
    got = s3.get_object(Bucket=bucket, Key="runs/run-a/metrics/metrics.jsonl")["Body"].read().decode()
    assert [json.loads(x)["step"] for x in got.splitlines()] == [1, 2]
    assert s3.get_object(Bucket=bucket, Key="runs/run-a/tensorboard/sub/events.out.tfevents.2.host")["Body"].read() == b"\x00tb2"
    # A later copy replaces the snapshot with the longer file.
    with open(run_dir / "metrics.jsonl", "a") as f:
        f.write(json.dumps({**RECORDS[1], "step": 3}) + "\n")
    upload_run_metrics(run_dir, store, "run-a")
    got = s3.get_object(Bucket=bucket, Key="runs/run-a/metrics/metrics.jsonl")["Body"].read().decode()
    assert [json.loads(x)["step"] for x in got.splitlines()] == [1, 2, 3]


def test_upload_bad_input(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        upload_run_metrics(tmp_path / "missing", f"file://{tmp_path}/store", "run-a")
    with pytest.raises(ValueError, match="run_id"):
        upload_run_metrics(tmp_path, f"file://{tmp_path}/store", "a/b")
