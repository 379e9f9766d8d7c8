"""The env pool's manifests for a run that names an environment (charts8s/envpool.py).

`moerl env` pods on env-cpu behind the moerl-env Service; the mounted run config points the
workers' env.url at that Service; only rollout pods may reach it; probes on /health; the
container's flags are `moerl env`'s own options. (tests/test_charts.py covers the verifier
pods of a run without an environment.)
"""

from __future__ import annotations

from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from app.cli import command
from app.config import RunConfig
from app.names import CLUSTER_CONFIG
from charts8s.main import build
from charts8s.workloads import load_workloads
from infra.config import POOL_LABEL, load_config

RUN = "env: {name: calculator}\ntask: {name: basic_arithmetic, params: {operators: ['*']}}\n"


@pytest.fixture(scope="module")
def docs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("envpool")
    (tmp / "run.yaml").write_text(RUN)
    (tmp / "workloads.yaml").write_text(f"env: {{replicas: 3, port: 8090}}\nrollout: {{model_path: Qwen/Qwen3-30B-A3B}}\n"
                                       f"run_config: {tmp / 'run.yaml'}\n")
    cfg = load_config("dev")
    plan = load_workloads(cfg, tmp / "workloads.yaml")
    build(plan, tmp / "dist")
    out = []
    for f in sorted((tmp / "dist").glob("*.k8s.yaml")):
        out += [d for d in yaml.safe_load_all(f.read_text()) if d]
    return cfg, out


def _get(docs, kind, name):
    (d,) = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    return d


def test_env_pods_serve_the_environment_on_the_env_pool(docs):
    cfg, docs = docs
    dep = _get(docs, "Deployment", "moerl-env")
    assert dep["spec"]["replicas"] == 3
    pod = dep["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == {POOL_LABEL: "env-cpu"}
    (c,) = pod["containers"]
    assert c["command"] == ["moerl", "env", "--config", CLUSTER_CONFIG, "--host", "0.0.0.0", "--port", "8090"]
    options = {p for param in command("env").params for p in param.opts}
    assert {a for a in c["command"] if a.startswith("--")} <= options
    for probe in ("readinessProbe", "livenessProbe"):
        assert c[probe]["httpGet"] == {"path": "/health", "port": 8090}
    validator = kubernetes_validate.utils.latest_version()
    for d in (dep, _get(docs, "Service", "moerl-env"), _get(docs, "NetworkPolicy", "moerl-env")):
        kubernetes_validate.validate(d, validator, strict=True)


def test_workers_reach_the_env_service_and_only_they_may(docs):
    cfg, docs = docs
    (cm,) = [d for d in docs if d["kind"] == "ConfigMap"]
    run = RunConfig.model_validate(yaml.safe_load(cm["data"]["run.yaml"]))
    assert run.env.name == "calculator"
    # the Service's port is the pods' (the VPC CNI enforces NetworkPolicies only that way)
    assert run.env.url == f"http://moerl-env.{cfg.namespace}.svc.cluster.local:8090"
    svc = _get(docs, "Service", "moerl-env")["spec"]
    assert svc["ports"] == [{"name": "http", "port": 8090, "targetPort": 8090}]
    pol = _get(docs, "NetworkPolicy", "moerl-env")["spec"]
    (rule,) = pol["ingress"]
    assert [f["podSelector"]["matchLabels"]["app.kubernetes.io/name"] for f in rule["from"]] == ["moerl-rollout"]
    assert rule["ports"] == [{"protocol": "TCP", "port": 8090}]


def test_a_users_environment_server_is_used_as_given_and_no_env_pool_is_rendered(tmp_path):
    """env.url set (bring your own server): the mounted run config keeps it, and no moerl-env
    pods are rendered to serve an environment nobody would call."""
    url = "http://guess-number.games.svc.cluster.local:8091"
    (tmp_path / "run.yaml").write_text(f"env: {{name: guess-number, url: '{url}'}}\n")
    (tmp_path / "workloads.yaml").write_text(f"rollout: {{model_path: Qwen/Qwen3-30B-A3B}}\n"
                                             f"run_config: {tmp_path / 'run.yaml'}\n")
    build(load_workloads(load_config("dev"), tmp_path / "workloads.yaml"), tmp_path / "dist")
    docs = [d for f in sorted((tmp_path / "dist").glob("*.k8s.yaml")) for d in yaml.safe_load_all(f.read_text()) if d]
    (cm,) = [d for d in docs if d["kind"] == "ConfigMap"]
    assert RunConfig.model_validate(yaml.safe_load(cm["data"]["run.yaml"])).env.url == url
    assert not [d for d in docs if d["metadata"]["name"] == "moerl-env" and d["kind"] in ("Deployment", "Service")]
