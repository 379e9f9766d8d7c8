"""Run a verifier where it can be killed: worker processes that each take one call at a time, and a
deadline per call after which the process is SIGKILLed and the call fails.

Why processes: model output reaches verifiers, and some of it never finishes (math-verify on
``Answer: 9^9^9^9`` builds a power tower in sympy). math-verify's own timeouts use SIGALRM, which
works only in a process's main thread, and a Python thread cannot be stopped, so a hung call in the
rollout worker's reward threads would hold its thread (and a core) for good. A process can be
killed.

The workers are forked from multiprocessing's forkserver, which imports ``preload`` once (sympy
and math-verify take seconds), so starting a replacement for a killed worker takes milliseconds.
Each worker gets SIGKILL when the forkserver exits (PR_SET_PDEATHSIG), and the forkserver exits
when this process does (Python docs, multiprocessing "Contexts and start methods"), so no worker
outlives the role that started it.
"""

from __future__ import annotations

import ctypes
import importlib
import multiprocessing
import signal
import threading
import time
from typing import Any


class CallTimeout(TimeoutError):
    """The call did not return within the pool's deadline; its worker process was killed."""


class CallFailed(RuntimeError):
    """The call raised in the worker process (the message is its type and text), or the worker died."""


def _die_with_parent() -> None:
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def _serve(conn, target: str) -> None:
    """Worker process: call ``target`` ("module:attr") with each argument tuple received, send back
    ("ok", value) or ("error", message); stop when the other end closes."""
    _die_with_parent()
    module, attr = target.split(":")
    fn = getattr(importlib.import_module(module), attr)
    while True:
        try:
            args = conn.recv()
        except (EOFError, OSError):
            return
        try:
            reply = ("ok", fn(*args))
        except Exception as e:  # noqa: BLE001 - reported to the caller, which raises CallFailed
            reply = ("error", f"{type(e).__name__}: {e}"[:500])
        conn.send(reply)


class DeadlinePool:
    """At most ``size`` worker processes calling ``target``; `call` waits for a free one.

    Args:
        target: "module:attr" of a module-level function; its arguments and result must pickle.
        size: worker processes at most (one call each at a time).
        deadline_s: how long one call may run, seconds, counted from when a worker has it.
        preload: modules the forkserver imports once before forking workers.

    Raises:
        ValueError: size < 1 or deadline_s <= 0.
    """

    def __init__(self, target: str, size: int, deadline_s: float, preload: tuple[str, ...] = ()):
        if size < 1:
            raise ValueError(f"size must be >= 1, got {size}")
        if not deadline_s > 0:
            raise ValueError(f"deadline_s must be > 0, got {deadline_s}")
        self.target, self.size, self.deadline_s = target, size, deadline_s
        self._ctx = multiprocessing.get_context("forkserver")
        if preload:
            self._ctx.set_forkserver_preload(list(preload))
        self._slots = threading.BoundedSemaphore(size)
        self._lock = threading.Lock()
        self._idle: list[tuple[Any, Any]] = []  # (connection, process) waiting for a call
        self.killed = 0  # workers killed at the deadline (a figure for the logs and tests)

    def _start(self) -> tuple[Any, Any]:
        ours, theirs = self._ctx.Pipe()
        proc = self._ctx.Process(target=_serve, args=(theirs, self.target), daemon=True,
                                 name=f"deadline-pool:{self.target}")
        proc.start()
        theirs.close()
        return ours, proc

    @staticmethod
    def _kill(worker: tuple[Any, Any]) -> None:
        conn, proc = worker
        proc.kill()
        proc.join(5)
        conn.close()

    def call(self, *args: Any) -> Any:
        """``target(*args)`` in a worker process.

        Raises:
            CallTimeout: it ran longer than ``deadline_s`` (the worker was killed).
            CallFailed: it raised in the worker, or the worker died.
        """
        with self._slots:
            with self._lock:
                worker = self._idle.pop() if self._idle else None
            if worker is None or not worker[1].is_alive():
                if worker is not None:
                    self._kill(worker)
                worker = self._start()
            conn, proc = worker
            t0 = time.monotonic()
            try:
                conn.send(args)
                ready = conn.poll(self.deadline_s)
                reply = conn.recv() if ready else None
            except (EOFError, OSError, BrokenPipeError) as e:
                self._kill(worker)
                raise CallFailed(f"{self.target}: worker process {proc.pid} died ({type(e).__name__})") from None
            if reply is None:
                self._kill(worker)
                with self._lock:
                    self.killed += 1
                raise CallTimeout(f"{self.target}: no answer within {self.deadline_s:g} s "
                                  f"(worker {proc.pid} killed after {time.monotonic() - t0:.1f} s)")
            with self._lock:
                self._idle.append(worker)
            status, value = reply
            if status == "error":
                raise CallFailed(f"{self.target}: {value}")
            return value

    def close(self) -> None:
        """Stop every idle worker (callers in flight finish or time out on their own)."""
        with self._lock:
            idle, self._idle = self._idle, []
        for worker in idle:
            self._kill(worker)
