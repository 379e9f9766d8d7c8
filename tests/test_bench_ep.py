"""Multi-rank EP benchmarks (`moerl bench dispatch | ep-train-step`) and the multi-GPU EP checks.

CPU: both benchmarks run under torchrun with 2 gloo ranks and tiny shapes and write valid result
files (no timing is asserted); the byte count behind the bandwidth matches a hand count for a fixed
routing, and the benchmark's own byte counts match that function on the routing it drew; NVLink
multicast must be off before anything starts on CUDA; scripts/gpu_ep_bench.sh only uses CLI
options that exist.

GPU only (skipped here; scripts/gpu_ep_bench.sh runs them on 2, 4 and 8 H200s): the EP equivalence
cases of tests/test_ep_equivalence.py with NCCL all-to-all at EP 4 and 8 (DeepEP's: tests/test_deepep.py).
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import typer.main
from typer.testing import CliRunner

from app.bench.cli import cli
from app.bench.dispatch import MULTICAST_OFF, check_multicast_off, rank_bytes, uniform_topk
from app.bench.results import read_result

ROOT = Path(__file__).resolve().parents[1]


def torchrun(*args: str, nproc: int = 2, timeout: int = 240) -> subprocess.CompletedProcess:
    """`torchrun --standalone --nproc-per-node N -m app.cli bench ARGS` on CPU (gloo ranks)."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "-m", "app.cli", "bench", *args]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def only_result(out_dir: Path, benchmark: str) -> dict:
    files = sorted(out_dir.glob(f"{benchmark}-*.json"))
    assert len(files) == 1, files  # rank 0 alone writes
    doc = read_result(files[0])
    assert doc["benchmark"] == benchmark
    assert not list(out_dir.glob(".*")), "temporary files left behind"
    return doc


def positive(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


def test_rank_bytes_matches_a_hand_count() -> None:
    # 4 ranks, 8 experts (2 per rank: rank = expert // 2), top-3, rank 1's view.
    topk_idx = torch.tensor([
        [0, 1, 2],    # ranks 0, 0, 1 -> to rank 0 once (dedup), own rank 1 not counted
        [2, 3, -1],   # only own rank 1 -> nothing crosses
        [4, 6, 7],    # ranks 2, 3, 3 -> two rows (rank 2, rank 3)
        [-1, -1, 5],  # rank 2 -> one row
        [7, 0, 4],    # ranks 3, 0, 2 -> three rows
    ])
    got = rank_bytes(topk_idx, rank=1, num_ranks=4, num_experts=8, row_bytes=14336.0)
    assert got["tokens_to_rank"] == [2, 2, 3, 2]  # tokens with >= 1 expert on each rank
    assert got["algorithm_bytes"] == (1 + 0 + 2 + 1 + 3) * 14336.0
    # alltoall's wire rows: one per (token, expert) slot on another rank
    assert got["slot_rows_to_others"] == 2 + 0 + 3 + 1 + 3


def test_multicast_must_be_off_on_cuda() -> None:
    with pytest.raises(ValueError) as e:
        check_multicast_off(True, env={"NCCL_NVLS_ENABLE": "1"})
    for key, value in MULTICAST_OFF.items():
        assert f"{key}={value}" in str(e.value)
    check_multicast_off(True, env=dict(MULTICAST_OFF))
    check_multicast_off(False, env={})  # CPU: nothing to switch off


@pytest.mark.parametrize("command", ["dispatch", "ep-train-step"])
def test_one_rank_is_refused_before_any_work(tmp_path, monkeypatch, command) -> None:
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    r = CliRunner().invoke(cli, [command, "--out-dir", str(tmp_path)], catch_exceptions=False)
    assert r.exit_code == 2
    assert "WORLD_SIZE=1" in r.output and "torchrun" in r.output
    assert not dist.is_initialized() and not list(tmp_path.iterdir())


def test_dispatch_bench_on_two_gloo_ranks(tmp_path) -> None:
    hidden, experts, topk, tokens = 64, 8, 3, 24
    proc = torchrun("dispatch", "--hidden", str(hidden), "--experts", str(experts), "--topk", str(topk),
                    "--tokens", str(tokens), "--iters", "2", "--warmup", "1", "--out-dir", str(tmp_path))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    doc = only_result(tmp_path, "dispatch")
    assert doc["shape"]["world_size"] == 2 and doc["shape"]["backends_run"] == ["alltoall"]
    assert any(n.startswith("deepep skipped:") for n in doc["notes"])
    by = {f["name"]: f for f in doc["figures"]}
    assert set(by) == {"alltoall:dispatch", "alltoall:combine"}
    row_bytes = hidden * 2  # bf16
    for f in by.values():
        assert f["row_bytes"] == row_bytes
        assert [p["rank"] for p in f["per_rank"]] == [0, 1]
        for p in f["per_rank"]:
            # The same routing the benchmark drew on that rank (seed * 1000 + rank, x first).
            gen = torch.Generator().manual_seed(p["rank"])
            torch.randn(tokens, hidden, generator=gen)
            idx = uniform_topk(tokens, experts, topk, gen, "cpu")
            want = rank_bytes(idx, p["rank"], 2, experts, row_bytes)
            assert p["algorithm_bytes"] == want["algorithm_bytes"] > 0
            assert p["wire_bytes"] == want["slot_rows_to_others"] * row_bytes >= p["algorithm_bytes"]
            assert positive(p["ms"]) and positive(p["gbps"])
            assert p["gbps"] == pytest.approx(p["algorithm_bytes"] / (p["ms"] / 1e3) / 1e9)
        assert f["vs_nvlink"] == pytest.approx(f["gbps_per_rank_mean"] / 450.0)
        assert f["round_trip_max_abs_err"] < 0.5  # identity expert: combine gives back topk x input
    assert doc["ratios"] == {}  # no deepep here, so no deepep/alltoall ratio


def test_ep_train_step_bench_on_two_gloo_ranks(tmp_path) -> None:
    proc = torchrun("ep-train-step", "--groups", "1", "--group-size", "2", "--prompt-len", "4",
                    "--completion-len", "4", "--iters", "2", "--warmup", "1", "--out-dir", str(tmp_path))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    doc = only_result(tmp_path, "ep_train_step")
    shape = doc["shape"]
    assert shape["world_size"] == 2 and shape["experts_per_rank"] == 4 and shape["backends_run"] == ["alltoall"]
    (f,) = doc["figures"]
    assert f["name"] == "alltoall:train_step" and f["applied"] is True and math.isfinite(f["loss"])
    assert f["tokens_per_step"] == 2 * 2 * 8  # 2 ranks x 2 rows x 8 tokens
    assert positive(f["ms_per_step"]) and positive(f["tokens_per_s"])
    assert f["tokens_per_s"] == pytest.approx(f["tokens_per_step"] / (f["ms_per_step"] / 1e3))
    # every MoE layer (2 in the tiny preset) was timed once per step, forward and backward
    for kind in ("dispatch", "combine", "dispatch_backward", "combine_backward"):
        assert f[f"{kind}_calls_per_step"] == shape["layers"], kind
        assert positive(f[f"{kind}_ms"]), kind
    assert 0 < f["dispatch_combine_share"] < 1
    for p in f["per_rank"]:
        parts = sum(p[f"{k}_ms"] for k in ("dispatch", "combine", "dispatch_backward", "combine_backward"))
        assert p["dispatch_combine_share"] == pytest.approx(parts / p["ms_per_step"])


def test_gpu_ep_script_uses_cli_options(tmp_path) -> None:
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_ep_bench.sh")], cwd=tmp_path,
                          env={**os.environ, "DRY_RUN": "1"}, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert not list(tmp_path.iterdir()), "a dry run writes nothing"
    bench = typer.main.get_command(cli)
    seen = {}
    for line in proc.stdout.splitlines():
        words = line.split()
        if "app.cli" not in words:
            continue
        # torchrun with 8 ranks, then `-m app.cli bench SUB ARGS`, parsed as click would.
        assert words[:4] == ["python3", "-m", "torch.distributed.run", "--nproc-per-node=8"], words
        sub_name = words[words.index("app.cli") + 2]
        sub = bench.get_command(bench.make_context("bench", [sub_name], resilient_parsing=True), sub_name)
        seen[sub_name] = sub.make_context(sub_name, words[words.index("app.cli") + 3:]).params
    d = seen["dispatch"]
    assert (d["hidden"], d["topk"], d["experts"], d["tokens"], d["dtype"]) == (7168, 8, 256, 4096, "bfloat16")
    assert d["backends"] == "auto" and d["fp8"] is True
    assert seen["ep-train-step"]["dtype"] == "bfloat16" and seen["ep-train-step"]["model"] == "small"
    assert "NCCL_NVLS_ENABLE=0" in proc.stdout  # the environment it would export is printed
    assert "test_ep_equivalence.py" in proc.stdout and "test_bench_ep.py" in proc.stdout
    assert "test_deepep.py::test_deepep_matches_ep1_on_gpus" in proc.stdout
    assert "scripts/deepep_checklist.py --preflight" in proc.stdout
    assert "scripts/deepep_checklist.py --out" in proc.stdout


# ---------------------------------------------------------------------------------------------
# GPU only: EP equivalence at 4 and 8 GPUs (alltoall).


def _equivalence():
    """tests/test_ep_equivalence.py's helpers (its directory is on sys.path under pytest)."""
    import test_ep_equivalence

    return test_ep_equivalence


@pytest.mark.parametrize("size", [4, 8])
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA GPUs")
def test_alltoall_matches_ep1_on_more_gpus(size: int) -> None:
    """tests/test_ep_equivalence.py's NCCL cases (fp32) at EP 4 and 8 (that file covers EP 2)."""
    if torch.cuda.device_count() < size:
        pytest.skip(f"needs {size} GPUs, found {torch.cuda.device_count()}")
    eq = _equivalence()
    mp.spawn(eq._worker, args=(size, eq.free_port(), "nccl"), nprocs=size, join=True)
