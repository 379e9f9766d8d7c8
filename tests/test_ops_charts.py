"""charts8s/ops.py output (issue 15 items 8 and 12): the GPU health-check Jobs and the PodMonitors,
synthesized once for prod and read back from disk; and app/healthcheck.py on two gloo ranks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import cdk8s
import jsonschema
import kubernetes_validate
import pytest
import yaml
from referencing import Registry, Resource

from app.healthcheck import bus_bandwidth
from app.metrics import METRICS_PORT
from charts8s.buffer import BufferChart
from charts8s.cluster import BUFFER_SERVICE, REDIS_EXPORTER_PORT
from charts8s.healthcheck import DCGM_IMAGE, NAMESPACE, NCCL_JOB, NCCL_SERVICE
from charts8s.monitoring import PODMONITOR_SCHEMA, SCRAPED, metrics_port
from charts8s.ops import build, main
from charts8s.placement import labels
from charts8s.workloads import load_workloads
from infra.charts import DCGM_EXPORTER, MONITORING_NAMESPACE
from infra.config import POOL_LABEL, load_config

ROOT = Path(__file__).resolve().parents[1]
os.environ.setdefault("JSII_SILENCE_WARNING_DEPRECATED_NODE_VERSION", "1")


@pytest.fixture(scope="module")
def ops(tmp_path_factory):
    cfg = load_config("prod")
    plan = load_workloads(cfg)
    out = tmp_path_factory.mktemp("ops") / "dist-ops"
    files = build(plan, out, nodes=2, min_busbw_gbps=100)
    docs = [d for f in files for d in yaml.safe_load_all(f.read_text()) if d]
    return cfg, plan, {f.name for f in files}, docs, out


def get(docs, kind, name):
    (d,) = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    return d


def _validator(version: str) -> jsonschema.Validator:
    defs_dir = Path(kubernetes_validate.__file__).parent / "kubernetes-json-schema" / f"v{version}.0-local-strict"
    defs = json.loads((defs_dir / "_definitions.json").read_text())
    registry = Registry().with_resources([(defs["$id"], Resource.from_contents(defs))])
    return jsonschema.Draft202012Validator(PODMONITOR_SCHEMA, registry=registry)


def test_files_and_schemas(ops):
    cfg, _, names, docs, _ = ops
    assert names == {"monitoring.k8s.yaml", "gpu-healthcheck.k8s.yaml"}
    monitors = [d for d in docs if d["kind"] == "PodMonitor"]
    assert len(monitors) == len(SCRAPED)
    for d in docs:
        if d["kind"] == "PodMonitor":
            _validator(cfg.k8s_version).validate(d)
        else:
            kubernetes_validate.validate(d, cfg.k8s_version, strict=True)


def test_podmonitor_schema_rejects_a_misspelt_field(ops):
    cfg, _, _, docs, _ = ops
    bad = json.loads(json.dumps(get(docs, "PodMonitor", "moerl-trainer")))
    bad["spec"]["podMetricEndpoints"] = bad["spec"].pop("podMetricsEndpoints")
    with pytest.raises(jsonschema.ValidationError):
        _validator(cfg.k8s_version).validate(bad)


def test_podmonitors_scrape_the_named_metrics_port_of_each_role(ops):
    cfg, _, _, docs, _ = ops
    assert SCRAPED == {"moerl-trainer": METRICS_PORT, "moerl-rollout": METRICS_PORT, BUFFER_SERVICE: REDIS_EXPORTER_PORT}
    for role in SCRAPED:
        pm = get(docs, "PodMonitor", role)
        assert pm["metadata"]["namespace"] == cfg.namespace
        assert pm["spec"]["selector"] == {"matchLabels": labels(role)}
        assert pm["spec"]["podMetricsEndpoints"] == [{"port": metrics_port()["name"], "path": "/metrics", "interval": "15s"}]
        np_ = get(docs, "NetworkPolicy", f"{role}-metrics")["spec"]
        assert np_["podSelector"] == {"matchLabels": labels(role)}
        (rule,) = np_["ingress"]
        assert rule["from"] == [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": MONITORING_NAMESPACE}}}]
        assert rule["ports"] == [{"protocol": "TCP", "port": SCRAPED[role]}]
    assert metrics_port() == {"name": "metrics", "containerPort": METRICS_PORT, "protocol": "TCP"}


def test_the_buffer_podmonitor_selects_the_buffer_pod_and_its_exporter_port(ops):
    """The moerl-buffer PodMonitor and its NetworkPolicy, against the buffer StatefulSet the
    same plan renders (dist/): its selector matches the pod's labels in its namespace, the
    endpoint's port name is the exporter container's port, and the policy opens that number."""
    cfg, plan, _, docs, _ = ops
    objs = BufferChart(cdk8s.App(), plan).to_json()
    (sts,) = [d for d in objs if d["kind"] == "StatefulSet"]
    tpl = sts["spec"]["template"]
    pm = get(docs, "PodMonitor", BUFFER_SERVICE)["spec"]
    assert pm["selector"]["matchLabels"].items() <= tpl["metadata"]["labels"].items()
    assert pm["namespaceSelector"]["matchNames"] == [sts["metadata"]["namespace"]]
    (endpoint,) = pm["podMetricsEndpoints"]
    ports = [(c["name"], p) for c in tpl["spec"]["containers"] for p in c.get("ports", []) if p["name"] == endpoint["port"]]
    assert [(c, p["containerPort"]) for c, p in ports] == [("redis-exporter", REDIS_EXPORTER_PORT)]
    assert endpoint["path"] == "/metrics"
    np_ = get(docs, "NetworkPolicy", f"{BUFFER_SERVICE}-metrics")["spec"]
    assert np_["podSelector"]["matchLabels"].items() <= tpl["metadata"]["labels"].items()
    (rule,) = np_["ingress"]
    assert rule["ports"] == [{"protocol": "TCP", "port": ports[0][1]["containerPort"]}]
    # the buffer's own policy still opens Redis to moerl's roles only, not to the monitoring namespace
    (own,) = [d for d in objs if d["kind"] == "NetworkPolicy"]
    assert all("namespaceSelector" not in f for r in own["spec"]["ingress"] for f in r["from"])


def _pod(docs, job):
    return get(docs, "Job", job)["spec"]["template"]["spec"]


@pytest.mark.parametrize("job", ["gpu-dcgm-diag", NCCL_JOB])
def test_health_jobs_one_pod_per_train_node(ops, job):
    cfg, plan, _, docs, _ = ops
    pool = cfg.pools["train-gpu"]
    spec = get(docs, "Job", job)["spec"]
    assert (spec["completionMode"], spec["completions"], spec["parallelism"], spec["backoffLimit"]) == ("Indexed", 2, 2, 0)
    pod = spec["template"]["spec"]
    assert pod["nodeSelector"] == {POOL_LABEL: "train-gpu"}
    assert {(t["key"], t["value"]) for t in pod["tolerations"]} == {(t.key, t.value) for t in pool.taints}
    (anti,) = pod["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert anti == {"labelSelector": {"matchLabels": labels(job)}, "topologyKey": "kubernetes.io/hostname"}
    assert spec["template"]["metadata"]["labels"] == labels(job)
    (ctr,) = pod["containers"]
    assert ctr["resources"]["limits"]["nvidia.com/gpu"] == str(plan.gpus_per_trainer)


def test_nccl_job_uses_every_efa_interface_and_fails_without_efa(ops):
    cfg, plan, _, docs, _ = ops
    pool = cfg.pools["train-gpu"]
    pod = _pod(docs, NCCL_JOB)
    (ctr,) = pod["containers"]
    lim = ctr["resources"]["limits"]
    assert lim["vpc.amazonaws.com/efa"] == str(pool.efa_interfaces) == "16"
    assert lim["hugepages-2Mi"] == f"{pool.hugepages_2mi}Mi" and ctr["resources"]["requests"] == lim
    env = {e["name"]: e["value"] for e in ctr["env"]}
    assert env["FI_PROVIDER"] == "efa" and env["NCCL_NET"] == "AWS Libfabric"
    assert ctr["image"] == plan.images["trainer"] and ctr["command"] == ["torchrun"]
    args = ctr["args"]
    assert args[args.index("--nnodes") + 1] == "2" and args[args.index("--nproc-per-node") + 1] == str(plan.gpus_per_trainer)
    assert args[args.index("--node-rank") + 1] == "$(JOB_COMPLETION_INDEX)"
    assert args[args.index("-m") + 1] == "app.healthcheck" and args[args.index("--min-busbw-gbps") + 1] == "100"
    # Pod 0 of an Indexed Job with a subdomain answers as <job>-0.<service>: the master address.
    assert pod["subdomain"] == NCCL_SERVICE
    assert args[args.index("--master-addr") + 1] == f"{NCCL_JOB}-0.{NCCL_SERVICE}.{NAMESPACE}.svc.cluster.local"
    svc = get(docs, "Service", NCCL_SERVICE)["spec"]
    assert svc["clusterIP"] == "None" and svc["publishNotReadyAddresses"] and svc["selector"] == labels(NCCL_JOB)
    assert pod["securityContext"]["runAsNonRoot"] and ctr["securityContext"]["allowPrivilegeEscalation"] is False


def test_dcgm_job_runs_the_pinned_dcgm(ops):
    _, _, _, docs, _ = ops
    (ctr,) = _pod(docs, "gpu-dcgm-diag")["containers"]
    assert ctr["image"] == DCGM_IMAGE and DCGM_IMAGE.split(":")[1].split("-")[1] == DCGM_EXPORTER[2]
    assert "dcgmi diag -r 2" in ctr["args"][0]
    ns = get(docs, "Namespace", NAMESPACE)
    assert ns["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "privileged"


def test_checkov_passes_on_dist_ops_with_every_skip_justified(ops):
    from tests.test_charts import _checkov
    docs = ops[3]
    report = _checkov(ops[4], "kubernetes")
    assert [(f["check_id"], f["resource"]) for f in report["results"]["failed_checks"]] == []
    assert report["summary"]["passed"] > 20
    for d in docs:
        for key, value in (d["metadata"].get("annotations") or {}).items():
            if key.startswith("checkov.io/skip"):
                check, _, reason = value.partition("=")
                assert check.startswith("CKV") and len(reason.split()) >= 5, (d["metadata"]["name"], value)


def test_bad_input_exit_2(tmp_path, capsys):
    assert main(["--env", "prod", "--nodes", "1", "--outdir", str(tmp_path / "o")]) == 2
    assert "nodes=1" in capsys.readouterr().err
    assert main(["--env", "prod", "--nodes", "17", "--outdir", str(tmp_path / "o")]) == 2
    assert not (tmp_path / "o").exists()


def test_bus_bandwidth_is_nccl_tests_definition():
    # 1 GB in 10 ms on 16 ranks: algbw 100 GB/s, busbw = 100 * 2 * 15 / 16
    assert bus_bandwidth(10**9, 0.01, 16) == pytest.approx(187.5)
    assert bus_bandwidth(10**9, 0.01, 1) == 0.0
    with pytest.raises(ValueError):
        bus_bandwidth(1, 0.0, 2)


def _torchrun(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           "-m", "app.healthcheck", "--sizes-mib", "1", "2", "--iters", "2", "--warmup", "1", *args],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def test_allreduce_check_on_two_gloo_ranks():
    ok = _torchrun()
    assert ok.returncode == 0, ok.stderr[-2000:]
    lines = [json.loads(x) for x in ok.stdout.splitlines() if x.startswith("{")]
    sizes, verdict = lines[:-1], lines[-1]
    assert [r["size_bytes"] for r in sizes] == [2**20, 2 * 2**20] and all(r["correct"] for r in sizes)
    assert all(r["world_size"] == 2 and r["busbw_gbps"] == pytest.approx(r["algbw_gbps"]) for r in sizes)
    assert verdict == {"ok": True, "min_busbw_gbps": 0.0}
    slow = _torchrun("--min-busbw-gbps", "1e9")
    assert slow.returncode != 0 and '"ok": false' in slow.stdout
