"""The env pool: CPU pods on env-cpu (Spot) that rollout workers call.

With the run config's ``env.name`` set, each pod serves that environment over OpenEnv's
protocol (`moerl env`, app/envs/openenv_server.py: WebSocket ``/ws``, one episode per
connection); the Service spreads connections over the pods, so an episode stays on one pod,
and the workers reach it at ``env.url`` (`charts8s.cluster.cluster_run_config`). Without it the
pods serve the task's verifier (`moerl reward --mode verifier`). Either way: a Deployment of
``env.replicas`` pods, scaled on its own (``kubectl scale deploy/moerl-env``), behind a Service
that only rollout pods may reach (NetworkPolicy), probed on ``/health``. A pod killed in the middle
of episodes ends them; their tasks go back to the queue (app/rollout/worker.py).
"""

from __future__ import annotations

import cdk8s
from constructs import Construct

from app.names import CLUSTER_CONFIG
from charts8s.cluster import ENV_SERVICE, run_config_volume
from charts8s.contract import ENV, contract_policies
from charts8s.kube import api_object, k8s_module, rollout_facing_service
from charts8s.placement import checkov_skips, container_security, labels, on_pool, pod_security

NAME = ENV_SERVICE  # the Deployment and its Service (charts8s/cluster.py reads it for env.url)
UID = 10001  # the moerl user of images/*.Dockerfile (high UID: no clash with host users)


def env_command(plan) -> list[str]:
    """The env pod's command: `moerl env` when the run names an environment, else the verifier."""
    port = str(plan.wl.env.port)
    if plan.run.env.name:
        return ["moerl", "env", "--config", CLUSTER_CONFIG, "--host", "0.0.0.0", "--port", port]
    # A learned reward model has its own GPU pods (charts8s/rewardmodel.py).
    return ["moerl", "reward", "--config", CLUSTER_CONFIG, "--host", "0.0.0.0", "--port", port, "--mode", "verifier"]


class EnvPoolChart(cdk8s.Chart):
    """Deployment, Service, PodDisruptionBudget and NetworkPolicy (rollout pods only) of the
    environment server (`moerl env`) or the verifier (`moerl reward`)."""

    def __init__(self, scope: Construct, plan):
        super().__init__(scope, "envpool")
        k8s, ns, lab, e = k8s_module(plan.cfg.k8s_version), plan.namespace, labels(NAME), plan.wl.env
        config_vol, config_mount = run_config_volume()
        res = {"cpu": str(e.cpu), "memory": f"{e.memory_gi}Gi"}
        # Both servers answer GET /health (OpenEnv's route; `moerl reward`'s own).
        probe = {"httpGet": {"path": "/health", "port": e.port}, "periodSeconds": 10, "timeoutSeconds": 3,
                 "failureThreshold": 3}
        container = {
            "name": "env" if plan.run.env.name else "reward", "image": plan.images["env"],
            "imagePullPolicy": "IfNotPresent",
            "command": env_command(plan),
            "ports": [{"name": "http", "containerPort": e.port}],
            "resources": {"requests": res, "limits": res},
            "securityContext": container_security(),
            "readinessProbe": probe, "livenessProbe": {**probe, "periodSeconds": 30},
            "volumeMounts": [config_mount, {"name": "tmp", "mountPath": "/tmp"}],
        }
        api_object(self, k8s.KubeDeployment, NAME, ns, labels=lab, annotations=checkov_skips(
            CKV_K8S_43="ECR repositories have immutable tags (infra/): a tag names exactly one digest",
            CKV_K8S_15="immutable tags never change; IfNotPresent avoids a registry round trip per start"), spec={
            "replicas": e.replicas, "selector": {"matchLabels": lab},
            "template": {"metadata": {"labels": lab}, "spec": {
                **on_pool(plan.pool("env-cpu"), spot=True),
                "serviceAccountName": NAME, "automountServiceAccountToken": False,
                "priorityClassName": NAME, "securityContext": pod_security(UID),
                "containers": [container],
                "volumes": [config_vol, {"name": "tmp", "emptyDir": {"sizeLimit": "4Gi"}}],
                "topologySpreadConstraints": [{"maxSkew": 1, "topologyKey": "kubernetes.io/hostname",
                                               "whenUnsatisfiable": "ScheduleAnyway",
                                               "labelSelector": {"matchLabels": lab}}],
            }},
        })
        rollout_facing_service(self, k8s, NAME, ns, lab, e.port)
        # In: the rollout workers. Out: DNS only; environments and verifiers need nothing else,
        # and model output runs here.
        contract_policies(self, k8s, plan, [ENV])
