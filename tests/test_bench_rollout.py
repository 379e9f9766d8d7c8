"""`moerl bench rollout` against two built-in engines (real processes on loopback), short T.

No speed is asserted: the result file must hold what the command promises (aggregate and
per-engine tokens/s, per GPU, latency percentiles, the baseline ratio), the tokens must be the
engines' own count, and bad flags fail with one message naming the flag.
"""

from __future__ import annotations

import math
import subprocess

import httpx
import pytest
from typer.testing import CliRunner

from app.bench.cli import cli
from app.bench.rollout import percentile
from app.buffer.redis_server import free_port
from app.config import RunConfig
from test_bench import only_result, positive
from app.rollout.engine_client import wait_until_healthy
from helpers import engine_argv
from test_worker import ROOT, make_checkpoint, stop_process


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    root = tmp_path_factory.mktemp("bench-rollout")
    ckpt = make_checkpoint(root / "m", seed=0)
    procs, urls = [], []
    try:
        for i in range(2):  # both start at once; then wait for both
            port = free_port()
            with open(root / f"engine-{i}.log", "wb") as log:
                procs.append(subprocess.Popen(engine_argv(ckpt, port), cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                              start_new_session=True))
            urls.append(f"http://127.0.0.1:{port}")
        for u in urls:
            wait_until_healthy(u, timeout_s=120)
        yield urls
    finally:
        for p in procs:
            stop_process(p)


def run_config(tmp_path) -> str:
    cfg = RunConfig()
    cfg.rollout.group_size = 4
    cfg.rollout.max_new_tokens = 8
    cfg.task.train_size, cfg.task.eval_size = 40, 10
    path = tmp_path / "run.yaml"
    cfg.save(path)
    return str(path)


def test_bench_rollout_drives_every_engine_and_writes_its_figures(tmp_path, engines):
    before = [httpx.get(f"{u}/server_info").json()["tokens"] for u in engines]
    r = CliRunner().invoke(cli, ["rollout", "--url", engines[0], "--url", engines[1], "--seconds", "2",
                                 "--baseline-seconds", "1", "--concurrency", "3", "--gpus-per-engine", "2",
                                 "--config", run_config(tmp_path), "--label", "builtin", "--out-dir", str(tmp_path / "out")],
                           catch_exceptions=False)
    assert r.exit_code == 0, r.output
    assert "aggregate" in r.output and "ratio aggregate tokens/s / baseline tokens/s" in r.output
    doc = only_result(tmp_path / "out", "rollout")
    by = {f["name"]: f for f in doc["figures"]}
    agg = by["aggregate"]
    assert agg["engines"] == 2 and agg["gpus"] == 4 and agg["concurrency_per_engine"] == 3 and agg["errors"] == 0
    assert positive(agg["tokens_per_s"]) and math.isclose(agg["tokens_per_s_per_gpu"], agg["tokens_per_s"] / 4)
    assert 0 < agg["latency_p50_s"] <= agg["latency_p90_s"] <= agg["latency_p99_s"]
    per_engine = [by[f"engine {u}"] for u in engines]
    assert all(e["requests"] > 0 and e["tokens"] > 0 for e in per_engine)  # both engines were driven
    assert sum(e["tokens"] for e in per_engine) == agg["tokens"]
    assert agg["sequences"] == 4 * agg["requests"]  # n = group_size per request
    assert positive(doc["ratios"]["aggregate tokens/s / baseline tokens/s"])
    # the tokens counted are tokens the engines generated (each also served the health probes: 1 token each)
    after = [httpx.get(f"{u}/server_info").json()["tokens"] for u in engines]
    base = by["baseline (engine 0, 1 request in flight)"]["tokens"]
    generated = sum(a - b for a, b in zip(after, before))
    assert agg["tokens"] + base <= generated <= agg["tokens"] + base + 2 * 4
    assert doc["shape"]["n"] == 4 and doc["shape"]["max_new_tokens"] == 8 and doc["shape"]["label"] == "builtin"


@pytest.mark.parametrize("args,flag", [
    (["--seconds", "1"], "--url"),
    (["--url", "ftp://x", "--seconds", "1"], "--url"),
    (["--url", "http://127.0.0.1:1", "--seconds", "0"], "--seconds"),
    (["--url", "http://127.0.0.1:1", "--gpus-per-engine", "0"], "--gpus-per-engine"),
    (["--url", "http://127.0.0.1:1", "--wait-s", "0.5"], "not healthy"),
])
def test_bad_flags_or_a_dead_engine_give_one_error(tmp_path, args, flag):
    r = CliRunner().invoke(cli, ["rollout", *args, "--config", run_config(tmp_path), "--out-dir", str(tmp_path / "out")])
    assert r.exit_code == 2 and flag in r.output, r.output
    assert not (tmp_path / "out").exists()


def test_percentile_is_nearest_rank():
    assert percentile([5.0, 1.0, 3.0, 2.0, 4.0], 50) == 3.0
    assert percentile([1.0, 2.0], 99) == 2.0 and percentile([7.0], 1) == 7.0
    assert math.isnan(percentile([], 50))


def test_partial_ab_runs_both_arms_through_weight_updates(tmp_path):
    """`--partial-ab`: a worker on the in-process built-in engine through weight updates, partial
    rollout off then on; the file holds both arms, both saw updates, only the on arm resumed
    completions (samples of two versions are tests/test_partial_rollout.py's), and its updates
    drained the engine for less time than waiting for the requests did."""
    cfg = RunConfig()
    cfg.rollout.group_size, cfg.rollout.max_new_tokens, cfg.rollout.inflight_sequences = 4, 48, 8
    cfg.task.train_size, cfg.task.eval_size = 40, 10
    cfg.save(tmp_path / "run.yaml")
    r = CliRunner().invoke(cli, ["rollout", "--partial-ab", "--config", str(tmp_path / "run.yaml"), "--seconds", "6",
                                 "--update-every-s", "1.5", "--out-dir", str(tmp_path / "out")])
    assert r.exit_code == 0, r.output
    result = only_result(tmp_path / "out", "rollout-partial")
    off, on = (next(f for f in result["figures"] if f["name"] == f"partial_rollout {x}") for x in ("off", "on"))
    assert off["weight_updates"] >= 1 and on["weight_updates"] >= 1
    assert off["partial_resumes"] == 0 and off["mixed_version_samples"] == 0
    assert on["partial_resumes"] > 0
    assert on["drained_s_per_update"] < off["drained_s_per_update"]
    assert "tokens/s partial on / off" in result["ratios"]
    bad = CliRunner().invoke(cli, ["rollout", "--partial-ab", "--url", "http://127.0.0.1:1", "--out-dir",
                                   str(tmp_path / "bad")])
    assert bad.exit_code == 2 and "--url" in bad.output
