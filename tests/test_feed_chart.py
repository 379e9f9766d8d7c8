"""The feed pod in dist/ (charts8s/feed.py): one replica with its PodDisruptionBudget,
NetworkPolicy and resources; with held-out evaluation an engine of its own on a rollout-gpu
node (the rollout pods' engine command), without it a CPU pod on buffer-mem; the workload
check counts its node; its priority may preempt a rollout pod."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from app.names import CLUSTER_CONFIG
from app.torchx_component import engine_command
from charts8s.main import build
from charts8s.workloads import WorkloadError, load_workloads
from infra.config import POOL_LABEL, load_config


def _synth(tmp_path: Path, run: str | None = None, text: str = "") -> tuple:
    if run is not None:
        (tmp_path / "run.yaml").write_text(run)
        text += f"\nrun_config: {tmp_path / 'run.yaml'}\n"
    (tmp_path / "wl.yaml").write_text(text)
    plan = load_workloads(load_config("dev"), tmp_path / "wl.yaml")
    docs = [d for f in build(plan, tmp_path / "dist") for d in yaml.safe_load_all(f.read_text()) if d]
    return plan, docs


from app.model.source import store_copy_dir  # noqa: E402
from charts8s.rollout import BASE_MODEL_DIR  # noqa: E402


def _get(docs, kind, name):
    (d,) = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    return d


def test_feed_pod_with_evaluation_has_its_engine_on_a_rollout_node(tmp_path):
    plan, docs = _synth(tmp_path)  # the dev recipe evaluates every 50 versions
    assert plan.run.feed.eval_every > 0
    dep = _get(docs, "Deployment", "moerl-feed")
    assert dep["spec"]["replicas"] == 1 and dep["spec"]["strategy"] == {"type": "Recreate"}
    pod = dep["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == {POOL_LABEL: "rollout-gpu"}
    feed, engine = pod["containers"]
    assert feed["command"] == ["moerl", "feed", "--config", CLUSTER_CONFIG, "--run-dir", "/models/feed",
                               "--when-done", "idle", "--engine-url", "http://127.0.0.1:30000"]
    # an s3:// base model: served from the copy the pod's init container fetches first
    assert plan.run.model.path.startswith("s3://")
    served = str(store_copy_dir(plan.run.model.path, BASE_MODEL_DIR))
    assert engine["command"] == engine_command("sglang", served, 30000, plan.gpus_per_rollout)
    (init,) = pod["initContainers"]
    assert init["command"] == ["python3", "-m", "app.model.source", plan.run.model.path, "--cache-dir", BASE_MODEL_DIR, "--unquantized"]
    assert int(engine["resources"]["limits"]["nvidia.com/gpu"]) == plan.feed_gpus == plan.gpus_per_rollout
    # a weight load blocks /health_generate: liveness must not depend on it; startup may
    assert "/health_generate" not in " ".join(engine["livenessProbe"]["exec"]["command"])
    assert "/health_generate" in " ".join(engine["startupProbe"]["exec"]["command"])
    # the engine loads the versions the feeder downloads: one volume at the same path in both
    mounts = lambda c: {m["mountPath"]: m["name"] for m in c["volumeMounts"]}  # noqa: E731
    assert mounts(feed)["/models"] == mounts(engine)["/models"] == "models"
    assert pod["serviceAccountName"] == plan.cfg.rollout_service_account  # S3 through Pod Identity
    assert all(c["resources"]["requests"] == c["resources"]["limits"] for c in pod["containers"])
    pdb = _get(docs, "PodDisruptionBudget", "moerl-feed")["spec"]
    assert pdb == {"maxUnavailable": 1, "selector": {"matchLabels": dep["spec"]["selector"]["matchLabels"]}}
    assert _get(docs, "NetworkPolicy", "moerl-feed")["spec"]["ingress"] == []
    prio = _get(docs, "PriorityClass", "moerl-feed")
    rollout = _get(docs, "PriorityClass", "moerl-rollout")
    assert prio["value"] > rollout["value"] and prio["preemptionPolicy"] == "PreemptLowerPriority"
    # the buffer admits the feeder
    (rule,) = _get(docs, "NetworkPolicy", "moerl-buffer")["spec"]["ingress"]
    assert {"podSelector": {"matchLabels": dep["spec"]["template"]["metadata"]["labels"]}} in rule["from"]


def test_feed_pod_without_evaluation_is_a_cpu_pod_beside_the_buffer(tmp_path):
    plan, docs = _synth(tmp_path, run="{model: {path: /models/base}, feed: {eval_every: 0}}")
    pod = _get(docs, "Deployment", "moerl-feed")["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == {POOL_LABEL: "buffer-mem"}
    (feed,) = pod["containers"]
    assert "--engine-url" not in feed["command"] and "nvidia.com/gpu" not in feed["resources"]["limits"]
    assert plan.feed_gpus == 0 and plan.feed_nodes == 0


def test_feed_evaluation_needs_a_rollout_node_of_its_own(tmp_path):
    with pytest.raises(WorkloadError, match="feed pod's held-out evaluation .* 3 > pools.rollout-gpu.max_size=2"):
        _synth(tmp_path, text="rollout: {replicas: 2}")
