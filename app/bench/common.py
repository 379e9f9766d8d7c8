"""What the `moerl bench` commands share: dtype names, flag checks, device timestamps, the dense
matmul baseline and the profiler's top list."""

from __future__ import annotations

import time

import torch
from torch.profiler import ProfilerActivity, profile

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


# Kernel families by name, for a step's device-time split (first match wins: attention before
# gemm, as FlashAttention kernels are built on CUTLASS). cuBLAS/CUTLASS GEMMs
# show as gemm/xmma/nvjet/cutlass kernels on Hopper; SDPA's as flash/fmha; our Triton kernels by
# their function names (app/model/kernels.py); FSDP2's casts and copies as copy/cat kernels.
KERNEL_FAMILIES = (
    ("attention", ("flash", "fmha", "attention", "attn")),
    ("gemm", ("gemm", "xmma", "nvjet", "cutlass", "wgmma", "splitk", "grouped_mm", "kernel2")),
    ("triton", ("triton", "_gather_sum", "swiglu", "_logit_")),
    ("optimizer", ("multi_tensor", "adam")),
    ("softmax_reduce", ("softmax", "reduce", "logsumexp", "norm")),
    ("collective", ("nccl",)),
    ("copy_cast", ("copy", "memcpy", "memset", "cat", "fill", "index", "gather", "scatter")),
    ("elementwise", ("elementwise",)),
)


def kernel_family(name: str) -> str:
    """The `KERNEL_FAMILIES` entry whose substrings occur in a kernel's name ("other" if none)."""
    low = name.lower()
    for family, keys in KERNEL_FAMILIES:
        if any(k in low for k in keys):
            return family
    return "other"


def profile_top(fn, device: torch.device, top: int = 15, prefix: str = "profile",
                families: bool = False) -> list[dict]:
    """Run ``fn`` once under `torch.profiler` and return its ``top`` entries by self time.

    Self time is device time of kernels and copies on CUDA (operator rows and record_function
    annotations, which repeat their kernels' time, are left out so nothing is counted twice) and CPU time of ops on CPU; each row
    has ``name`` (``<prefix>:<op or kernel>``), ``self_ms``, ``calls`` and ``share`` of the total.
    With ``families`` it also returns one ``<prefix>_family:<family>`` row per `kernel_family`
    (every kernel counted, not only the top ones) and ``<prefix>_total:kernels`` /
    ``<prefix>_total:wall`` (the summed self time, and the wall-clock of the profiled call:
    where wall exceeds kernels on CUDA the device waited on the host).
    """
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        wall_ms = (time.perf_counter() - start) * 1e3
    attr = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
    events = prof.key_averages()
    if device.type == "cuda":
        # Kernels and copies only: record_function ranges (FSDP's, the optimizer's) also appear on
        # the device timeline as user annotations and would count their kernels' time twice.
        events = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA
                  and not getattr(e, "is_user_annotation", False)]
    total = sum(getattr(e, attr) for e in events) or 1.0
    rows = sorted(events, key=lambda e: getattr(e, attr), reverse=True)[:top]
    out = [{"name": f"{prefix}:{e.key[:120]}", "self_ms": getattr(e, attr) / 1e3, "calls": e.count,
            "share": getattr(e, attr) / total} for e in rows]
    if families:
        split: dict[str, list[float]] = {}
        for e in events:
            t = split.setdefault(kernel_family(e.key), [0.0, 0])
            t[0] += getattr(e, attr)
            t[1] += e.count
        out += [{"name": f"{prefix}_family:{k}", "self_ms": v[0] / 1e3, "calls": v[1], "share": v[0] / total}
                for k, v in sorted(split.items(), key=lambda kv: -kv[1][0])]
        out += [{"name": f"{prefix}_total:kernels", "self_ms": total / 1e3, "calls": len(events), "share": 1.0},
                {"name": f"{prefix}_total:wall", "self_ms": wall_ms, "calls": 1, "share": wall_ms * 1e3 / total}]
    return out
