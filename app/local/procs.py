"""Child processes of the embedded default: start, signal, restart and stop them.

`moerl run` and `moerl chaos` start every role (engine, rollout worker, trainer) as its own
process, each in its own process group. SIGTERM goes to the group (torchrun forwards it to its
ranks, which start sessions of their own); SIGKILL goes to the whole process tree, found through
/proc, since a group signal would miss those ranks. Output goes to one log file per process under
the run directory.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class Proc:
    """One supervised child process (a role replica)."""

    name: str
    argv: list[str]
    log_path: Path
    env: dict[str, str] = field(default_factory=dict)
    popen: subprocess.Popen | None = None
    starts: int = 0

    def start(self) -> "Proc":
        """Start (or restart) the process; stdout and stderr are appended to `log_path`."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "ab")
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **self.env}
        self.popen = subprocess.Popen(
            self.argv, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        log.close()
        self.starts += 1
        return self

    @property
    def pid(self) -> int | None:
        return self.popen.pid if self.popen else None

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def returncode(self) -> int | None:
        return None if self.popen is None else self.popen.poll()

    def signal(self, sig: int) -> None:
        """Send `sig` to the process group (the role and its children); no-op if it is gone."""
        if self.alive():
            try:
                os.killpg(self.popen.pid, sig)
            except ProcessLookupError:
                pass

    def kill_tree(self) -> None:
        """SIGKILL the process and every descendant (a lost node).

        A process-group signal is not enough for the trainer: torchrun starts each rank in a
        session of its own, so `signal(SIGKILL)` would kill torchrun and leave its ranks running.
        """
        if not self.alive():
            return
        pids = [self.popen.pid, *descendants(self.popen.pid)]
        for pid in pids:  # parent first: a dead torchrun starts no new rank
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.popen.wait()

    def wait(self, timeout_s: float) -> int | None:
        """Wait up to `timeout_s` seconds; returns the exit code or None if still running."""
        if self.popen is None:
            return None
        try:
            return self.popen.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return None

    def stop(self, grace_s: float = 10.0) -> int | None:
        """SIGTERM, wait `grace_s` seconds, then SIGKILL. Returns the exit code."""
        if not self.alive():
            return self.returncode()
        self.signal(signal.SIGTERM)
        code = self.wait(grace_s)
        if code is None:
            self.kill_tree()
            code = self.wait(5.0)
        return code

    def tail(self, n: int = 20) -> str:
        """The last `n` lines of the log, for error messages."""
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except FileNotFoundError:
            return ""


class Supervisor:
    """Owns the child processes of one run; stops all of them on exit, Ctrl-C included."""

    def __init__(self, log_dir: Path):
        self.log_dir = Path(log_dir)
        self.procs: dict[str, Proc] = {}

    def start(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> Proc:
        """Start a process named `name` (unique within the run)."""
        if name in self.procs and self.procs[name].alive():
            raise RuntimeError(f"process {name!r} is already running")
        proc = Proc(name, argv, self.log_dir / f"{name}.log", env or {})
        self.procs[name] = proc
        return proc.start()

    def stop_all(self, grace_s: float = 10.0) -> None:
        """Stop every process: SIGTERM to all first, then wait, then SIGKILL what is left."""
        for proc in self.procs.values():
            proc.signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for proc in self.procs.values():
            proc.wait(max(0.0, deadline - time.monotonic()))
        for proc in self.procs.values():
            if proc.alive():
                proc.kill_tree()
                proc.wait(5.0)

    def __enter__(self) -> "Supervisor":
        return self

    def __exit__(self, *exc) -> None:
        self.stop_all()


def sigterm_as_interrupt(signum, frame) -> None:
    """Signal handler: SIGTERM (``timeout``, ``kill``, a pod's stop) ends a command as Ctrl-C
    does, so its finally blocks stop the processes it started instead of orphaning them."""
    raise KeyboardInterrupt


def descendants(pid: int) -> list[int]:
    """Process ids of every descendant of ``pid`` (Linux: parent ids read from /proc/*/stat)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue  # exited while we looked
        # Field 4 is the parent pid; the command name (field 2) may hold spaces, so split after ')'.
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry.name))
    out: list[int] = []
    stack = [pid]
    while stack:
        for child in children.get(stack.pop(), []):
            out.append(child)
            stack.append(child)
    return out


def moerl_argv(*args: str) -> list[str]:
    """argv that runs a `moerl` sub-command with this interpreter (works without the script on PATH)."""
    return [sys.executable, "-m", "app.cli", *args]
