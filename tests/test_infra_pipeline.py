"""The pipeline's pinned tools (issue 27 item 5, issue 28 item 7), without a synth: the CDK CLI and
aws-cdk-lib pair, the hashed lock of the synth job, and the npm lock of the CLI."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
from importlib.metadata import version
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LOCK = ROOT / "infra" / "requirements-synth.txt"


def _lock() -> dict[str, tuple[str, list[str]]]:
    """name -> (version, sha256 hashes) of infra/requirements-synth.txt."""
    text = re.sub(r"\\\n\s*", " ", LOCK.read_text())
    out = {}
    for line in text.splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        spec, *hashes = line.split()
        name, _, ver = spec.partition("==")
        assert ver and hashes, f"{line!r}: every line needs name==version and --hash"
        out[re.sub(r"[-_.]+", "-", name).lower()] = (ver, [h.removeprefix("--hash=sha256:") for h in hashes])
    return out


def test_the_cli_and_the_library_are_a_pinned_pair():
    from infra.pipeline import CDK_CLI_VERSION
    pkg = json.loads((ROOT / "infra/cdk-cli/package.json").read_text())
    lock = json.loads((ROOT / "infra/cdk-cli/package-lock.json").read_text())
    assert pkg["dependencies"] == {"aws-cdk": CDK_CLI_VERSION}
    entry = lock["packages"]["node_modules/aws-cdk"]
    assert entry["version"] == CDK_CLI_VERSION and entry["integrity"].startswith("sha512-")
    pins = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["infra"]
    (lib,) = [p for p in pins if p.startswith("aws-cdk-lib")]
    assert lib == f"aws-cdk-lib=={version('aws-cdk-lib')}", "pyproject pins the aws-cdk-lib the tests run"
    assert _lock()["aws-cdk-lib"][0] == version("aws-cdk-lib")
    # CLI 2.1148.1 bundles cloud-assembly-schema >= 55.5.0 (npm devDependencies): it reads the
    # schema major that this aws-cdk-lib writes; a library of a newer major needs a newer CLI.
    assert int(version("aws-cdk.cloud-assembly-schema").split(".")[0]) <= 55


def test_the_synth_lock_holds_every_package_at_the_tested_version_with_a_hash():
    lock = _lock()
    for name, (ver, hashes) in lock.items():
        assert version(name) == ver, f"{name}: locked {ver}, tests run {version(name)}"
        assert all(re.fullmatch(r"[0-9a-f]{64}", h) for h in hashes), name
    # what `python -m infra.app` imports, and everything those need (pip --no-deps installs no more)
    for root in ("aws-cdk-lib", "constructs", "cdk-nag", "aws-cdk-lambda-layer-kubectl-v36", "pydantic", "pyyaml",
                 "jsii", "typeguard", "pydantic-core", "aws-cdk-cloud-assembly-schema"):
        assert root in lock, root


def test_make_runs_the_cdk_on_node_22_without_an_end_of_life_notice():
    """Issue 39 item 5: jsii printed "Node 20 is end-of-life and not supported anymore" on every CDK
    and cdk8s call. The Makefile's node (NODE_VERSION, first on PATH for every target, and for pytest
    through tests/conftest.py) is Node 22, the major the pipeline's jobs select (infra/pipeline.py
    RUNTIMES); a jsii kernel started as the tests start one prints no notice."""
    from infra.pipeline import RUNTIMES
    (major,) = re.findall(r"^NODE_VERSION := (\d+)\.\d+\.\d+$", (ROOT / "Makefile").read_text(), re.M)
    assert major == RUNTIMES["nodejs"] == "22"
    node = shutil.which("node")
    got = subprocess.run([node, "-p", "process.versions.node"], capture_output=True, text=True, check=True).stdout
    assert int(got.split(".")[0]) >= 22, f"{node} is Node {got.strip()}: run `make test` (it installs Node 22 into .venv/node)"
    proc = subprocess.run([sys.executable, "-c", "import aws_cdk"], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "JSII_SILENCE_WARNING_DEPRECATED_NODE_VERSION": "1"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "end-of-life" not in proc.stderr + proc.stdout, proc.stderr[-2000:]
