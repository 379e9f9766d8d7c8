"""FP8 engines (issue 26 item 2): the engines serve unquantized weights, and synth refuses one that would not.

Policy versions (the store and the network push) carry the trainer's bf16 tensors without
scales. SGLang's ``default_weight_loader`` (compiled from the 0.5.23 wheel) copies an update's
tensor into the engine's parameter as it is: into an FP8 checkpoint's e4m3 weight the values are
cast, and the layer's ``weight_scale_inv`` keeps the checkpoint's scales, so the weights the
engine computes with are far from the update, with no error. So charts8s refuses an engine
declared FP8 (``rollout.model_quantization``), asked to quantize (``--quantization``), or
serving a release known to be FP8 (``deepseek-ai/DeepSeek-V3``), naming the field.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from charts8s.workloads import WorkloadError, load_workloads
from infra.config import load_config
from sglang_oracle import wheel_function

EXAMPLES = Path(__file__).resolve().parents[1] / "charts8s" / "examples"
BLOCK = 128  # DeepSeek-V3's weight_block_size [128, 128]


def test_sglang_loads_a_bf16_update_into_fp8_weights_under_the_old_scales():
    load = wheel_function("srt/model_loader/weight_utils.py", "default_weight_loader", {"torch": torch})
    torch.manual_seed(0)
    served = torch.randn(2 * BLOCK, 2 * BLOCK) * 3.0  # the checkpoint's weights
    blocks = served.reshape(2, BLOCK, 2, BLOCK).abs().amax(dim=(1, 3))
    scale_inv = blocks / torch.finfo(torch.float8_e4m3fn).max  # the release's per-block scales
    expand = lambda s: s.repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)  # noqa: E731
    weight = torch.nn.Parameter((served / expand(scale_inv)).to(torch.float8_e4m3fn), requires_grad=False)
    update = (torch.randn(2 * BLOCK, 2 * BLOCK) * 0.02).to(torch.bfloat16)  # a policy version's tensor
    load(weight, update)
    computed = weight.data.float() * expand(scale_inv)  # what the engine's FP8 GEMM multiplies by
    error = ((computed - update.float()).norm() / update.float().norm()).item()
    # the values go in as they are and are read back times the old scale: ~37x too small here
    assert weight.dtype == torch.float8_e4m3fn and error > 0.9


def _workloads(tmp_path: Path, run: str, text: str) -> Path:
    (tmp_path / "run.yaml").write_text(run + "\nmodel: {path: Qwen/Qwen3-30B-A3B}\n")
    p = tmp_path / "w.yaml"
    p.write_text(text + f"\nrun_config: {tmp_path / 'run.yaml'}\n")
    return p


@pytest.mark.parametrize("run,text,field", [
    ("", "rollout: {model_path: deepseek-ai/DeepSeek-V3, model_gib: 642}", "rollout.model_path"),
    ("", "rollout: {model_quantization: fp8}", "rollout.model_quantization"),
    ("rollout: {engine: {extra_args: [--quantization, fp8]}}", "", "run config rollout.engine.extra_args"),
])
def test_synth_refuses_an_engine_the_updates_do_not_match(tmp_path, run, text, field):
    cfg = load_config("prod", EXAMPLES / "p5en-rollout.deploy.yaml")
    with pytest.raises(WorkloadError, match=rf"{field}: the rollout engines would serve fp8 weights, but policy "
                                            r"versions carry float32 tensors without scales"):
        load_workloads(cfg, _workloads(tmp_path, run, text))


def test_an_unquantized_engine_passes(tmp_path):
    cfg = load_config("prod", EXAMPLES / "p5en-rollout.deploy.yaml")
    plan = load_workloads(cfg, _workloads(tmp_path, "", "rollout: {model_gib: 57}"))
    assert plan.wl.rollout.model_quantization is None


# Issue 37 item 8: a bf16 copy made with DeepSeek's fp8_cast_bf16.py keeps config.json's
# quantization_config, and SGLang builds FP8 layers from it; the name of the copy says nothing.
FP8_CONFIG = {"model_type": "deepseek_v3", "quantization_config": {"quant_method": "fp8", "fmt": "e4m3",
                                                                    "weight_block_size": [128, 128]}}


def _copy(path: Path, config: dict) -> Path:
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(config))
    (path / "model.safetensors").write_bytes(b"0")
    return path


def test_synth_reads_a_local_copys_config(tmp_path):
    cfg = load_config("prod", EXAMPLES / "p5en-rollout.deploy.yaml")
    fp8 = _copy(tmp_path / "DeepSeek-V3-bf16", FP8_CONFIG)
    with pytest.raises(WorkloadError, match=re.escape(f"{fp8}/config.json quantization_config: the rollout engines "
                                                      "would serve fp8 weights")):
        load_workloads(cfg, _workloads(tmp_path, "", f"rollout: {{model_path: {fp8}, model_gib: 57}}"))
    plain = _copy(tmp_path / "bf16", {"model_type": "deepseek_v3"})
    assert load_workloads(cfg, _workloads(tmp_path, "", f"rollout: {{model_path: {plain}, model_gib: 57}}"))


def test_synth_reads_an_s3_copys_config_when_asked(tmp_path, moto_s3, monkeypatch):
    """With --read-model-config (charts8s.main) the store is read with this machine's credentials
    (moto's server here); without it synth stays offline and the engine pods' copy refuses it."""
    import boto3

    from charts8s.main import main

    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", moto_s3)
    deploy = tmp_path / "deploy.yaml"
    deploy.write_text((EXAMPLES / "p5en-rollout.deploy.yaml").read_text() + "checkpoint_bucket: fp8-copy-bucket\n")
    cfg = load_config("prod", deploy)
    boto3.client("s3", endpoint_url=moto_s3).create_bucket(Bucket="fp8-copy-bucket")
    boto3.client("s3", endpoint_url=moto_s3).put_object(Bucket="fp8-copy-bucket", Key="models/DeepSeek-V3-bf16/config.json",
                                                        Body=json.dumps(FP8_CONFIG).encode())
    w = _workloads(tmp_path, "", "rollout: {model_path: 's3://{checkpoint_bucket}/{models_prefix}/DeepSeek-V3-bf16', "
                                 "model_gib: 57}")
    url = "s3://fp8-copy-bucket/models/DeepSeek-V3-bf16/config.json"
    with pytest.raises(WorkloadError, match=re.escape(f"{url} quantization_config: the rollout engines would serve fp8")):
        load_workloads(cfg, w, read_store=True)
    assert load_workloads(cfg, w).wl.rollout.model_path == "s3://fp8-copy-bucket/models/DeepSeek-V3-bf16"  # offline
    out = tmp_path / "dist"
    assert main(["--env", "prod", "--config", str(deploy), "--workloads", str(w), "--outdir", str(out),
                 "--read-model-config"]) == 2 and not out.exists()
    missing = _workloads(tmp_path, "", "rollout: {model_path: 's3://{checkpoint_bucket}/{models_prefix}/none', model_gib: 57}")
    with pytest.raises(WorkloadError, match=r"models/none/config.json: cannot read the served model's config"):
        load_workloads(cfg, missing, read_store=True)


def test_the_engine_pods_model_copy_refuses_a_quantized_config(tmp_path):
    """What stands where synth could not read it: the init container (charts8s/rollout.py
    model_init_container) runs `app.model.source --unquantized`, one line and exit 2 before SGLang."""
    import subprocess
    import sys

    from charts8s.rollout import model_init_container

    fp8 = _copy(tmp_path / "fp8", FP8_CONFIG)
    proc = subprocess.run([sys.executable, "-m", "app.model.source", str(fp8), "--cache-dir", str(tmp_path / "c"),
                           "--unquantized"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert "config.json has quantization_config (quant_method 'fp8')" in proc.stderr
    plain = _copy(tmp_path / "bf16", {"model_type": "deepseek_v3"})
    ok = subprocess.run([sys.executable, "-m", "app.model.source", str(plain), "--cache-dir", str(tmp_path / "c"),
                         "--unquantized"], capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0 and ok.stdout.strip() == str(plain)
    plan = load_workloads(load_config("prod", EXAMPLES / "p5en-rollout.deploy.yaml"),
                          EXAMPLES / "dsv3-2node-deepep.workloads.yaml")
    assert model_init_container(plan)["command"][-1] == "--unquantized"
