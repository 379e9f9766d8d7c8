"""The chaos harness and its ledger (issue 4).

- the ledger's arithmetic on hand-written files: a lost prompt, a sample trained twice, an
  over-stale sample, a step rolled back by a resume, a line cut short by a kill, are each
  found (so the zeros of the real run mean something);
- the fault schedule: seeded, both signals, one trainer kill after an unsaved step;
- a short chaos run of the real embedded loop (engines, workers, trainer, redis-server as
  processes): worker SIGTERM and SIGKILL (with the engine), one trainer SIGKILL + --resume and
  one redis-server SIGKILL + restart; zero lost, zero trained twice, zero over-stale.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from app.local.chaos import make_schedule, run_chaos
from app.ledger import audit, read_issued, read_lineage


def _step(step: int, tv: int, groups: list[tuple[str, int, int]]) -> dict:
    """A trained.jsonl line: groups of (task_id, attempt, policy_version), 2 samples each."""
    return {"step": step, "trainer_version": tv, "time": float(step), "skipped": [],
            "groups": [{"task_id": t, "attempt": a, "samples": [[f"r/{t}/{k}/{a}", v] for k in range(2)]}
                       for t, a, v in groups]}


def _write(path: Path, records: list, tail: str = "") -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records) + tail)
    return path


def test_ledger_counts_lost_duplicated_and_overstale(tmp_path):
    issued = _write(tmp_path / "issued.jsonl", [{"task_id": f"p{i}", "attempt": 0} for i in range(6)])
    trained = _write(tmp_path / "trained.jsonl", [
        _step(1, 0, [("p0", 0, 0), ("p1", 0, 0)]),
        _step(2, 1, [("p1", 0, 0), ("p2", 0, 0)]),  # p1 again: 2 duplicated samples
        _step(3, 3, [("p3", 0, 1)]),  # staleness 2 > 1: 2 over-stale samples
    ])
    a = audit(read_issued(issued), read_lineage(trained), pending={"p4", "x"}, max_staleness=1)
    assert (a.issued, a.completed, a.pending, a.lost) == (6, 4, 1, 1)
    assert a.lost_ids == ["p5"]
    assert (a.duplicated, a.overstale) == (2, 2)
    assert a.duplicated_ids == ["r/p1/0/0", "r/p1/1/0"]
    assert a.samples_trained == 10 and not a.ok()


def test_ledger_rolls_back_steps_voided_by_a_resume(tmp_path):
    trained = _write(tmp_path / "trained.jsonl", [
        _step(1, 0, [("p0", 0, 0)]),
        _step(2, 1, [("p1", 0, 1)]),
        _step(3, 2, [("p2", 0, 2)]),  # trained, then the trainer died before saving step 3
        {"resume_from_step": 2, "version": 4, "time": 9.0},
        _step(3, 4, [("p2", 1, 4)]),  # the same prompt again after the resume: not a duplicate
    ], tail='{"step": 4, "trainer_version": 5, "gro')  # a line cut short by a kill
    lin = read_lineage(trained)
    assert [r["step"] for r in lin.steps] == [1, 2, 3]
    assert (lin.rolled_back_steps, lin.resumes) == (1, 1)
    a = audit({"p0", "p1", "p2"}, lin, pending=set(), max_staleness=1)
    assert (a.completed, a.lost, a.duplicated, a.overstale) == (3, 0, 0, 0) and a.ok()


def test_schedule_is_seeded_and_has_every_fault():
    a = make_schedule(random.Random(3), steps=20, workers=2, worker_kills=6, save_every=2)
    b = make_schedule(random.Random(3), steps=20, workers=2, worker_kills=6, save_every=2)
    assert [(e.at_step, e.kind, e.target) for e in a] == [(e.at_step, e.kind, e.target) for e in b]
    kinds = [e.kind for e in a]
    assert kinds.count("worker-term") == 3 and kinds.count("worker-kill") == 3
    assert kinds.count("trainer-kill") == 1 and kinds.count("redis-restart") == 1
    trainer_kill = next(e for e in a if e.kind == "trainer-kill")
    assert trainer_kill.at_step % 2 == 1  # after an unsaved step: the resume rolls it back
    assert all(1 <= e.at_step < 20 for e in a)


@pytest.mark.slow
def test_short_chaos_run_loses_nothing(tmp_path):
    s = run_chaos(steps=12, workers=2, seed=1, worker_kills=2, out=tmp_path / "chaos", baseline=False,
                  group_size=4, groups_per_step=2, save_every=2, timeout_s=420, say=lambda m: None)
    d = s["disturbed"]
    f = d["faults"]
    assert f["worker_sigterm"] == 1 and f["worker_sigkill"] == 1 and f["engine_sigkill"] == 1
    assert f["trainer_sigkill"] == 1 and f["redis_restart"] == 1
    assert d["resumes"] == 1
    assert d["steps"] == 12 and d["samples_trained"] == 12 * 2 * 4
    assert d["issued"] >= d["completed"] >= 10
    assert (d["lost"], d["duplicated"], d["overstale"]) == (0, 0, 0), d
    assert s["ok"] and (tmp_path / "chaos" / "chaos.json").exists()


@pytest.mark.slow
def test_watchdog_kills_a_hung_engine_and_it_is_restarted(tmp_path):
    """A hung engine (SIGSTOP: alive, answers nothing) is killed after failed liveness probes;
    check_roles starts it again and it serves."""
    import os
    import signal
    import time

    from app.local.chaos import chaos_config, make_base_policy
    from app.local.embedded import EmbeddedLoop

    cfg = chaos_config(4, 0, tmp_path, group_size=2, groups_per_step=1, save_every=1, max_new_tokens=4, workers=1)
    base = make_base_policy(cfg, tmp_path / "base")
    loop = EmbeddedLoop(cfg, tmp_path / "run", workers=1)
    try:
        engine = loop.start_engine(0, base)
        loop.wait_engine(0)
        loop.watch_engines(period_s=0.5, timeout_s=2.0, strikes=2)
        os.kill(engine.pid, signal.SIGSTOP)
        deadline = time.monotonic() + 60
        while engine.alive():
            assert time.monotonic() < deadline, "the hung engine was not killed"
            time.sleep(0.2)
        assert engine.returncode() == -signal.SIGKILL
        loop.check_roles()
        assert engine.alive() and engine.starts == 2
        loop.wait_engine(0)
    finally:
        loop.close()


def test_ledger_counts_dropped_prompts_apart_from_lost(tmp_path):
    issued = _write(tmp_path / "issued.jsonl", [{"task_id": f"p{i}", "attempt": 0} for i in range(4)])
    trained = _write(tmp_path / "trained.jsonl", [_step(1, 0, [("p0", 0, 0)])])
    a = audit(read_issued(issued), read_lineage(trained), pending={"p1"}, max_staleness=1, dropped={"p2", "p0"})
    assert (a.completed, a.pending, a.dropped, a.lost) == (1, 1, 1, 1)  # p0 was trained: not dropped
    assert a.lost_ids == ["p3"] and not a.ok()


def test_schedule_env_kills_leave_the_rest_of_the_seed_alone():
    plain = make_schedule(random.Random(5), steps=20, workers=2, worker_kills=4, save_every=2)
    with_env = make_schedule(random.Random(5), steps=20, workers=2, worker_kills=4, save_every=2, env_kills=3)
    assert [e for e in with_env if e.kind != "env-kill"] == plain
    kills = [e.at_step for e in with_env if e.kind == "env-kill"]
    assert len(kills) == 3 and all(1 <= s < 20 for s in kills) and kills == sorted(kills)


@pytest.mark.slow
def test_chaos_with_env_pod_kills_loses_nothing(tmp_path):
    """Multi-turn episodes against `moerl env`, SIGKILLed twice mid-run (plus the harness's
    trainer kill and Redis restart): failed episodes are played again, nothing is lost or
    trained twice."""
    s = run_chaos(steps=8, workers=2, seed=2, worker_kills=0, env_kills=2, out=tmp_path / "chaos", baseline=False,
                  group_size=4, groups_per_step=2, save_every=2, timeout_s=420, say=lambda m: None)
    d = s["disturbed"]
    assert d["faults"]["env_sigkill"] == 2 and d["faults"]["trainer_sigkill"] == 1
    assert d["faults"]["failed_rollouts_requeued"] >= 1  # the kills did cut open episodes
    assert d["steps"] == 8 and d["samples_trained"] == 8 * 2 * 4
    assert (d["lost"], d["duplicated"], d["overstale"]) == (0, 0, 0), d
    assert s["ok"]
