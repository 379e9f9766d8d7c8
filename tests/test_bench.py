"""The benchmark entry points (`moerl bench moe | train-step | engine`) on CPU with tiny shapes.

No timings are asserted (speed belongs to the benchmark output): the tests check that each
command runs through the real CLI, writes a well-formed result file with the figures its
docs promise, refuses bad flags with one message naming the flag, and that
scripts/gpu_bench.sh only uses commands and options the CLI has, for every issue-7 shape.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import typer.main
from typer.testing import CliRunner

from app.bench.cli import cli
from app.bench.results import read_result
from app.cli import COMMANDS

ROOT = Path(__file__).resolve().parents[1]


def invoke(*args: str):
    """`moerl bench ARGS` in this process (app.cli hands the arguments to this typer app)."""
    return CliRunner().invoke(cli, list(args), catch_exceptions=False)


def only_result(out_dir: Path, benchmark: str) -> dict:
    files = sorted(out_dir.glob(f"{benchmark}-*.json"))
    assert len(files) == 1, files
    doc = read_result(files[0])
    assert doc["benchmark"] == benchmark
    for key in ("created", "machine", "versions", "shape", "figures", "ratios", "notes"):
        assert key in doc, key
    assert doc["versions"]["torch"] and doc["machine"]["cpu_count"] >= 1
    assert not list(out_dir.glob(".*")), "temporary files left behind"
    return doc


def positive(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


def test_moe_bench_writes_result(tmp_path):
    r = invoke("moe", "--hidden", "32", "--intermediate", "16", "--experts", "4", "--topk", "2",
               "--tokens", "32", "--iters", "1", "--warmup", "0", "--out-dir", str(tmp_path))
    assert r.exit_code == 0, r.output
    doc = only_result(tmp_path, "moe")
    names = {f["name"] for f in doc["figures"]}
    assert {"ours", "dense-mlp", "dense_matmul"} <= names
    assert all(positive(f["tflops"]) for f in doc["figures"])


def test_train_step_bench_writes_result(tmp_path):
    r = invoke("train-step", "--groups", "2", "--group-size", "2", "--prompt-len", "4", "--completion-len", "4",
               "--micro-batch-tokens", "16", "--activation-checkpointing", "selective",
               "--iters", "2", "--warmup", "0", "--profile", "--out-dir", str(tmp_path))
    assert r.exit_code == 0, r.output
    doc = only_result(tmp_path, "train_step")
    by = {f["name"]: f for f in doc["figures"]}
    ours, stock = by["ours"], by["stock_transformers"]
    assert ours["applied"] is True and math.isfinite(ours["loss"]) and ours["micro_batches"] == 2
    for key in ("ms_per_step", "tokens_per_s", "model_tflops", "mfu_vs_dense"):
        assert positive(ours[key]) and positive(stock[key]), key
    assert ours["peak_memory_gb"] is None  # CPU: not measured, and the notes say so
    assert any("peak memory" in n for n in doc["notes"])
    assert positive(by["dense_matmul"]["tflops"])
    assert doc["ratios"]["ours tokens/s / stock transformers tokens/s"] == pytest.approx(
        ours["tokens_per_s"] / stock["tokens_per_s"])
    fsdp2 = by["stock_fsdp2"]  # the stock model with fp32 master weights under FSDP2: the peer that learns
    for key in ("ms_per_step", "tokens_per_s", "model_tflops", "mfu_vs_dense"):
        assert positive(fsdp2[key]), key
    assert doc["ratios"]["ours tokens/s / stock FSDP2 tokens/s"] == pytest.approx(
        ours["tokens_per_s"] / fsdp2["tokens_per_s"])
    for prefix in ("profile", "peer_profile", "fsdp2_peer_profile"):  # ours, then the stock steps, each split by kernel family
        profiled = [f for f in doc["figures"] if f["name"].startswith(prefix + ":")]
        assert 0 < len(profiled) <= 20 and all(f["calls"] >= 1 for f in profiled)
        assert [f["self_ms"] for f in profiled] == sorted((f["self_ms"] for f in profiled), reverse=True)
        families = [f for f in doc["figures"] if f["name"].startswith(prefix + "_family:")]
        total = by[prefix + "_total:kernels"]["self_ms"]
        assert families and sum(f["self_ms"] for f in families) == pytest.approx(total)
        assert profiled[0]["self_ms"] <= total <= sum(f["self_ms"] for f in profiled) + total
        assert by[prefix + "_total:wall"]["self_ms"] > 0
    shape = doc["shape"]
    assert shape["rows"] == 4 and shape["seq_len"] == 8 and shape["tokens_per_step"] == 32
    assert doc["ratios"]["ours model TFLOP/s / dense matmul TFLOP/s (MFU)"] == pytest.approx(ours["mfu_vs_dense"])


def test_lm_head_bench_compares_logprobs_and_gradients_with_torch(tmp_path):
    r = invoke("lm-head", "--model", "tiny", "--tokens", "40", "--chunk", "16", "--temperature", "0.7",
               "--dtype", "float32", "--device", "cpu", "--iters", "1", "--warmup", "0", "--out-dir", str(tmp_path))
    assert r.exit_code == 0, r.output
    doc = only_result(tmp_path, "lm_head")
    by = {f["name"]: f for f in doc["figures"]}
    assert positive(by["ours"]["ms_fwd_bwd"]) and positive(by["torch"]["ms_fwd_bwd"])
    # ours computes torch's logprobs and the gradients of sum(w * logp) for per-token weights w
    assert by["ours"]["max_abs_diff_logp"] < 1e-5
    assert by["ours"]["max_rel_diff_grad_h"] < 1e-5 and by["ours"]["max_rel_diff_grad_w"] < 1e-5
    assert doc["ratios"]["torch ms / ours ms"] == pytest.approx(by["torch"]["ms_fwd_bwd"] / by["ours"]["ms_fwd_bwd"])
    bad = invoke("lm-head", "--model", "tiny", "--temperature", "0", "--device", "cpu", "--out-dir", str(tmp_path))
    assert bad.exit_code == 2 and "--temperature" in bad.output


def test_param_counts_follow_the_config():
    """Active parameters = total - embedding - norms - the (E - K)/E unused share of the experts."""
    from app.bench.train_step import model_config, param_counts, step_flops
    from app.config import RouterConfig
    from app.model.parallel import EPContext
    from app.model.policy import build_policy

    config = model_config("tiny")
    model = build_policy(config, RouterConfig(), EPContext.local(), init=False)
    c = model.config
    h, layers, e, k, i = c.hidden_size, c.num_hidden_layers, c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size
    q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    attention = h * q + 2 * h * kv + q * h
    per_layer = attention + e * h + k * 3 * h * i  # projections, router, K experts of 3 matrices
    expected_active = layers * per_layer + c.vocab_size * h  # + LM head
    counts = param_counts(model)
    assert counts["active"] == expected_active
    assert counts["total"] == sum(p.numel() for p in model.parameters())
    tokens = 3 * 10
    assert step_flops(c, counts["active"], 3, 10) == 6 * expected_active * tokens + 12 * layers * q * 10 * tokens


def _check_engine_doc(doc: dict, batch_sizes: list[int], output_len: int) -> None:
    by = {f["name"]: f for f in doc["figures"]}
    for name in ("disk_read_cold", "disk_read_warm", "download_policy", "load_cold", "load_warm"):
        assert positive(by[name]["seconds"]) and positive(by[name]["gb"]), name
    assert by["load_cold"]["gb"] == pytest.approx(doc["shape"]["checkpoint_bytes"] / 1e9)
    assert by["load_cold"]["s_per_gb"] == pytest.approx(by["load_cold"]["seconds"] / by["load_cold"]["gb"])
    for b in batch_sizes:
        f = by[f"generate_b{b}"]
        assert positive(f["tokens_per_s"]) and positive(f["decode_tokens_per_s"])
        assert f["tokens_per_s"] == pytest.approx(b * output_len / f["seconds"])
    assert not any("tokens generated, expected" in n for n in doc["notes"])


def test_engine_bench_writes_result(tmp_path):
    work = tmp_path / "work"
    r = invoke("engine", "--batch-sizes", "1,3", "--prompt-len", "5", "--output-len", "4", "--repeats", "2",
               "--work-dir", str(work), "--out-dir", str(tmp_path / "out"))
    assert r.exit_code == 0, r.output
    doc = only_result(tmp_path / "out", "engine")
    _check_engine_doc(doc, [1, 3], 4)
    assert doc["shape"]["batch_sizes"] == [1, 3]
    # The published version and its downloaded copy are where a worker would have them.
    assert (work / "store" / "bench" / "policy" / "latest").read_text() == "1"
    assert (work / "cache" / "v1" / "config.json").is_file()


# In our .venv but not in the GPU image (/work/.library/device/KINDS.md lists the image's
# packages); pydantic is absent there too but travels as wheels (scripts/gpu_bench.sh).
NOT_IN_GPU_IMAGE = ("fastapi", "starlette", "uvicorn", "redis", "boto3", "botocore", "s3transfer", "moto",
                    "reasoning_gym", "math_verify", "torchx", "trl", "datasets", "kubernetes", "jsii", "cdk8s")


def test_benches_run_with_only_the_gpu_image_packages(tmp_path):
    """`python3 -m app.cli bench train-step | engine` (as gpu_bench.sh runs them) must not need
    packages the GPU image lacks; the engine bench then loads through the engine's own loader."""
    code = f"""
import runpy, sys
# None in sys.modules: `import x` raises ModuleNotFoundError and importlib.util.find_spec(x)
# returns None, as when the package is not installed.
for name in {NOT_IN_GPU_IMAGE!r}:
    sys.modules[name] = None
for args in (["train-step", "--groups", "1", "--group-size", "2", "--prompt-len", "3", "--completion-len", "3",
              "--iters", "1", "--warmup", "0"],
             ["engine", "--batch-sizes", "2", "--prompt-len", "3", "--output-len", "3"]):
    sys.argv = ["python3 -m app.cli", "bench", *args, "--out-dir", {str(tmp_path)!r}]
    try:
        runpy.run_module("app.cli", run_name="__main__")  # what `python3 -m app.cli` runs
    except SystemExit as e:
        assert e.code in (0, None), (args, e.code)
"""
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert only_result(tmp_path, "train_step")["figures"][0]["applied"] is True  # "ours"
    doc = only_result(tmp_path, "engine")
    _check_engine_doc(doc, [2], 3)
    # the engine's own loader, without FastAPI (app/engine/load.py is apart from the server)
    assert "loader: app.engine.load.load_checkpoint" in doc["notes"], doc["notes"]


@pytest.mark.parametrize("args, flag", [
    (["train-step", "--dtype", "float16"], "--dtype"),
    (["train-step", "--model", "huge"], "--model"),
    (["train-step", "--iters", "0"], "--iters"),
    (["train-step", "--device", "cuda"], "--device"),
    (["train-step", "--layers", "2"], "--layers"),
    # More than the real model has: a 100000-layer model hung building, 100000 experts a 1.2 TB allocation.
    (["train-step", "--model", "qwen3-30b-a3b", "--layers", "49"], "--layers 49"),
    (["train-step", "--model", "deepseek-v3", "--experts", "257"], "--experts 257"),
    (["train-step", "--activation-checkpointing", "some"], "--activation-checkpointing"),
    (["engine", "--batch-sizes", "1,x"], "--batch-sizes"),
    (["engine", "--batch-sizes", "0"], "--batch-sizes"),
    (["engine", "--output-len", "1"], "--output-len"),
    (["engine", "--repeats", "0"], "--repeats"),
    (["engine", "--prompt-len", "500", "--output-len", "100"], "max_position_embeddings"),
    (["weight-sync", "--model", "qwen3-30b-a3b"], "--model"),
    (["weight-sync", "--engines", "0"], "--engines"),
    (["weight-sync", "--bucket-mb", "0"], "--bucket-mb"),
    (["weight-sync", "--bucket-mb", "nan"], "--bucket-mb"),
    (["weight-sync", "--bucket-mb", "inf"], "--bucket-mb"),
    (["weight-sync", "--bucket-mb", "1e-9"], "--bucket-mb"),  # int(bytes) would be 0
    (["weight-sync", "--device", "cuda"], "--device"),
    (["buffer", "--writers", "0"], "--writers"),
    (["buffer", "--replay", "maybe"], "--replay"),
    (["buffer", "--model", "gpt"], "--model"),
])
def test_bad_flags_give_one_error_naming_the_flag(tmp_path, args, flag):
    if "cuda" in args:
        import torch

        if torch.cuda.is_available():
            pytest.skip("CUDA is available here")
    r = CliRunner().invoke(cli, [*args, "--out-dir", str(tmp_path)])
    assert r.exit_code == 2, r.output
    assert flag in r.output
    assert not list(tmp_path.iterdir()), "nothing may be written for a bad flag"


@pytest.mark.parametrize("args", [["train-step", "--iters", "1"], ["weight-sync", "--work-dir", "work"]])
def test_out_dir_that_is_a_file_is_refused_before_the_run(tmp_path, monkeypatch, args):
    monkeypatch.chdir(tmp_path)
    Path("a-file").write_text("")
    r = CliRunner().invoke(cli, [*args, "--out-dir", "a-file"])
    assert r.exit_code == 2 and "--out-dir" in r.output, r.output
    assert not Path("work").exists()  # refused before the scratch directory and the engines


def test_buffer_bench_writes_result(tmp_path):
    """A writer process and the trainer side against a real redis-server, both legs, tiny
    groups: every figure the docs promise is there."""
    r = invoke("buffer", "--model", "tiny", "--writers", "1", "--groups", "4", "--group-size", "2", "--prompt-len", "8",
               "--completion-len", "16", "--batch-groups", "2", "--commit-every", "1", "--baseline-calls", "1",
               "--out-dir", str(tmp_path))
    assert r.exit_code == 0, r.output
    doc = only_result(tmp_path, "buffer")
    legs = {f["name"]: f for f in doc["figures"] if f["name"] in ("plain", "replay")}
    assert set(legs) == {"plain", "replay"}
    for f in legs.values():
        assert f["groups"] == 4
        for key in ("groups_per_s", "wire_bytes_in_per_group", "redis_memory_bytes_per_group", "redis_cpu_ms_per_group",
                    "publish_p99_s", "take_batch_p99_s", "baseline_xadd_usec"):
            assert positive(f[key]), (f["name"], key, f[key])
    assert any(f["name"].startswith("plain ") and f["calls"] > 0 for f in doc["figures"])  # per-command rows
    assert doc["shape"]["capacity"] == 4  # (commit_every + 1) x batch_groups


def test_weight_sync_bench_writes_result(tmp_path):
    """One engine and worker as processes: the network and store paths each deliver versions
    (the bench itself fails unless every engine acked each push and serves the last version)."""
    r = invoke("weight-sync", "--engines", "1", "--versions", "1", "--work-dir", str(tmp_path / "work"),
               "--out-dir", str(tmp_path / "out"))
    assert r.exit_code == 0, r.output
    doc = only_result(tmp_path / "out", "weight_sync")
    assert [f["name"] for f in doc["figures"]] == ["network (first: builds the group)", "network", "store (baseline)"]
    assert all(positive(f["s_per_version"]) for f in doc["figures"])
    assert positive(doc["ratios"]["store s / network s per version"])
    assert doc["shape"]["bytes_per_version"] > 0 and doc["shape"]["engines"] == 1


def test_weight_sync_gpu_mode_runs_with_gpu_image_packages_and_plans_the_real_width_model(tmp_path):
    """The GPU mode without the packages the GPU image lacks: its sender and receiver processes
    run every path and the receiver's check on the CPU with a tiny model (CPU tensors shared
    through the same queue stand in for CUDA IPC; only the device differs), and its plan of
    Qwen3-30B-A3B at 2 layers (on the meta device) is the whole model in bf16."""
    code = f"""
import json, sys
from pathlib import Path
for name in {NOT_IN_GPU_IMAGE!r}:
    sys.modules[name] = None
import torch
from transformers import AutoModelForCausalLM
import app.bench.cli
from app.bench.weight_sync import WeightSyncBench
from app.bench.weight_sync_gpu import real_width_config, run_gpu
from app.model.config import tiny_config
from app.trainer.publish import plan_version
from app.weight_group import plan_buckets
if __name__ == "__main__":
    shape, figures, ratios, _ = run_gpu(WeightSyncBench(model="qwen3-30b-a3b", versions=1, bucket_mb=0.01,
                                        dtype="bfloat16"), Path({str(tmp_path)!r}), device="cpu",
                                        config=tiny_config("tiny-qwen3-moe"))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(real_width_config(2), dtype=torch.bfloat16)
    tensors = plan_version(model, None, torch.bfloat16).tensors
    buckets = plan_buckets([t.nbytes for t in tensors], 512 * 2**20)
    print(json.dumps({{"shape": shape, "figures": figures, "ratios": ratios,
                      "params": sum(p.numel() for p in model.parameters()), "bytes": sum(t.nbytes for t in tensors),
                      "largest": max(sum(tensors[i].nbytes for i in b) for b in buckets)}}))
"""
    script = tmp_path / "gpu_mode.py"  # a file, not -c: the receiver is a spawned process
    script.write_text(code)
    proc = subprocess.run([sys.executable, str(script)], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.splitlines()[-1])
    assert [f["name"] for f in got["figures"]] == ["cuda-ipc", "gloo-staged", "disk", "baseline copies"]
    assert all(positive(f["s_per_version"]) for f in got["figures"])
    assert all(positive(v) for v in got["ratios"].values())
    assert got["shape"]["buckets"] > 10  # 10 KiB buckets: the plan split the version
    assert 1.8e9 < got["params"] < 1.95e9  # 2 layers of Qwen3-30B-A3B (reference/trainer-scale-2026-12.md: 1.87 B)
    assert got["bytes"] == 2 * got["params"]
    assert got["largest"] <= 512 * 2**20 or got["largest"] == 151936 * 2048 * 2  # only a lone embedding is larger
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_bench.sh")], cwd=tmp_path, capture_output=True,
                          text=True, timeout=60, env={**os.environ, "DRY_RUN": "1", "STEPS": "weight-sync"})
    (words,) = [line.split() for line in proc.stdout.splitlines() if line.strip()]
    bench = typer.main.get_command(cli)
    params = bench.get_command(bench.make_context("bench", ["weight-sync"], resilient_parsing=True),
                               "weight-sync").make_context("weight-sync", words[5:]).params
    assert params["device"] == "cuda" and params["model"] == "qwen3-30b-a3b" and params["layers"] == 2


def test_page_cache_helpers(tmp_path):
    from app.bench.engine import drop_from_page_cache, read_seconds, write_file

    path = tmp_path / "probe.bin"
    write_file(path, 3_000_000)
    assert path.stat().st_size == 3_000_000
    data = path.read_bytes()
    assert len(set(data[:4096])) > 100  # random bytes, not zeros
    assert drop_from_page_cache(path) is hasattr(os, "posix_fadvise")
    assert read_seconds(path) > 0
    assert path.read_bytes() == data  # dropping the cache never changes the file


def test_gpu_script_uses_cli_options_for_every_issue7_shape(tmp_path):
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_bench.sh")], cwd=tmp_path,
                          env={**os.environ, "DRY_RUN": "1"}, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert not list(tmp_path.iterdir()), "a dry run writes nothing"
    assert COMMANDS["bench"] == "app.bench.cli:cli"  # what `python3 -m app.cli bench` dispatches to
    lines = [line.split() for line in proc.stdout.splitlines() if line.strip()]
    seen_moe = set()
    for words in lines:
        assert words[:4] == ["python3", "-m", "app.cli", "bench"], words
        # Parse (not run) the command line exactly as click would: unknown options fail here.
        bench = typer.main.get_command(cli)
        ctx = bench.make_context("bench", [words[4]], resilient_parsing=True)
        sub = bench.get_command(ctx, words[4])
        assert sub is not None, words[4]
        params = sub.make_context(words[4], words[5:]).params
        assert params["device"] == "cuda" and params["dtype"] == "bfloat16"
        if words[4] == "moe":
            seen_moe.add((params["family"], params["hidden"], params["intermediate"], params["experts"],
                          params["topk"], params["tokens"]))
    want = {("deepseek-v3", 7168, 2048, e, 8, t) for e in (32, 8) for t in (4096, 16384)}
    want |= {("qwen3", 2048, 768, 128, 8, t) for t in (4096, 16384)}
    assert seen_moe == want
    assert {w[4] for w in lines} == {"moe", "train-step", "engine"}


def test_results_json_of_the_gpu_script_is_a_list_of_documents(tmp_path):
    """collect() in scripts/lib.sh (sourced by gpu_bench.sh) merges result files; run it on two real ones."""
    script = (ROOT / "scripts" / "lib.sh").read_text()
    body = script.split("<<'EOF'\n", 1)[1].split("\nEOF\n", 1)[0]
    src = tmp_path / "results"
    src.mkdir()
    for i in range(2):
        (src / f"x-{i}.json").write_text(json.dumps({"benchmark": "x", "figures": [{"name": str(i)}]}))
    subprocess.run([sys.executable, "-c", body, str(src), str(tmp_path / "results.json")], check=True, timeout=60)
    docs = json.loads((tmp_path / "results.json").read_text())
    assert [d["figures"][0]["name"] for d in docs] == ["0", "1"]


def test_kernel_families_name_the_kernels_of_a_step():
    from app.bench.common import kernel_family

    assert kernel_family("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64") == "gemm"
    assert kernel_family("nvjet_tst_192x192_64x3_1x2_h_bz_coopB_TNN") == "gemm"
    assert kernel_family("pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128>>") == "attention"
    assert kernel_family("_gather_sum_kernel") == "triton" and kernel_family("_logit_grad_kernel") == "triton"
    assert kernel_family("void at::native::(anonymous namespace)::cunn_SoftMaxForward<8, float>") == "softmax_reduce"
    assert kernel_family("void at::native::multi_tensor_apply_kernel<FusedAdamMathFunctor>") == "optimizer"
    assert kernel_family("Memcpy DtoD (Device -> Device)") == "copy_cast"
    assert kernel_family("void at::native::vectorized_elementwise_kernel<4, CUDAFunctor_add<float>>") == "elementwise"
    assert kernel_family("ncclDevKernel_AllGather_RING_LL") == "collective"
    assert kernel_family("void at::native::_scatter_gather_elementwise_kernel<128, 4>") == "copy_cast"
    assert kernel_family("void at::native::radixSortKVInPlace<-2, -1, 128, 32>") == "other"


def test_sigterm_stops_the_processes_a_bench_started(tmp_path):
    """`timeout` or a pod's stop sends SIGTERM: the bench's finally blocks still stop its engines and
    redis-server (they are process-group leaders of their own, so nothing else would)."""
    import signal
    import time

    psutil = pytest.importorskip("psutil")
    proc = subprocess.Popen([sys.executable, "-m", "app.cli", "bench", "weight-sync", "--model", "tiny",
                             "--versions", "200", "--work-dir", str(tmp_path / "w"), "--out-dir", str(tmp_path)],
                            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    me = psutil.Process(proc.pid)
    deadline = time.monotonic() + 240
    started = []
    while time.monotonic() < deadline and proc.poll() is None:  # wait until both engines run
        started = [c for c in me.children(recursive=True) if "engine" in " ".join(c.cmdline())]
        if len(started) >= 2:
            break
        time.sleep(0.5)
    assert len(started) >= 2, proc.stderr.read()[-2000:] if proc.poll() is not None else "engines never started"
    children = me.children(recursive=True)
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=120)
    gone, alive = psutil.wait_procs(children, timeout=30)
    assert not alive, [" ".join(p.cmdline())[:120] for p in alive]
