"""The prompt source: `moerl feed` in a Deployment of one pod, and its held-out evaluation engine.

Why one replica: the feeder is restart-safe (task ids are idempotent in the buffer), so a
second replica adds nothing but a second walk over the same ids; a Deployment brings a lost
pod back. `--when-done idle` keeps the container up after the trainer's done marker, since a
Deployment restarts a container that exits.

Pool (say which and why):
- with held-out evaluation (run config ``feed.eval_every`` > 0): **rollout-gpu**. The
  evaluation generates through an engine that holds the policy, so it needs the GPUs, the image
  and the engine command of the rollout pods (`engine_command`: the figure is measured with the
  engine the rollouts use). It takes a node of its own there (`charts8s.workloads.check` counts
  it). Spot is acceptable: everything the pod does survives a reclaim (idempotent tasks; the
  evaluator measures the newest version when it is back), and the queue holds up to
  2 x low_water prompt groups meanwhile. Its priority (moerl-feed) is above the rollout pods'
  and may preempt one, so a shortage of Spot nodes takes a rollout pod rather than the run's
  only prompt source.
- without evaluation: **buffer-mem** (on-demand), next to the Redis buffer it talks to: a
  CPU-only pod that must live as long as the run should not sit on Spot, and the buffer node
  has room beside Redis (`BufferSpec.memory_gi` < the node's memory).
It reads the run prefix of the checkpoint bucket (the JSONL task, policy versions, the done
marker) through Pod Identity with the rollout service account (read-only on the run prefix).
"""

from __future__ import annotations

import cdk8s
from constructs import Construct

from app.names import CLUSTER_CONFIG
from app.torchx_component import engine_command
from charts8s.buffer import redis_credentials
from charts8s.cluster import FEED, run_config_volume
from charts8s.contract import FEED_POD, contract_policies
from charts8s.fsx import mount_fsx
from charts8s.kube import api_object, k8s_module
from charts8s.placement import checkov_skips, container_security, labels, on_pool, pod_security
from charts8s.rollout import model_init_container, served_model_path
from charts8s.workloads import Plan

NAME = FEED
UID = 10001  # the moerl user of images/*.Dockerfile
RUN_DIR = "/models/feed"  # on the volume the engine container also mounts: it loads versions from here


def feed_command(port: int | None) -> list[str]:
    """The feed container's command (`moerl feed`); ``port``: the evaluation engine on loopback."""
    cmd = ["moerl", "feed", "--config", CLUSTER_CONFIG, "--run-dir", RUN_DIR, "--when-done", "idle"]
    if port is not None:
        cmd += ["--engine-url", f"http://127.0.0.1:{port}"]
    return cmd


def _python_probe(code: str, period: int, timeout: int, failures: int) -> dict:
    # The engine listens on loopback only, out of the kubelet's reach: probe from inside.
    return {"exec": {"command": ["python3", "-c", code]}, "periodSeconds": period,
            "timeoutSeconds": timeout + 1, "failureThreshold": failures}


def feed_pod(plan: Plan) -> dict:
    """The pod spec: the feed container, plus the evaluation engine when the run evaluates."""
    f = plan.wl.feed
    config_vol, config_mount = run_config_volume()
    res = {"cpu": str(f.cpu), "memory": f"{f.memory_gi}Gi"}
    feed = {
        "name": "feed", "image": plan.images["rollout"], "imagePullPolicy": "IfNotPresent",
        "command": feed_command(f.engine_port if plan.feed_evaluates else None),
        "env": redis_credentials(plan, "feed"), "resources": {"requests": res, "limits": res},
        "securityContext": container_security(),
        "volumeMounts": [config_mount, {"name": "models", "mountPath": "/models"}, {"name": "tmp", "mountPath": "/tmp"}],
    }
    containers = [feed]
    volumes = [config_vol, {"name": "models", "emptyDir": {"sizeLimit": "400Gi" if plan.feed_evaluates else "20Gi"}},
               {"name": "tmp", "emptyDir": {"sizeLimit": "8Gi"}}]
    if plan.feed_evaluates:
        pool = plan.pool("rollout-gpu")
        spec = min(pool.specs, key=lambda s: s.vcpus)
        share = plan.feed_gpus / plan.gpus_per_rollout
        engine_res = {"cpu": str(max(2, int(spec.vcpus * share) - 16)),
                      "memory": f"{max(16, int(spec.memory_gib * share * 0.85))}Gi",
                      "nvidia.com/gpu": str(plan.feed_gpus)}
        url = f"http://127.0.0.1:{f.engine_port}/health_generate"
        generates = f"import urllib.request; urllib.request.urlopen('{url}', timeout=5)"
        # Liveness only asks whether the server accepts connections: a weight load blocks
        # /health_generate for as long as it takes, and must not get the engine killed.
        listens = f"import socket; socket.create_connection(('127.0.0.1', {f.engine_port}), 5).close()"
        containers.append({
            "name": "engine", "image": plan.images["rollout"], "imagePullPolicy": "IfNotPresent",
            "command": engine_command("sglang", served_model_path(plan), f.engine_port, plan.feed_gpus),
            "env": [{"name": "HF_HOME", "value": "/models/hf"}],
            "resources": {"requests": engine_res, "limits": engine_res},
            "securityContext": container_security(),
            "volumeMounts": [{"name": "dshm", "mountPath": "/dev/shm"}, {"name": "models", "mountPath": "/models"},
                             {"name": "tmp", "mountPath": "/tmp"}, {"name": "cache", "mountPath": "/home/moerl/.cache"}],
            "startupProbe": _python_probe(generates, 10, 5, 180),
            "livenessProbe": _python_probe(listens, 30, 5, 5),
        })
        volumes += [{"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": f"{plan.wl.rollout.shm_gi}Gi"}},
                    {"name": "cache", "emptyDir": {"sizeLimit": "32Gi"}}]
        placement = on_pool(pool, spot=True)
        init = model_init_container(plan)  # an s3:// base model: a local copy first (charts8s/rollout.py)
        if init:
            placement["initContainers"] = [init]
    else:
        placement = on_pool(plan.pool("buffer-mem"), spot=False)
    pod = {
        **placement,
        "serviceAccountName": plan.cfg.rollout_service_account,
        # No Kubernetes API token: Pod Identity (task file, policy versions) brings its own (charts8s/cluster.py).
        "automountServiceAccountToken": False,
        "priorityClassName": NAME,
        "securityContext": pod_security(UID),
        "terminationGracePeriodSeconds": 30,
        "containers": containers,
        "volumes": volumes,
    }
    # The evaluating feed's engine runs on rollout-gpu and serves the base model as the fleet's do.
    return mount_fsx(plan, pod) if plan.feed_evaluates else pod


class FeedChart(cdk8s.Chart):
    """Deployment (one replica), PodDisruptionBudget and an ingress-deny NetworkPolicy."""

    def __init__(self, scope: Construct, plan: Plan):
        super().__init__(scope, "feed")
        k8s, ns, lab = k8s_module(plan.cfg.k8s_version), plan.namespace, labels(NAME)
        skips = checkov_skips(
            CKV_K8S_43="ECR repositories have immutable tags (infra/): a tag names exactly one digest",
            CKV_K8S_15="immutable tags never change; IfNotPresent avoids pulling a 30 GB image again on restart",
            CKV_K8S_8="the feed container serves no endpoint; it runs until the trainer is done",
            CKV_K8S_9="the feed container serves no endpoint; nothing routes to this pod",
            CKV_K8S_35="redis-py takes the password as a value; it is read from the Secret at start only",
        )
        api_object(self, k8s.KubeDeployment, NAME, ns, labels=lab, annotations=skips, spec={
            "replicas": 1, "selector": {"matchLabels": lab},
            # One pod: never two feeders walking the ids at once during an update.
            "strategy": {"type": "Recreate"},
            "template": {"metadata": {"labels": lab}, "spec": feed_pod(plan)},
        })
        # A node drain may move the pod (it is restart-safe); no more than the one pod at a time.
        api_object(self, k8s.KubePodDisruptionBudget, NAME, ns, labels=lab, spec={
            "maxUnavailable": 1, "selector": {"matchLabels": lab}})
        # Nothing calls into the feed pod: the engine is on loopback, the feeder only dials out, to
        # the buffer, the Pod Identity agent and HTTPS (the task file, policy versions, the model).
        contract_policies(self, k8s, plan, [FEED_POD])
