"""`moerl run --task gpu`: the GPU-sized preset (app/local/run.py `gpu_preset`, the gpu-qwen3-moe
policy of app/model/config.py).

Its full width is checked on the meta device (no memory) and its layout on a faked one-GPU
machine; its code path runs end to end on the CPU at toy width, with what a GPU run sets (one
trainer rank, bf16 compute, versions pushed to the engines and stored every 10), so that the
GPU call (scripts/gpu_onegpu.sh) does not discover a crash.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from app.config import RouterConfig
from app.local.machine import Machine, plan_local
from app.local.run import gpu_preset, task_preset
from app.model.config import num_routed_experts, tiny_config

# The preset's shape at toy width: every field the width changes, nothing else.
TOY = dict(hidden_size=64, intermediate_size=64, moe_intermediate_size=32, num_attention_heads=4,
           num_key_value_heads=2, head_dim=16)


def test_the_preset_is_gpu_sized():
    from app.bench.train_step import param_counts
    from app.model.parallel import EPContext
    from app.model.policy import build_policy

    cfg = task_preset("gpu")
    config = tiny_config(cfg.model.preset)
    assert config.model_type == "qwen3_moe" and config.num_experts == 64 and config.num_experts_per_tok == 8
    counts = param_counts(build_policy(config, RouterConfig(), EPContext.local(), device="meta"))
    assert 300e6 < counts["total"] < 600e6 and 50e6 < counts["active"] < 100e6  # hundreds of millions
    out, layout = plan_local(cfg, Machine(cores=16, gpus=1), num_routed_experts(config), preset=True, sglang=False,
                             params=counts["total"])
    assert layout.trainer_ranks == 1 and out.model.dtype == "bfloat16" and out.weight_sync.mode == "network"
    # Two engine copies of 424 M parameters beside the trainer (each version is pushed once per engine).
    assert layout.engine_devices == ("cuda:0", "cuda:0")
    assert out.rollout.inflight_sequences == 512 == out.rollout.engine.max_running_requests  # a step's batch each
    assert out.trainer.groups_per_step * out.rollout.group_size == 512  # samples per trainer step


@pytest.mark.slow
def test_the_preset_runs_at_toy_width_on_the_cpu(tmp_path):
    """The preset's recipe on a toy-width checkpoint of its own shape: the warm-up, one trainer
    rank, bf16 compute, the push to the engines (gloo here, cuda:gloo on one GPU) with the store
    every 10 versions, the held-out evaluation and the summary."""
    from app.model.checkpoint import save_policy
    from app.model.parallel import EPContext
    from app.model.policy import build_policy
    from app.model.tokenizer import save_tokenizer

    toy = tmp_path / "toy"
    save_policy(build_policy(tiny_config("gpu-qwen3-moe", **TOY), RouterConfig(), EPContext.local()), toy,
                EPContext.local())
    save_tokenizer(toy)
    cfg = gpu_preset()
    cfg.run_id = "gpu-toy"
    cfg.model.path = str(toy)
    cfg.model.dtype = "bfloat16"
    cfg.weight_sync.mode, cfg.weight_sync.store_every, cfg.weight_sync.master_address = "network", 10, "127.0.0.1"
    # Short and small for CI: the batch size is not a code path.
    cfg.trainer.steps, cfg.trainer.groups_per_step, cfg.buffer.capacity_groups = 3, 2, 8
    cfg.rollout.group_size = 4
    cfg.task.train_size, cfg.task.eval_size, cfg.task.warmup_steps = 100, 10, 2
    config = tmp_path / "run.yaml"
    cfg.save(config)
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "app.cli", "run", "--config", str(config), "--out", str(out),
                           "--cache", str(tmp_path / "cache"), "--workers", "1"],
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 3 and summary["policy_version"] == 2  # steps 2 and 3 publish
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r.get("pushed_engines") for r in lines] == [None, 1, 1]  # each version reached the engine
    versions = sorted(int(p.name[1:]) for p in (out / "store" / "gpu-toy" / "policy").glob("v*"))
    assert versions == [0, 2]  # v1 was pushed only; the last is stored
    assert "layout: 0 GPUs" in proc.stdout
