"""The JSON result file every benchmark writes under runs/bench/.

One file per run, named ``<benchmark>-<UTC timestamp>.json``:

    {
      "benchmark": "moe",                      # which benchmark
      "created": "2026-01-01T00:00:00Z",       # UTC, ISO 8601
      "machine": {...},                        # host, CPU, cores, accelerator (machine_info)
      "versions": {...},                       # python, torch, transformers, CUDA, moerl (versions)
      "shape": {...},                          # the benchmark's inputs (flags)
      "figures": [{"name": ..., ...}, ...],    # one row per measured variant; units in the key names
      "ratios": {"a/b": 1.23, ...},            # derived comparisons, as printed
      "notes": [...]                           # variants skipped and why, formulas used
    }

Written atomically (temporary name in the same directory, then os.replace).
"""

from __future__ import annotations

import json
import os
import platform
import socket
import sys
import tempfile
import time
from importlib.metadata import version
from pathlib import Path

DEFAULT_DIR = Path("runs/bench")


def machine_info() -> dict:
    """Host name, OS, CPU model and core count, and the CUDA device if any."""
    # torch and transformers: only their versions; the buffer and rollout benches run without them
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    info = {
        "host": socket.gethostname(),
        "os": platform.platform(),
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
    }
    if torch.cuda.is_available():
        info["cuda_device"] = torch.cuda.get_device_name()
        info["cuda_capability"] = ".".join(map(str, torch.cuda.get_device_capability()))
        info["cuda_device_count"] = torch.cuda.device_count()
    return info


def versions() -> dict:
    """Versions of the software that decides the numbers."""
    # torch and transformers: only their versions; the buffer and rollout benches run without them
    import torch
    import transformers

    out = {"python": sys.version.split()[0], "torch": torch.__version__, "transformers": transformers.__version__}
    if torch.version.cuda:
        out["cuda"] = torch.version.cuda
    try:
        out["moerl"] = version("moerl")
    except Exception:  # noqa: BLE001 - not installed as a distribution (e.g. a plain checkout)
        pass
    return out


def check_out_dir(out_dir: str | os.PathLike) -> None:
    """Refuse an ``--out-dir`` that cannot hold the result before a benchmark runs, not after.

    Raises:
        ValueError: ``out_dir`` (or a parent) exists and is not a directory.
    """
    for p in (Path(out_dir), *Path(out_dir).parents):
        if p.exists():
            if not p.is_dir():
                raise ValueError(f"--out-dir: {p} is not a directory")
            return


def write_result(benchmark: str, shape: dict, figures: list[dict], ratios: dict | None = None,
                 notes: list[str] | None = None, out_dir: str | os.PathLike = DEFAULT_DIR,
                 extra: dict | None = None) -> Path:
    """Write one result file and return its path; ``extra`` adds top-level keys (e.g. ``quiet``).

    Raises:
        ValueError: `benchmark` is empty or a figure lacks a "name".
    """
    if not benchmark:
        raise ValueError("benchmark name is empty")
    for f in figures:
        if "name" not in f:
            raise ValueError(f"figure without a 'name': {f}")
    doc = {
        "benchmark": benchmark,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": machine_info(),
        "versions": versions(),
        "shape": shape,
        "figures": figures,
        "ratios": ratios or {},
        "notes": notes or [],
        **(extra or {}),
    }
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    fd, tmp = tempfile.mkstemp(dir=out_dir, prefix=f".{benchmark}-{stamp}.")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(doc, f, indent=2)
        os.chmod(tmp, 0o644)  # mkstemp makes 0600; a result file is for everyone to read
        # Two results in the same second get -1, -2, ...: link() never replaces an existing file.
        for n in range(1000):
            path = out_dir / f"{benchmark}-{stamp}{f'-{n}' if n else ''}.json"
            try:
                os.link(tmp, path)
                return path
            except FileExistsError:
                continue
        raise OSError(f"{out_dir}: 1000 result files named {benchmark}-{stamp}*.json already exist")
    finally:
        os.unlink(tmp)


def print_notes_and_write(benchmark: str, shape: dict, figures: list[dict], ratios: dict, notes: list[str],
                          out_dir: str | os.PathLike = DEFAULT_DIR) -> dict:
    """The common end of every bench command: print the notes, write the result file (`write_result`)
    and say where. Returns {"figures", "ratios", "notes", "path"}."""
    for n in notes:
        print(f"note: {n}")
    path = write_result(benchmark, shape, figures, ratios, notes, out_dir)
    print(f"wrote {path}")
    return {"figures": figures, "ratios": ratios, "notes": notes, "path": str(path)}


def read_result(path: str | os.PathLike) -> dict:
    """Load a result file written by `write_result`."""
    return json.loads(Path(path).read_text())
