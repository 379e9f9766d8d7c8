"""Where the embedded loop's CPU goes: py-spy on every role process, per-thread CPU from psutil.

`moerl bench loop --profile` runs this over the first moerl leg's window. For each role process
(trainer ranks, engines, rollout workers) it runs ``py-spy record --format raw --threads
--nonblocking`` (https://github.com/benfred/py-spy: sampled Python stacks per thread, without
stopping the process) and reads each thread's CPU time (``/proc/<pid>/task``, through psutil)
at the start and the end. redis-server (C, no Python stacks) and the benchmark's own process
(the supervisor and the task feeder, as in `moerl run`) get their CPU time only.

Attribution: a thread's CPU seconds are split over activities in proportion to its samples
(each stack goes to the first rule of its role in `RULES` that matches one of its frames);
threads that ended inside the window are covered by the process's CPU time, split like the
samples of the threads that were not measured. On a loaded machine py-spy also counts a thread
that is runnable but waiting for a core as active, at the line where it blocked: samples whose
innermost frame is a blocking wait (`WAIT_LEAVES`: a queue get, epoll, a condition) get none
of the thread's CPU time, and weighting by each thread's measured CPU keeps every activity
within its thread's real CPU time.
"""

from __future__ import annotations

import collections
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

# Rules per role kind: (activity, frame substrings). A stack goes to the first rule one of whose
# substrings occurs in one of its frames; py-spy frames read "function (package/file.py:line)".
RULES: dict[str, list[tuple[str, tuple[str, ...]]]] = {
    "trainer": [
        ("state save (DCP)", ("save_state (app/trainer/state.py",)),
        ("publish: gather shards (gloo)", ("_gathered (app/trainer/publish.py", "all_gather_object")),
        ("publish: write, upload, announce, prune", ("publish_version (app/trainer/publish.py",)),
        ("step: EP all-to-all (gloo)", ("all_to_all (app/model/dispatch/alltoall.py",
                                        "_exchange_counts (app/model/dispatch/alltoall.py")),
        ("step: FSDP all-gather / reduce-scatter (gloo)", ("torch/distributed/fsdp/",)),
        ("step: optimizer (AdamW)", ("torch/optim/",)),
        ("step: grad-norm clip", ("clip_grad_norm (app/trainer/step.py",)),
        ("step: other collectives (all-reduce of counts, stats)", ("_all_reduce (app/trainer/step.py",)),
        ("step: backward", ("Tensor.backward (torch/_tensor.py",)),
        ("step: forward + loss", ("train_step (app/trainer/step.py",)),
        ("batch: take groups from Redis", ("take_groups (app/trainer/intake.py",)),
        ("batch: scatter to ranks", ("scatter_groups (app/trainer/intake.py",)),
        ("batch: collate", ("collate_groups (app/trainer/batch.py",)),
        ("ledger + metrics (fsync, Redis stats)", ("append_line (app/trainer/trainer.py", "json/", "logging/",
                                                   "ExperienceBuffer.stats", "ExperienceBuffer.commit")),
    ],
    "engine": [
        ("weight reload: checks", ("check_checkpoint (app/model/checkpoint.py",)),
        ("weight reload: load model + tokenizer", ("load_checkpoint (app/engine/load.py",
                                                   "Engine.update_weights", "transformers/core_model_loading")),
        ("decode forward + sampling", ("DecodeBatch.step (app/engine/sampler.py",)),
        ("prefill forward", ("DecodeBatch.add (app/engine/sampler.py",)),
        ("HTTP + JSON (uvicorn, FastAPI)", ("uvicorn/", "starlette/", "fastapi/", "h11/", "httptools",
                                           "_response_item (app/engine", "parse_generate (app/engine", "json/")),
        ("health probes", ("Engine.health (app/engine",)),
        ("thread hand-off (to_thread, wake-ups)", ("concurrent/futures/thread.py", "call_soon_threadsafe",
                                                   "_write_to_self", "to_thread")),
        ("event loop (select, scheduling)", ("asyncio/", "selectors.py")),
    ],
    "worker": [
        ("policy download (copy, fsync) + cache pruning", ("RolloutWorker._download (app/rollout/worker.py",)),
        ("weight update calls (pause, update, continue)", ("RolloutWorker.sync_policy (app/rollout/worker.py",)),
        ("leasing within back-pressure (lease, its polling included)", ("ExperienceBuffer.lease",)),
        ("Redis calls (lease, publish, extend, policy)", ("redis/", "app/buffer/")),
        ("reward function", ("app/envs/", "reasoning_gym/", "RewardPool")),
        ("HTTP client (httpx)", ("httpx/", "httpcore/", "anyio/", "h11/", "app/rollout/engine_client.py")),
        ("logging", ("logging/",)),
        ("building samples", ("app/buffer/records.py", "RolloutWorker.rollout (app/rollout/worker.py")),
        ("thread hand-off (executors, wake-ups)", ("concurrent/futures/thread.py", "call_soon_threadsafe",
                                                   "_write_to_self", "run_in_executor")),
        ("event loop (select, scheduling)", ("asyncio/", "selectors.py")),
    ],
}
OTHER = "other (unmatched)"
# A stack whose innermost Python frame is one of these waits in C (a queue, epoll, a condition
# variable): no CPU is spent there. py-spy still counts it as active while the woken thread
# waits for a core on a loaded machine, so these samples get none of the thread's CPU time.
WAITING = "waiting (blocked, or runnable without a core)"
WAIT_LEAVES = ("_worker (concurrent/futures/thread.py", "select (selectors.py", "wait (threading.py",
               "RewardPool._serve (app/rollout/scoring.py", "get (queue.py")
IMPORTS = ("start-up: imports", ("<frozen importlib._bootstrap",))
for _rules in RULES.values():
    _rules.insert(0, IMPORTS)


def role_kind(name: str) -> str:
    """Rule set of a role process: "trainer-rank0" -> "trainer", "engine-1" -> "engine"."""
    for kind in RULES:
        if name.startswith(kind):
            return kind
    raise ValueError(f"no profile rules for role {name!r}")


def activity(kind: str, frames: list[str]) -> str:
    """The activity of one sampled stack (root first) under ``RULES[kind]``."""
    for label, needles in RULES[kind]:
        for frame in frames:
            if any(n in frame for n in needles):
                return label
    return OTHER


def parse_raw(path: Path, kind: str) -> dict[int, tuple[str, collections.Counter]]:
    """py-spy ``--format raw --threads`` output -> {thread id: (thread name, Counter(activity))}.

    Each line is ``thread (TID): NAME;frame;frame;... COUNT``.
    """
    out: dict[int, tuple[str, collections.Counter]] = {}
    if not path.is_file():
        return out
    for line in path.read_text().splitlines():
        stack, _, count = line.rstrip().rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames = stack.split(";")
        head = frames[0]  # "thread (TID): NAME" (py-spy 0.4) or "thread (TID)"
        try:
            tid = int(head.split("(", 1)[1].split(")", 1)[0], 0)
        except (IndexError, ValueError):
            continue
        name = head.split(":", 1)[1].strip() if ":" in head else (frames[1] if len(frames) > 1 else "?")
        if tid not in out:
            out[tid] = (name, collections.Counter())
        waiting = len(frames) > 1 and frames[-1].startswith(WAIT_LEAVES)
        out[tid][1][WAITING if waiting else activity(kind, frames[1:])] += int(count)
    return out


def thread_cpu_s(pid: int) -> tuple[float, dict[int, float]]:
    """(process CPU seconds, {thread id: CPU seconds}) now; (0, {}) if the process is gone."""
    # psutil: the bench extra (pyproject.toml)
    import psutil

    try:
        p = psutil.Process(pid)
        t = p.cpu_times()
        return t.user + t.system, {th.id: th.user_time + th.system_time for th in p.threads()}
    except psutil.Error:
        return 0.0, {}


@dataclass
class RoleProfile:
    """One role process over the window: CPU seconds per activity (sum = its CPU seconds)."""

    name: str
    pid: int
    cpu_s: float = 0.0
    samples: int = 0
    activities: dict[str, float] = field(default_factory=dict)
    threads: list = field(default_factory=list)  # [[thread name, CPU s, samples], ...], busiest first


def attribute(name: str, pid: int, cpu0: tuple[float, dict], cpu1: tuple[float, dict],
              sampled: dict[int, tuple[str, collections.Counter]]) -> RoleProfile:
    """Split a process's CPU seconds over activities (see the module docstring)."""
    proc_s = max(cpu1[0] - cpu0[0], 0.0)
    acts: collections.Counter = collections.Counter()
    threads = []
    measured = 0.0
    unmeasured: collections.Counter = collections.Counter()  # samples of threads that ended in the window
    for tid, (tname, all_counts) in sampled.items():
        busy = {a: c for a, c in all_counts.items() if a != WAITING}
        counts = busy or dict(all_counts)  # only waiting samples: keep them, CPU must go somewhere
        n = sum(counts.values())
        if tid in cpu1[1]:  # a thread that started inside the window: all of its CPU time is in it
            s = max(cpu1[1][tid] - cpu0[1].get(tid, 0.0), 0.0)
            measured += s
            for a, c in counts.items():
                acts[a] += s * c / n
            threads.append([tname, round(s, 3), sum(all_counts.values())])
        else:
            unmeasured.update(counts)
    # CPU of threads py-spy never saw in Python (gloo, OpenMP, C extensions' own threads).
    native = sum(max(cpu1[1][t] - cpu0[1].get(t, 0.0), 0.0) for t in cpu1[1] if t not in sampled)
    rest = max(proc_s - measured - native, 0.0)
    total_unmeasured = sum(unmeasured.values())
    if total_unmeasured:
        for a, c in unmeasured.items():
            acts[a] += rest * c / total_unmeasured
    else:
        native += rest
    if native > 0:
        acts["threads without Python frames (gloo, OpenMP, C)"] += native
    threads.sort(key=lambda t: -t[1])
    total_samples = sum(sum(c.values()) for _, c in sampled.values())
    return RoleProfile(name, pid, proc_s, total_samples, {a: round(s, 4) for a, s in acts.most_common()}, threads[:8])


class LoopProfiler:
    """py-spy on every role process of one window; ``stop()`` returns their `RoleProfile`s.

    Args:
        roles: role name (``trainer-rank0``, ``engine-1``, ``worker-0``: see `role_kind`) -> pid.
        out_dir: where py-spy's raw files go (kept, for a flame graph or a second look).
        rate: samples per second per process.

    Raises:
        FileNotFoundError: py-spy is not installed (``pip install py-spy``).
    """

    def __init__(self, roles: dict[str, int], out_dir: Path, rate: int = 50):
        exe = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
        if not Path(exe).is_file():
            raise FileNotFoundError("--profile needs py-spy (pip install py-spy): not found on PATH or beside python")
        self.exe, self.roles, self.rate = exe, roles, rate
        self.out_dir = Path(out_dir)
        self.procs: dict[str, subprocess.Popen] = {}
        self.cpu0: dict[str, tuple[float, dict]] = {}

    def start(self) -> LoopProfiler:
        self.out_dir.mkdir(parents=True, exist_ok=True)
        for name, pid in self.roles.items():
            argv = [self.exe, "record", "--pid", str(pid), "--rate", str(self.rate), "--format", "raw",
                    "--threads", "--nonblocking", "--output", str(self.out_dir / f"{name}.txt")]
            with open(self.out_dir / f"{name}.py-spy.log", "wb") as log:
                self.procs[name] = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=log)
        for name, pid in self.roles.items():
            self.cpu0[name] = thread_cpu_s(pid)
        return self

    def stop(self) -> list[RoleProfile]:
        cpu1 = {name: thread_cpu_s(pid) for name, pid in self.roles.items()}
        for p in self.procs.values():
            p.send_signal(signal.SIGINT)  # py-spy writes its file on SIGINT
        for p in self.procs.values():
            try:
                p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        out = []
        for name, pid in self.roles.items():
            sampled = parse_raw(self.out_dir / f"{name}.txt", role_kind(name))
            out.append(attribute(name, pid, self.cpu0[name], cpu1[name], sampled))
        return out


def per_step_table(profiles: list[RoleProfile], extra_cpu_s: dict[str, float], steps: int) -> list[dict]:
    """Rows ``{"role", "activity", "cpu_ms_per_step", "share"}`` summed over processes of a kind
    (both engines, both workers, both ranks), busiest first; ``extra_cpu_s`` adds CPU-only
    processes (redis-server, the benchmark process). Shares are of the whole loop's CPU."""
    rows: collections.Counter = collections.Counter()
    for p in profiles:
        kind = role_kind(p.name)
        for a, s in p.activities.items():
            rows[(kind, a)] += s
    for name, s in extra_cpu_s.items():
        rows[(name, "all")] += s
    total = sum(rows.values()) or 1.0
    steps = max(steps, 1)
    return [{"role": k, "activity": a, "cpu_ms_per_step": round(1000 * s / steps, 2), "share": round(s / total, 4)}
            for (k, a), s in rows.most_common()]
