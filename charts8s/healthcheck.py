"""GPU health check of train-gpu nodes, run by an operator before a long job (not part of dist/).

Two Indexed Jobs in the namespace `moerl-health`, as the AWS references run them
(aws-samples/awsome-distributed-training 4.validation_and_observability/2.gpu-cluster-healthcheck:
DCGM diagnostics, then a multi-node NCCL all-reduce over EFA):

- `gpu-dcgm-diag`: one pod per node (`nodes` of them, never two on one node), all GPUs of the
  node (so nothing else runs on them meanwhile), `dcgmi diag -r <level>` (level 2: about 2.5 to 10
  minutes; 3 or 4 for a node under suspicion). By default (`dcgm_host="node"`) dcgmi connects to
  the node's one DCGM host engine, the node monitoring agent's (infra/cluster.py
  DCGM_HOSTENGINE_PORT, `--host` the node's IP), which runs the tests; no second host engine
  splits the GPUs' watches and profiling counters. `dcgm_host="embedded"` starts nv-hostengine in
  the Job's container instead (CAP_SYS_ADMIN), for a node whose agent host engine is down. The
  image is NVIDIA's DCGM image (nvcr.io/nvidia/cloud-native/dcgm: core, proprietary and the CUDA
  diagnostic plugins; the AWS health-check recipe builds on it) at the DCGM version of the
  agent's host engine (infra/addons.py NODE_AGENT_DCGM); the DCGM exporter's image has no
  diagnostic plugins (its Dockerfile installs datacenter-gpu-manager-4-core and -proprietary
  only). The namespace admits privileged pods (Pod Security Admission level "privileged") for
  the embedded mode and the node health agent (charts8s/nodehealth.py).
- `gpu-nccl-allreduce`: `nodes` pods on different nodes, every GPU and every EFA interface of
  the node, the trainer image, `torchrun -m app.healthcheck`: an all-reduce across all GPUs of
  the nodes, checked for exact results, with nccl-tests' bus bandwidth, failing under
  `min_busbw_gbps`. FI_PROVIDER=efa and NCCL_NET="AWS Libfabric" make NCCL fail rather than fall
  back to TCP when EFA is broken. Ranks meet through a headless Service; pod 0 hosts the store.

A failed Job (backoffLimit 0) names the node in its pod's spec.nodeName: cordon it and let node
auto repair or the operator replace the instance. Nodes, GPU and EFA counts, hugepages, taints
come from the deployment config (infra.config), declared once.
"""

from __future__ import annotations

import cdk8s
from constructs import Construct

from charts8s.kube import api_object, k8s_module
from charts8s.placement import checkov_skips, container_security, labels, on_pool, pod_security
from charts8s.workloads import Plan
from infra.addons import NODE_AGENT_DCGM, addon_versions
from infra.charts import HEALTH_NAMESPACE

NAMESPACE = HEALTH_NAMESPACE
DCGM_JOB, NCCL_JOB, NCCL_SERVICE = "gpu-dcgm-diag", "gpu-nccl-allreduce", "gpu-nccl-allreduce"
DCGM_HOSTS = ("node", "embedded")


def dcgm_image(k8s_version: str) -> str:
    """NVIDIA's DCGM image at the DCGM version of the node monitoring agent pinned for `k8s_version`
    (tag form `<dcgm>-1-ubuntu22.04`, as NVIDIA publishes it, e.g. 4.5.2-1-ubuntu22.04)."""
    agent = addon_versions(k8s_version)["eks-node-monitoring-agent"]
    return f"nvcr.io/nvidia/cloud-native/dcgm:{NODE_AGENT_DCGM[agent]}-1-ubuntu22.04"


def dcgm_diag_command(level: int, dcgm_host: str) -> str:
    """The diagnostics container's shell command (NODE_IP from the downward API)."""
    if dcgm_host == "node":
        # dcgmi's --host takes the address; its default port 5555 is the agent's DCGM_HOSTENGINE_PORT
        # (tests/test_ops_charts.py holds the two equal).
        return f"dcgmi diag -r {level} -j --host $(NODE_IP)"
    # nv-hostengine in the background of this container; dcgmi's exit status is the result.
    return f"(nv-hostengine -n &) ; sleep 5; dcgmi diag -r {level} -j"
RDZV_PORT = 29500
TRAINER_UID = 10001  # images/trainer.Dockerfile
DEADLINE_S = 3 * 3600


def _spread(component: str) -> dict:
    # One pod per node: the check is per node, and two pods on one node would share its GPUs.
    return {"podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [{
        "labelSelector": {"matchLabels": labels(component)}, "topologyKey": "kubernetes.io/hostname"}]}}


def _placement(plan: Plan, component: str) -> dict:
    spec = on_pool(plan.pool("train-gpu"), spot=False)
    spec["affinity"].update(_spread(component))
    return spec


def _indexed_job(nodes: int, component: str, pod: dict) -> dict:
    return {"completionMode": "Indexed", "completions": nodes, "parallelism": nodes, "backoffLimit": 0,
            "activeDeadlineSeconds": DEADLINE_S, "ttlSecondsAfterFinished": 7 * 86400,
            "template": {"metadata": {"labels": labels(component)}, "spec": {"restartPolicy": "Never", **pod}}}


class HealthCheckChart(cdk8s.Chart):
    """Namespace, the DCGM diagnostics Job, the NCCL all-reduce Job and its headless Service.

    nodes: train-gpu nodes to check (2 or more for the all-reduce; at most the pool's max_size).
    dcgm_level: `dcgmi diag -r` level (1 to 4).
    dcgm_host: "node" (the agent's host engine) or "embedded" (module docstring).
    min_busbw_gbps: all-reduce bus-bandwidth floor at the largest size, GB/s (0: report only).
    Raises ValueError naming the argument when it is out of range.
    """

    def __init__(self, scope: Construct, plan: Plan, nodes: int = 2, dcgm_level: int = 2, min_busbw_gbps: float = 0.0,
                 dcgm_host: str = "node"):
        super().__init__(scope, "gpu-healthcheck")
        pool = plan.pool("train-gpu")
        if not 2 <= nodes <= pool.max_size:
            raise ValueError(f"nodes={nodes}: need 2 to pools.train-gpu.max_size={pool.max_size} nodes")
        if dcgm_level not in (1, 2, 3, 4):
            raise ValueError(f"dcgm_level={dcgm_level}: dcgmi diag levels are 1 to 4")
        if min_busbw_gbps < 0:
            raise ValueError(f"min_busbw_gbps={min_busbw_gbps} must be >= 0")
        if dcgm_host not in DCGM_HOSTS:
            raise ValueError(f"dcgm_host={dcgm_host!r}: one of {list(DCGM_HOSTS)}")
        k8s, gpus = k8s_module(plan.cfg.k8s_version), plan.gpus_per_trainer
        api_object(self, k8s.KubeNamespace, NAMESPACE, labels={
            **labels("moerl-health"), "pod-security.kubernetes.io/enforce": "privileged"})

        embedded = dcgm_host == "embedded"
        caps = {"drop": ["ALL"], "add": ["SYS_ADMIN"]} if embedded else {"drop": ["ALL"]}
        dcgm = {
            **_placement(plan, DCGM_JOB), "automountServiceAccountToken": False,
            "containers": [{
                "name": "dcgm", "image": dcgm_image(plan.cfg.k8s_version), "imagePullPolicy": "IfNotPresent",
                "command": ["/bin/bash", "-c"],
                "args": [dcgm_diag_command(dcgm_level, dcgm_host)],
                "env": [{"name": "NODE_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.hostIP"}}}],
                "resources": {"limits": {"nvidia.com/gpu": str(gpus), "cpu": "8", "memory": "32Gi"},
                              "requests": {"nvidia.com/gpu": str(gpus), "cpu": "8", "memory": "32Gi"}},
                "securityContext": {"allowPrivilegeEscalation": False, "capabilities": caps},
            }],
            "securityContext": {"seccompProfile": {"type": "RuntimeDefault"}},
        }
        sys_admin = "DCGM diagnostics need CAP_SYS_ADMIN for their GPU tests (dcgm-exporter Dockerfile notes)"
        root = "dcgmi (and nv-hostengine when embedded) run as root in NVIDIA's DCGM image; only this short-lived Job does"
        pinned = "a version tag pinned in the repository (infra/addons.py NODE_AGENT_DCGM); IfNotPresent is intended"
        skips = dict(CKV_K8S_23=root, CKV_K8S_40=root, CKV_K8S_22="dcgmi and nv-hostengine write logs and sockets under /var and /run",
                     CKV_K8S_15=pinned, CKV_K8S_43=pinned)
        if embedded:
            skips.update(CKV_K8S_39=sys_admin, CKV_K8S_25=sys_admin, CKV_K8S_37=sys_admin)
        api_object(self, k8s.KubeJob, DCGM_JOB, NAMESPACE, labels=labels(DCGM_JOB), spec=_indexed_job(nodes, DCGM_JOB, dcgm),
                   annotations=checkov_skips(**skips))

        master = f"{NCCL_JOB}-0.{NCCL_SERVICE}.{NAMESPACE}.svc.cluster.local"
        limits = {"nvidia.com/gpu": str(gpus), "memory": "64Gi", "cpu": "32"}
        if pool.efa_interfaces:
            limits["vpc.amazonaws.com/efa"] = str(pool.efa_interfaces)
        if pool.hugepages_2mi:
            limits["hugepages-2Mi"] = f"{pool.hugepages_2mi}Mi"
        nccl = {
            **_placement(plan, NCCL_JOB), "automountServiceAccountToken": False,
            "subdomain": NCCL_SERVICE, "securityContext": pod_security(TRAINER_UID),
            "containers": [{
                "name": "allreduce", "image": plan.images["trainer"], "imagePullPolicy": "IfNotPresent",
                "command": ["torchrun"],
                "args": ["--nnodes", str(nodes), "--nproc-per-node", str(gpus), "--node-rank", "$(JOB_COMPLETION_INDEX)",
                         "--master-addr", master, "--master-port", str(RDZV_PORT),
                         "-m", "app.healthcheck", "--min-busbw-gbps", str(min_busbw_gbps)],
                "env": [{"name": "FI_PROVIDER", "value": "efa"}, {"name": "NCCL_NET", "value": "AWS Libfabric"},
                        {"name": "NCCL_DEBUG", "value": "INFO"}, {"name": "NCCL_DEBUG_SUBSYS", "value": "INIT,NET"}],
                "ports": [{"name": "c10d", "containerPort": RDZV_PORT}],
                "resources": {"limits": limits, "requests": dict(limits)},
                "securityContext": container_security(),
                "volumeMounts": [{"name": "dshm", "mountPath": "/dev/shm"}, {"name": "tmp", "mountPath": "/tmp"}],
            }],
            "volumes": [{"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "64Gi"}},
                        {"name": "tmp", "emptyDir": {"sizeLimit": "20Gi"}}],
        }
        api_object(self, k8s.KubeJob, NCCL_JOB, NAMESPACE, labels=labels(NCCL_JOB), spec=_indexed_job(nodes, NCCL_JOB, nccl),
                   annotations=checkov_skips(CKV_K8S_15=pinned, CKV_K8S_43=pinned))
        # Ranks talk to each other only; the diagnostics pods take no traffic.
        api_object(self, k8s.KubeNetworkPolicy, NCCL_JOB, NAMESPACE, labels=labels(NCCL_JOB), spec={
            "podSelector": {"matchLabels": labels(NCCL_JOB)}, "policyTypes": ["Ingress"],
            "ingress": [{"from": [{"podSelector": {"matchLabels": labels(NCCL_JOB)}}]}]})
        api_object(self, k8s.KubeNetworkPolicy, DCGM_JOB, NAMESPACE, labels=labels(DCGM_JOB), spec={
            "podSelector": {"matchLabels": labels(DCGM_JOB)}, "policyTypes": ["Ingress"], "ingress": []})
        api_object(self, k8s.KubeService, NCCL_SERVICE, NAMESPACE, labels=labels(NCCL_JOB), spec={
            "clusterIP": "None", "publishNotReadyAddresses": True, "selector": labels(NCCL_JOB),
            "ports": [{"name": "c10d", "port": RDZV_PORT, "targetPort": RDZV_PORT}]})
