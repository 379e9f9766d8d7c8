"""Continuous GPU and EFA health with quarantine on every GPU node (dist-ops/node-health.k8s.yaml).

One DaemonSet per GPU pool (train-gpu, rollout-gpu) in the `moerl-health` namespace, so each
knows its pool's GPU and EFA counts (infra/config.py pools, infra/instances.py), each pod with
two containers:

- `agent`: `python -m app.nodehealth` from the trainer image (nvidia-smi every 5 minutes, the
  EFA device count and port states from the host's /sys, DCGM level 2 every 6 hours while no
  other pod holds a GPU of the node), taints and labels the node (infra/config.py
  UNHEALTHY_TAINT_KEY, DIAG_TAINT_KEY, HEALTH_LABEL), and serves the node's EFA hw_counters and
  the checks' results on METRICS_PORT (a PodMonitor here). It requests no GPU: the NVIDIA
  container runtime of the EKS NVIDIA AMI puts nvidia-smi and every GPU device in a container
  whose NVIDIA_VISIBLE_DEVICES is "all" (NVIDIA Container Toolkit, "Environment variables").
- `dcgm`: NVIDIA's DCGM image (charts8s/healthcheck.py dcgm_image); when the agent leaves a
  request in the shared directory it runs `dcgmi diag -r 2 -j` against the node's one host
  engine (the node monitoring agent's, infra/addons.py DCGM_HOSTENGINE_PORT) and writes the
  result and exit status back.

The pods tolerate their pool's taints and the two health taints (a quarantined node is still
watched). The ServiceAccount may get and patch nodes and list pods (to see whether a node is
idle): a ClusterRole, since nodes are cluster-scoped. As in the AWS GPU health-check recipe
(aws-samples/awsome-distributed-training 4.validation_and_observability/2.gpu-cluster-healthcheck/
kubernetes: an agent DaemonSet that labels and taints a failing node).
"""

from __future__ import annotations

import cdk8s
from constructs import Construct

from charts8s.healthcheck import NAMESPACE, dcgm_image
from charts8s.kube import api_object, k8s_module
from charts8s.monitoring import API_VERSION as MONITORING_API, METRICS_PORT_NAME
from charts8s.placement import checkov_skips, container_security, labels
from charts8s.workloads import Plan
from infra.charts import MONITORING_NAMESPACE
from infra.config import DIAG_TAINT_KEY, POOL_LABEL, UNHEALTHY_TAINT_KEY

NAME = "moerl-node-health"
METRICS_PORT = 9465
TRAINER_UID = 10001  # images/trainer.Dockerfile
GPU_POOLS = ("train-gpu", "rollout-gpu")
SHARED = "/shared"
# The DCGM sidecar: one diagnostics run per request file the agent writes (app/nodehealth.py
# DIAG_REQUEST / DIAG_RESULT / DIAG_RC); the result appears whole (written, then renamed).
DCGM_LOOP = f"""set -u
cd {SHARED}
while true; do
  if [ -f diag.request ]; then
    rm -f diag.request
    dcgmi diag -r 2 -j --host "$NODE_IP" > diag.json.tmp 2>&1; echo $? > diag.rc.tmp
    mv diag.json.tmp diag.json; mv diag.rc.tmp diag.rc
  fi
  sleep 10
done
"""


def agent_args(gpus: int, efa: int) -> list[str]:
    return ["-m", "app.nodehealth", "--expected-gpus", str(gpus), "--expected-efa", str(efa),
            "--shared", SHARED, "--sys-root", "/host/sys", "--port", str(METRICS_PORT)]


class NodeHealthChart(cdk8s.Chart):
    """ServiceAccount, ClusterRole and binding, one DaemonSet per GPU pool, PodMonitor, NetworkPolicy."""

    def __init__(self, scope: Construct, plan: Plan):
        super().__init__(scope, "node-health")
        k8s, lab = k8s_module(plan.cfg.k8s_version), labels(NAME)
        api_object(self, k8s.KubeServiceAccount, NAME, NAMESPACE, labels=lab, automountServiceAccountToken=True)
        api_object(self, k8s.KubeClusterRole, NAME, labels=lab, rules=[
            {"apiGroups": [""], "resources": ["nodes"], "verbs": ["get", "patch"]},
            {"apiGroups": [""], "resources": ["pods"], "verbs": ["list"]},
        ])
        api_object(self, k8s.KubeClusterRoleBinding, NAME, labels=lab,
                   roleRef={"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": NAME},
                   subjects=[{"kind": "ServiceAccount", "name": NAME, "namespace": NAMESPACE}])
        api_object(self, k8s.KubeConfigMap, NAME, NAMESPACE, labels=lab, data={"dcgm-loop.sh": DCGM_LOOP})
        pinned = "images pinned by tag in the repository (ECR tags are immutable); IfNotPresent is intended"
        for pool_name in GPU_POOLS:
            pool = plan.pool(pool_name)
            gpus = min(s.gpus for s in pool.specs)
            tolerations = [{"key": t.key, "operator": "Equal", "value": t.value, "effect": t.effect} for t in pool.taints]
            tolerations += [{"key": k, "operator": "Exists", "effect": "NoSchedule"} for k in (UNHEALTHY_TAINT_KEY, DIAG_TAINT_KEY)]
            pod_lab = {**lab, POOL_LABEL: pool_name}
            agent = {
                "name": "agent", "image": plan.images["trainer"], "imagePullPolicy": "IfNotPresent",
                "command": ["python3"], "args": agent_args(gpus, pool.efa_interfaces),
                "env": [{"name": "NODE_NAME", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
                        {"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"},
                        {"name": "NVIDIA_DRIVER_CAPABILITIES", "value": "utility"}],
                "ports": [{"name": METRICS_PORT_NAME, "containerPort": METRICS_PORT, "protocol": "TCP"}],
                "livenessProbe": {"httpGet": {"path": "/metrics", "port": METRICS_PORT}, "periodSeconds": 60},
                "readinessProbe": {"httpGet": {"path": "/metrics", "port": METRICS_PORT}, "periodSeconds": 30},
                "resources": {"requests": {"cpu": "50m", "memory": "128Mi"}, "limits": {"cpu": "500m", "memory": "512Mi"}},
                "securityContext": container_security(),
                "volumeMounts": [{"name": "sys", "mountPath": "/host/sys", "readOnly": True},
                                 {"name": "shared", "mountPath": SHARED}, {"name": "tmp", "mountPath": "/tmp"}],
            }
            dcgm = {
                "name": "dcgm", "image": dcgm_image(plan.cfg.k8s_version), "imagePullPolicy": "IfNotPresent",
                "command": ["/bin/bash", "/etc/moerl-node-health/dcgm-loop.sh"],
                "env": [{"name": "NODE_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.hostIP"}}}],
                "livenessProbe": {"exec": {"command": ["test", "-d", SHARED]}, "periodSeconds": 60},
                "readinessProbe": {"exec": {"command": ["test", "-d", SHARED]}, "periodSeconds": 60},
                "resources": {"requests": {"cpu": "50m", "memory": "128Mi"}, "limits": {"cpu": "2", "memory": "2Gi"}},
                "securityContext": {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                                    "capabilities": {"drop": ["ALL"]}},
                "volumeMounts": [{"name": "shared", "mountPath": SHARED}, {"name": "tmp", "mountPath": "/tmp"},
                                 {"name": "script", "mountPath": "/etc/moerl-node-health", "readOnly": True}],
            }
            spec = {
                "selector": {"matchLabels": pod_lab},
                "updateStrategy": {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": "25%"}},
                "template": {"metadata": {"labels": pod_lab}, "spec": {
                    "serviceAccountName": NAME, "priorityClassName": "system-node-critical",
                    "nodeSelector": {POOL_LABEL: pool_name}, "tolerations": tolerations,
                    "securityContext": {"runAsNonRoot": True, "runAsUser": TRAINER_UID, "runAsGroup": TRAINER_UID,
                                        "fsGroup": TRAINER_UID, "seccompProfile": {"type": "RuntimeDefault"}},
                    "containers": [agent, dcgm],
                    "volumes": [{"name": "sys", "hostPath": {"path": "/sys", "type": "Directory"}},
                                {"name": "shared", "emptyDir": {"sizeLimit": "64Mi"}},
                                {"name": "tmp", "emptyDir": {"sizeLimit": "256Mi"}},
                                {"name": "script", "configMap": {"name": NAME}}],
                }},
            }
            api_object(self, k8s.KubeDaemonSet, f"{NAME}-{pool_name}", NAMESPACE, labels=pod_lab, spec=spec,
                       annotations=checkov_skips(
                           CKV_K8S_15=pinned, CKV_K8S_43=pinned,
                           CKV_K8S_38="the agent patches its own node (taints, labels) through the API server",
                           CKV_K8S_21="the health namespace holds the health-check Jobs and this agent only"))
        monitor = cdk8s.ApiObject(self, "PodMonitor-node-health", api_version=MONITORING_API, kind="PodMonitor",
                                  metadata=cdk8s.ApiObjectMetadata(name=NAME, namespace=NAMESPACE, labels=lab))
        monitor.add_json_patch(cdk8s.JsonPatch.add("/spec", {
            "selector": {"matchLabels": lab}, "namespaceSelector": {"matchNames": [NAMESPACE]},
            "podMetricsEndpoints": [{"port": METRICS_PORT_NAME, "path": "/metrics", "interval": "30s"}]}))
        api_object(self, k8s.KubeNetworkPolicy, NAME, NAMESPACE, labels=lab, spec={
            "podSelector": {"matchLabels": lab}, "policyTypes": ["Ingress"],
            "ingress": [{"from": [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": MONITORING_NAMESPACE}}}],
                         "ports": [{"protocol": "TCP", "port": METRICS_PORT}]}]})
