"""`moerl bench moe` runs end to end on a tiny CPU shape and writes a well-formed result file.

Not a speed test: it checks that every variant is measured, the ratios are derived from the
figures, ours agrees with transformers' block numerically, and the file lands atomically.
"""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from app.bench.cli import cli
from app.bench.results import write_result


def test_bench_moe_cli_writes_result(tmp_path) -> None:
    args = ["moe", "--family", "deepseek-v3", "--hidden", "32", "--intermediate", "16", "--experts", "8",
            "--topk", "2", "--tokens", "24", "--iters", "1", "--warmup", "1", "--out-dir", str(tmp_path)]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 0, result.output
    files = list(tmp_path.glob("moe-*.json"))
    assert len(files) == 1 and not list(tmp_path.glob(".*"))
    doc = json.loads(files[0].read_text())
    names = [f["name"] for f in doc["figures"]]
    assert names[0] == "ours" and "transformers-eager" in names and "dense-mlp" in names
    matmul = next(f for f in doc["figures"] if f["name"] == "dense_matmul")
    assert matmul["n"] == 512 and matmul["tflops"] > 0
    assert doc["ratios"]["ours TFLOP/s / dense_matmul TFLOP/s"] == pytest.approx(
        doc["figures"][0]["tflops"] / matmul["tflops"])
    for f in doc["figures"]:
        if f["name"] == "dense_matmul":
            continue
        assert f["tokens_per_s"] > 0 and f["tflops"] > 0
        assert f["tokens_per_s"] == pytest.approx(24 / (f["ms_per_iter"] / 1e3))
    ours = doc["figures"][0]["tokens_per_s"]
    eager = next(f for f in doc["figures"] if f["name"] == "transformers-eager")["tokens_per_s"]
    assert doc["ratios"]["ours/transformers-eager tokens_per_s"] == pytest.approx(ours / eager)
    agreement = next(n for n in doc["notes"] if n.startswith("ours vs transformers-eager"))
    errors = [float(part.split("=")[1]) for part in agreement.split(": ", 1)[1].split(", ")]
    assert len(errors) == 4 and max(errors) < 1e-5  # fp32: same routing, same math
    assert doc["shape"]["hidden"] == 32 and doc["versions"]["torch"] and doc["machine"]["cpu_count"]
    assert "ratio ours/transformers-eager" in result.output


def test_bench_moe_in_bf16_reports_its_error_against_fp32(tmp_path) -> None:
    args = ["moe", "--family", "qwen3", "--hidden", "32", "--intermediate", "16", "--experts", "8", "--topk", "2",
            "--tokens", "64", "--dtype", "bfloat16", "--iters", "1", "--warmup", "0", "--out-dir", str(tmp_path)]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 0, result.output
    doc = json.loads(next(tmp_path.glob("moe-*.json")).read_text())
    acc = {f["name"]: f for f in doc["figures"] if f["name"].startswith("accuracy:")}
    assert {"accuracy:ours", "accuracy:transformers-eager"} <= set(acc)
    for f in acc.values():
        assert 0 < f["rel_err_vs_fp32"] < 0.05  # bf16 rounding: not zero, far below a wrong layer
        assert 0 <= f["topk_differs_frac"] <= 1
    assert "top-k differs on" in result.output


def test_bench_moe_profile_adds_top_ops_without_changing_ratios(tmp_path) -> None:
    args = ["moe", "--hidden", "32", "--intermediate", "16", "--experts", "4", "--topk", "2", "--tokens", "16",
            "--iters", "1", "--warmup", "0", "--profile", "--out-dir", str(tmp_path)]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 0, result.output
    doc = json.loads(next(tmp_path.glob("moe-*.json")).read_text())
    profiled = [f for f in doc["figures"] if f["name"].startswith("profile:")]
    assert 0 < len(profiled) <= 20 and all(f["calls"] >= 1 and 0 <= f["share"] <= 1 for f in profiled)
    assert [f["self_ms"] for f in profiled] == sorted((f["self_ms"] for f in profiled), reverse=True)
    # ratios come from the timed variants only
    assert all(not k.startswith("ours/profile:") for k in doc["ratios"])
    assert set(doc["ratios"]) == {f"ours/{n} tokens_per_s" for n in ("transformers-eager", "transformers-grouped_mm", "dense-mlp")} | {
        "ours TFLOP/s / dense_matmul TFLOP/s"}


def test_bench_moe_rejects_bad_flags(tmp_path) -> None:
    result = CliRunner().invoke(cli, ["moe", "--dtype", "float16", "--out-dir", str(tmp_path)])
    assert result.exit_code != 0 and "--dtype must be one of" in result.output
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("args, message", [
    (["--hidden", "0"], "--hidden must be at least 1"),
    (["--intermediate", "-1"], "--intermediate must be at least 1"),
    (["--warmup", "-1"], "--warmup must be at least 0"),
    (["--device", "tpu"], "--device 'tpu': not a torch device"),
])
def test_bench_moe_rejects_bad_shapes_before_building(tmp_path, args, message) -> None:
    result = CliRunner().invoke(cli, ["moe", *args, "--out-dir", str(tmp_path)])
    assert result.exit_code != 0 and message in result.output
    assert not list(tmp_path.iterdir())


def test_write_result_requires_named_figures(tmp_path) -> None:
    with pytest.raises(ValueError, match="figure without a 'name'"):
        write_result("moe", {}, [{"tokens_per_s": 1.0}], out_dir=tmp_path)
    assert not list(tmp_path.iterdir())


def test_write_result_never_replaces_a_result_of_the_same_second(tmp_path) -> None:
    paths = [write_result("moe", {"run": i}, [{"name": "x"}], out_dir=tmp_path) for i in range(3)]
    assert len(set(paths)) == 3
    assert sorted(json.loads(p.read_text())["shape"]["run"] for p in paths) == [0, 1, 2]
    assert all(p.stat().st_mode & 0o777 == 0o644 for p in paths)
    assert not list(tmp_path.glob(".*"))


def test_write_result_leaves_no_temporary_file_when_a_figure_is_not_json(tmp_path) -> None:
    with pytest.raises(TypeError):
        write_result("moe", {}, [{"name": "x", "value": object()}], out_dir=tmp_path)
    assert not list(tmp_path.iterdir())


def test_bench_moe_rejects_devices_it_does_not_measure(tmp_path) -> None:
    result = CliRunner().invoke(cli, ["moe", "--device", "meta", "--out-dir", str(tmp_path)])
    assert result.exit_code == 2 and "only cpu and cuda are measured" in result.output
