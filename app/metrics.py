"""Prometheus metrics of a moerl run, and the copy of a run's metrics to its object-store prefix.

The figures are the ones the trainer already writes to ``metrics.jsonl`` (one JSON object per
step: step, policy_version, reward_mean, staleness_mean/max, samples_total, publish_s, and the
buffer's counters under ``buffer``) and the rollout worker's counters (app.rollout.worker
WorkerStats). `RunMetrics` holds them in a prometheus_client registry of its own; `serve` puts
that registry on ``http://<addr>:<port>/metrics`` (Prometheus text exposition format 0.0.4, the
format prometheus_client's own parser reads); `follow` feeds a registry from a growing
metrics.jsonl, so a process can export the trainer's figures without touching the training loop.
charts8s/monitoring.py points PodMonitors at these ports.

`upload_run_metrics` copies ``metrics.jsonl`` and ``tensorboard/`` of a run directory under the
run's prefix of the object store (``<run_id>/metrics/metrics.jsonl`` and
``<run_id>/tensorboard/...``, the app.storage layout), so they outlive the pod.

Metric names follow the Prometheus naming guide (base units, ``_total`` for counters).
"""

from __future__ import annotations

import json
import math
import threading
from pathlib import Path

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from app.storage import ObjectStore, open_store
from app.storage.store import run_area

# Buffer counters (app.buffer.experience STAT_NAMES) exported as Prometheus counters.
BUFFER_COUNTERS = ("issued", "finished", "taken", "consumed", "dropped_stale", "requeued", "duplicates", "released",
                   "failed_requeued", "failed_dropped", "dead_lettered")
# Rollout worker counters (app.rollout.worker.WorkerStats fields) exported as counters.
WORKER_COUNTERS = ("groups_published", "samples_published", "duplicate_groups", "tasks_leased", "tasks_released",
                   "engine_errors", "rejected_tasks", "reward_errors", "reward_timeouts", "groups_failed",
                   "tasks_dropped", "weight_updates", "weight_update_failures", "buffer_errors")
# Seconds; a weight update is a disk load of a whole policy version on the engine.
WEIGHT_UPDATE_BUCKETS = (0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300, 600)


class RunMetrics:
    """The Prometheus metrics of one process (trainer rank 0 or a rollout worker; the buffer pod's
    Redis figures come from its redis_exporter sidecar, charts8s/buffer.py).

    Attributes: registry (prometheus_client.CollectorRegistry). Every metric carries the
    ``run_id`` label. Counters are fed from running totals (metrics.jsonl, WorkerStats): each
    observe call adds the increase since the previous one, so a restarted process that starts
    its totals from zero again never makes a counter go down.
    """

    def __init__(self, run_id: str):
        self.run_id = run_id
        self.registry = CollectorRegistry()
        r, lab = self.registry, ["run_id"]
        self.step = Gauge("moerl_trainer_step", "Trainer steps completed.", lab, registry=r)
        self.policy_version = Gauge("moerl_policy_version", "Newest published policy version.", lab, registry=r)
        self.reward_mean = Gauge("moerl_reward_mean", "Mean reward of the last step's samples.", lab, registry=r)
        self.staleness = Gauge("moerl_staleness", "Staleness (trainer version minus sample version) of the "
                               "last step's samples.", [*lab, "stat"], registry=r)
        self.samples_per_second = Gauge("moerl_samples_per_second", "Trained samples per second between the "
                                        "last two steps.", lab, registry=r)
        self.samples = Counter("moerl_trained_samples", "Samples trained.", lab, registry=r)
        self.publish_seconds = Gauge("moerl_weight_publish_seconds", "Seconds the trainer spent publishing the "
                                     "last policy version (0 on steps without a publish).", lab, registry=r)
        self.buffer_tasks = Gauge("moerl_buffer_tasks", "Tasks in the buffer's queue, by state (queued, leased).",
                                  [*lab, "state"], registry=r)
        self.buffer_ready = Gauge("moerl_buffer_ready_groups", "Finished groups waiting for the trainer.", lab,
                                  registry=r)
        self.buffer_events = Counter("moerl_buffer_events", "Buffer counters (requeued: stale tasks queued again; "
                                     "released: leases returned by draining workers).", [*lab, "event"], registry=r)
        self.worker_events = Counter("moerl_rollout_events", "Rollout worker counters.", [*lab, "event"], registry=r)
        self.weight_update_seconds = Histogram("moerl_rollout_weight_update_seconds", "Seconds an engine took to "
                                               "load a new policy version.", lab, buckets=WEIGHT_UPDATE_BUCKETS,
                                               registry=r)
        self._totals: dict[tuple[int, str], float] = {}
        self._last: dict | None = None
        self._lock = threading.Lock()

    def _add(self, counter: Counter, key: str, total: float, **labels: str) -> None:
        # Counters only go up: add the increase of a running total (a total that fell, after a
        # restart, starts a new baseline).
        prev = self._totals.get((id(counter), key), 0.0)
        if total > prev:
            counter.labels(run_id=self.run_id, **labels).inc(total - prev)
        else:
            counter.labels(run_id=self.run_id, **labels).inc(0)  # the series exists from the first observe
        self._totals[(id(counter), key)] = total

    def observe_trainer_step(self, record: dict) -> None:
        """Update from one metrics.jsonl record (app/trainer/train.py writes them, one per step).

        Raises:
            KeyError: the record lacks "step", "time" or "samples_total".
        """
        with self._lock:
            rid = self.run_id
            self.step.labels(run_id=rid).set(record["step"])
            if "policy_version" in record:
                self.policy_version.labels(run_id=rid).set(record["policy_version"])
            reward = record.get("reward_mean")
            if isinstance(reward, (int, float)) and math.isfinite(reward):
                self.reward_mean.labels(run_id=rid).set(reward)
            for stat in ("mean", "max"):
                if f"staleness_{stat}" in record:
                    self.staleness.labels(run_id=rid, stat=stat).set(record[f"staleness_{stat}"])
            self.publish_seconds.labels(run_id=rid).set(record.get("publish_s", 0.0))
            self._add(self.samples, "samples_total", float(record["samples_total"]))
            last = self._last
            if last is not None and record["time"] > last["time"]:
                rate = (record["samples_total"] - last["samples_total"]) / (record["time"] - last["time"])
                self.samples_per_second.labels(run_id=rid).set(max(rate, 0.0))
            self._last = {"time": record["time"], "samples_total": record["samples_total"]}
            buf = record.get("buffer") or {}
            for state in ("queued", "leased"):
                if state in buf:
                    self.buffer_tasks.labels(run_id=rid, state=state).set(buf[state])
            if "ready" in buf:
                self.buffer_ready.labels(run_id=rid).set(buf["ready"])
            for name in BUFFER_COUNTERS:
                if name in buf:
                    self._add(self.buffer_events, name, float(buf[name]), event=name)

    def observe_worker_stats(self, stats: dict) -> None:
        """Update from a rollout worker's running totals (dataclasses.asdict(WorkerStats))."""
        with self._lock:
            for name in WORKER_COUNTERS:
                if name in stats:
                    self._add(self.worker_events, name, float(stats[name]), event=name)

    def observe_weight_update(self, seconds: float) -> None:
        """Record one engine weight update that took `seconds`."""
        self.weight_update_seconds.labels(run_id=self.run_id).observe(seconds)


def serve(metrics: RunMetrics, port: int, addr: str = "0.0.0.0"):
    """Serve `metrics` on http://addr:port/metrics from a daemon thread; port 0 picks a free one.

    Returns the server (its `server_port` is the bound port; `shutdown()` stops it).
    Raises OSError when the port is taken.
    """
    server, _thread = start_http_server(port, addr=addr, registry=metrics.registry)
    return server


def follow(path: str | Path, metrics: RunMetrics, stop: threading.Event, poll_s: float = 2.0) -> threading.Thread:
    """Feed `metrics` from every complete line appended to the metrics.jsonl at `path`.

    Reads from the start (a restarted exporter catches up), skips a torn last line until its
    newline arrives, waits for the file to appear, and returns when `stop` is set. Returns the
    started daemon thread.
    """
    path = Path(path)

    def run() -> None:
        offset, partial = 0, b""
        while not stop.is_set():
            try:
                with open(path, "rb") as f:
                    f.seek(offset)
                    chunk = f.read()
            except FileNotFoundError:
                chunk = b""
            offset += len(chunk)
            *lines, partial = (partial + chunk).split(b"\n")
            for line in lines:
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if isinstance(record, dict) and {"step", "time", "samples_total"} <= record.keys():
                    metrics.observe_trainer_step(record)
            stop.wait(poll_s)

    thread = threading.Thread(target=run, name="moerl-metrics-follow", daemon=True)
    thread.start()
    return thread


def upload_run_metrics(run_dir: str | Path, store: ObjectStore | str, run_id: str) -> list[str]:
    """Copy `run_dir`/metrics.jsonl and every file under `run_dir`/tensorboard/ to the store.

    Keys: ``<run_id>/metrics/metrics.jsonl`` and ``<run_id>/tensorboard/<relative path>``
    (app.storage.store.run_area). metrics.jsonl is read once and written whole, so a file still
    being appended to lands as a consistent snapshot; each object appears only when complete.
    Call it on a timer and at exit; a later call overwrites with the longer file.

    Args:
        store: an ObjectStore or a store URL (``s3://bucket/prefix``, ``file://...``).
    Returns:
        The keys written, sorted.
    Raises:
        FileNotFoundError: `run_dir` is not a directory.
        ValueError: run_id is not a clean key without '/'.
    """
    run_dir = Path(run_dir)
    metrics_area, tb_area = run_area(run_id, "metrics"), run_area(run_id, "tensorboard")  # checks run_id
    if not run_dir.is_dir():
        raise FileNotFoundError(f"run directory {run_dir} does not exist")
    store = open_store(store) if isinstance(store, str) else store
    written = []
    metrics_file = run_dir / "metrics.jsonl"
    if metrics_file.is_file():
        key = metrics_area + "metrics.jsonl"
        store.put_bytes(key, metrics_file.read_bytes())
        written.append(key)
    tb = run_dir / "tensorboard"
    if tb.is_dir():
        for f in sorted(p for p in tb.rglob("*") if p.is_file()):
            key = tb_area + f.relative_to(tb).as_posix()
            store.put_file(f, key)
            written.append(key)
    return sorted(written)


def export_forever(run_dir: str | Path, run_id: str, port: int, store_url: str | None = None,
                   upload_every_s: float = 60.0, stop: threading.Event | None = None, addr: str = "0.0.0.0") -> None:
    """Serve the trainer's figures from `run_dir`/metrics.jsonl on `addr`:`port` and, with `store_url`,
    copy the run's metrics to the store every `upload_every_s` seconds and once more at stop.

    Blocks until `stop` is set (None: forever). For a sidecar or a thread next to rank 0.
    """
    stop = stop or threading.Event()
    metrics = RunMetrics(run_id)
    server = serve(metrics, port, addr)
    follow(Path(run_dir) / "metrics.jsonl", metrics, stop)
    try:
        while not stop.wait(upload_every_s if store_url else 3600):
            if store_url:
                upload_run_metrics(run_dir, store_url, run_id)
    finally:
        if store_url:
            upload_run_metrics(run_dir, store_url, run_id)
        server.shutdown()
