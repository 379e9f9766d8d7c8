"""End to end: `moerl run` as a user runs it, with real processes (redis-server, engines,
rollout workers, a 2-rank torchrun trainer), on a short schedule."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from app.local.run import embedded_default, warmup_dir

pytestmark = pytest.mark.slow


def small_config(tmp_path: Path, steps: int, router: bool = False) -> Path:
    """The embedded default, shortened: fewer steps, a shorter warm-up, fewer held-out prompts;
    with ``router``, SGLang's router in front of the engines."""
    cfg = embedded_default()
    cfg.run_id = "e2e"
    cfg.trainer.steps = steps
    cfg.task.train_size = 200
    cfg.task.eval_size = 40
    cfg.task.warmup_steps = 20
    if router:
        cfg.rollout.router, cfg.rollout.pause_mode = True, "abort"
    path = tmp_path / "run.yaml"
    cfg.save(path)
    return path


def moerl(*args: str) -> list[str]:
    return [sys.executable, "-m", "app.cli", *args]


def descendants(pid: int) -> list[int]:
    """PIDs of every live process whose parent chain reaches `pid` (from /proc)."""
    parents = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            # The command name may hold spaces; fields after the closing parenthesis are fixed.
            fields = stat.rsplit(")", 1)[1].split()
            if fields[0] != "Z":
                parents[int(entry)] = int(fields[1])
    found, frontier = [], [pid]
    while frontier:
        p = frontier.pop()
        kids = [c for c, pp in parents.items() if pp == p]
        found += kids
        frontier += kids
    return found


@pytest.fixture(scope="module")
def warm_cache(tmp_path_factory) -> Path:
    """One warm-up cache for this module's runs: the first run warms the recipe up, the next reuses it."""
    return tmp_path_factory.mktemp("cache")


def run_small(tmp_path: Path, config: Path, cache: Path, timeout_s: float) -> tuple[Path, dict, str]:
    """`moerl run` on ``config`` into tmp_path/run; (run dir, summary, its stdout)."""
    out = tmp_path / "run"
    proc = subprocess.run(
        moerl("run", "--config", str(config), "--out", str(out), "--cache", str(cache)),
        capture_output=True, text=True, timeout=timeout_s,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out, json.loads((out / "summary.json").read_text()), proc.stdout


def test_run_end_to_end(tmp_path, warm_cache):
    config = small_config(tmp_path, steps=4)
    out, summary, stdout = run_small(tmp_path, config, warm_cache, 600)
    assert summary["steps"] == 4
    # A version every trainer.publish_every steps and after the last step (v0 is the start).
    every = embedded_default().trainer.publish_every
    version = len([s for s in range(1, 5) if s % every == 0 or s == 4])
    assert summary["policy_version"] == version
    assert summary["held_out_prompts"] == 40
    assert 0.0 <= summary["held_out_reward_before"] <= 1.0
    assert 0.0 <= summary["held_out_reward_after"] <= 1.0
    assert summary["samples_trained"] == 4 * 8 * 8  # steps x groups x G
    # metrics, plot and TensorBoard events are written
    lines = (out / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [1, 2, 3, 4]
    assert (out / "plot.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert list((out / "tensorboard").glob("events.out.tfevents.*"))
    # the last policy version is a complete HF checkpoint in the store
    latest = out / "store" / "e2e" / "policy" / "latest"
    assert latest.read_text().strip() == str(version)
    assert (out / "final" / f"v{version}" / "config.json").exists()
    # every staleness the trainer saw is within the bound
    bound = embedded_default().buffer.max_staleness
    for line in lines:
        assert json.loads(line)["staleness_max"] <= bound
    # quiet logs: no request lines from any role, and the trainer's one line per step
    for log in (out / "logs").glob("*.log"):
        assert "HTTP Request:" not in log.read_text(), log.name
    trainer_log = (out / "logs" / "trainer.log").read_text()
    assert [int(m) for m in __import__("re").findall(r"rank0 step (\d+) v", trainer_log)] == [1, 2, 3, 4]
    # the summary gives greedy beside sampled, and run.yaml records that the warm-up is done
    assert {"held_out_greedy_before", "held_out_greedy_after", "gain_points_greedy"} <= set(summary)
    assert __import__("yaml").safe_load((out / "run.yaml").read_text())["task"]["warmup_done"] is True
    # the warm-up checkpoint was cached for the next run
    cfg = embedded_default().model_validate(__import__("yaml").safe_load(config.read_text()))
    assert (warmup_dir(cfg, warm_cache) / "config.json").exists()
    # no silent minutes: each stage says it started and ended (plain lines: stdout is not a terminal),
    # and the held-out figure before RL is the warm-up's own (measured once, not twice)
    if "warm-up: reusing" not in stdout:  # this module's first run makes the warm-up
        for line in ("warm-up: started", "warm-up: done, 20/20 steps, held-out evaluation 200/200"):
            assert line in stdout, stdout[-3000:]
    for line in ("start-up: trainer, 2 engines and 2 rollout workers: done",
                 "held-out evaluation after RL: done, 200/200 completions"):
        assert line in stdout, stdout[-3000:]
    assert "held-out evaluation before RL" not in stdout
    warm = json.loads((warmup_dir(cfg, warm_cache) / "warmup.json").read_text())["heldout"]
    assert (summary["held_out_reward_before"], summary["held_out_greedy_before"]) == (warm["sampled"], warm["greedy"])
    assert summary["failures"] == {"failed": 0, "requeued": 0, "dropped": 0, "top_reasons": []}
    assert "failed rollout groups: 0 (0 requeued, 0 dropped after buffer.max_failures)" in stdout


def test_run_with_the_router(tmp_path, warm_cache):
    """`moerl run` with rollout.router: the real sglang-router binary, with an API key and a
    control-plane key, in front of the built-in engines; the router starts with no engines,
    each worker registers its own, every /generate goes through the router (a worker sends it
    nowhere else), and the run trains as without it."""
    out, summary, _ = run_small(tmp_path, small_config(tmp_path, steps=2, router=True), warm_cache, 900)
    assert summary["steps"] == 2 and summary["samples_trained"] == 2 * 8 * 8
    router = (out / "logs" / "router.log").read_text()
    assert "--api-key" not in router  # the keys are in neither run.yaml nor the log
    assert "router" in __import__("yaml").safe_load((out / "run.yaml").read_text())["rollout"]
    for i in range(2):
        log = (out / "logs" / f"worker-{i}.log").read_text()
        assert "asked the router http://127.0.0.1:" in log and "to add engine http://127.0.0.1:" in log, log[-2000:]
        assert "could not register" not in log and "HTTP 401" not in log, log[-2000:]
        stats = json.loads(next(line for line in reversed(log.splitlines()) if line.startswith('{"worker_id"')))
        assert stats["groups_published"] > 0 and stats["engine_errors"] == 0


def test_run_ctrl_c_stops_every_process_and_the_run_resumes(tmp_path, warm_cache):
    """Ctrl-C after step 2 (a saved state: trainer.save_every is 2) stops every process, writes the
    summary and plot of what was trained and prints the command that continues the run; `moerl run
    --resume` then continues from the saved state (the buffer from its append-only file, the
    held-out figure before RL the first start's) and ends with its summary."""
    config = small_config(tmp_path, steps=1000)
    out = tmp_path / "run"
    proc = subprocess.Popen(
        moerl("run", "--config", str(config), "--out", str(out), "--cache", str(warm_cache)),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    try:
        # Wait until the trainer has made two steps: every role is up by then, and a state is saved.
        deadline = time.monotonic() + 300
        metrics = out / "metrics.jsonl"
        while time.monotonic() < deadline and not (metrics.exists() and len(metrics.read_text().splitlines()) >= 2):
            assert proc.poll() is None, proc.stdout.read()[-3000:]
            time.sleep(0.5)
        assert metrics.exists(), "the trainer made no step within 300 s"
        children = descendants(proc.pid)
        assert len(children) >= 6  # redis, 2 engines, 2 workers, torchrun + 2 ranks
        proc.send_signal(signal.SIGINT)
        time.sleep(0.05)
        proc.send_signal(signal.SIGINT)  # an impatient second Ctrl-C must not orphan anything
        code = proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert code == 130
    time.sleep(1)
    alive = [pid for pid in children if Path(f"/proc/{pid}").exists() and
             Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"]
    assert alive == [], f"processes left running after Ctrl-C: {alive}"
    # What was trained is summarized and plotted, and the command that continues the run is printed.
    text = proc.stdout.read()
    assert f"continue it with:  moerl run --resume {out.resolve()}" in text, text[-3000:]
    first = json.loads((out / "summary.json").read_text())
    assert not first["finished"] and first["held_out_reward_after"] is None and first["steps"] >= 2
    assert (out / "plot.png").exists()

    done = first["steps"]
    resumed = subprocess.run(moerl("run", "--resume", str(out), "--steps", str(done + 2)),
                             capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["finished"] and summary["steps"] == done + 2
    assert summary["held_out_reward_before"] == first["held_out_reward_before"]
    trained = [json.loads(x) for x in (out / "trained.jsonl").read_text().splitlines()]
    resumes = [t for t in trained if "resume_from_step" in t]
    assert len(resumes) == 1 and resumes[0]["resume_from_step"] >= 2  # from a saved state, not from scratch
    steps = [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert sorted(set(steps)) == list(range(1, done + 3))


def test_the_first_interrupt_ignores_the_next_before_anything_unwinds():
    """`moerl run`'s handler: the Ctrl-C that raises KeyboardInterrupt has already set SIGINT and
    SIGTERM to be ignored, so a second one during the unwinding cannot abort the clean-up (it
    did when the except clause set them: a second SIGINT 50 ms after the first could land before)."""
    from app.local.run import _interrupt

    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        signal.signal(signal.SIGINT, _interrupt)
        signal.signal(signal.SIGTERM, _interrupt)
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(5)
        assert signal.getsignal(signal.SIGINT) == signal.SIG_IGN
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_IGN
        os.kill(os.getpid(), signal.SIGINT)  # the impatient second Ctrl-C: nothing is raised
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.05)
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)


def test_rolling_mean_skips_missing_values():
    from app.local.report import rolling_mean

    nan = float("nan")
    out = rolling_mean([nan, 1.0, nan, 3.0, 5.0], window=2)
    assert out[0] != out[0]  # NaN before the first value
    assert out[1:] == [1.0, 1.0, 2.0, 4.0]


@pytest.mark.parametrize("yaml_text, expected", [
    ("buffer:\n  capacity_groups: 1\n", "buffer.capacity_groups=1"),
    ("trainer:\n  adam_betas: [1.5, 0.9]\n", "trainer.adam_betas"),
    ("trainer:\n  lr: .inf\n", "trainer.lr"),
    ("task:\n  name: nope_task\n", "task.name"),
    ("trainer:\n  parallel:\n    ep: 3\n", "trainer.parallel.ep (3)"),
    ("ep:\n  size: 2\n", "moved to trainer.parallel"),
])
def test_bad_config_fails_before_anything_starts(tmp_path, yaml_text, expected):
    config = tmp_path / "bad.yaml"
    config.write_text(yaml_text)
    out = tmp_path / "run"
    proc = subprocess.run(moerl("run", "--config", str(config), "--out", str(out)),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert expected in proc.stdout + proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr
    assert not out.exists()  # no redis, no run directory: nothing was started or written
