"""The reward-model server: `moerl reward` with a learned model on GPU nodes (issue 9).

Synthesized only when the run config names ``task.reward_model``. The pods run on the
rollout-gpu pool (Spot, like rollout: a lost pod only delays scoring, the worker scores 0 after
``rollout.reward_timeout_s`` and counts it) and take ``reward_model.gpus`` GPUs each, so they
use nodes of their own next to the rollout pods (`charts8s.workloads.check` counts them). Rollout
workers reach them through the Service, whose address the mounted run config carries as
``rollout.reward_url`` (`charts8s.cluster.cluster_run_config`).
"""

from __future__ import annotations

import cdk8s
from constructs import Construct

from app.names import CLUSTER_CONFIG
from charts8s.cluster import ENV_SERVICE, REWARD_MODEL_SERVICE, run_config_volume
from charts8s.kube import api_object, k8s_module, rollout_facing_service
from charts8s.contract import REWARD, contract_policies
from charts8s.placement import checkov_skips, container_security, labels, on_pool, pod_security
from charts8s.workloads import Plan

NAME = REWARD_MODEL_SERVICE
UID = 10001  # the moerl user of images/*.Dockerfile (high UID: no clash with host users)


def reward_command(port: int, max_batch: int) -> list[str]:
    """The container command (options of `moerl reward`)."""
    return ["moerl", "reward", "--config", CLUSTER_CONFIG, "--host", "0.0.0.0", "--port", str(port),
            "--max-batch", str(max_batch), "--mode", "model"]


class RewardModelChart(cdk8s.Chart):
    """Deployment, Service, PodDisruptionBudget and NetworkPolicy (rollout pods only) of the
    reward-model server."""

    def __init__(self, scope: Construct, plan: Plan):
        super().__init__(scope, "rewardmodel")
        k8s, ns, lab, rm = k8s_module(plan.cfg.k8s_version), plan.namespace, labels(NAME), plan.wl.reward_model
        pool = plan.pool("rollout-gpu")
        spec = min(pool.specs, key=lambda s: s.vcpus)
        # A share of the node's CPU and memory in proportion to the GPUs taken.
        share = rm.gpus / plan.gpus_per_rollout
        res = {"cpu": str(max(1, int(spec.vcpus * share) - 2)), "memory": f"{max(8, int(spec.memory_gib * share * 0.8))}Gi",
               "nvidia.com/gpu": str(rm.gpus)}
        config_vol, config_mount = run_config_volume()
        probe = {"httpGet": {"path": "/health", "port": rm.port}, "periodSeconds": 10, "timeoutSeconds": 3,
                 "failureThreshold": 3}
        container = {
            "name": "reward", "image": plan.images["rollout"], "imagePullPolicy": "IfNotPresent",
            "command": reward_command(rm.port, rm.max_batch),
            "env": [{"name": "HF_HOME", "value": "/models/hf"}],
            "ports": [{"name": "http", "containerPort": rm.port}],
            "resources": {"requests": res, "limits": res},
            "securityContext": container_security(),
            # Loading the model takes a while: liveness only after the first success.
            "startupProbe": {**probe, "failureThreshold": 60},
            "readinessProbe": probe, "livenessProbe": {**probe, "periodSeconds": 30},
            "volumeMounts": [config_mount, {"name": "models", "mountPath": "/models"},
                             {"name": "tmp", "mountPath": "/tmp"}],
        }
        api_object(self, k8s.KubeDeployment, NAME, ns, labels=lab, annotations=checkov_skips(
            CKV_K8S_43="ECR repositories have immutable tags (infra/): a tag names exactly one digest",
            CKV_K8S_15="immutable tags never change; IfNotPresent avoids a registry round trip per start"), spec={
            "replicas": rm.replicas, "selector": {"matchLabels": lab},
            "template": {"metadata": {"labels": lab}, "spec": {
                **on_pool(pool, spot=True),
                "serviceAccountName": ENV_SERVICE, "automountServiceAccountToken": False,
                "priorityClassName": "moerl-rollout", "securityContext": pod_security(UID),
                "containers": [container],
                "volumes": [config_vol, {"name": "models", "emptyDir": {"sizeLimit": f"{rm.models_gi}Gi"}},
                            {"name": "tmp", "emptyDir": {"sizeLimit": "4Gi"}}],
            }},
        })
        rollout_facing_service(self, k8s, NAME, ns, lab, rm.port)
        # In: the rollout workers. Out: DNS, and HTTPS for a Hub model (no AWS credentials here).
        contract_policies(self, k8s, plan, [REWARD])
