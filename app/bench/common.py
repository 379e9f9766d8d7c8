"""What the `moerl bench` commands share: dtype names, flag checks, device timestamps, the dense
matmul baseline and the profiler's top list."""

from __future__ import annotations

import time

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def check_device(device: str) -> None:
    """Raise ValueError naming --device unless it is cpu, or cuda with CUDA available."""
    try:
        kind = torch.device(device).type
    except RuntimeError:
        raise ValueError(f"--device {device!r}: not a torch device (cpu, cuda, cuda:N)") from None
    if kind not in ("cpu", "cuda"):
        raise ValueError(f"--device {device!r}: only cpu and cuda are measured")
    if kind == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda asked for but CUDA is not available")


def check_at_least_one(bench, names: tuple[str, ...]) -> None:
    """Raise ValueError naming the first of the integer flags `names` (attributes of `bench`,
    snake_case) that is below 1."""
    for name in names:
        if getattr(bench, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(bench, name)}")


def clock(cuda: bool):
    """A timestamp on the device timeline: a recorded CUDA event, or the host clock."""
    if cuda:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event
    return time.perf_counter()


def seconds_between(a, b, cuda: bool) -> float:
    """Seconds from timestamp a to b (both from `clock`; CUDA events must have completed)."""
    return a.elapsed_time(b) / 1e3 if cuda else b - a


class Marks:
    """A sequence of `clock` timestamps, read after one synchronize."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.points: list = []

    def mark(self) -> None:
        self.points.append(clock(self.cuda))

    def intervals(self) -> list[float]:
        """Seconds between consecutive marks."""
        if self.cuda:
            torch.cuda.synchronize()
        return [seconds_between(a, b, self.cuda) for a, b in zip(self.points, self.points[1:])]


def dense_matmul_tflops(device: torch.device, dtype: torch.dtype, n: int, iters: int = 10, warmup: int = 3) -> float:
    """TFLOP/s of ``torch.matmul`` on two random n x n matrices (2 n^3 FLOPs each)."""
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(warmup):
        torch.matmul(a, b)
    marks = Marks(device)
    marks.mark()
    for _ in range(iters):
        torch.matmul(a, b)
    marks.mark()
    return 2.0 * n**3 * iters / marks.intervals()[0] / 1e12


def profile_top(fn, device: torch.device, top: int = 15) -> list[dict]:
    """Run ``fn`` once under `torch.profiler` and return its ``top`` entries by self time.

    Self time is device time of kernels and copies on CUDA (operator rows, which repeat their
    kernels' time, are left out so nothing is counted twice) and CPU time of ops on CPU; each row
    has ``name`` (``profile:<op or kernel>``), ``self_ms``, ``calls`` and ``share`` of the total.
    """
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    attr = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
    events = prof.key_averages()
    if device.type == "cuda":
        events = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
    total = sum(getattr(e, attr) for e in events) or 1.0
    rows = sorted(events, key=lambda e: getattr(e, attr), reverse=True)[:top]
    return [{"name": f"profile:{e.key[:120]}", "self_ms": getattr(e, attr) / 1e3, "calls": e.count,
             "share": getattr(e, attr) / total} for e in rows]
