"""scripts/gpu_onegpu.sh, the one GPU call of issue 40, as far as it runs without a GPU: the commands
it runs (its dry run, parsed with the CLI's own options) and the install of the carried wheels and
redis-server (scripts/lib.sh `install_carried`, with a stand-in pip and redis-server)."""

from __future__ import annotations

import os
import stat
import subprocess
from pathlib import Path

import typer

from app.cli import command

ROOT = Path(__file__).resolve().parents[1]


def dry_run(tmp_path: Path, **env) -> list[list[str]]:
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_onegpu.sh")], cwd=tmp_path, capture_output=True,
                          text=True, timeout=60, env={**os.environ, "DRY_RUN": "1", **env})
    assert proc.returncode == 0, proc.stderr
    assert not list(tmp_path.iterdir()), "a dry run writes nothing"
    return [line.split() for line in proc.stdout.splitlines() if line.strip()]


def params(words: list[str]) -> dict:
    """The options of ``python3 -m app.cli NAME ...`` as click parses them (unknown ones fail)."""
    assert words[:3] == ["python3", "-m", "app.cli"], words
    cmd = command(words[3])
    rest = words[4:]
    if isinstance(cmd, typer.core.TyperGroup):  # `bench loop`
        cmd, rest = cmd.get_command(cmd.make_context(words[3], rest[:1], resilient_parsing=True), rest[0]), rest[1:]
    return cmd.make_context(words[3], rest).params


def test_the_run_is_moerl_run_with_no_flags_and_the_bench_is_on_the_gpu(tmp_path):
    run, bench = dry_run(tmp_path)
    assert run == ["python3", "-m", "app.cli", "run"]  # as a user starts it
    assert params(run)["config"] is None and params(run)["workers"] is None
    p = params(bench)
    assert (p["device"], p["task"], p["rounds"], p["seconds"]) == ("cuda", "gpu", 1, 45.0)
    (default,) = dry_run(tmp_path, STEPS="bench-default", BENCH_SECONDS="90")
    p = params(default)
    assert (p["device"], p["task"], p["seconds"]) == ("cuda", "", 90.0)


def test_install_carried_takes_one_wheel_of_each_name_and_wraps_redis_server(tmp_path):
    """The first wheel of each name over the directories goes to pip (here a stand-in that
    records its arguments), an sdist under src/ is built, and REDIS_BIN runs the carried
    redis-server with its libraries."""
    a, b = tmp_path / "a", tmp_path / "b"
    for d in (a, b, a / "src", a / "redis" / "lib"):
        d.mkdir(parents=True)
    for w in (a / "trl-1.16.0-py3-none-any.whl", b / "trl-1.15.0-py3-none-any.whl",
              b / "datasets-5.2.0-py3-none-any.whl", a / "src" / "pycosat-0.6.6.tar.gz"):
        w.write_text("")
    redis = a / "redis" / "redis-server"
    redis.write_text('#!/bin/sh\necho "redis $LD_LIBRARY_PATH $@"\n')
    pip_log = tmp_path / "pip.log"
    fake_py = tmp_path / "python"
    fake_py.write_text(f'#!/bin/sh\necho "$@" >> {pip_log}\n')
    fake_py.chmod(fake_py.stat().st_mode | stat.S_IEXEC)
    bin_path = tmp_path / "redis-server"
    script = (f'LOG={tmp_path}/log; PY={fake_py}; REDIS_BIN={bin_path}; source {ROOT}/scripts/lib.sh; '
              f'cd {tmp_path} && install_carried a b && echo "PYTHONPATH=$PYTHONPATH" && {bin_path} --version')
    out = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    wheels, sdist = pip_log.read_text().splitlines()
    assert sorted(Path(w).name for w in wheels.split() if w.endswith(".whl")) == [
        "datasets-5.2.0-py3-none-any.whl", "trl-1.16.0-py3-none-any.whl"]  # a's trl, not b's
    assert "--target /tmp/moerl-site" in wheels and sdist.endswith("a/src/pycosat-0.6.6.tar.gz")
    assert "PYTHONPATH=/tmp/moerl-site" in out.stdout
    assert f"redis {tmp_path}/a/redis/lib --version" in out.stdout
