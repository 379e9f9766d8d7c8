"""GPU utilisation and memory while a benchmark leg runs, sampled outside the leg's processes.

`GpuMonitor` runs ``nvidia-smi --query-gpu=timestamp,index,utilization.gpu,memory.used
--format=csv,noheader,nounits -lms PERIOD`` (one line per GPU per sample) beside the leg and
reads its lines; where nvidia-smi is missing it samples NVML through ``pynvml`` (the
``nvidia-ml-py`` package) in a thread; with neither it reports ``source: none``. Both count
every process on the GPU, so the moerl leg's trainer and engines are measured together and the
TRL leg's one process the same way.

Utilisation is NVML's: the share of the sample period in which a kernel ran on the GPU, not how
much of the GPU it used; memory is what the driver reports used (every process, the CUDA
contexts included).
"""

from __future__ import annotations

import shutil
import subprocess
import threading
import time
from dataclasses import asdict, dataclass

QUERY = "timestamp,index,utilization.gpu,memory.used"


@dataclass
class GpuWindow:
    """What the GPUs did during one window.

    Attributes:
        source: ``nvidia-smi``, ``pynvml`` or ``none``.
        samples: sampling instants read.
        util_mean_pct, util_max_pct: NVML utilisation over the samples and GPUs (percent).
        mem_peak_mib: most memory used at one instant, summed over the GPUs (MiB).
        mem_start_mib: memory used at the first sample (what was there before the leg).
    """

    source: str
    samples: int = 0
    util_mean_pct: float = float("nan")
    util_max_pct: float = float("nan")
    mem_peak_mib: float = float("nan")
    mem_start_mib: float = float("nan")

    def as_dict(self) -> dict:
        return asdict(self)


def summarize(rows: list[tuple[str, int, float, float]], source: str) -> GpuWindow:
    """A `GpuWindow` of ``(instant, gpu index, utilisation %, memory MiB)`` rows (one per GPU
    per instant; rows of one instant share its timestamp)."""
    if not rows:
        return GpuWindow(source=source)
    by_instant: dict[str, list[tuple[float, float]]] = {}
    for instant, _, util, mem in rows:
        by_instant.setdefault(instant, []).append((util, mem))
    utils = [u for _, _, u, _ in rows]
    mems = [sum(m for _, m in gpus) for gpus in by_instant.values()]
    return GpuWindow(source=source, samples=len(by_instant), util_mean_pct=sum(utils) / len(utils),
                     util_max_pct=max(utils), mem_peak_mib=max(mems), mem_start_mib=mems[0])


def parse_line(line: str) -> tuple[str, int, float, float] | None:
    """One ``nvidia-smi`` CSV line of `QUERY`; None for anything else ("[N/A]", a header)."""
    parts = [p.strip() for p in line.split(",")]
    if len(parts) != 4:
        return None
    try:
        return parts[0], int(parts[1]), float(parts[2]), float(parts[3])
    except ValueError:
        return None


class GpuMonitor:
    """Sample the GPUs every ``period_s`` between `start` and `stop`.

    Args:
        period_s: seconds between samples.
        command: the nvidia-smi to run (None: found on PATH).
    """

    def __init__(self, period_s: float = 0.5, command: str | None = None):
        self.period_s = period_s
        self.command = command or shutil.which("nvidia-smi")
        self.rows: list[tuple[str, int, float, float]] = []
        self.source = "none"
        self._proc: subprocess.Popen | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    def start(self) -> "GpuMonitor":
        if self.command:
            self.source = "nvidia-smi"
            self._proc = subprocess.Popen(
                [self.command, f"--query-gpu={QUERY}", "--format=csv,noheader,nounits",
                 "-lms", str(max(1, int(self.period_s * 1000)))],
                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
            self._thread = threading.Thread(target=self._read, name="gpu-monitor", daemon=True)
        elif _nvml() is not None:
            self.source = "pynvml"
            self._thread = threading.Thread(target=self._sample_nvml, name="gpu-monitor", daemon=True)
        if self._thread is not None:
            self._thread.start()
        return self

    def _read(self) -> None:
        for line in self._proc.stdout:
            row = parse_line(line)
            if row is not None:
                self.rows.append(row)

    def _sample_nvml(self) -> None:
        nvml = _nvml()
        nvml.nvmlInit()
        try:
            handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(nvml.nvmlDeviceGetCount())]
            while not self._stop.wait(self.period_s):
                instant = f"{time.time():.3f}"
                for i, h in enumerate(handles):
                    util = nvml.nvmlDeviceGetUtilizationRates(h).gpu
                    mem = nvml.nvmlDeviceGetMemoryInfo(h).used / 2**20
                    self.rows.append((instant, i, float(util), float(mem)))
        finally:
            nvml.nvmlShutdown()

    def stop(self) -> GpuWindow:
        """Stop sampling; what the GPUs did since `start`."""
        self._stop.set()
        if self._proc is not None:
            self._proc.terminate()
            try:
                self._proc.wait(5)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait(5)
        if self._thread is not None:
            self._thread.join(timeout=10)
        return summarize(list(self.rows), self.source)


def _nvml():
    """The ``pynvml`` module if installed (nvidia-ml-py), else None."""
    try:
        # optional: NVIDIA's NVML bindings, where the machine has them
        import pynvml
    except ImportError:
        return None
    return pynvml
