"""Rollout workers: a Deployment on the rollout-gpu Spot pool, one pod per node.

Each pod runs SGLang (container "engine", every GPU and EFA device of the node) and the moerl
rollout worker (container "worker") which talks to it on loopback. On a Spot interruption the
kubelet sends SIGTERM: the worker drains (rollout.drain_grace_s) while the engine's preStop sleep
keeps it serving until the drain is over; terminationGracePeriodSeconds covers both plus a margin.
"""

from __future__ import annotations

import math

import cdk8s
from constructs import Construct

from app.buffer.experience import PASSWORD_ENV
from app.torchx_component import CLUSTER_CONFIG, EFA_ENV, EFA_RESOURCE, engine_command, worker_command
from charts8s.cluster import run_config_volume
from charts8s.kube import api_object, k8s_module
from charts8s.placement import checkov_skips, container_security, labels, on_pool, pod_security
from charts8s.workloads import Plan

NAME = "moerl-rollout"
UID = 10001  # the moerl user of images/*.Dockerfile (high UID: no clash with host users)
HEALTH_PATH = "/health_generate"  # SGLang: runs one tiny generation, so a hung scheduler fails it


def grace_seconds(drain_s: float, margin_s: int) -> int:
    """terminationGracePeriodSeconds for a drain budget of `drain_s` seconds plus `margin_s` seconds."""
    return math.ceil(drain_s) + margin_s


def _probe(port: int, period: int, timeout: int, failures: int) -> dict:
    # SGLang listens on loopback only, out of the kubelet's reach from the node: probe from inside.
    url = f"http://127.0.0.1:{port}{HEALTH_PATH}"
    code = f"import urllib.request; urllib.request.urlopen('{url}', timeout={timeout})"
    return {"exec": {"command": ["python3", "-c", code]}, "periodSeconds": period,
            "timeoutSeconds": timeout + 1, "failureThreshold": failures}


def rollout_pod(plan: Plan) -> dict:
    """The rollout pod spec (engine + worker)."""
    wl, pool = plan.wl.rollout, plan.pool("rollout-gpu")
    spec = min(pool.specs, key=lambda s: s.vcpus)
    drain = plan.run.rollout.drain_grace_s
    config_vol, config_mount = run_config_volume()
    secret_env = {"name": PASSWORD_ENV, "valueFrom": {"secretKeyRef": {
        "name": plan.wl.buffer.password_secret, "key": "password"}}}
    model = wl.model_path or plan.run.model.path
    engine_res = {"cpu": str(spec.vcpus - 16), "memory": f"{int(spec.memory_gib * 0.85)}Gi",
                  "nvidia.com/gpu": str(plan.gpus_per_rollout)}
    if plan.efa_per_rollout:
        engine_res[EFA_RESOURCE] = str(plan.efa_per_rollout)
    engine = {
        "name": "engine", "image": plan.images["rollout"], "imagePullPolicy": "IfNotPresent",
        "command": engine_command("sglang", model, wl.engine_port, wl.tp_size or plan.gpus_per_rollout),
        # Hugging Face downloads (the base model) go to the large shared volume, not the cache one.
        "env": [{"name": "HF_HOME", "value": "/models/hf"}]
        + ([{"name": k, "value": v} for k, v in EFA_ENV.items()] if plan.efa_per_rollout else []),
        "resources": {"requests": engine_res, "limits": engine_res},
        "securityContext": container_security(),
        "volumeMounts": [{"name": "dshm", "mountPath": "/dev/shm"}, {"name": "models", "mountPath": "/models"},
                         {"name": "tmp", "mountPath": "/tmp"}, {"name": "cache", "mountPath": "/home/moerl/.cache"}],
        # Loading a large MoE checkpoint takes minutes: liveness starts only after the first success.
        "startupProbe": _probe(wl.engine_port, 10, 5, 180),
        "readinessProbe": _probe(wl.engine_port, 10, 5, 3),
        "livenessProbe": _probe(wl.engine_port, 30, 20, 5),
        # Keep serving while the worker drains (the worker gets SIGTERM at the same moment).
        "lifecycle": {"preStop": {"sleep": {"seconds": math.ceil(drain)}}},
    }
    worker_res = {"cpu": "4", "memory": "16Gi"}
    worker = {
        "name": "worker", "image": plan.images["rollout"], "imagePullPolicy": "IfNotPresent",
        # The pod name is the worker id (its task-lease consumer name); the kubelet expands $(POD_NAME).
        "command": worker_command(CLUSTER_CONFIG, "$(POD_NAME)"),
        "env": [{"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}, secret_env],
        "resources": {"requests": worker_res, "limits": worker_res},
        "securityContext": container_security(),
        "volumeMounts": [config_mount, {"name": "models", "mountPath": "/models"}, {"name": "tmp", "mountPath": "/tmp"}],
    }
    return {
        **on_pool(pool, spot=True),
        "serviceAccountName": plan.cfg.rollout_service_account,
        "automountServiceAccountToken": True,  # Pod Identity: policy weights from S3
        "priorityClassName": NAME,
        "securityContext": pod_security(UID),
        "terminationGracePeriodSeconds": grace_seconds(drain, wl.drain_margin_s),
        "containers": [engine, worker],
        "volumes": [
            config_vol,
            {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": f"{wl.shm_gi}Gi"}},
            {"name": "models", "emptyDir": {"sizeLimit": "400Gi"}},
            {"name": "tmp", "emptyDir": {"sizeLimit": "16Gi"}},
            {"name": "cache", "emptyDir": {"sizeLimit": "32Gi"}}  # triton / flashinfer JIT,
        ],
        "topologySpreadConstraints": [
            {"maxSkew": 1, "topologyKey": "kubernetes.io/hostname", "whenUnsatisfiable": "DoNotSchedule",
             "labelSelector": {"matchLabels": labels(NAME)}},
            # Spread over Spot instance types: one type's capacity reclaim takes fewer workers.
            {"maxSkew": 1, "topologyKey": "node.kubernetes.io/instance-type", "whenUnsatisfiable": "ScheduleAnyway",
             "labelSelector": {"matchLabels": labels(NAME)}},
        ],
    }


class RolloutChart(cdk8s.Chart):
    """Deployment, PodDisruptionBudget and an ingress-deny NetworkPolicy of the rollout workers."""

    def __init__(self, scope: Construct, plan: Plan):
        super().__init__(scope, "rollout")
        k8s, ns, lab = k8s_module(plan.cfg.k8s_version), plan.namespace, labels(NAME)
        skips = checkov_skips(
            CKV_K8S_43="ECR repositories have immutable tags (infra/): a tag names exactly one digest",
            CKV_K8S_15="immutable tags never change; IfNotPresent avoids pulling a 30 GB image again on restart",
            CKV_K8S_38="the worker reads policy weights from S3 through EKS Pod Identity, which needs the token",
            CKV_K8S_8="the worker container serves no endpoint; the engine container has liveness probes",
            CKV_K8S_9="the worker container serves no endpoint; the engine container has readiness probes",
            CKV_K8S_35="redis-py takes the password as a value; it is read from the Secret at start only",
        )
        api_object(self, k8s.KubeDeployment, NAME, ns, labels=lab, annotations=skips, spec={
            "replicas": plan.rollout_replicas,
            "selector": {"matchLabels": lab},
            # One pod per GPU node: replace in place instead of surging onto nodes that may not exist.
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 1, "maxSurge": 0}},
            "template": {"metadata": {"labels": lab}, "spec": rollout_pod(plan)},
        })
        api_object(self, k8s.KubePodDisruptionBudget, NAME, ns, labels=lab, spec={
            "maxUnavailable": "25%", "selector": {"matchLabels": lab}})
        # Nothing calls into a rollout pod: the engine is on loopback, the worker only dials out.
        api_object(self, k8s.KubeNetworkPolicy, NAME, ns, labels=lab, spec={
            "podSelector": {"matchLabels": lab}, "policyTypes": ["Ingress"], "ingress": []})
