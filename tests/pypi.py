"""PyPI for tests: what pip would install (`pip install --dry-run --report`) and wheel downloads.

The venv's own pip, against https://pypi.org/simple, with no pip configuration at all
(PIP_CONFIG_FILE=os.devnull and no PIP_* variables: a machine's global config, e.g. a torch cap in
/etc/xdg/pip or local find-links, must not decide the answer), a 20 s network timeout and one
retry. A resolution reads only metadata where the index publishes it separately (PEP 658: wheels);
an sdist-only dependency has its metadata built. When PyPI cannot be reached the call fails with
one message that says so, instead of hanging.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import urllib.request
from pathlib import Path

INDEX = "https://pypi.org/simple"


class PyPIError(AssertionError):
    """pip could not answer (PyPI unreachable, or the requirements cannot be resolved)."""


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env.update(PIP_CONFIG_FILE=os.devnull, PIP_DISABLE_PIP_VERSION_CHECK="1")
    return env


def unreachable() -> str | None:
    """Why PyPI cannot be reached from here, or None."""
    try:
        urllib.request.urlopen(f"{INDEX}/pip/", timeout=15).close()
    except OSError as e:
        return f"PyPI ({INDEX}) cannot be reached from this machine: {e}"
    return None


def _pip(args: list[str], timeout: float) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "pip", *args, "--index-url", INDEX, "--timeout", "20", "--retries", "1"]
    try:
        proc = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        raise PyPIError(unreachable() or f"pip {args[0]} did not finish in {timeout:.0f} s") from e
    if proc.returncode:
        # pip explains a conflict ("The conflict is caused by: ...") on stdout, the verdict on stderr.
        raise PyPIError(unreachable() or f"pip {' '.join(args)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-2000:]}")
    return proc


def resolve(requirements: list[str], constraints: list[str] = (), no_deps: bool = False,
            timeout: float = 300) -> list[dict]:
    """The distributions pip would install for `requirements` under `constraints` (pip's
    installation-report `metadata` dicts: name, version, requires_dist, ...), for this interpreter.

    Raises:
        PyPIError: PyPI is unreachable, or pip finds no consistent set (its error is in the message).
    """
    with tempfile.TemporaryDirectory() as d:
        constraints_txt = Path(d, "constraints.txt")
        constraints_txt.write_text("".join(f"{c}\n" for c in constraints))
        report = Path(d, "report.json")
        _pip(["install", "--dry-run", "--ignore-installed", "--prefer-binary", "--progress-bar", "off",
              "--report", str(report), "-c", str(constraints_txt), *(["--no-deps"] if no_deps else []),
              *requirements], timeout)
        return [item["metadata"] for item in json.loads(report.read_text())["install"]]


def download_wheel(spec: str, dest: Path, timeout: float = 300) -> Path:
    """Download one wheel (no dependencies) into `dest` and return its path."""
    dest.mkdir(parents=True, exist_ok=True)
    _pip(["download", "--no-deps", "--only-binary=:all:", "--quiet", "-d", str(dest), spec], timeout)
    wheels = sorted(dest.glob("*.whl"))
    if len(wheels) != 1:
        raise PyPIError(f"pip download {spec} left {len(wheels)} wheels in {dest}")
    return wheels[0]
