"""How busy the machine was while a benchmark leg ran: load average and other tenants' CPU.

A benchmark on a shared machine measures the other tenants as much as itself. The 1-minute
load average alone cannot tell them apart: it counts the leg's own runnable threads (and, for a
minute after it, the previous leg's). So `LoadMonitor` also measures, from ``/proc/stat``
through psutil, the CPU time the cores of this process's affinity spent busy (user, nice,
system, irq, softirq, steal) while the leg ran, and subtracts the CPU time of the leg's own
processes: what remains is everyone else's, as a number of cores (``others_cores``).

Quiet: ``others_cores <= QUIET_SHARE * cores``. Why 10 %: a leg that wants every core loses at
least the share the others take, and it does not lose it evenly. A synchronous trainer whose
OpenMP threads wait on each other at every op loses far more than single-thread processes that
overlap (the earlier `bench loop` figures went from 0.26x on an idle machine to 2.5x at load 5-6
on 2 cores). At 10 % of the machine (0.2 cores on 2) the share taken from a leg is within the
run-to-run spread of an idle machine, and anything above it is reported as not comparable.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

QUIET_SHARE = 0.10  # other tenants' CPU, as a fraction of this process's cores, still called quiet


def affinity_cores() -> list[int]:
    """The CPU numbers this process may run on."""
    return sorted(os.sched_getaffinity(0))


def busy_cpu_s(cpus: list[int]) -> float:
    """CPU seconds the cores ``cpus`` have spent busy since boot (psutil per-CPU times: user,
    nice, system, irq, softirq and steal; guest time is already inside user)."""
    # psutil: the bench extra (pyproject.toml)
    import psutil

    total = 0.0
    per = psutil.cpu_times(percpu=True)
    for i in cpus:
        t = per[i]
        total += t.user + t.nice + t.system + getattr(t, "irq", 0.0) + getattr(t, "softirq", 0.0)
        total += getattr(t, "steal", 0.0)
    return total


def process_cpu_s() -> dict[int, tuple[str, float]]:
    """Every visible process: pid -> (name, CPU seconds user + system so far)."""
    # psutil: the bench extra (pyproject.toml)
    import psutil

    out = {}
    for p in psutil.process_iter(["name", "cpu_times"]):
        t = p.info.get("cpu_times")
        if t is not None:
            out[p.pid] = (p.info.get("name") or "?", t.user + t.system)
    return out


@dataclass
class LoadWindow:
    """How busy the machine was during one leg.

    Attributes:
        window_s: wall seconds measured.
        cores: cores of this process's affinity.
        load_before: 1-minute load average when the leg started.
        load_mean, load_max: 1-minute load average sampled about once a second during the leg.
        busy_cpu_s: CPU seconds the cores were busy (everyone).
        own_cpu_s: CPU seconds of the leg's own processes.
        others_cores: (busy - own) / window, cores' worth used by everyone else (>= 0).
        quiet: others_cores <= QUIET_SHARE * cores.
        top_others: the other processes that used the most CPU in the window:
            [[name, pid, CPU seconds], ...] (at most 5).
    """

    window_s: float
    cores: int
    load_before: float
    load_mean: float
    load_max: float
    busy_cpu_s: float
    own_cpu_s: float
    others_cores: float
    quiet: bool
    top_others: list = field(default_factory=list)

    def as_dict(self) -> dict:
        d = asdict(self)
        return {k: round(v, 3) if isinstance(v, float) else v for k, v in d.items()}

    def describe(self) -> str:
        return (f"load {self.load_before:.2f} before, {self.load_mean:.2f} mean / {self.load_max:.2f} max during; "
                f"others used {self.others_cores:.2f} of {self.cores} cores "
                f"({'quiet' if self.quiet else 'NOT QUIET'}: threshold {QUIET_SHARE * self.cores:.2f})")


def summarize(samples: list[tuple[float, float, float, float]], load_before: float, cores: int,
              top_others: list | None = None) -> LoadWindow:
    """A `LoadWindow` from monitor samples ``(time s, load average, busy CPU s, own CPU s)``,
    in time order (at least two).

    Raises:
        ValueError: fewer than two samples.
    """
    if len(samples) < 2:
        raise ValueError(f"need at least two load samples, got {len(samples)}")
    (t0, _, busy0, own0), (t1, _, busy1, own1) = samples[0], samples[-1]
    window = max(t1 - t0, 1e-9)
    busy, own = busy1 - busy0, own1 - own0
    others = max(busy - own, 0.0) / window
    loads = [s[1] for s in samples]
    return LoadWindow(window_s=window, cores=cores, load_before=load_before, load_mean=sum(loads) / len(loads),
                      load_max=max(loads), busy_cpu_s=busy, own_cpu_s=own, others_cores=others,
                      quiet=others <= QUIET_SHARE * cores, top_others=top_others or [])


class LoadMonitor:
    """Samples the machine about once a second in a daemon thread while a leg runs.

    Args:
        own_cpu_s: returns the CPU seconds used so far by the leg's own processes (it may change
            which processes it counts as they start; it must not count a process twice).
        own_pids: returns the pids of the leg's own processes (left out of ``top_others``).
        period_s: seconds between samples.

    Use: ``mon.start()`` when the leg's window opens, ``window = mon.stop()`` when it closes.
    """

    def __init__(self, own_cpu_s: Callable[[], float], own_pids: Callable[[], set[int]] = set,
                 period_s: float = 1.0):
        self.own_cpu_s = own_cpu_s
        self.own_pids = own_pids
        self.period_s = period_s
        self.cpus = affinity_cores()
        self.samples: list[tuple[float, float, float, float]] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._procs0: dict[int, tuple[str, float]] = {}
        self.load_before = 0.0

    def _sample(self) -> None:
        self.samples.append((time.monotonic(), os.getloadavg()[0], busy_cpu_s(self.cpus), self.own_cpu_s()))

    def start(self) -> LoadMonitor:
        self.load_before = os.getloadavg()[0]
        self._procs0 = process_cpu_s()
        self._sample()

        def run() -> None:
            while not self._stop.wait(self.period_s):
                self._sample()

        self._thread = threading.Thread(target=run, name="load-monitor", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> LoadWindow:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self._sample()
        mine = self.own_pids() | {os.getpid()}
        procs1 = process_cpu_s()
        used = [(name, pid, cpu - self._procs0[pid][1]) for pid, (name, cpu) in procs1.items()
                if pid in self._procs0 and pid not in mine]
        used += [(name, pid, cpu) for pid, (name, cpu) in procs1.items() if pid not in self._procs0 and pid not in mine]
        top = [[n, p, round(c, 2)] for n, p, c in sorted(used, key=lambda x: -x[2])[:5] if c > 0]
        return summarize(self.samples, self.load_before, len(self.cpus), top)


def wait_quiet(max_s: float, probe_s: float = 10.0, own_cpu_s: Callable[[], float] = time.process_time) -> LoadWindow:
    """Probe the machine for ``probe_s`` seconds at a time, up to ``max_s`` seconds in all, until a
    probe finds it quiet; returns the last probe's `LoadWindow` (check ``.quiet``).

    Nothing of the benchmark runs meanwhile except this process (``own_cpu_s``).
    """
    deadline = time.monotonic() + max_s
    while True:
        mon = LoadMonitor(own_cpu_s).start()
        time.sleep(max(min(probe_s, deadline - time.monotonic()), 1.0))
        window = mon.stop()
        if window.quiet or time.monotonic() >= deadline:
            return window
