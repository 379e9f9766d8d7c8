"""The parts of `moerl bench loop` that decide what its figures mean, without running the legs:
leg order, load accounting and the quiet mark, ratios over rounds, the profile's attribution
of CPU time to activities, the GPU's sampling, where each leg's time goes, and the GPU legs'
layout on a faked GPU (app/bench/loop.py, app/bench/machine.py, app/bench/loop_profile.py,
app/bench/gpu.py)."""

from __future__ import annotations

import collections
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from app.bench.loop import comparison, leg_order, mean_of
from app.bench.loop_profile import OTHER, activity, attribute, parse_raw, per_step_table, role_kind
from app.bench.machine import QUIET_SHARE, LoadMonitor, summarize


def test_leg_order_alternates_abba():
    assert leg_order(1) == [(0, "moerl"), (0, "trl")]
    order = leg_order(4)
    assert [leg for _, leg in order] == ["moerl", "trl", "trl", "moerl", "moerl", "trl", "trl", "moerl"]
    firsts = [order[i][1] for i in range(0, len(order), 2)]
    assert firsts.count("moerl") == firsts.count("trl")  # each system goes first equally often


def test_load_summary_subtracts_own_cpu_and_marks_quiet():
    # 10 s on 2 cores: the cores were busy 12 CPU-s, the leg's own processes used 11.5.
    samples = [(0.0, 1.0, 100.0, 50.0), (5.0, 2.0, 106.0, 55.5), (10.0, 3.0, 112.0, 61.5)]
    w = summarize(samples, load_before=0.5, cores=2)
    assert w.window_s == 10.0 and w.busy_cpu_s == 12.0 and w.own_cpu_s == 11.5
    assert math.isclose(w.others_cores, 0.05)
    assert w.quiet  # 0.05 <= 0.1 * 2
    assert w.load_mean == 2.0 and w.load_max == 3.0 and w.load_before == 0.5
    busy = summarize([(0.0, 5.0, 100.0, 50.0), (10.0, 6.0, 118.0, 61.0)], load_before=4.0, cores=2)
    assert math.isclose(busy.others_cores, 0.7) and not busy.quiet
    assert f"threshold {QUIET_SHARE * 2:.2f}" in busy.describe() and "NOT QUIET" in busy.describe()
    with pytest.raises(ValueError, match="two load samples"):
        summarize(samples[:1], 0.0, 2)


def test_load_monitor_sees_another_process_burn_cpu():
    """A process outside the leg that spins for the whole window shows up as others' CPU and by name."""
    import psutil

    burner = subprocess.Popen([sys.executable, "-c", "import time\nt = time.time()\nwhile time.time() - t < 30: pass"])
    cpu = lambda: sum(psutil.Process(burner.pid).cpu_times()[:2])  # noqa: E731
    try:
        time.sleep(0.3)
        c0 = cpu()
        mon = LoadMonitor(time.process_time, period_s=0.2).start()
        time.sleep(1.5)
        w = mon.stop()
        burned = cpu() - c0
    finally:
        burner.kill()
        burner.wait()
    assert w.others_cores > 0.5  # one spinning process is close to a core
    assert len(w.top_others) <= 5
    # On a loaded machine (CI) other spinning processes get the same share as the burner, so it is
    # listed unless five others used at least as much CPU in the window (0.05 s: the window's
    # ends differ by a few ms between the monitor's reads and ours).
    if burner.pid not in [pid for _, pid, _ in w.top_others]:
        assert len(w.top_others) == 5 and all(c >= burned - 0.05 for _, _, c in w.top_others), (burned, w.top_others)


def test_comparison_uses_means_over_legs_and_rounds():
    def row(name, rnd, sps, cpu, after, gain):
        return {"name": name, "round": rnd, "samples_per_s": sps, "samples_per_cpu_s": cpu,
                "heldout_reward_after": after, "gain_points": gain}

    rows = [row("moerl", 1, 100.0, 50.0, 0.6, 10.0), row("trl", 1, 50.0, 25.0, 0.5, 2.0),
            row("trl", 2, 150.0, 75.0, 0.7, 6.0), row("moerl", 2, 200.0, 50.0, 0.8, 20.0)]
    r = comparison(rows)
    assert math.isclose(r["samples_per_s moerl/trl"], 150.0 / 100.0)
    assert math.isclose(r["samples_per_cpu_s moerl/trl"], 50.0 / 50.0)
    assert math.isclose(r["heldout_reward_after moerl/trl"], 0.7 / 0.6)
    assert math.isclose(r["gain_points moerl-trl"], 15.0 - 4.0)
    assert math.isclose(r["samples_per_s moerl/trl round 1"], 2.0)
    assert math.isclose(r["samples_per_s moerl/trl round 2"], 200.0 / 150.0)
    assert math.isnan(mean_of([{"x": float("nan")}], "x"))
    one = comparison(rows[:2])
    assert "samples_per_s moerl/trl round 1" not in one  # per-round ratios only with several rounds


def test_activity_rules_pick_the_first_matching_rule():
    save = ["run_training (app/trainer/loop.py:385)", "save_state (app/trainer/state.py:219)",
            "all_gather (torch/distributed/distributed_c10d.py:4280)"]
    assert activity("trainer", save) == "state save (DCP)"
    a2a = ["train_step (app/trainer/step.py:153)", "MoEBlock.forward (app/model/moe.py:181)",
           "all_to_all (app/model/dispatch/alltoall.py:42)"]
    assert activity("trainer", a2a) == "step: EP all-to-all (gloo)"
    assert activity("trainer", ["train_step (app/trainer/step.py:153)"]) == "step: forward + loss"
    assert activity("engine", ["_worker (concurrent/futures/thread.py:81)", "DecodeBatch.step (app/engine/sampler.py:316)"]) \
        == "decode forward + sampling"
    assert activity("worker", ["<module> (x.py:1)"]) == OTHER
    assert role_kind("trainer-rank1") == "trainer" and role_kind("engine-0") == "engine"
    with pytest.raises(ValueError, match="redis"):
        role_kind("redis")


def test_attribute_weights_samples_by_each_threads_cpu(tmp_path):
    raw = tmp_path / "engine-0.txt"
    raw.write_text(
        "thread (11): MainThread;serve (app/engine/server.py:827);run (uvicorn/main.py:632) 30\n"
        "thread (11): MainThread;x (asyncio/base_events.py:1884);select (selectors.py:468) 10\n"
        "thread (12): asyncio_0;_worker (concurrent/futures/thread.py:83);DecodeBatch.step (app/engine/sampler.py:316) 10\n"
        "thread (13): gone;DecodeBatch.add (app/engine/sampler.py:277) 4\n"
        "malformed line\n")
    sampled = parse_raw(raw, "engine")
    assert set(sampled) == {11, 12, 13} and sampled[12][0] == "asyncio_0"
    # Thread 11 used 1.0 CPU-s, 12 used 3.0 (more CPU per sample than 11),
    # 13 ended inside the window, 14 has no Python frames (0.5 s); the process used 5.0 in all.
    cpu0 = (10.0, {11: 1.0, 12: 1.0, 13: 0.0, 14: 0.0})
    cpu1 = (15.0, {11: 2.0, 12: 4.0, 14: 0.5})
    p = attribute("engine-0", 1, cpu0, cpu1, sampled)
    assert math.isclose(p.cpu_s, 5.0)
    acts = p.activities
    # Thread 11's select samples wait in epoll: its CPU goes to the samples where it ran.
    assert math.isclose(acts["HTTP + JSON (uvicorn, FastAPI)"], 1.0, abs_tol=1e-3)
    assert "event loop (select, scheduling)" not in acts
    assert math.isclose(acts["decode forward + sampling"], 3.0, abs_tol=1e-3)
    assert math.isclose(acts["prefill forward"], 0.5, abs_tol=1e-3)  # the rest: 5 - 4 - 0.5
    assert math.isclose(acts["threads without Python frames (gloo, OpenMP, C)"], 0.5, abs_tol=1e-3)
    assert math.isclose(sum(acts.values()), p.cpu_s, abs_tol=1e-3)
    table = per_step_table([p], {"redis-server": 1.0}, steps=10)
    assert table[0] == {"role": "engine", "activity": "decode forward + sampling", "cpu_ms_per_step": 300.0,
                        "share": 0.5}
    assert {"role": "redis-server", "activity": "all", "cpu_ms_per_step": 100.0, "share": round(1 / 6, 4)} in table


def test_parse_raw_of_real_py_spy_output(tmp_path):
    """py-spy's own raw output parses into thread ids, names and activities (skipped without py-spy)."""
    import shutil

    exe = shutil.which("py-spy") or os.path.join(os.path.dirname(sys.executable), "py-spy")
    if not os.path.isfile(exe):
        pytest.skip("py-spy is not installed")
    code = "import threading, time\ndef spin():\n    while True: sum(range(1000))\n" \
           "threading.Thread(target=spin, name='spinner', daemon=True).start()\ntime.sleep(30)\n"
    proc = subprocess.Popen([sys.executable, "-c", code])
    out = tmp_path / "worker-0.txt"
    try:
        time.sleep(0.5)
        r = subprocess.run([exe, "record", "--pid", str(proc.pid), "--duration", "1", "--rate", "50", "--format",
                            "raw", "--threads", "--nonblocking", "--output", str(out)], capture_output=True, timeout=60)
    finally:
        proc.kill()
        proc.wait()
    if r.returncode != 0:
        pytest.skip(f"py-spy cannot attach here: {r.stderr.decode()[-200:]}")
    sampled = parse_raw(out, "worker")
    names = {name for name, _ in sampled.values()}
    assert "spinner" in names
    counts = collections.Counter()
    for _, c in sampled.values():
        counts.update(c)
    assert sum(counts.values()) > 10


def test_samples_blocked_in_a_wait_get_no_cpu(tmp_path):
    """A thread sampled mostly in a queue wait (py-spy counts a woken thread waiting for a core
    as active) gets all of its CPU time on the samples where it ran."""
    raw = tmp_path / "engine-0.txt"
    raw.write_text(
        "thread (12): asyncio_0;Thread.run (threading.py:982);_worker (concurrent/futures/thread.py:81) 30\n"
        "thread (12): asyncio_0;_worker (concurrent/futures/thread.py:83);DecodeBatch.step (app/engine/sampler.py:316) 10\n"
        "thread (13): idle;_worker (concurrent/futures/thread.py:81) 5\n")
    sampled = parse_raw(raw, "engine")
    p = attribute("engine-0", 1, (0.0, {12: 0.0, 13: 0.0}), (2.5, {12: 2.0, 13: 0.5}), sampled)
    assert math.isclose(p.activities["decode forward + sampling"], 2.0)
    # A thread seen only waiting keeps its (small) CPU time there, so the total still adds up.
    assert math.isclose(p.activities["waiting (blocked, or runnable without a core)"], 0.5)
    assert math.isclose(sum(p.activities.values()), 2.5)


def test_gpu_monitor_reads_nvidia_smi_lines(tmp_path):
    """`GpuMonitor` runs nvidia-smi in a loop beside the leg and sums memory over the GPUs of one
    instant (here a stand-in script on the same command line that prints two GPUs' lines)."""
    import stat

    from app.bench.gpu import GpuMonitor

    fake = tmp_path / "nvidia-smi"
    args = tmp_path / "args"
    fake.write_text(f"""#!/bin/sh
echo "$@" > {args}
echo "2026/12/03 10:00:00.000, 0, 10, 1000"
echo "2026/12/03 10:00:00.000, 1, 30, 500"
echo "[N/A]"
echo "2026/12/03 10:00:00.500, 0, 50, 3000"
echo "2026/12/03 10:00:00.500, 1, 90, 1000"
sleep 30
""")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    monitor = GpuMonitor(period_s=0.25, command=str(fake)).start()
    deadline = time.monotonic() + 20
    while len(monitor.rows) < 4 and time.monotonic() < deadline:
        time.sleep(0.05)
    w = monitor.stop()
    assert (w.source, w.samples) == ("nvidia-smi", 2)
    assert (w.util_mean_pct, w.util_max_pct) == (45.0, 90.0)
    assert (w.mem_peak_mib, w.mem_start_mib) == (4000.0, 1500.0)
    assert args.read_text().split() == ["--query-gpu=timestamp,index,utilization.gpu,memory.used",
                                        "--format=csv,noheader,nounits", "-lms", "250"]


def test_gpu_monitor_without_nvidia_smi_or_pynvml_says_none(monkeypatch):
    import app.bench.gpu as gpu

    monkeypatch.setattr(gpu.shutil, "which", lambda name: None)
    monkeypatch.setattr(gpu, "_nvml", lambda: None)
    w = gpu.GpuMonitor().start().stop()
    assert w.source == "none" and w.samples == 0


def test_where_the_time_goes():
    from app.bench.loop import engine_state, trainer_split, where_time_goes

    records = [{"step_s": 1.0, "push_s": 0.5, "publish_s": 0.0, "save_s": 0.5},
               {"step_s": 2.0, "publish_s": 1.0, "save_s": 0.0}]  # push_s only with the network push
    split = trainer_split(records, 10.0)
    assert split == {"train_step": 0.3, "weight_update": 0.15, "save": 0.05, "idle": 0.5}
    assert engine_state({"paused": True, "running": 3}) == "weight_update"
    assert engine_state({"paused": False, "running": 0, "waiting": 2}) == "generating"
    assert engine_state({"paused": False, "running": 0, "waiting": 0}) == "idle"
    assert engine_state({"engine": "sglang"}) == "unknown"
    row = {"tokens_per_s": 1234.4, "gpu": {"samples": 3, "source": "nvidia-smi", "util_mean_pct": 71.2,
                                           "mem_peak_mib": 2048.0},
           "time_split": {"trainer": split, "engines": {"generating": 0.8, "idle": 0.2, "samples": 9}}}
    line = where_time_goes(row)
    assert "1234 tokens/s" in line and "GPU busy 71%" in line and "peak memory 2.0 GiB" in line
    assert "trainer: train step 30%, weight update 15%, save 5%, idle 50%" in line
    assert "engines: generating 80%, idle 20%" in line


def test_device_cuda_without_a_gpu_is_refused_before_work(tmp_path, monkeypatch):
    import app.bench.loop as bench_loop
    import app.local.machine as machine
    from typer.testing import CliRunner

    from app.bench.cli import cli

    monkeypatch.setattr(bench_loop, "detect_machine", lambda: machine.Machine(cores=2, gpus=0))
    r = CliRunner().invoke(cli, ["loop", "--device", "cuda", "--out-dir", str(tmp_path / "out"),
                                 "--work-dir", str(tmp_path / "work")])
    assert r.exit_code == 2 and "--device cuda: torch sees no GPU" in r.output, r.output
    r = CliRunner().invoke(cli, ["loop", "--device", "tpu", "--out-dir", str(tmp_path / "out")])
    assert r.exit_code == 2 and "--device must be cpu or cuda" in r.output, r.output
    r = CliRunner().invoke(cli, ["loop", "--task", "nope", "--out-dir", str(tmp_path / "out")])
    assert r.exit_code == 2 and "--task: 'nope'" in r.output, r.output
    assert not (tmp_path / "out").exists() and not (tmp_path / "work").exists()


def test_the_gpu_legs_plan_the_machines_layout(monkeypatch):
    """`--device cuda --task gpu` on a (faked) one-GPU, 16-core machine: moerl as `moerl run`
    lays it out there, and TRL's arguments on the GPU with bf16 autocast."""
    import app.bench.loop as bench_loop
    import app.local.machine as machine
    from app.bench.loop import LoopBench, grpo_args, grpo_kwargs, load_config, plan_legs

    monkeypatch.delenv("MOERL_SHARED_GPU", raising=False)
    monkeypatch.setattr(bench_loop, "detect_machine", lambda: machine.Machine(cores=16, gpus=1))
    bench = LoopBench(seconds=60, task="gpu", device="cuda")
    bench.validate()
    cfg, layout = plan_legs(bench, load_config(bench))
    assert layout.trainer_gpus == (0,) and set(layout.engine_devices) == {"cuda:0"}
    assert cfg.model.preset == "gpu-qwen3-moe" and cfg.model.dtype == "bfloat16"
    args = grpo_kwargs(cfg, Path("unused"), 10, "cuda")  # TRL's own check of bf16 needs the GPU
    assert not args["use_cpu"] and args["bf16"] and args["per_device_train_batch_size"] == 512
    cpu_cfg, cpu_layout = plan_legs(LoopBench(seconds=60), load_config(LoopBench(seconds=60)))
    assert cpu_layout.trainer_gpus == () and set(cpu_layout.engine_devices) == {"cpu"}  # GPUs hidden
    assert grpo_args(cpu_cfg, Path("unused"), 10, "cpu").use_cpu
