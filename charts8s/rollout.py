"""Rollout engines on the rollout-gpu Spot pool, one pod per node, laid out by the run config's
engine profile (``rollout.engine``: tp | ep | ep-deepep, nodes per engine).

- An engine of one node: a Deployment; each pod runs SGLang (container "engine", every GPU and
  EFA device of the node) and the moerl rollout worker (container "worker"), which talks to it
  on loopback.
- An engine over several nodes: a LeaderWorkerSet (charts8s/lws.py), one group per engine. The
  leader pod runs SGLang's node rank 0 (the HTTP server) and the worker; the other pods run the
  other node ranks (``--node-rank $(LWS_WORKER_INDEX)``, no HTTP server, so no probe and no
  worker). Losing any pod of a group (a Spot node) recreates the whole group; the leader's worker
  gets SIGTERM, its requests fail, and it releases their leases without publishing a partial
  group (a group is one /generate request: all G completions or none).

Probes (leader only): `app.rollout.probe`, which passes while the worker holds the engine paused
for a weight update (its pause marker on a shared in-memory volume) and otherwise asks SGLang's
/health_generate. SGLang answers 503 there during a pause, so probing it directly would restart
an engine in the middle of a long weight load and flap readiness on every update.

On a Spot interruption the kubelet sends SIGTERM: the worker drains (rollout.drain_grace_s)
while the engine's preStop sleep keeps it serving; terminationGracePeriodSeconds covers both.

DeepEP over EFA (profile ep-deepep): the EFA devices, the node's 2 MiB hugepages, the EFA and
NVSHMEM libfabric environment (app/torchx_component.py). No IPC_LOCK capability: the namespace
enforces Pod Security "restricted", which admits no added capability but NET_BIND_SERVICE, and the
EKS accelerated AMIs run containerd with an unlimited memlock limit, which is what libfabric and
NVSHMEM need to register memory (the trainer's DeepEP over EFA runs the same way).
"""

from __future__ import annotations

import math

import cdk8s
from constructs import Construct

from app.metrics import METRICS_PORT
from app.rollout.engine_args import EngineLayout, sglang_command
from app.torchx_component import CLUSTER_CONFIG, EFA_ENV, EFA_RESOURCE, HUGEPAGES_RESOURCE, NVSHMEM_EFA_ENV, worker_command
from charts8s.buffer import redis_credentials
from charts8s.cluster import (BUFFER_SERVICE, ENV_SERVICE, REDIS_PORT, REWARD_MODEL_SERVICE, ROLLOUT, TRAINER,
                              WEIGHT_SOURCE_LABEL, run_config_volume, weight_group_port)
from charts8s.kube import api_object, k8s_module
from charts8s.lws import leader_worker_set
from charts8s.monitoring import metrics_port
from charts8s.netpol import dns, nccl_ports, pod_identity, pods, policy, port_range_sysctl, public_https, tcp
from charts8s.placement import checkov_skips, container_security, labels, on_pool, pod_security
from charts8s.workloads import CACHE_GI, TMP_GI, Plan

NAME = ROLLOUT
UID = 10001  # the moerl user of images/*.Dockerfile (high UID: no clash with host users)
STATE_DIR = "/run/moerl"  # shared by engine and worker: the worker's pause marker
PAUSE_MARKER = f"{STATE_DIR}/engine-paused"
PROBE_TIMEOUT_S = 25  # longer than SGLang's own 20 s /health_generate wait


def grace_seconds(drain_s: float, margin_s: int) -> int:
    """terminationGracePeriodSeconds for a drain budget of `drain_s` seconds plus `margin_s` seconds."""
    return math.ceil(drain_s) + margin_s


def probe_command(port: int) -> list[str]:
    """The engine probe (`app.rollout.probe`) against SGLang on loopback (out of the kubelet's
    reach from the node, hence an exec probe)."""
    return ["python3", "-m", "app.rollout.probe", "--url", f"http://127.0.0.1:{port}", "--marker", PAUSE_MARKER,
            "--timeout", str(PROBE_TIMEOUT_S)]


def _probe(port: int, period: int, failures: int) -> dict:
    return {"exec": {"command": probe_command(port)}, "periodSeconds": period,
            "timeoutSeconds": PROBE_TIMEOUT_S + 5, "failureThreshold": failures}


def engine_container(plan: Plan, layout: EngineLayout, *, leader: bool, host: str = "127.0.0.1",
                     probes: bool = True) -> dict:
    """The SGLang container of one node of an engine (`layout`); `leader`: node rank 0, which
    serves HTTP and gets the probes (when `probes`)."""
    wl, pool = plan.wl.rollout, plan.pool("rollout-gpu")
    spec = min(pool.specs, key=lambda s: s.vcpus)
    model = wl.model_path or plan.run.model.path
    res = {"cpu": str(spec.vcpus - 16), "memory": f"{int(spec.memory_gib * 0.85) - pool.hugepages_2mi // 1024}Gi",
           "nvidia.com/gpu": str(plan.gpus_per_rollout)}
    if plan.efa_per_rollout:
        res[EFA_RESOURCE] = str(plan.efa_per_rollout)
    if pool.hugepages_2mi:
        res[HUGEPAGES_RESOURCE] = f"{pool.hugepages_2mi}Mi"
    env = {"HF_HOME": "/models/hf"}  # the base model goes to the large model volume
    if plan.efa_per_rollout:
        env.update(EFA_ENV)
        if layout.profile.kind == "ep-deepep":
            env.update(NVSHMEM_EFA_ENV)
    c = {
        "name": "engine", "image": plan.images["rollout"], "imagePullPolicy": "IfNotPresent",
        "command": sglang_command(layout, model, port=wl.engine_port, host=host,
                                  routing_replay=plan.run.rollout.routing_replay),
        "env": [{"name": k, "value": v} for k, v in env.items()],
        "resources": {"requests": res, "limits": res},
        "securityContext": container_security(),
        "volumeMounts": [{"name": "dshm", "mountPath": "/dev/shm"}, {"name": "models", "mountPath": "/models"},
                         {"name": "tmp", "mountPath": "/tmp"}, {"name": "cache", "mountPath": "/home/moerl/.cache"},
                         {"name": "state", "mountPath": STATE_DIR}],
        # Keep serving while the worker drains (the worker gets SIGTERM at the same moment).
        "lifecycle": {"preStop": {"sleep": {"seconds": math.ceil(plan.run.rollout.drain_grace_s)}}},
    }
    if leader and probes:
        # Loading a large MoE checkpoint takes minutes: liveness starts only after the first success.
        c["startupProbe"] = _probe(wl.engine_port, 10, 180)
        c["readinessProbe"] = _probe(wl.engine_port, 10, 3)
        c["livenessProbe"] = _probe(wl.engine_port, 30, 5)
    return c


def engine_volumes(plan: Plan) -> list[dict]:
    """The volumes of an engine pod: run config, shm, the model volume sized from the model
    (`Plan.models_volume_gib`; emptyDir on the node's instance-store NVMe), scratch, state."""
    config_vol, _ = run_config_volume()
    return [
        config_vol,
        {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": f"{plan.wl.rollout.shm_gi}Gi"}},
        {"name": "models", "emptyDir": {"sizeLimit": f"{plan.models_volume_gib}Gi"}},
        {"name": "tmp", "emptyDir": {"sizeLimit": f"{TMP_GI}Gi"}},
        {"name": "cache", "emptyDir": {"sizeLimit": f"{CACHE_GI}Gi"}},  # triton / flashinfer JIT
        {"name": "state", "emptyDir": {"medium": "Memory", "sizeLimit": "1Mi"}},
    ]


def engine_pod(plan: Plan, component: str, containers: list[dict]) -> dict:
    """Pod spec of one engine node: on the rollout-gpu pool (Spot tolerated), one per node."""
    pool = plan.pool("rollout-gpu")
    return {
        **on_pool(pool, spot=True),
        "serviceAccountName": plan.cfg.rollout_service_account,
        # No Kubernetes API token: Pod Identity (policy weights from S3) brings its own (charts8s/cluster.py).
        "automountServiceAccountToken": False,
        "priorityClassName": NAME,
        # Every engine rank joins the weight-update group: NCCL's ports in the declared range.
        "securityContext": {**pod_security(UID), "sysctls": [port_range_sysctl()]},
        "terminationGracePeriodSeconds": grace_seconds(plan.run.rollout.drain_grace_s, plan.wl.rollout.drain_margin_s),
        "containers": containers,
        "volumes": engine_volumes(plan),
        "topologySpreadConstraints": [
            {"maxSkew": 1, "topologyKey": "kubernetes.io/hostname", "whenUnsatisfiable": "DoNotSchedule",
             "labelSelector": {"matchLabels": labels(component)}},
            # Spread over Spot instance types: one type's capacity reclaim takes fewer engines.
            {"maxSkew": 1, "topologyKey": "node.kubernetes.io/instance-type", "whenUnsatisfiable": "ScheduleAnyway",
             "labelSelector": {"matchLabels": labels(component)}},
        ],
    }


def worker_container(plan: Plan) -> dict:
    """The moerl rollout worker beside the engine's node rank 0."""
    _, config_mount = run_config_volume()
    res = {"cpu": "4", "memory": "16Gi"}
    return {
        "name": "worker", "image": plan.images["rollout"], "imagePullPolicy": "IfNotPresent",
        # The pod name is the worker id (its task-lease consumer name); the kubelet expands $(POD_NAME).
        "command": worker_command(CLUSTER_CONFIG, "$(POD_NAME)", PAUSE_MARKER, metrics_port=METRICS_PORT),
        "ports": [metrics_port()],  # scraped by the moerl-rollout PodMonitor (charts8s/monitoring.py)
        "env": [{"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
                *redis_credentials(plan, "rollout")],
        "resources": {"requests": res, "limits": res},
        "securityContext": container_security(),
        "volumeMounts": [config_mount, {"name": "models", "mountPath": "/models"}, {"name": "tmp", "mountPath": "/tmp"},
                         {"name": "state", "mountPath": STATE_DIR}],
    }


def rollout_pod(plan: Plan, leader: bool = True) -> dict:
    """A rollout pod spec: the leader (engine node rank 0 + worker) or, in a multi-node engine,
    one of the other nodes (engine only)."""
    containers = [engine_container(plan, plan.engine, leader=leader)]
    if leader:
        containers.append(worker_container(plan))
    return engine_pod(plan, NAME, containers)


LWS_NAME_LABEL = "leaderworkerset.sigs.k8s.io/name"  # set on every pod of a group by the LWS controller
LWS_GROUP_LABEL = "leaderworkerset.sigs.k8s.io/group-index"  # (kubernetes-sigs/lws api/leaderworkerset/v1)


def engine_network_policies(scope: Construct, k8s, name: str, namespace: str, lab: dict, *, groups: int,
                            multi_node: bool, ingress: list[dict], egress: list[dict]) -> None:
    """The NetworkPolicies of a fleet of engines ``name`` (pods labelled ``lab``): ``ingress`` and
    ``egress`` (DNS added) for every pod; for multi-node engines, one policy per LeaderWorkerSet
    group ``<name>-group-<g>`` letting the pods of group g, and only them, talk to each other on
    every port (SGLang's torch.distributed rendezvous and NCCL bootstrap go over the pod network;
    EFA traffic does not). A group beyond ``groups`` (scaled by hand) has no such policy: its pods
    cannot reach each other, so its engine fails to start rather than reach another group."""
    policy(scope, k8s, name, namespace, lab, ingress=ingress, egress=[dns(), *egress])
    if multi_node:
        for g in range(groups):
            group = {**lab, LWS_NAME_LABEL: name, LWS_GROUP_LABEL: str(g)}
            policy(scope, k8s, f"{name}-group-{g}", namespace, group, labels=lab,
                   ingress=[pods(group, direction="from")], egress=[pods(group, direction="to")])


def rollout_network_policies(scope: Construct, k8s, plan: Plan) -> None:
    """Rollout pods take nothing in (the engine is on loopback, the worker only dials out) but,
    with ``weight_sync.mode: network``, the trainer's source rank on NCCL's range; out they reach
    the buffer, the env pool, the reward model, the Pod Identity agent and HTTPS (S3, the Hub),
    and the source rank on the group's rendezvous port and NCCL's range (charts8s/trainer.py)."""
    ingress: list[dict] = []
    egress = [pods(labels(BUFFER_SERVICE), [tcp(REDIS_PORT)], direction="to"),
              pods(labels(ENV_SERVICE), [tcp(plan.wl.env.port)], direction="to"),
              pod_identity(), public_https(plan.cfg.vpc_cidr)]
    if plan.run.task.reward_model:
        egress.append(pods(labels(REWARD_MODEL_SERVICE), [tcp(plan.wl.reward_model.port)], direction="to"))
    if plan.run.weight_sync.mode == "network":
        source = {**labels(TRAINER), WEIGHT_SOURCE_LABEL: "true"}
        ingress.append(pods(source, nccl_ports(), direction="from"))
        egress.append(pods(source, [tcp(weight_group_port(plan.run)), *nccl_ports()], direction="to"))
    engine_network_policies(scope, k8s, NAME, plan.namespace, labels(NAME), groups=plan.rollout_replicas,
                            multi_node=plan.engine.nodes > 1, ingress=ingress, egress=egress)


ROLLOUT_SKIPS = dict(
    CKV_K8S_43="ECR repositories have immutable tags (infra/): a tag names exactly one digest",
    CKV_K8S_15="immutable tags never change; IfNotPresent avoids pulling a 30 GB image again on restart",
    CKV_K8S_35="redis-py takes the password as a value; it is read from the Secret at start only",
)
NO_PROBE_SKIPS = dict(
    CKV_K8S_8="the worker container and SGLang node ranks above 0 serve no endpoint; the leader's engine is probed",
    CKV_K8S_9="the worker container and SGLang node ranks above 0 serve no endpoint; the leader's engine is probed",
)


class RolloutChart(cdk8s.Chart):
    """The rollout engines (Deployment, or LeaderWorkerSet for multi-node engines), their
    PodDisruptionBudget and NetworkPolicy."""

    def __init__(self, scope: Construct, plan: Plan):
        super().__init__(scope, "rollout")
        k8s, ns, lab = k8s_module(plan.cfg.k8s_version), plan.namespace, labels(NAME)
        skips = checkov_skips(**ROLLOUT_SKIPS, **NO_PROBE_SKIPS)
        multi = plan.engine.nodes > 1
        if multi:
            leader_worker_set(self, NAME, ns, labels=lab, annotations=skips, replicas=plan.rollout_replicas,
                              size=plan.engine.nodes, leader_pod=rollout_pod(plan, leader=True),
                              worker_pod=rollout_pod(plan, leader=False))
        else:
            api_object(self, k8s.KubeDeployment, NAME, ns, labels=lab, annotations=skips, spec={
                "replicas": plan.rollout_replicas,
                "selector": {"matchLabels": lab},
                # One pod per GPU node: replace in place instead of surging onto nodes that may not exist.
                "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 1, "maxSurge": 0}},
                "template": {"metadata": {"labels": lab}, "spec": rollout_pod(plan)},
            })
        api_object(self, k8s.KubePodDisruptionBudget, NAME, ns, labels=lab, spec={
            "maxUnavailable": "25%", "selector": {"matchLabels": lab}})
        rollout_network_policies(self, k8s, plan)
