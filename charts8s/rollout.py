"""Rollout engines on the rollout-gpu Spot pool, one pod per node, laid out by the run config's
engine profile (``rollout.engine``: tp | ep | ep-deepep, nodes per engine).

- An engine of one node: a Deployment; each pod runs SGLang (container "engine", every GPU and
  EFA device of the node) and the moerl rollout worker (container "worker"), which talks to it
  on loopback.
- An engine over several nodes: a LeaderWorkerSet (charts8s/lws.py), one group per engine. The
  leader pod runs SGLang's node rank 0 (the HTTP server, on the pod network, so with an admin key
  of its own: charts8s/keys.py `keyed_engine`); the other pods run
  the other node ranks (``--node-rank $(LWS_WORKER_INDEX)``, no HTTP server, so no probe). Every
  pod of the group also runs a fetcher (app/rollout/group.py) that puts each policy version on
  its own node's disk, since SGLang loads a disk update on every rank. The workers are a
  StatefulSet of their own (pod i drives group i over the network and updates it once every
  pod holds the version): LWS recreates a group when any of its containers restarts, and a
  worker restart must not cost two nodes their 0.6-1.3 TB of weights. Losing any pod of a group
  (a Spot node) recreates the whole group; the worker's requests fail, it releases their
  leases without publishing a partial group (a group is one /generate request: all G
  completions or none) and waits for the engine to answer again.

Keys of an engine on the pod network (multi-node engines, and one-node engines behind the router):
charts8s/keys.py.

Probes (leader only): `app.rollout.probe`, which passes while the worker holds the engine paused
for a weight update (its pause marker on a shared in-memory volume; for a multi-node engine the
leader's fetcher writes it from the pause the worker records in Redis) and otherwise asks
SGLang's /health_generate. SGLang answers 503 there during a pause, so probing it directly would
restart an engine in the middle of a long weight load and flap readiness on every update. The
startup probe's budget is sized from the model and the node (`startup_budget_s`).

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

from app.model.source import store_copy_dir
from app.names import (CLUSTER_CONFIG, ENGINE_KEYS_FILE_ENV, METRICS_PORT, ROUTER_API_KEY_ENV,
                       ROUTER_CONTROL_KEY_ENV)
from app.rollout.engine_args import LWS_GROUP_SIZE, LWS_LEADER_ADDRESS, LWS_WORKER_INDEX, EngineLayout, sglang_command
from app.torchx_component import (EFA_ENV, EFA_RESOURCE, ENGINE_NCCL_ENV, HUGEPAGES_RESOURCE, NVSHMEM_EFA_ENV,
                                  worker_command)
from charts8s.buffer import redis_credentials
from charts8s.fsx import fsx_model_path, mount_fsx
from charts8s.keys import (API_KEY, CONTROL_KEY, KEYS_FILE, KEYS_VOLUME_SPEC, keyed_engine, keys_init_container,
                           keys_mount, secret_env)
from charts8s.cluster import ROLLOUT, ROLLOUT_WORKER, run_config_volume
from charts8s.contract import ENGINE, ENGINE_HTTP, FETCHER, WORKER, contract_policies
from charts8s.kube import api_object, k8s_module
from charts8s.lws import ROLE_LABEL, leader_worker_set
from charts8s.monitoring import metrics_port
from charts8s.netpol import port_range_sysctl
from charts8s.placement import checkov_skips, container_security, labels, on_pool, pod_security
from charts8s.router import router_url
from charts8s.workloads import CACHE_GI, TMP_GI, Plan

NAME = ROLLOUT
UID = 10001  # the moerl user of images/*.Dockerfile (high UID: no clash with host users)
BASE_MODEL_DIR = "/models/base"  # an s3:// base model's copy on each engine node (init container "model")
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


def startup_budget_s(plan: Plan) -> int:
    """Seconds the startup probe allows SGLang to come up: read the checkpoint (model_gib at
    load_gib_per_s from the node's disk), boot_s for kernel JIT and CUDA-graph capture, and,
    for a Hub id SGLang downloads itself, model_gib at download_gib_per_s. An s3:// model is
    on disk before the engine starts (init container, no probe runs meanwhile)."""
    wl = plan.wl.rollout
    budget = wl.boot_s + wl.model_gib / wl.load_gib_per_s
    model = base_model(plan)
    if not model.startswith(("s3://", "/")):
        budget += wl.model_gib / wl.download_gib_per_s
    return math.ceil(budget)


def base_model(plan: Plan) -> str:
    """The base checkpoint as the run names it (HF id, s3:// prefix or local path)."""
    return plan.wl.rollout.model_path or plan.run.model.path


def served_model_path(plan: Plan) -> str:
    """SGLang's ``--model-path``: an s3:// base model's local copy (`model_init_container`
    fetches it on every node of the engine first), else the path as given (a Hub id SGLang
    downloads into HF_HOME itself). SGLang would map s3:// to its runai_streamer loader, which
    the image does not carry, and every disk update would then inherit that load format."""
    model = base_model(plan)
    if not model.startswith("s3://"):
        return model
    # With the shared file system the engines read the linked prefix where it is mounted (charts8s/fsx.py).
    return fsx_model_path(plan, model) or str(store_copy_dir(model, BASE_MODEL_DIR))


def model_init_container(plan: Plan) -> dict | None:
    """Init container of every engine pod whose base model is an s3:// prefix: downloads it
    into `BASE_MODEL_DIR` on the node's model volume (app/model/source.py, through the pod's S3
    access); None for other paths."""
    model = base_model(plan)
    if not model.startswith("s3://") or fsx_model_path(plan, model):
        return None
    res = {"cpu": "8", "memory": "16Gi"}
    return {
        "name": "model", "image": plan.images["rollout"], "imagePullPolicy": "IfNotPresent",
        # --unquantized: a copy whose config.json keeps a quantization_config stops here (workloads.served_config)
        "command": ["python3", "-m", "app.model.source", model, "--cache-dir", BASE_MODEL_DIR, "--unquantized"],
        "resources": {"requests": res, "limits": res},
        "securityContext": container_security(),
        "volumeMounts": [{"name": "models", "mountPath": "/models"}, {"name": "tmp", "mountPath": "/tmp"}],
    }


def engine_container(plan: Plan, layout: EngineLayout, *, leader: bool, host: str = "127.0.0.1",
                     probes: bool = True) -> dict:
    """The SGLang container of one node of an engine (`layout`); `leader`: node rank 0, which
    serves HTTP and gets the probes (when `probes`)."""
    wl, pool = plan.wl.rollout, plan.pool("rollout-gpu")
    spec = min(pool.specs, key=lambda s: s.vcpus)
    model = served_model_path(plan)
    res = {"cpu": str(spec.vcpus - 16), "memory": f"{int(spec.memory_gib * 0.85) - pool.hugepages_2mi // 1024}Gi",
           "nvidia.com/gpu": str(plan.gpus_per_rollout)}
    if plan.efa_per_rollout:
        res[EFA_RESOURCE] = str(plan.efa_per_rollout)
    if pool.hugepages_2mi:
        res[HUGEPAGES_RESOURCE] = f"{pool.hugepages_2mi}Mi"
    env = {"HF_HOME": "/models/hf", **ENGINE_NCCL_ENV}  # the base model goes to the large model volume
    if plan.efa_per_rollout:
        env.update(EFA_ENV)
        if layout.profile.kind == "ep-deepep":
            env.update(NVSHMEM_EFA_ENV)
    env.update(layout.engine_env())  # DeepEP's dispatch cap, consistent with the command's batch flags
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
        c["startupProbe"] = _probe(wl.engine_port, 10, math.ceil(startup_budget_s(plan) / 10))
        c["readinessProbe"] = _probe(wl.engine_port, 10, 3)
        c["livenessProbe"] = _probe(wl.engine_port, 30, 5)
    return c


POD_NAME_ENV = {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}
POD_INDEX_ENV = {"name": "POD_INDEX", "valueFrom": {"fieldRef": {
    "fieldPath": "metadata.labels['apps.kubernetes.io/pod-index']"}}}


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


def engine_pod(plan: Plan, component: str, containers: list[dict], keys: dict | None = None) -> dict:
    """Pod spec of one engine node: on the rollout-gpu pool (Spot tolerated), one per node.
    keys: the pod's `keys_init_container` (an engine on the pod network), which gets the keys volume."""
    pool = plan.pool("rollout-gpu")
    init = [c for c in (keys, model_init_container(plan)) if c]
    return mount_fsx(plan, {
        **on_pool(pool, spot=True),
        **({"initContainers": init} if init else {}),
        "serviceAccountName": plan.cfg.rollout_service_account,
        # No Kubernetes API token: Pod Identity (policy weights from S3) brings its own (charts8s/cluster.py).
        "automountServiceAccountToken": False,
        "priorityClassName": NAME,
        # Every engine rank joins the weight-update group: NCCL's ports in the declared range.
        "securityContext": {**pod_security(UID), "sysctls": [port_range_sysctl()]},
        "terminationGracePeriodSeconds": grace_seconds(plan.run.rollout.drain_grace_s, plan.wl.rollout.drain_margin_s),
        "containers": containers,
        "volumes": engine_volumes(plan) + ([KEYS_VOLUME_SPEC] if keys else []),
        "topologySpreadConstraints": [
            {"maxSkew": 1, "topologyKey": "kubernetes.io/hostname", "whenUnsatisfiable": "DoNotSchedule",
             "labelSelector": {"matchLabels": labels(component)}},
            # Spread over Spot instance types: one type's capacity reclaim takes fewer engines.
            {"maxSkew": 1, "topologyKey": "node.kubernetes.io/instance-type", "whenUnsatisfiable": "ScheduleAnyway",
             "labelSelector": {"matchLabels": labels(component)}},
        ],
    })


def leader_address(plan: Plan, group: str) -> str:
    """A LeaderWorkerSet group's leader address, as LWS writes ``LWS_LEADER_ADDRESS``
    (``<lws>-<group>.<lws>.<namespace>``, through the controller's headless Service)."""
    return f"{NAME}-{group}.{NAME}.{plan.namespace}"


def worker_container(plan: Plan, group: bool = False) -> dict:
    """The moerl rollout worker: beside the engine's node rank 0 (one-node engines), or, with
    `group`, alone in a pod of the workers' StatefulSet driving multi-node engine number
    $(POD_INDEX) over the pod network (app/rollout/group.py)."""
    _, config_mount = run_config_volume()
    res = {"cpu": "4", "memory": "16Gi"}
    env = [POD_NAME_ENV, *redis_credentials(plan, "rollout")]
    # The pod name is the worker id (its task-lease consumer name); the kubelet expands $(POD_NAME).
    cmd = worker_command(CLUSTER_CONFIG, "$(POD_NAME)", None if group else PAUSE_MARKER, metrics_port=METRICS_PORT)
    routed = plan.run.rollout.router
    if routed:  # /generate through the router; the control calls still to its own engine, which it registers there
        cmd += ["--router-url", router_url(plan)]
        if not group:  # the router reaches this pod's engine by its name (the headless Service)
            cmd += ["--router-engine-url", f"http://$(POD_NAME).{NAME}.{plan.namespace}:{plan.wl.rollout.engine_port}"]
        env += secret_env(plan.wl.rollout.api_key_secret, {API_KEY: ROUTER_API_KEY_ENV, CONTROL_KEY: ROUTER_CONTROL_KEY_ENV})
    mounts = [config_mount, {"name": "tmp", "mountPath": "/tmp"}]
    if group:
        # StatefulSet pod i drives group i (the controller labels each pod with its ordinal).
        env.insert(1, POD_INDEX_ENV)
        addr = leader_address(plan, "$(POD_INDEX)")
        cmd += ["--engine-url", f"http://{addr}:{plan.wl.rollout.engine_port}", "--engine-group", addr,
                "--group-size", str(plan.engine.nodes)]
    else:
        mounts += [{"name": "models", "mountPath": "/models"}, {"name": "state", "mountPath": STATE_DIR}]
    if group or routed:  # the engine serves on the pod network and asks for its own admin key (module doc)
        env.append({"name": ENGINE_KEYS_FILE_ENV, "value": KEYS_FILE})
        mounts.append(keys_mount())
    return {
        "name": "worker", "image": plan.images["rollout"], "imagePullPolicy": "IfNotPresent",
        "command": cmd,
        "ports": [metrics_port()],  # scraped by the PodMonitors (charts8s/monitoring.py)
        "env": env,
        "resources": {"requests": res, "limits": res},
        "securityContext": container_security(),
        "volumeMounts": mounts,
    }


def fetcher_container(plan: Plan, leader: bool) -> dict:
    """Every pod of a multi-node engine: puts each policy version on this node's model volume
    and reports it (app/rollout/group.py); on the leader it also keeps the probes' pause marker.
    It catches every error itself: a restart of any container recreates the group."""
    _, config_mount = run_config_volume()
    res = {"cpu": "2", "memory": "4Gi"}
    cmd = ["python3", "-m", "app.rollout.group", "--config", CLUSTER_CONFIG, "--engine", LWS_LEADER_ADDRESS,
           "--index", LWS_WORKER_INDEX, "--size", LWS_GROUP_SIZE]
    mounts = [config_mount, {"name": "models", "mountPath": "/models"}, {"name": "tmp", "mountPath": "/tmp"}]
    if leader:
        cmd += ["--marker", PAUSE_MARKER]
        mounts.append({"name": "state", "mountPath": STATE_DIR})
    return {
        "name": "fetcher", "image": plan.images["rollout"], "imagePullPolicy": "IfNotPresent", "command": cmd,
        "env": redis_credentials(plan, "rollout"), "resources": {"requests": res, "limits": res},
        "securityContext": container_security(), "volumeMounts": mounts,
    }


def rollout_pod(plan: Plan, leader: bool = True) -> dict:
    """A rollout pod spec. One-node engine: SGLang and the worker. Multi-node engine: SGLang's
    node rank and the fetcher, on the leader (rank 0, serving HTTP to its worker's pod) and on
    every other node; the worker runs in a pod of its own (`worker_set_pod`), so that its
    restarts do not recreate the group."""
    secret = plan.wl.rollout.api_key_secret
    if plan.engine.nodes == 1:
        if not plan.run.rollout.router:
            return engine_pod(plan, NAME, [engine_container(plan, plan.engine, leader=True), worker_container(plan)])
        # the router reaches it on the pod network
        engine = keyed_engine(engine_container(plan, plan.engine, leader=True, host="0.0.0.0"))
        return engine_pod(plan, NAME, [engine, worker_container(plan)],
                          keys=keys_init_container(plan, secret, "$(POD_NAME)", [POD_NAME_ENV]))
    engine = engine_container(plan, plan.engine, leader=leader, host="0.0.0.0")
    if not leader:  # node ranks above 0 serve no HTTP: no keys
        return engine_pod(plan, NAME, [engine, fetcher_container(plan, leader)])
    return engine_pod(plan, NAME, [keyed_engine(engine), fetcher_container(plan, leader)],
                      keys=keys_init_container(plan, secret, "$(POD_NAME)", [POD_NAME_ENV]))


def worker_set_pod(plan: Plan) -> dict:
    """Pod of the multi-node engines' workers: on the rollout-gpu nodes' spare CPU (the engine
    pod leaves 16 vCPU), near a leader where it can (preferred, not required), one per node."""
    config_vol, _ = run_config_volume()
    leaders = {**labels(NAME), ROLE_LABEL: "leader"}
    return mount_fsx(plan, {
        **on_pool(plan.pool("rollout-gpu"), spot=True),
        "serviceAccountName": plan.cfg.rollout_service_account,
        # No Kubernetes API token: Pod Identity (the store, opened at start) brings its own.
        "automountServiceAccountToken": False,
        "priorityClassName": NAME,
        "securityContext": pod_security(UID),
        "terminationGracePeriodSeconds": grace_seconds(plan.run.rollout.drain_grace_s, plan.wl.rollout.drain_margin_s),
        # its engine's keys: the leader pod of group $(POD_INDEX) is moerl-rollout-$(POD_INDEX)
        "initContainers": [keys_init_container(plan, plan.wl.rollout.api_key_secret, f"{NAME}-$(POD_INDEX)",
                                               [POD_INDEX_ENV])],
        "containers": [worker_container(plan, group=True)],
        "volumes": [config_vol, {"name": "tmp", "emptyDir": {"sizeLimit": f"{TMP_GI}Gi"}}, KEYS_VOLUME_SPEC],
        "affinity": {
            "podAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [{"weight": 100, "podAffinityTerm": {
                "topologyKey": "kubernetes.io/hostname", "labelSelector": {"matchLabels": leaders}}}]},
            "podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [{
                "topologyKey": "kubernetes.io/hostname", "labelSelector": {"matchLabels": labels(ROLLOUT_WORKER)}}]},
        },
    })


ROLLOUT_SKIPS = dict(
    CKV_K8S_43="ECR repositories have immutable tags (infra/): a tag names exactly one digest",
    CKV_K8S_15="immutable tags never change; IfNotPresent avoids pulling a 30 GB image again on restart",
    CKV_K8S_35="redis-py and the router's clients take the password and keys as values; read at start only",
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
            wlab = labels(ROLLOUT_WORKER)
            api_object(self, k8s.KubeStatefulSet, ROLLOUT_WORKER, ns, labels=wlab, annotations=skips, spec={
                "replicas": plan.rollout_replicas, "serviceName": ROLLOUT_WORKER,
                "podManagementPolicy": "Parallel",  # pod i needs only group i, not pod i - 1
                "selector": {"matchLabels": wlab},
                "template": {"metadata": {"labels": wlab}, "spec": worker_set_pod(plan)},
            })
        elif plan.run.rollout.router:
            # Named pods behind a headless Service: the router reaches each engine by name (charts8s/router.py).
            api_object(self, k8s.KubeService, NAME, ns, labels=lab, spec={
                "clusterIP": "None", "selector": lab,
                "ports": [{"name": "engine", "port": plan.wl.rollout.engine_port,
                           "targetPort": plan.wl.rollout.engine_port}]})
            api_object(self, k8s.KubeStatefulSet, NAME, ns, labels=lab, annotations=skips, spec={
                "replicas": plan.rollout_replicas, "serviceName": NAME,
                "podManagementPolicy": "Parallel",  # engine i does not wait for engine i - 1
                "selector": {"matchLabels": lab},
                "updateStrategy": {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 1}},
                "template": {"metadata": {"labels": lab}, "spec": rollout_pod(plan)},
            })
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
        # The engines, their workers and (multi-node) fetchers: what charts8s/contract.py TABLE
        # names, each worker of a multi-node engine to its own engine only.
        parties = [ENGINE, ENGINE_HTTP, WORKER] + ([FETCHER] if multi else [])
        contract_policies(self, k8s, plan, parties)
