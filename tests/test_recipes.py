"""The cluster recipes (recipes/*.yaml): each is a valid run config whose workloads file
synthesizes on its deployment (charts8s applies the node-pool, capacity and parallel-layout
rules), and the mounted run config is the recipe's with only the cluster's addresses filled in.

`moerl plan` (app/plan.py, another branch) is checked by `test_recipe_passes_moerl_plan` once it
exists; until then that test is skipped with the reason.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from app.config import RunConfig
from app.layout import resolve_layout
from charts8s.main import build
from charts8s.workloads import load_workloads
from infra.config import load_config

ROOT = Path(__file__).resolve().parents[1]
RECIPES = {"qwen3-30b-a3b-grpo": "dev", "deepseek-v3-grpo": "prod"}
# (world, ep, efsdp, experts) each recipe is written for: Qwen3-30B-A3B has 128 routed experts, DeepSeek-V3 256.
PROMPT_TOKENS = 512  # the recipes' datasets: prompts of a few hundred tokens
MODELS = {"qwen3-30b-a3b-grpo": "qwen3-30b-a3b", "deepseek-v3-grpo": "deepseek-v3"}  # moerl plan's presets
LAYOUT = {"qwen3-30b-a3b-grpo": (8, 8, 1, 128), "deepseek-v3-grpo": (128, 64, 2, 256)}
# task.jsonl_path: its {checkpoint_bucket} and {data_prefix} are the deployment config's (charts8s.workloads.fill_store_path)
CLUSTER_FIELDS = {("buffer", "redis_url"), ("rollout", "engine_url"), ("store_url",), ("rollout", "policy_cache_dir"),
                  ("model", "path"), ("model", "cache_dir"), ("weight_sync", "trainer_host"), ("weight_sync", "master_port"),
                  ("task", "jsonl_path")}
os.environ.setdefault("JSII_SILENCE_WARNING_DEPRECATED_NODE_VERSION", "1")


def _flat(d: dict, prefix=()) -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, prefix + (k,)))
        else:
            out[prefix + (k,)] = v
    return out


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_recipe_synthesizes_on_its_deployment(name, tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)  # workloads files name their run config relative to the repository
    recipe = RunConfig.load(ROOT / "recipes" / f"{name}.yaml")
    deploy = ROOT / "recipes" / f"{name}.deploy.yaml"  # a recipe's own deployment override, if any
    cfg = load_config(RECIPES[name], deploy if deploy.exists() else None)
    plan = load_workloads(cfg, ROOT / "recipes" / f"{name}.workloads.yaml")
    world, ep, efsdp, experts = LAYOUT[name]
    layout = resolve_layout(recipe.trainer.parallel, plan.trainer_world_size, num_experts=experts)
    assert (layout.world, layout.ep, layout.efsdp) == (world, ep, efsdp)
    assert recipe.model.dtype == "bfloat16" and recipe.trainer.micro_batch_tokens
    files = build(plan, tmp_path / "dist")
    docs = [d for f in files for d in yaml.safe_load_all(f.read_text()) if d]
    (cm,) = [d for d in docs if d["kind"] == "ConfigMap"]
    mounted = RunConfig.model_validate(yaml.safe_load(cm["data"]["run.yaml"]))
    a, b = _flat(recipe.model_dump(mode="json")), _flat(mounted.model_dump(mode="json"))
    assert {k for k in a if a[k] != b[k]} <= CLUSTER_FIELDS
    assert mounted.model.path == plan.wl.rollout.model_path  # one base model for SGLang and the trainer
    (job,) = [d for d in docs if d["kind"] == "Job"]
    assert len(job["spec"]["tasks"]) == plan.trainer_nodes
    # the feed pod evaluates through its own engine on a rollout-gpu node when the recipe evaluates
    feed = next(d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == "moerl-feed")
    want = ["feed", "engine"] if recipe.feed.eval_every else ["feed"]
    assert [c["name"] for c in feed["spec"]["template"]["spec"]["containers"]] == want


def test_recipes_keep_the_buffer_rule_for_their_save_interval():
    """Taken groups stay in Redis until a save: capacity_groups is exactly the minimum the
    config allows, (save_every + 1) x groups_per_step, so workers cannot run further ahead."""
    for name in RECIPES:
        r = RunConfig.load(ROOT / "recipes" / f"{name}.yaml")
        assert r.buffer.capacity_groups == (r.trainer.save_every + 1) * r.trainer.groups_per_step, name


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_recipe_passes_moerl_plan(name):
    """`moerl plan` finds each recipe's trainer layout fitting its GPUs (141 GB H200) at the
    recipe's rollouts per GPU and their length (a prompt budget of PROMPT_TOKENS + max_new_tokens)."""
    recipe = RunConfig.load(ROOT / "recipes" / f"{name}.yaml")
    world, _, _, _ = LAYOUT[name]
    nodes = world // 8
    per_gpu = recipe.trainer.groups_per_step * recipe.rollout.group_size // world
    proc = subprocess.run([sys.executable, "-m", "app.cli", "plan", "--config", str(ROOT / "recipes" / f"{name}.yaml"),
                           "--model", MODELS[name], "--nodes", str(nodes), "--rollouts-per-gpu", str(per_gpu),
                           "--seq-len", str(PROMPT_TOKENS + recipe.rollout.max_new_tokens)],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "FITS" in proc.stdout
