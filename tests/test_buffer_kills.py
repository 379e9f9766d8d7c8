"""The buffer stays live through any kill (issue 38), against a real redis-server, with real
processes and SIGKILL:

- a trainer SIGKILLed before each of its Redis calls in turn (a tripwire on the redis client
  of a forked trainer process: call k kills it, for every k) through a resume, a take with a
  malformed payload, a save and its commit, and a take that meets a dead letter and a window
  of stale groups at the top of the stream; each time a resumed trainer gets its next batches
  from the real `RolloutWorker`s the back-pressure lets through, and the ledger (app/ledger.py)
  finds nothing lost, trained twice or over-stale;
- rollout workers SIGKILLed while they hold every lease the capacity allows: a live worker
  takes their leases over once they expire, and the trainer gets its batches;
- what back-pressure counts stays true: N workers leasing at once never overshoot
  ``capacity_groups``; a dead-lettered newest entry leaves no phantom; a resumed trainer does
  not count what an earlier one consumed again; a stale group whose next attempt was queued
  before is counted; staleness admission leases only groups that can still be trained fresh.

The trainer here is the real trainer's Redis side in its order (app/trainer/trainer.py,
app/trainer/intake.py): `take_groups` with `usable` against the lineage, `read_groups` and
`dead_letter_taken` for a payload that does not decode, the step's line in trained.jsonl, the
announce of the next version, then at each save the state (a manifest file written whole, as
the store's is written last) and `commit` up to its commit point; a resume runs
`drop_committed` first. Only the model is left out.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
import time
import traceback
from pathlib import Path

import pytest
import redis

from app.buffer import ExperienceBuffer, Sample, Task
from app.buffer.encoding import GroupHeader
from app.buffer.experience import stale_share
from app.config import RunConfig
from app.ledger import append_issued, audit, pending_prompts, read_issued, read_lineage
from app.rollout.engine_client import EngineClient, GenOutput
from app.rollout.worker import RolloutWorker
from app.trainer.intake import take_groups, usable
from app.trainer.state import TrainState, drop_committed, newer_entry

G = 2  # samples per group


def run_config(url: str, run_id: str, **buffer) -> RunConfig:
    return RunConfig.model_validate({
        "run_id": run_id,
        "buffer": {"redis_url": url, "capacity_groups": 4, "max_staleness": 1, "stale_policy": "requeue",
                   "lease_ms": 400, **buffer},
        "rollout": {"group_size": G, "inflight_sequences": 2 * G, "policy_poll_s": 0.1, "drain_grace_s": 1.0,
                    "publish_every_groups": 1},
        "trainer": {"groups_per_step": 2, "save_every": 1, "batch_timeout_s": 20, "steps": 100},
    }).validated()


def make_task(i: int, attempt: int = 0) -> Task:
    return Task(f"p{i:03d}", [1, 2, 3 + i], f"prompt {i}", "{}", G, attempt=attempt)


def samples_for(task: Task, run_id: str, version: int) -> list[Sample]:
    return [Sample(task.sample_id(run_id, k), task.task_id, k, task.attempt, task.prompt_ids, [7, 8],
                   [-0.5, -0.25], float(k % 2), version, "stop") for k in range(G)]


# ---- a forked process and a tripwire on its redis client ---------------------------------------


def fork(child) -> int:
    """Run ``child()`` in a forked process (it ends with os._exit: no pytest clean-up runs there)."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            child()
            code = 0
        except BaseException:  # noqa: BLE001 - said on stderr, then the exit code says it
            traceback.print_exc()
        finally:
            os._exit(code)
    return pid


def wait_pid(pid: int, timeout_s: float) -> int:
    """The signal that ended process ``pid`` (negative) or its exit code; kills it after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
        time.sleep(0.01)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    raise AssertionError(f"process {pid} still ran after {timeout_s} s")


def arm_tripwire(kill_at: int | None, calls: Path) -> None:
    """From now on this process SIGKILLs itself just before it sends its ``kill_at``-th Redis
    command (a pipeline or a script is one), so that commands 1..k-1 ran and none after, or once
    a blocking read came back empty (it waited: nothing was left to read); each command sent is
    counted in ``calls`` (one byte each, for the caller to count)."""
    sent, blocking = 0, False
    conn = redis.connection.AbstractConnection
    send, read = conn.send_packed_command, conn.read_response

    def send_or_die(self, command, check_health=True):
        nonlocal sent, blocking
        sent += 1
        if sent == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        with open(calls, "ab") as f:
            f.write(b".")
        packed = b"".join(command) if isinstance(command, list) else bytes(command)
        blocking = b"\r\nBLOCK\r\n" in packed
        return send(self, command, check_health)

    def read_or_die(self, *args, **kwargs):
        response = read(self, *args, **kwargs)
        if blocking and not response:
            os.kill(os.getpid(), signal.SIGKILL)
        return response

    conn.send_packed_command, conn.read_response = send_or_die, read_or_die


# ---- the trainer's Redis side, and real rollout workers on a stand-in engine -------------------


def incarnation(cfg: RunConfig, d: Path, last_step: int, arm=None) -> None:
    """One trainer process's life (module docstring) from the newest saved state in ``d`` up to
    step ``last_step``; ``arm()`` runs once the connections are open."""
    buf = ExperienceBuffer.from_config(cfg, autocommit=False)
    buf.r.ping()
    buf.raw.ping()
    m = json.loads((d / "manifest.json").read_text())
    step, version, commit_point, trained = m["step"], m["version"], m["commit_point"], set(m["lineage"])
    if arm is not None:
        arm()
    drop_committed(buf, commit_point)
    ledger = open(d / "trained.jsonl", "a")
    ledger.write(json.dumps({"resume_from_step": step}) + "\n")
    ledger.flush()
    buf.announce_policy(version, f"v{version}", force=True)
    while step < last_step:
        scratch, skipped, point = TrainState(version=version), [], [None]

        def keep(h) -> bool:
            point[0] = newer_entry(point[0], h.entry_id)
            return usable(h, scratch, cfg.buffer.max_staleness, 0, trained=trained, skipped=skipped)

        headers, _ = take_groups(buf, cfg, version, lambda: False, keep)
        _, bad = buf.read_groups(headers)
        for h, reason in bad:
            buf.dead_letter_taken(h, reason)
        bad_ids = {h.entry_id for h, _ in bad}
        good = [h for h in headers if h.entry_id not in bad_ids]
        step += 1
        ledger.write(json.dumps({"step": step, "trainer_version": version, "time": time.time(), "skipped": skipped,
                                 "groups": [{"task_id": h.task_id, "attempt": h.attempt,
                                             "samples": [[s.sample_id, s.policy_version] for s in h.samples]}
                                            for h in good]}) + "\n")
        ledger.flush()
        trained |= {f"{h.task_id}/{h.attempt}" for h in good}
        commit_point = newer_entry(commit_point, point[0])
        version += 1
        buf.announce_policy(version, f"v{version}")
        if step % cfg.trainer.save_every == 0:
            tmp = d / ".manifest.json.tmp"
            tmp.write_text(json.dumps({"step": step, "version": version, "commit_point": commit_point,
                                       "lineage": sorted(trained)}))
            os.replace(tmp, d / "manifest.json")
            buf.commit(upto=commit_point)
    buf.close()


class StandInEngine(EngineClient):
    """An engine that answers /generate at once with two tokens, stamped with the version the
    buffer announces (which it reports as its own); ``hang``: it never answers."""

    def __init__(self, cfg: RunConfig, hang: bool = False):
        super().__init__("http://127.0.0.1:9", timeout_s=5.0)
        self.policy = ExperienceBuffer.from_config(cfg)
        self.hang = hang

    async def generate(self, prompt, *, n: int = 1, **kwargs) -> list[GenOutput]:
        if self.hang:
            await asyncio.Event().wait()
        v = await self.weight_version()
        return [GenOutput([7, 8], [-0.5, -0.25], "ab", "stop", v) for _ in range(n)]

    async def health_generate(self, timeout_s: float = 30.0) -> bool:
        return True

    async def weight_version(self) -> int | None:
        current = self.policy.current_policy()
        return current[0] if current else 0


def run_worker(cfg: RunConfig, worker_id: str, hang: bool = False, stop: threading.Event | None = None) -> None:
    """A real `RolloutWorker` on a `StandInEngine` until ``stop`` is set (then it drains)."""
    async def go() -> None:
        worker = RolloutWorker(cfg, ExperienceBuffer.from_config(cfg), StandInEngine(cfg, hang), worker_id,
                               score_fn=lambda task, completion: 1.0)
        if stop is not None:
            loop = asyncio.get_running_loop()
            threading.Thread(target=lambda: (stop.wait(), loop.call_soon_threadsafe(worker.request_stop)),
                             daemon=True).start()
        await worker.run()

    asyncio.run(go())


class Fleet:
    """``n`` real rollout workers in threads of this process."""

    def __init__(self, cfg: RunConfig, n: int = 1):
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=run_worker, args=(cfg, f"live-{i}", False, self.stop), daemon=True)
                        for i in range(n)]
        for t in self.threads:
            t.start()

    def close(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(30)
        assert not any(t.is_alive() for t in self.threads), "a worker did not drain"


# ---- a trainer killed at every Redis call ------------------------------------------------------


def setup_run(url: str, run_id: str, d: Path) -> RunConfig:
    """The state the killed trainer starts from: the tasks queued (and in issued.jsonl), and in
    the samples stream, oldest first:
      A1 A2  v0, taken by an earlier trainer and covered by its saved state (its commit was
             interrupted: the resume deletes them);
      B1 B2  v1, taken by it after that save (B1's payload does not decode);
      J      a foreign entry (dead-lettered);
      C1     v1;
      S1-S4  v0: stale at the step after B's (max_staleness 1), the newest entries, as many as
             the capacity: the window that closed the gate for good before.
    """
    d.mkdir(parents=True)
    cfg = run_config(url, run_id)
    tasks = [make_task(i) for i in range(24)]
    append_issued(d / "issued.jsonl", [t.task_id for t in tasks])
    setup = ExperienceBuffer.from_config(cfg, capacity_groups=1000)
    setup.put_tasks(tasks)
    leased = setup.lease("setup", count=9, block_ms=0)
    for v in [0, 0, 1, 1, None, 1, 0, 0, 0, 0]:
        if v is None:
            setup.r.xadd(setup.keys["samples"], {"something": "else"})
            continue
        task = leased.pop(0)
        assert setup.publish(task, samples_for(task, run_id, v))
    earlier = ExperienceBuffer.from_config(cfg, autocommit=False)
    a = earlier.take_headers(2, trainer_version=1, timeout_s=1.0)
    b = earlier.take_headers(2, trainer_version=1, timeout_s=1.0)
    assert [h.task_id for h in a + b] == ["p000", "p001", "p002", "p003"]
    setup.raw.set(b[0].blob, b"\x00" * 16)  # B1: a payload that does not decode
    (d / "manifest.json").write_text(json.dumps({"step": 1, "version": 1, "commit_point": a[-1].entry_id,
                                                 "lineage": ["p000/0", "p001/0"]}))
    with open(d / "trained.jsonl", "w") as f:  # the earlier trainer's lines: step 1 (saved), step 2 (not)
        for step, hs in ((1, a), (2, b)):
            f.write(json.dumps({"step": step, "trainer_version": step - 1, "time": 0.0, "skipped": [],
                                "groups": [{"task_id": h.task_id, "attempt": h.attempt,
                                            "samples": [[s.sample_id, s.policy_version] for s in h.samples]}
                                           for h in hs]}) + "\n")
    setup.close()
    earlier.close()
    return cfg


def killed_then_resumed(url: str, run_id: str, d: Path, kill_at: int | None) -> int:
    """Set up, run the trainer in a process of its own up to its wait for step 3's groups (it
    is SIGKILLed there, or before its ``kill_at``-th Redis call), then a resumed trainer with
    a live worker to step 4. Returns the calls the killed trainer sent."""
    cfg = setup_run(url, run_id, d)
    calls = d / "calls"
    calls.touch()
    pid = fork(lambda: incarnation(cfg, d, last_step=3, arm=lambda: arm_tripwire(kill_at, calls)))
    assert wait_pid(pid, 30) == -signal.SIGKILL  # it cannot finish step 3: it waits, and dies there
    fleet = Fleet(cfg)
    try:
        incarnation(cfg, d, last_step=4)  # raises TimeoutError (take_groups) if the gate never opens
    finally:
        fleet.close()
    buf = ExperienceBuffer.from_config(cfg)
    lineage = read_lineage(d / "trained.jsonl")
    a = audit(read_issued(d / "issued.jsonl") - {"p002"}, lineage, pending_prompts(buf), cfg.buffer.max_staleness)
    # p002 is B1, whose payload the harness broke: dead-lettered, never trained (not a loss of the buffer's)
    assert (a.lost, a.duplicated, a.overstale) == (0, 0, 0), (kill_at, a)
    assert [r["step"] for r in lineage.steps] == [1, 2, 3, 4]
    assert "p002" not in {g["task_id"] for r in lineage.steps for g in r["groups"]}
    s = buf.stats()
    assert s["dead_lettered"] == 2, s  # J and B1, each once, whoever read them
    buf.close()
    return calls.stat().st_size


@pytest.mark.slow
def test_a_trainer_killed_at_any_redis_call_resumes_and_gets_its_batches(redis_server, tmp_path):
    """The whole life first (killed while it waits), which says how many Redis calls it makes;
    then killed before each of them in turn."""
    hung = []
    try:
        total = killed_then_resumed(redis_server, "k0", tmp_path / "k0", None)
    except TimeoutError:  # the resumed trainer got no batch: say how many calls the sweep would cover
        total, hung = (tmp_path / "k0" / "calls").stat().st_size, [None]
    assert total > 10
    for k in range(1, total + 1):
        try:
            killed_then_resumed(redis_server, f"k{k}", tmp_path / f"k{k}", k)
        except TimeoutError:
            hung.append(k)
    assert not hung, f"killed before these of its {total} Redis calls (None: while waiting), the resumed trainer got no batch: {hung}"


# ---- workers lost holding every lease ----------------------------------------------------------


@pytest.mark.slow
def test_workers_killed_holding_all_the_capacity_do_not_stop_the_run(redis_server, tmp_path):
    """Two worker processes lease the whole capacity (4) from engines that never answer and are
    SIGKILLed (a lost node: no drain). A live worker takes their leases over once they expire
    (lease_ms), and the trainer gets four batches; every prompt is trained once or still queued."""
    cfg = run_config(redis_server, "lost")
    buf = ExperienceBuffer.from_config(cfg, autocommit=False)
    tasks = [make_task(i) for i in range(12)]
    append_issued(tmp_path / "issued.jsonl", [t.task_id for t in tasks])
    buf.put_tasks(tasks)
    lost = [fork(lambda i=i: run_worker(cfg, f"lost-{i}", hang=True)) for i in range(2)]
    deadline = time.monotonic() + 30
    while buf.stats()["leased"] < cfg.buffer.capacity_groups:
        assert time.monotonic() < deadline, buf.stats()
        time.sleep(0.05)
    for pid in lost:
        os.kill(pid, signal.SIGKILL)
        assert wait_pid(pid, 10) == -signal.SIGKILL
    assert buf.stats()["leased"] == cfg.buffer.capacity_groups and not buf.has_capacity()
    fleet = Fleet(cfg)
    trained = []
    try:
        for version in range(4):
            buf.announce_policy(version, f"v{version}")
            headers, _ = take_groups(buf, cfg, version, lambda: False, lambda h: True)
            trained += headers
            buf.commit()
    finally:
        fleet.close()
    assert len(trained) == 8 and len({h.task_id for h in trained}) == 8
    pending = pending_prompts(buf)
    assert {h.task_id for h in trained} | pending == {t.task_id for t in tasks}


# ---- what back-pressure counts -------------------------------------------------------------------


def test_workers_leasing_at_once_never_overshoot_the_capacity(redis_server):
    """Eight workers lease 4 tasks each at the same moment against capacity 6: six leases in
    all (the check and the lease were two calls: each worker saw room and leased its 4)."""
    cfg = run_config(redis_server, "race", capacity_groups=6, lease_ms=60_000)
    buf = ExperienceBuffer.from_config(cfg)
    buf.put_tasks([make_task(i) for i in range(40)])
    go = threading.Barrier(8)
    got: list[int] = []

    def worker(i: int) -> None:
        mine = ExperienceBuffer.from_config(cfg)
        go.wait()
        got.append(len(mine.lease(f"w{i}", count=4, block_ms=0)))

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sum(got) == 6 and buf.stats()["leased"] == 6


def test_a_dead_lettered_newest_entry_leaves_no_phantom(redis_server, monkeypatch):
    """The newest group comes from a worker whose header the trainer does not know (a newer
    image: an unknown key): dead-lettered, it is counted nowhere any more."""
    cfg = run_config(redis_server, "phantom")
    buf = ExperienceBuffer.from_config(cfg, autocommit=False)
    buf.put_tasks([make_task(0), make_task(1)])
    first, second = buf.lease("w", count=2, block_ms=0)
    assert buf.publish(first, samples_for(first, "phantom", 0))
    to_json = GroupHeader.to_json
    monkeypatch.setattr(GroupHeader, "to_json", lambda h: to_json(h)[:-1] + ', "from_a_newer_worker": 1}')
    assert buf.publish(second, samples_for(second, "phantom", 0))
    monkeypatch.undo()
    assert [h.task_id for h in buf.take_headers(2, trainer_version=0, timeout_s=0.2)] == ["p000"]
    s = buf.stats()
    assert (s["dead_lettered"], s["untaken"], s["ready"]) == (1, 0, 1)


def test_a_resumed_trainer_does_not_count_consumed_groups_again(redis_server):
    """An earlier trainer took two groups (not committed) and requeued the newest four as stale;
    a resumed one reads the two again: nothing is untaken, the gate is open."""
    cfg = run_config(redis_server, "resume")
    setup = ExperienceBuffer.from_config(cfg, capacity_groups=100)
    setup.put_tasks([make_task(i) for i in range(6)])
    for i, task in enumerate(setup.lease("w", count=6, block_ms=0)):
        assert setup.publish(task, samples_for(task, "resume", 1 if i < 2 else 0))
    earlier = ExperienceBuffer.from_config(cfg, autocommit=False)
    assert len(earlier.take_headers(3, trainer_version=2, timeout_s=0.3)) == 2  # four stale, requeued
    resumed = ExperienceBuffer.from_config(cfg, autocommit=False)
    again = resumed.take_headers(2, trainer_version=2, timeout_s=0.3)
    assert [h.task_id for h in again] == ["p000", "p001"]
    s = resumed.stats()
    assert (s["untaken"], s["leased"], s["queued"], s["requeued"]) == (0, 0, 4, 4)
    assert resumed.has_capacity()
    assert [t.attempt for t in setup.lease("w", count=4, block_ms=0)] == [1, 1, 1, 1]


def test_a_stale_group_whose_next_attempt_was_queued_before_is_counted_dropped(redis_server):
    """requeue: the stale group of p000 attempt 0 arrives when p000 attempt 1 is already queued:
    it leaves counted (dropped_stale) and nothing is queued twice."""
    cfg = run_config(redis_server, "superseded")
    buf = ExperienceBuffer.from_config(cfg, autocommit=False)
    buf.put_tasks([make_task(0)])
    (task,) = buf.lease("w", block_ms=0)
    assert buf.publish(task, samples_for(task, "superseded", 0))
    assert buf.put_tasks([make_task(0, attempt=1)]) == 1
    assert buf.take_headers(1, trainer_version=5, timeout_s=0.2) == []
    s = buf.stats()
    assert (s["requeued"], s["dropped_stale"], s["queued"], s["ready"]) == (0, 1, 1, 0)
    assert s["finished"] == s["requeued"] + s["dropped_stale"] + s["consumed"] + s["ready"]
    assert stale_share(s) == 1.0


def test_staleness_admission_leases_only_groups_that_can_be_trained_fresh(redis_server):
    """capacity 20, 2 groups a step and a version a step, max_staleness 1. The trainer waits at
    v5 for 2 groups: a group leased by an engine at v3 is trained at v5 at the soonest (staleness
    2): none; at v4, only the 2 the take lacks; at v5, 2 more (trained at v6); at v6, 2 more (v7).
    Without the engine's version only the capacity counts. Once the take at v6 has its groups,
    the next group goes to the take after it (v7): an engine at v5 gets none, one at v6 two."""
    cfg = run_config(redis_server, "admit", capacity_groups=20, lease_ms=60_000)
    buf = ExperienceBuffer.from_config(cfg, autocommit=False)
    buf.put_tasks([make_task(i) for i in range(40)])
    assert buf.take_headers(2, trainer_version=5, timeout_s=0) == []  # the trainer waits at v5
    assert len(buf.lease("a", count=10, block_ms=0, engine_version=3)) == 0
    at4 = buf.lease("a", count=10, block_ms=0, engine_version=4)
    at5 = buf.lease("a", count=10, block_ms=0, engine_version=5)
    at6 = buf.lease("a", count=10, block_ms=0, engine_version=6)
    unknown = buf.lease("a", count=20, block_ms=0)
    assert [len(x) for x in (at4, at5, at6, unknown)] == [2, 2, 2, 14]
    for t in at6:
        assert buf.publish(t, samples_for(t, "admit", 6))
    buf.release(at4 + at5 + unknown)
    assert len(buf.take_headers(2, trainer_version=6, timeout_s=1.0)) == 2  # the take at v6 is complete
    assert len(buf.lease("a", count=10, block_ms=0, engine_version=5)) == 0
    assert len(buf.lease("a", count=10, block_ms=0, engine_version=6)) == 2
    # a version every 3 steps of up to 2 + 3 groups (dynamic sampling skips at most 3 a step)
    cfg.trainer.publish_every, cfg.trainer.dynamic_sampling, cfg.trainer.dynamic_sampling_max_skipped = 3, True, 3
    assert ExperienceBuffer.from_config(cfg).groups_per_version == 15
