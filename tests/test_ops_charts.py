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
from app.names import METRICS_PORT
from charts8s.buffer import BufferChart
from charts8s.cluster import BUFFER_SERVICE, REDIS_EXPORTER_PORT
from charts8s.healthcheck import NAMESPACE, NCCL_JOB, NCCL_SERVICE, HealthCheckChart, dcgm_image
from charts8s.monitoring import PODMONITOR_SCHEMA, SCRAPED, metrics_port
from charts8s.alerts import PROMETHEUSRULE_SCHEMA
from charts8s.ops import build, main
from charts8s.placement import labels
from charts8s.workloads import load_workloads
from infra.addons import DCGM_HOSTENGINE_PORT, NODE_AGENT_DCGM, addon_versions
from infra.charts import MONITORING_NAMESPACE
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


def _validator(version: str, schema: dict = PODMONITOR_SCHEMA) -> jsonschema.Validator:
    defs_dir = Path(kubernetes_validate.__file__).parent / "kubernetes-json-schema" / f"v{version}.0-local-strict"
    defs = json.loads((defs_dir / "_definitions.json").read_text())
    registry = Registry().with_resources([(defs["$id"], Resource.from_contents(defs))])
    return jsonschema.Draft202012Validator(schema, registry=registry)


def test_files_and_schemas(ops):
    cfg, _, names, docs, _ = ops
    assert names == {"monitoring.k8s.yaml", "gpu-healthcheck.k8s.yaml", "node-health.k8s.yaml", "alerts.k8s.yaml",
                     "dashboards.k8s.yaml", "prepull.k8s.yaml"}
    monitors = [d for d in docs if d["kind"] == "PodMonitor"]
    assert len(monitors) == len(SCRAPED) + 1  # and the node health agents'
    for d in docs:
        if d["kind"] == "PodMonitor":
            _validator(cfg.k8s_version).validate(d)
        elif d["kind"] == "PrometheusRule":
            _validator(cfg.k8s_version, PROMETHEUSRULE_SCHEMA).validate(d)
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
    # moerl-rollout-worker: the workers of multi-node engines, a StatefulSet of their own (charts8s/rollout.py)
    assert SCRAPED == {"moerl-trainer": METRICS_PORT, "moerl-rollout": METRICS_PORT, "moerl-rollout-worker": METRICS_PORT,
                       BUFFER_SERVICE: REDIS_EXPORTER_PORT}
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
    cfg, _, _, docs, _ = ops
    (ctr,) = _pod(docs, "gpu-dcgm-diag")["containers"]
    # NVIDIA's DCGM image (with the diagnostic plugins), at the DCGM of the node agent's host engine
    agent = addon_versions(cfg.k8s_version)["eks-node-monitoring-agent"]
    assert ctr["image"] == dcgm_image(cfg.k8s_version) == f"nvcr.io/nvidia/cloud-native/dcgm:{NODE_AGENT_DCGM[agent]}-1-ubuntu22.04"
    assert "dcgmi diag -r 2" in ctr["args"][0]
    ns = get(docs, "Namespace", NAMESPACE)
    assert ns["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "privileged"


def test_dcgm_job_shares_the_node_host_engine(ops, tmp_path):
    """Issue 27 items 6 and 10: dcgmi talks to the node monitoring agent's host engine (one per
    node) instead of starting a second one; no CAP_SYS_ADMIN then. The embedded mode, for a node
    whose agent is down, starts nv-hostengine itself and needs the capability."""
    _, plan, _, docs, _ = ops
    (ctr,) = _pod(docs, "gpu-dcgm-diag")["containers"]
    assert DCGM_HOSTENGINE_PORT == 5555  # dcgmi's default port: --host takes the address alone
    assert ctr["args"] == ["dcgmi diag -r 2 -j --host $(NODE_IP)"] and "nv-hostengine" not in ctr["args"][0]
    assert ctr["env"] == [{"name": "NODE_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.hostIP"}}}]
    assert ctr["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    embedded = [d for d in HealthCheckChart(cdk8s.App(), plan, dcgm_host="embedded").to_json()
                if d["kind"] == "Job" and d["metadata"]["name"] == "gpu-dcgm-diag"]
    (ectr,) = embedded[0]["spec"]["template"]["spec"]["containers"]
    assert ectr["args"][0].startswith("(nv-hostengine -n &)") and ectr["securityContext"]["capabilities"]["add"] == ["SYS_ADMIN"]
    with pytest.raises(ValueError, match="dcgm_host"):
        HealthCheckChart(cdk8s.App(), plan, dcgm_host="remote")


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


# ---------------------------------------------------------------- issue 27 items 13, 14, 15


def _metric_names(expr: str) -> set[str]:
    """Metric names of a PromQL expression (identifiers that are not functions, keywords or labels)."""
    import re
    words = set(re.findall(r"\b([A-Za-z_:][A-Za-z0-9_:]*)\b(?!\s*\()", re.sub(r"\{[^}]*\}|\[[^\]]*\]|\"[^\"]*\"", "", expr)))
    return {w for w in words if ("_" in w) and w not in {"by", "and", "or", "unless", "le"}}


def _served_metric_names() -> set[str]:
    """What the exporters really serve: app.metrics (trainer), app.nodehealth (EFA, checks), the DCGM exporter."""
    from prometheus_client import CollectorRegistry, Gauge

    from app.metrics import RunMetrics
    from app.nodehealth import efa_collector
    import tempfile
    names = set()
    reg = CollectorRegistry()
    sysfs = Path(tempfile.mkdtemp())
    counters = sysfs / "class/infiniband/rdmap0s0/ports/1/hw_counters"
    counters.mkdir(parents=True)
    (counters / "tx_bytes").write_text("1\n")
    reg.register(efa_collector(sysfs))
    Gauge("moerl_node_health_check", "x", ["check"], registry=reg)  # the name app/nodehealth.py main() registers
    for r in (RunMetrics("r1").registry, reg):
        for fam in r.collect():
            names |= {s.name for s in fam.samples} | {fam.name}
            if fam.type == "histogram":  # exposition format: <name>_bucket, _sum, _count
                names |= {fam.name + x for x in ("_bucket", "_sum", "_count")}
    csv = (ROOT / "tests/data/dcgm-exporter-4.5.3-4.8.2-default-counters.csv").read_text()
    names |= {line.split(",")[0].strip() for line in csv.splitlines() if line.strip() and not line.startswith("#")}
    return names


def test_node_health_daemonset_per_gpu_pool(ops):
    """Issue 27 item 13: an agent on every node of each GPU pool, expecting that pool's GPUs and EFA
    devices, allowed to patch nodes, tolerating its pool's taints and the quarantine taint."""
    from app.nodehealth import DIAG_RC, DIAG_REQUEST, DIAG_RESULT, build_parser
    from charts8s.nodehealth import DCGM_LOOP, NAME
    from infra.config import DIAG_TAINT_KEY, UNHEALTHY_TAINT_KEY
    cfg, plan, _, docs, _ = ops
    for pool_name, efa in (("train-gpu", 16), ("rollout-gpu", 32)):
        pool = cfg.pools[pool_name]
        pod = get(docs, "DaemonSet", f"{NAME}-{pool_name}")["spec"]["template"]["spec"]
        assert pod["nodeSelector"] == {POOL_LABEL: pool_name} and pod["serviceAccountName"] == NAME
        keys = {(t["key"], t.get("value")) for t in pod["tolerations"]}
        assert {(t.key, t.value) for t in pool.taints} | {(UNHEALTHY_TAINT_KEY, None), (DIAG_TAINT_KEY, None)} == keys
        agent, dcgm = pod["containers"]
        args = build_parser().parse_args(agent["args"][2:])
        assert agent["args"][:2] == ["-m", "app.nodehealth"] and agent["image"] == plan.images["trainer"]
        assert (args.expected_gpus, args.expected_efa) == (8, efa) == (8, pool.efa_interfaces)
        assert "nvidia.com/gpu" not in agent["resources"]["requests"]  # sees the GPUs without taking them
        assert {"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"} in agent["env"]
        assert {"name": "sys", "hostPath": {"path": "/sys", "type": "Directory"}} in pod["volumes"]
        assert dcgm["image"] == dcgm_image(cfg.k8s_version)
    role = get(docs, "ClusterRole", NAME)
    assert role["rules"] == [{"apiGroups": [""], "resources": ["nodes"], "verbs": ["get", "patch"]},
                             {"apiGroups": [""], "resources": ["pods"], "verbs": ["list"]}]
    binding = get(docs, "ClusterRoleBinding", NAME)
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": NAME, "namespace": NAMESPACE}]
    script = get(docs, "ConfigMap", NAME)["data"]["dcgm-loop.sh"]
    assert script == DCGM_LOOP and 'dcgmi diag -r 2 -j --host "$NODE_IP"' in script
    assert all(f in script for f in (DIAG_REQUEST, DIAG_RESULT, DIAG_RC))  # the files app/nodehealth.py reads


def test_alert_rules_query_what_the_exporters_serve(ops):
    """Issue 27 item 14: XIDs, EFA errors, node health and a stalled run, on metric names the DCGM
    exporter (its default counters), app/metrics.py and app/nodehealth.py really serve."""
    _, _, _, docs, _ = ops
    rule = get(docs, "PrometheusRule", "moerl")
    assert rule["metadata"]["namespace"] == MONITORING_NAMESPACE
    (group,) = rule["spec"]["groups"]
    alerts = {r["alert"]: r for r in group["rules"]}
    assert {"MoerlGpuXid", "MoerlEfaErrors", "MoerlNodeUnhealthy", "MoerlTrainingStalled"} <= set(alerts)
    assert "changes(moerl_policy_version[30m]) == 0" in alerts["MoerlTrainingStalled"]["expr"]
    served = _served_metric_names()
    for r in group["rules"]:
        names = _metric_names(r["expr"])
        assert names and names <= served, (r["alert"], names - served)
    assert _metric_names("increase(moerl_missing_total[5m]) > 0") - served  # the check can fail


def test_dashboards_load_into_grafana_and_query_served_metrics(ops):
    from infra.charts import GRAFANA_DASHBOARD_LABEL
    _, _, _, docs, _ = ops
    maps = [d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["namespace"] == MONITORING_NAMESPACE]
    assert {m["metadata"]["name"] for m in maps} == {"moerl-gpu", "moerl-efa", "moerl-training"}
    served = _served_metric_names()
    for m in maps:
        assert m["metadata"]["labels"][GRAFANA_DASHBOARD_LABEL[0]] == GRAFANA_DASHBOARD_LABEL[1]
        (text,) = m["data"].values()
        board = json.loads(text)
        for panel in board["panels"]:
            names = _metric_names(panel["targets"][0]["expr"])
            assert names and names <= served, (panel["title"], names - served)


def test_prepull_pulls_each_pools_images_when_a_node_joins(ops):
    """Issue 27 item 15: the trainer image on train-gpu, the rollout image on rollout-gpu."""
    from charts8s.prepull import NAME, PAUSE_IMAGE
    cfg, plan, _, docs, _ = ops
    for pool_name, role in (("train-gpu", "trainer"), ("rollout-gpu", "rollout")):
        ds = get(docs, "DaemonSet", f"{NAME}-{pool_name}")
        pod = ds["spec"]["template"]["spec"]
        assert ds["metadata"]["namespace"] == cfg.namespace and pod["nodeSelector"] == {POOL_LABEL: pool_name}
        assert [(c["image"], c["imagePullPolicy"]) for c in pod["initContainers"]] == [(plan.images[role], "IfNotPresent")]
        assert {(t["key"], t["value"]) for t in pod["tolerations"]} == {(t.key, t.value) for t in cfg.pools[pool_name].taints}
        (pause,) = pod["containers"]
        assert pause["image"] == cfg.cached_image(PAUSE_IMAGE) and "/k8s/pause:" in pause["image"]
