"""Cluster objects every workload relies on: namespace, service accounts, priority classes,
quotas, and the ONE ConfigMap holding the run configuration all pods read."""

from __future__ import annotations

import yaml
from constructs import Construct
import cdk8s

from app.config import RunConfig
from charts8s.kube import api_object, k8s_module
from charts8s.netpol import WEIGHT_GROUP_PORT
from charts8s.placement import labels
from charts8s.workloads import Plan

RUN_CONFIG_MAP = "moerl-run-config"
RUN_CONFIG_KEY = "run.yaml"
TRAINER = "moerl-trainer"  # the trainer's Volcano Job, its pods' component label (charts8s/trainer.py)
ROLLOUT = "moerl-rollout"  # the engines' Deployment or LeaderWorkerSet (charts8s/rollout.py)
ROLLOUT_WORKER = "moerl-rollout-worker"  # the workers of multi-node engines, a StatefulSet (charts8s/rollout.py)
ROUTER = "moerl-router"  # SGLang's router in front of the engines, a Deployment (charts8s/router.py)
FEED = "moerl-feed"  # the prompt source's Deployment (charts8s/feed.py)
BUFFER_SERVICE = "moerl-buffer"
REWARD_MODEL_SERVICE = "moerl-reward-model"  # charts8s/rewardmodel.py, when task.reward_model is set
ENV_SERVICE = "moerl-env"  # charts8s/envpool.py
# Trainer above rollout: when GPUs are short the gang is placed first and rollout pods wait
# (rollout only refills the buffer; a stalled trainer stalls the run).
# The prompt source (moerl-feed) above rollout, and allowed to preempt one: without it the run
# starves, and with held-out evaluation it needs a rollout-gpu node (charts8s/feed.py).
PRIORITY = {TRAINER: 100000, BUFFER_SERVICE: 90000, FEED: 60000, ROLLOUT: 50000, ENV_SERVICE: 40000}
PREEMPTING = (TRAINER, FEED)
REDIS_PORT = 6379
REDIS_DB = 0  # the database of buffer.redis_url
REDIS_EXPORTER_PORT = 9121  # oliver006/redis_exporter's default listen port (charts8s/buffer.py)
# Label of the trainer's replica 0 pod, global rank 0 (charts8s/trainer.py): the weight-update
# group's source rank, the only trainer pod the rollout pods may reach.
WEIGHT_SOURCE_LABEL = "moerl.dev/weight-source"
MODEL_CACHE = "/tmp/moerl-model-cache"  # on every pod's writable /tmp volume


def trainer_source_host(namespace: str) -> str:
    """DNS name of the trainer's replica 0 (``trainer-0`` in the headless Service, charts8s/trainer.py),
    the pod of global rank 0: torchrun's c10d rendezvous ranks nodes by their sorted host names."""
    return f"trainer-0.{TRAINER}.{namespace}.svc.cluster.local"


def weight_group_port(run: RunConfig) -> int:
    """The weight-update group's rendezvous port in the cluster: the run's, else WEIGHT_GROUP_PORT."""
    return run.weight_sync.master_port or WEIGHT_GROUP_PORT


def cluster_run_config(plan: Plan) -> RunConfig:
    """The run config as mounted in the cluster: the user's, with the cluster's addresses.

    buffer.redis_url -> the buffer Service; rollout.engine_url -> SGLang on loopback;
    store_url -> the checkpoint bucket under run_prefix; model.path -> rollout.model_path if set;
    rollout.policy_cache_dir -> the volume both rollout containers mount; model.cache_dir -> /tmp;
    rollout.reward_url -> the reward-model Service (when task.reward_model is set);
    env.url -> the env pool's Service (when env.name is set: `moerl env` pods), unless the run
    config gives env.url (an environment server of the user's: kept, and no env pool).
    weight_sync.trainer_host -> the trainer's replica 0 and weight_sync.master_port -> a fixed port
    (the user's, else WEIGHT_GROUP_PORT): the workers refuse a push from anywhere else.
    """
    run = plan.run.model_copy(deep=True)
    run.buffer.redis_url = f"redis://{BUFFER_SERVICE}.{plan.namespace}.svc.cluster.local:{REDIS_PORT}/{REDIS_DB}"
    run.rollout.engine_url = f"http://127.0.0.1:{plan.wl.rollout.engine_port}"
    run.store_url = f"s3://{plan.cfg.checkpoint_bucket}/{plan.cfg.run_prefix}"
    if plan.wl.rollout.model_path:
        run.model.path = plan.wl.rollout.model_path
    # An s3:// or Hub base model is downloaded onto the pod's writable /tmp volume (instance-store
    # NVMe on GPU nodes), once per node (app/model/source.py).
    run.model.cache_dir = MODEL_CACHE
    # Policy versions land on the pod's shared /models volume, where the engine container reads them.
    run.rollout.policy_cache_dir = "/models/policy-cache"
    # The Services' ports are their pods' (the VPC CNI enforces NetworkPolicies only that way).
    if run.task.reward_model:
        run.rollout.reward_url = f"http://{REWARD_MODEL_SERVICE}.{plan.namespace}.svc.cluster.local:{plan.wl.reward_model.port}"
    if run.env.served_by_moerl():  # env.url set: the user's own server, used as it is
        run.env.url = f"http://{ENV_SERVICE}.{plan.namespace}.svc.cluster.local:{plan.wl.env.port}"
    run.weight_sync.trainer_host = trainer_source_host(plan.namespace)
    run.weight_sync.master_port = weight_group_port(run)
    return run


class ClusterChart(cdk8s.Chart):
    """Namespace, service accounts (names match infra's Pod Identity associations), priority
    classes, a ResourceQuota per GPU resource, and the run-config ConfigMap."""

    def __init__(self, scope: Construct, plan: Plan):
        super().__init__(scope, "cluster")
        k8s, ns, cfg = k8s_module(plan.cfg.k8s_version), plan.namespace, plan.cfg
        api_object(self, k8s.KubeNamespace, ns, labels={
            **labels("moerl"),
            # Pod Security Admission: reject anything beyond the "restricted" profile.
            "pod-security.kubernetes.io/enforce": "restricted",
        })
        # The trainer's account is its run's (one per trainer_runs entry, infra/config.py).
        trainer_sa = cfg.trainer_service_account_of(plan.run.run_id)
        for sa in sorted({trainer_sa, cfg.rollout_service_account, BUFFER_SERVICE, ENV_SERVICE}):
            # No pod calls the Kubernetes API: no API token anywhere. Pod Identity does not need it:
            # its webhook adds a projected token of its own (audience pods.eks.amazonaws.com) to
            # pods of an associated service account (aws/amazon-eks-pod-identity-webhook, handler.go).
            api_object(self, k8s.KubeServiceAccount, sa, ns, labels=labels(sa), automountServiceAccountToken=False)
        for name, value in PRIORITY.items():
            api_object(self, k8s.KubePriorityClass, name, labels=labels(name), value=value,
                       globalDefault=False, preemptionPolicy="PreemptLowerPriority" if name in PREEMPTING else "Never",
                       description=f"moerl {name.removeprefix('moerl-')} pods")
        rollout_nodes = plan.rollout_nodes + plan.bench_nodes  # rollout engines and bench fleets
        gpus = (plan.trainer_world_size + rollout_nodes * plan.gpus_per_rollout + plan.reward_model_gpus
                + plan.feed_gpus)
        efa = plan.trainer_nodes * plan.efa_per_trainer + rollout_nodes * plan.efa_per_rollout
        api_object(self, k8s.KubeResourceQuota, "moerl-accelerators", ns, labels=labels("moerl"), spec={
            "hard": {"requests.nvidia.com/gpu": str(gpus), "requests.vpc.amazonaws.com/efa": str(efa)}})
        api_object(self, k8s.KubeLimitRange, "moerl-defaults", ns, labels=labels("moerl"), spec={
            "limits": [{"type": "Container", "defaultRequest": {"cpu": "100m", "memory": "128Mi"},
                        "default": {"cpu": "1", "memory": "1Gi"}}]})
        text = yaml.safe_dump(cluster_run_config(plan).model_dump(mode="json"), sort_keys=False)
        api_object(self, k8s.KubeConfigMap, RUN_CONFIG_MAP, ns, labels=labels("moerl"), data={RUN_CONFIG_KEY: text})


def run_config_volume() -> tuple[dict, dict]:
    """(volume, volumeMount) mounting the run config at /etc/moerl/run.yaml, read-only."""
    return ({"name": "run-config", "configMap": {"name": RUN_CONFIG_MAP}},
            {"name": "run-config", "mountPath": "/etc/moerl", "readOnly": True})
