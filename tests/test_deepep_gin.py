"""The trainer's DeepEP and NCCL GIN by layout (issue 26 item 6).

The sgl-deep-ep 0.1.2.post1 buffer asserts an NCCL GIN backend for more than one rank unless
EP_DISABLE_GIN is set (the message and the variable are in its ``_C`` extension; the stand-in in
tests/deep_ep_standin.py refuses the same way), and NCCL 2.30.7 gives p5en no GIN over EFA, so
`auto` fell back to all-to-all on every multi-rank layout. EP groups within one node run over
NVLink and need no GIN: those trainer pods get EP_DISABLE_GIN=1, layouts whose EP groups span
nodes do not; `auto`'s log line says which case it is in.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from app.model.parallel import deepep_gin_env, gin_note
from charts8s.trainer import render_job
from charts8s.workloads import load_workloads
from infra.config import load_config

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("ep,per_node,want", [(8, 8, {"EP_DISABLE_GIN": "1"}), (4, 8, {"EP_DISABLE_GIN": "1"}),
                                              (16, 8, {}), (64, 8, {}), (1, 8, {}), (3, 8, {})])
def test_gin_is_disabled_exactly_when_every_ep_group_is_within_a_node(ep, per_node, want):
    assert deepep_gin_env(ep, per_node) == want


def _job_env(recipe: str, env: str) -> dict:
    os.chdir(ROOT)
    deploy = ROOT / "recipes" / f"{recipe}.deploy.yaml"
    plan = load_workloads(load_config(env, deploy if deploy.exists() else None), ROOT / "recipes" / f"{recipe}.workloads.yaml")
    job = render_job(plan)
    envs = [{e["name"]: e.get("value") for e in t["template"]["spec"]["containers"][0].get("env", [])}
            for t in job["spec"]["tasks"]]
    assert envs and all(e.get("EP_DISABLE_GIN") == envs[0].get("EP_DISABLE_GIN") for e in envs)  # every pod of the gang
    return plan, envs[0]


def test_the_trainer_pods_of_an_intranode_ep_layout_disable_gin():
    plan, env = _job_env("qwen3-30b-a3b-grpo", "dev")  # ep 8 on 8-GPU nodes: NVLink only
    assert plan.run.trainer.parallel.ep == plan.gpus_per_trainer == 8
    assert env.get("EP_DISABLE_GIN") == "1"


def test_the_trainer_pods_of_an_ep_layout_across_nodes_keep_gin():
    plan, env = _job_env("deepseek-v3-grpo", "prod")  # ep 64 over 8 nodes
    assert plan.run.trainer.parallel.ep > plan.gpus_per_trainer
    assert "EP_DISABLE_GIN" not in env


def test_auto_says_why_gin_is_or_is_not_needed(monkeypatch):
    monkeypatch.setenv("EP_DISABLE_GIN", "1")
    assert gin_note(8, 8) == "EP groups of 8 ranks within a node (NVLink): NCCL GIN disabled (EP_DISABLE_GIN=1)"
    assert gin_note(16, 8) == "EP groups of 16 ranks span nodes of 8: DeepEP needs NCCL GIN, but EP_DISABLE_GIN is set"
    monkeypatch.delenv("EP_DISABLE_GIN")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert gin_note(4) == "EP groups of 4 ranks within a node (NVLink): NCCL GIN not disabled: set EP_DISABLE_GIN=1"
    assert gin_note(64) == "EP groups of 64 ranks span nodes of 8: DeepEP needs NCCL GIN"


def test_the_gpu_trainer_pods_use_the_allocator_the_plan_fits_deepseek_v3_with():
    """`moerl plan` fits DeepSeek-V3 on 16 x 8 H200 (EP 32, 8K micro-batches) only with the
    fragmentation of expandable segments: every GPU trainer pod sets it."""
    for recipe, env in (("deepseek-v3-grpo", "prod"), ("qwen3-30b-a3b-grpo", "dev")):
        _, pod_env = _job_env(recipe, env)
        assert pod_env.get("PYTORCH_CUDA_ALLOC_CONF") == "expandable_segments:True", recipe

