"""Prometheus scrape targets of the moerl pods: PodMonitors (monitoring.coreos.com/v1) and the
NetworkPolicies that let Prometheus reach the metrics port.

kube-prometheus-stack (infra/cluster.py) selects every PodMonitor in the cluster. A PodMonitor,
not a ServiceMonitor: the rollout workers have no Service, and a trainer rank's pod is its
target. Each selects one role's pods by their labels (charts8s.placement.labels) and scrapes the
container port named "metrics": app.names.METRICS_PORT on trainer rank 0 and the rollout
workers, the Redis exporter's port (charts8s.cluster.REDIS_EXPORTER_PORT) on the buffer pod,
whose sidecar (charts8s/buffer.py) exports redis-server's figures and the length of the run's
queue keys, and with ``rollout.router`` the router's ``rollout.router_metrics_port``. The roles and
ports are charts8s/contract.py's rows from Prometheus (`scraped`). A pod that declares no such port is no target, so only trainer rank 0, which serves
the trainer's figures, is scraped. NetworkPolicies add up: the ones here only open the metrics
port to the monitoring namespace beside the roles' own policies.

`PODMONITOR_SCHEMA` is the JSON schema of the fields written here, transcribed from the
prometheus-operator CRD shipped in kube-prometheus-stack 88.5.3 (charts/crds/crds/
crd-podmonitors.yaml: spec.selector, namespaceSelector, podMetricsEndpoints[].port/path/interval/
scrapeTimeout/honorLabels, jobLabel); unknown fields are errors.
"""

from __future__ import annotations

from typing import Any

import cdk8s
from constructs import Construct

from app.names import METRICS_PORT
from charts8s.contract import COMPONENT, PROMETHEUS, TABLE, applies, ports
from charts8s.kube import api_object, k8s_module
from charts8s.placement import labels
from charts8s.workloads import Plan
from infra.charts import MONITORING_NAMESPACE

API_VERSION = "monitoring.coreos.com/v1"
KIND = "PodMonitor"
METRICS_PORT_NAME = "metrics"
SCRAPE_INTERVAL = "15s"


def scraped(plan: Plan | None = None) -> dict[str, int]:
    """Roles that serve /metrics, and the number of their port named METRICS_PORT_NAME: the rows of
    charts8s/contract.py TABLE from Prometheus into the namespace that hold for ``plan`` (None:
    those of every render). The buffer's counters (buffer.stats()) also come from trainer rank 0;
    its exporter adds Redis's own figures; the router's, with ``rollout.router``."""
    return {r.dst.removeprefix(COMPONENT): ports(plan, r.ports)[0]["port"] for r in TABLE
            if r.src == PROMETHEUS and r.dst.startswith(COMPONENT) and (applies(plan, r.when) if plan else r.when == "always")}


SCRAPED = scraped()

_LABEL_SELECTOR = {"$ref": "/api/_definitions.json#/$defs/io.k8s.apimachinery.pkg.apis.meta.v1.LabelSelector"}
_OBJECT_META = {"$ref": "/api/_definitions.json#/$defs/io.k8s.apimachinery.pkg.apis.meta.v1.ObjectMeta"}
_DURATION = {"type": "string", "pattern": r"^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$"}
PODMONITOR_SCHEMA: dict[str, Any] = {
    "$id": "https://kubernetes.io/api/podmonitor-v1.json",
    "type": "object", "additionalProperties": False, "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": API_VERSION}, "kind": {"const": KIND}, "metadata": _OBJECT_META,
        "spec": {
            "type": "object", "additionalProperties": False, "required": ["selector"],
            "properties": {
                "selector": _LABEL_SELECTOR, "jobLabel": {"type": "string"},
                "namespaceSelector": {"type": "object", "additionalProperties": False, "properties": {
                    "any": {"type": "boolean"}, "matchNames": {"type": "array", "items": {"type": "string"}}}},
                "podMetricsEndpoints": {"type": "array", "items": {
                    "type": "object", "additionalProperties": False,
                    "properties": {
                        "port": {"type": "string", "minLength": 1}, "path": {"type": "string"},
                        "interval": _DURATION, "scrapeTimeout": _DURATION, "honorLabels": {"type": "boolean"},
                    },
                }},
            },
        },
    },
}


def metrics_port(port: int = METRICS_PORT) -> dict:
    """The container port a role declares to be scraped: trainer rank 0's and the rollout
    worker's container (METRICS_PORT), the buffer's exporter (REDIS_EXPORTER_PORT)."""
    return {"name": METRICS_PORT_NAME, "containerPort": port, "protocol": "TCP"}


class MonitoringChart(cdk8s.Chart):
    """One PodMonitor and one scrape NetworkPolicy per role of `scraped` (the router's with ``rollout.router``)."""

    def __init__(self, scope: Construct, plan: Plan):
        super().__init__(scope, "monitoring")
        k8s, ns = k8s_module(plan.cfg.k8s_version), plan.namespace
        for role, port in scraped(plan).items():
            lab = labels(role)
            obj = cdk8s.ApiObject(self, f"{KIND}-{role}", api_version=API_VERSION, kind=KIND,
                                  metadata=cdk8s.ApiObjectMetadata(name=role, namespace=ns, labels=lab))
            obj.add_json_patch(cdk8s.JsonPatch.add("/spec", {
                "selector": {"matchLabels": lab},
                "namespaceSelector": {"matchNames": [ns]},
                "podMetricsEndpoints": [{"port": METRICS_PORT_NAME, "path": "/metrics", "interval": SCRAPE_INTERVAL}],
            }))
            api_object(self, k8s.KubeNetworkPolicy, f"{role}-metrics", ns, labels=lab, spec={
                "podSelector": {"matchLabels": lab}, "policyTypes": ["Ingress"],
                "ingress": [{
                    "from": [{"namespaceSelector": {"matchLabels": {
                        "kubernetes.io/metadata.name": MONITORING_NAMESPACE}}}],
                    "ports": [{"protocol": "TCP", "port": port}],
                }],
            })
