"""charts8s: the reward-model Deployment and Service (issue 9), synthesized only when the run
config names task.reward_model; placement on GPU nodes, the run config's reward_url, the GPU
quota, the container command against `moerl reward`'s options, and the capacity rule."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml

from charts8s.main import build
from charts8s.workloads import WorkloadError, load_workloads
from infra.config import POOL_LABEL, load_config

os.environ.setdefault("JSII_SILENCE_WARNING_DEPRECATED_NODE_VERSION", "1")


def workloads(tmp_path: Path, text: str = "", run: str = "{task: {reward_model: /models/rm}, model: {path: /models/base}}") -> Path:
    (tmp_path / "run.yaml").write_text(run)
    p = tmp_path / "workloads.yaml"
    p.write_text(text + f"\nrun_config: {tmp_path / 'run.yaml'}\n")
    return p


def docs(outdir: Path) -> list[dict]:
    out = []
    for f in sorted(outdir.glob("*.k8s.yaml")):
        out += [d for d in yaml.safe_load_all(f.read_text()) if d]
    return out


def find(all_docs: list[dict], kind: str, name: str) -> list[dict]:
    return [d for d in all_docs if d["kind"] == kind and d["metadata"]["name"] == name]


@pytest.fixture(scope="module")
def synthesized(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("rm-chart")
    cfg = load_config("dev")
    plan = load_workloads(cfg, workloads(tmp, "reward_model: {replicas: 2, gpus: 2}"))
    build(plan, tmp / "dist")
    return plan, docs(tmp / "dist")


def test_reward_model_runs_on_gpu_nodes_behind_a_service(synthesized):
    from app.cli import command

    plan, all_docs = synthesized
    (dep,) = find(all_docs, "Deployment", "moerl-reward-model")
    pod = dep["spec"]["template"]["spec"]
    pool = plan.pool("rollout-gpu")
    assert dep["spec"]["replicas"] == 2
    assert pod["nodeSelector"] == {POOL_LABEL: "rollout-gpu"}
    tolerated = {(t["key"], t["value"]) for t in pod["tolerations"]}
    assert {(t.key, t.value) for t in pool.taints} <= tolerated
    (container,) = pod["containers"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "2"
    assert container["securityContext"]["privileged"] is False
    options = {opt for p in command("reward").params for opt in p.opts}
    assert {a for a in container["command"] if a.startswith("--")} <= options
    (svc,) = find(all_docs, "Service", "moerl-reward-model")
    assert svc["spec"]["selector"] == dep["spec"]["selector"]["matchLabels"]
    assert svc["spec"]["ports"][0]["targetPort"] == container["ports"][0]["containerPort"]
    (netpol,) = find(all_docs, "NetworkPolicy", "moerl-reward-model")
    assert netpol["spec"]["ingress"][0]["from"][0]["podSelector"]["matchLabels"]["app.kubernetes.io/name"] == "moerl-rollout"


def test_run_config_points_workers_at_the_service_and_quota_counts_its_gpus(synthesized):
    from app.config import RunConfig

    plan, all_docs = synthesized
    (cm,) = find(all_docs, "ConfigMap", "moerl-run-config")
    run = RunConfig.model_validate(yaml.safe_load(cm["data"]["run.yaml"]))
    assert run.task.reward_model == "/models/rm"
    assert run.rollout.reward_url == f"http://moerl-reward-model.{plan.namespace}.svc.cluster.local:{plan.wl.reward_model.port}"
    (quota,) = find(all_docs, "ResourceQuota", "moerl-accelerators")
    want = plan.trainer_world_size + plan.rollout_replicas * plan.gpus_per_rollout + 4
    assert quota["spec"]["hard"]["requests.nvidia.com/gpu"] == str(want)


def test_no_reward_model_no_deployment(tmp_path):
    plan = load_workloads(load_config("dev"), workloads(tmp_path, run="{model: {path: /models/base}}"))
    build(plan, tmp_path / "dist")
    assert not find(docs(tmp_path / "dist"), "Deployment", "moerl-reward-model")
    assert plan.reward_model_gpus == 0


@pytest.mark.parametrize("text,message", [
    ("reward_model: {gpus: 16}", "reward_model.gpus=16 exceeds the 8 GPUs of a rollout-gpu node"),
    ("rollout: {replicas: 2}", "needs 1 rollout-gpu node(s) beside 2 rollout pods; pools.rollout-gpu.max_size=2"),
])
def test_reward_model_that_does_not_fit_fails_before_synth(tmp_path, text, message):
    with pytest.raises(WorkloadError) as e:
        load_workloads(load_config("dev"), workloads(tmp_path, text))
    assert message in str(e.value) and "\n" not in str(e.value)


def test_reward_model_objects_validate_against_the_kubernetes_schema(synthesized):
    import kubernetes_validate

    plan, all_docs = synthesized
    mine = [d for d in all_docs if d["metadata"]["name"] == "moerl-reward-model"]
    assert {d["kind"] for d in mine} == {"Deployment", "Service", "PodDisruptionBudget", "NetworkPolicy"}
    for d in mine:
        kubernetes_validate.validate(d, plan.cfg.k8s_version, strict=True)
