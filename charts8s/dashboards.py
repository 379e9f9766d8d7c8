"""Grafana dashboards (dist-ops/dashboards.k8s.yaml): ConfigMaps in the monitoring namespace with
the label kube-prometheus-stack's Grafana sidecar loads dashboards from (infra/charts.py
GRAFANA_DASHBOARD_LABEL, set in the chart's values by infra/cluster.py).

- moerl-gpu: utilisation, memory, tensor-core activity, power, XIDs (DCGM exporter metrics);
- moerl-efa: bytes sent and received and error counters per EFA device (app/nodehealth.py);
- moerl-training: policy version, trainer step, samples/s, staleness, reward, weight publish and
  update times, buffer depth (app/metrics.py).

NCCL has no metrics endpoint of its own: collective bandwidth shows as EFA bytes per device here,
and as the health check's bus bandwidth (app/healthcheck.py) before a job.
"""

from __future__ import annotations

import json

import cdk8s
from constructs import Construct

from charts8s.kube import api_object, k8s_module
from charts8s.placement import labels
from charts8s.workloads import Plan
from infra.charts import GRAFANA_DASHBOARD_LABEL, MONITORING_NAMESPACE

# title -> [(panel title, PromQL, unit)]
DASHBOARDS: dict[str, list[tuple[str, str, str]]] = {
    "moerl-gpu": [
        ("GPU utilisation", "avg by (Hostname, gpu) (DCGM_FI_DEV_GPU_UTIL)", "percent"),
        ("Tensor core activity", "avg by (Hostname, gpu) (DCGM_FI_PROF_PIPE_TENSOR_ACTIVE)", "percentunit"),
        ("Framebuffer used", "DCGM_FI_DEV_FB_USED", "decmbytes"),
        ("Power", "DCGM_FI_DEV_POWER_USAGE", "watt"),
        ("Last XID", "max by (Hostname, gpu) (DCGM_FI_DEV_XID_ERRORS)", "none"),
    ],
    "moerl-efa": [
        ("EFA bytes sent per second", 'sum by (pod, device) (rate(moerl_efa_hw_counter_total{counter="tx_bytes"}[1m]))', "Bps"),
        ("EFA bytes received per second", 'sum by (pod, device) (rate(moerl_efa_hw_counter_total{counter="rx_bytes"}[1m]))', "Bps"),
        ("EFA RDMA read bytes per second",
         'sum by (pod) (rate(moerl_efa_hw_counter_total{counter="rdma_read_bytes"}[1m]))', "Bps"),
        ("EFA errors (10 min)", 'sum by (pod, counter) (increase(moerl_efa_hw_counter_total{counter=~".*_err"}[10m]))', "none"),
        ("EFA devices per node", "moerl_efa_devices", "none"),
        ("Node health checks", "moerl_node_health_check", "none"),
    ],
    "moerl-training": [
        ("Policy version", "moerl_policy_version", "none"),
        ("Trainer step", "moerl_trainer_step", "none"),
        ("Samples per second", "moerl_samples_per_second", "none"),
        ("Staleness", "moerl_staleness", "none"),
        ("Mean reward", "moerl_reward_mean", "none"),
        ("Weight publish seconds", "moerl_weight_publish_seconds", "s"),
        ("Engine weight update p90", "histogram_quantile(0.9, sum by (le) (rate(moerl_rollout_weight_update_seconds_bucket[5m])))", "s"),
        ("Buffer ready groups", "moerl_buffer_ready_groups", "none"),
    ],
}


def dashboard(title: str, panels: list[tuple[str, str, str]]) -> dict:
    """A Grafana dashboard model (schemaVersion 39): one time-series panel per query, two per row."""
    return {
        "title": title, "uid": title, "schemaVersion": 39, "time": {"from": "now-6h", "to": "now"},
        "refresh": "30s", "tags": ["moerl"],
        "panels": [{
            "id": i + 1, "type": "timeseries", "title": name,
            "gridPos": {"h": 8, "w": 12, "x": 12 * (i % 2), "y": 8 * (i // 2)},
            "datasource": {"type": "prometheus", "uid": "prometheus"},
            "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
            "targets": [{"refId": "A", "expr": expr, "datasource": {"type": "prometheus", "uid": "prometheus"}}],
        } for i, (name, expr, unit) in enumerate(panels)],
    }


class DashboardsChart(cdk8s.Chart):
    """One ConfigMap per dashboard of DASHBOARDS."""

    def __init__(self, scope: Construct, plan: Plan):
        super().__init__(scope, "dashboards")
        k8s = k8s_module(plan.cfg.k8s_version)
        key, value = GRAFANA_DASHBOARD_LABEL
        for title, panels in DASHBOARDS.items():
            api_object(self, k8s.KubeConfigMap, title, MONITORING_NAMESPACE, labels={**labels(title), key: value},
                       data={f"{title}.json": json.dumps(dashboard(title, panels), indent=1)})
