"""Alert rules of the cluster (dist-ops/alerts.k8s.yaml): one PrometheusRule in the monitoring
namespace, which kube-prometheus-stack's Prometheus loads (infra/cluster.py sets
ruleSelectorNilUsesHelmValues false, so rules need no release label).

- MoerlGpuXid: a GPU reported an XID (`DCGM_FI_DEV_XID_ERRORS`, the last XID of the GPU, from the
  DCGM exporter's default counters of the pinned chart, etc/default-counters.csv);
- MoerlGpuRowRemapFailure: a GPU could not remap a memory row (`DCGM_FI_DEV_ROW_REMAP_FAILURE`);
- MoerlNodeUnhealthy: the node health agent's last check failed (`moerl_node_health_check`,
  app/nodehealth.py) and the node is quarantined;
- MoerlEfaErrors: an EFA device counted errors in the last 10 minutes (the `*_err` hw_counters,
  `moerl_efa_hw_counter_total`, app/nodehealth.py);
- MoerlTrainingStalled: no new policy version in `stall_minutes` while the trainer serves its
  figures (`moerl_policy_version`, app/metrics.py): a hung collective or a stalled buffer.

`PROMETHEUSRULE_SCHEMA` is the JSON schema of the fields written here, transcribed from the
prometheus-operator CRD of kube-prometheus-stack 88.5.3 (crd-prometheusrules.yaml: spec.groups[]
name, interval, rules[] alert, expr, for, labels, annotations); unknown fields are errors.
"""

from __future__ import annotations

from typing import Any

import cdk8s
from constructs import Construct

from charts8s.monitoring import API_VERSION, _DURATION, _OBJECT_META
from charts8s.placement import labels
from charts8s.workloads import Plan
from infra.charts import MONITORING_NAMESPACE

KIND = "PrometheusRule"
NAME = "moerl"
EFA_ERROR_COUNTERS = ("alloc_pd_err", "alloc_ucontext_err", "cmds_err", "create_ah_err", "create_cq_err",
                      "create_qp_err", "mmap_err", "rdma_read_wr_err", "rdma_write_wr_err", "reg_mr_err")

PROMETHEUSRULE_SCHEMA: dict[str, Any] = {
    "$id": "https://kubernetes.io/api/prometheusrule-v1.json",
    "type": "object", "additionalProperties": False, "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": API_VERSION}, "kind": {"const": KIND}, "metadata": _OBJECT_META,
        "spec": {"type": "object", "additionalProperties": False, "properties": {"groups": {"type": "array", "items": {
            "type": "object", "additionalProperties": False, "required": ["name"],
            "properties": {
                "name": {"type": "string", "minLength": 1}, "interval": _DURATION,
                "rules": {"type": "array", "items": {
                    "type": "object", "additionalProperties": False, "required": ["expr"],
                    "properties": {
                        "alert": {"type": "string"}, "record": {"type": "string"},
                        "expr": {"type": "string", "minLength": 1}, "for": _DURATION,
                        "labels": {"type": "object", "additionalProperties": {"type": "string"}},
                        "annotations": {"type": "object", "additionalProperties": {"type": "string"}},
                    },
                }},
            },
        }}}},
    },
}


def rules(stall_minutes: int) -> list[dict]:
    """The alert rules (module docstring)."""
    errs = "|".join(EFA_ERROR_COUNTERS)
    return [
        {"alert": "MoerlGpuXid", "expr": "DCGM_FI_DEV_XID_ERRORS > 0", "for": "0m",
         "labels": {"severity": "critical"},
         "annotations": {"summary": "GPU {{ $labels.gpu }} on {{ $labels.Hostname }} reported XID {{ $value }}",
                         "description": "An XID is an error the NVIDIA driver logged; see NVIDIA's XID catalog for its action."}},
        {"alert": "MoerlGpuRowRemapFailure", "expr": "DCGM_FI_DEV_ROW_REMAP_FAILURE > 0", "for": "0m",
         "labels": {"severity": "critical"},
         "annotations": {"summary": "GPU {{ $labels.gpu }} on {{ $labels.Hostname }} failed to remap a memory row"}},
        {"alert": "MoerlNodeUnhealthy", "expr": "moerl_node_health_check == 0", "for": "1m",
         "labels": {"severity": "critical"},
         "annotations": {"summary": "node health check {{ $labels.check }} failed on {{ $labels.pod }}; the node is quarantined"}},
        {"alert": "MoerlEfaErrors", "expr": f'increase(moerl_efa_hw_counter_total{{counter=~"{errs}"}}[10m]) > 0',
         "for": "0m", "labels": {"severity": "warning"},
         "annotations": {"summary": "EFA device {{ $labels.device }} counted {{ $labels.counter }} on {{ $labels.pod }}"}},
        {"alert": "MoerlTrainingStalled",
         "expr": f"changes(moerl_policy_version[{stall_minutes}m]) == 0 and moerl_trainer_step > 0",
         "for": "5m", "labels": {"severity": "critical"},
         "annotations": {"summary": f"run {{{{ $labels.run_id }}}}: no new policy version in {stall_minutes} minutes"}},
    ]


class AlertsChart(cdk8s.Chart):
    """The PrometheusRule `moerl` in the monitoring namespace.

    stall_minutes: minutes without a new policy version before MoerlTrainingStalled (>= 1).
    Raises ValueError naming stall_minutes when it is out of range.
    """

    def __init__(self, scope: Construct, plan: Plan, stall_minutes: int = 30):
        super().__init__(scope, "alerts")
        if stall_minutes < 1:
            raise ValueError(f"stall_minutes={stall_minutes} must be >= 1")
        obj = cdk8s.ApiObject(self, f"{KIND}-{NAME}", api_version=API_VERSION, kind=KIND,
                              metadata=cdk8s.ApiObjectMetadata(name=NAME, namespace=MONITORING_NAMESPACE, labels=labels(NAME)))
        obj.add_json_patch(cdk8s.JsonPatch.add("/spec", {"groups": [{"name": "moerl", "rules": rules(stall_minutes)}]}))
