"""`moerl plan --traffic` start-up reads (issue 27 item 12): where each role reads its start-up
bytes from (S3 or an S3-linked FSx for Lustre) and the seconds per node, by the formulas of
app/plan/traffic.py, checked by hand for DeepSeek-V3 on 16 trainer and 32 rollout nodes."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from app.model.config import deepseek_v3_config
from app.plan import traffic
from app.plan.cli import cli
from app.plan.params import param_shapes


@pytest.fixture(scope="module")
def dsv3():
    return deepseek_v3_config()


def test_startup_by_hand(dsv3):
    prefix = 5500 * 16 * 1024**2  # one S3 prefix: GET/s x part size, bytes/s
    assert traffic.s3_rate(32) == prefix / 32 < 100e9 / 8  # 32 readers share the prefix
    assert traffic.s3_rate(1) == 100e9 / 8  # one reader: its own link
    rows = {r.role: r for r in traffic.startup(dsv3, 16, 32)}
    start = rows["rollout nodes start (base model)"]
    assert start.nbytes == traffic.fp8_version_bytes(dsv3) and start.nodes == 32
    assert start.s3_s == pytest.approx(start.nbytes / (prefix / 32)) and start.fsx_s is None and start.reads_from == "S3"
    assert 200 < start.s3_s < 260  # ~673 GB at ~2.9 GB/s
    alone = rows["rollout node replaced (base model)"]
    assert alone.s3_s == pytest.approx(alone.nbytes / 12.5e9)
    params = sum(p.numel for p in param_shapes(dsv3))
    resume = rows["trainer gang resumes (training state, own shard)"]
    assert resume.nbytes == -(-params * 12 // 16)  # fp32 master + two AdamW moments, 1/16 each


def test_fsx_wins_only_where_its_throughput_beats_one_s3_prefix(dsv3):
    # 96 TiB x 1000 MB/s/TiB = 96 GB/s, about one S3 prefix (92 GB/s): the fleet start stays on S3
    # (FSx also pays the one import of the model).
    small = {r.role: r for r in traffic.startup(dsv3, 16, 32, fsx_tib=96)}
    start = small["rollout nodes start (base model)"]
    assert start.fsx_s == pytest.approx(start.nbytes / (96 * 1000e6 / 32) + start.nbytes / 12.5e9)
    assert start.reads_from == "S3"
    # 480 TiB: 15 GB/s per reader, capped at the client's 12.5 GB/s: the fleet start reads FSx.
    big = {r.role: r for r in traffic.startup(dsv3, 16, 32, fsx_tib=480)}
    assert big["rollout nodes start (base model)"].reads_from == "FSx"
    assert big["rollout nodes start (base model)"].fsx_s == pytest.approx(2 * start.nbytes / 12.5e9)
    with pytest.raises(ValueError, match="--fsx-mbps-per-tib"):
        traffic.startup(dsv3, 16, 32, fsx_tib=96, fsx_mbps_per_tib=300)


@pytest.mark.parametrize("args,message", [
    (("--fsx-tib", "inf"), "--fsx-tib"), (("--fsx-tib", "-1"), "--fsx-tib"),
    (("--fsx-tib", "96", "--fsx-mbps-per-tib", "200"), "--fsx-mbps-per-tib"),
    # A file system FSx cannot create (0.001 TiB was planned, at 1 GB/s for the whole fleet).
    (("--fsx-tib", "0.001"), "--fsx-tib 0.001: 1 GiB is not a PERSISTENT_2 capacity"),
    (("--fsx-tib", "3.6"), "--fsx-tib 3.6: 3600 GiB is not a PERSISTENT_2 capacity"),
    # Alone, the throughput was ignored without a word.
    (("--fsx-mbps-per-tib", "250"), "--fsx-mbps-per-tib needs --fsx-tib"),
])
def test_cli_startup_rows_and_bad_input(args, message):
    runner = CliRunner()
    base = ["--model", "deepseek-v3", "--nodes", "16", "--ep", "32", "--traffic", "--rollout-nodes", "32"]
    for allowed in ("1.2", "2.4", "480"):
        assert runner.invoke(cli, [*base, "--fsx-tib", allowed, "--json"]).exit_code in (0, 1)
    ok = runner.invoke(cli, [*base, "--fsx-tib", "480", "--json"])
    assert ok.exit_code in (0, 1), ok.output  # 1: the network path's staleness, not the start-up table
    rows = {r["role"]: r for r in json.loads(ok.output)["startup"]}
    assert rows["rollout nodes start (base model)"]["reads_from"] == "FSx"
    bad = runner.invoke(cli, [*base, *args])
    assert bad.exit_code == 2 and message in bad.output, bad.output
