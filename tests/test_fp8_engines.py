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
