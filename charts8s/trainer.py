"""The trainer gang: a Volcano Job rendered by TorchX from app/torchx_component.py:trainer.

Why Volcano (docs/cluster.md, "Gang scheduler: Volcano"): it schedules the N pods as one gang (PodGroup
minMember = N: all or none, so a half-placed job never holds p5en nodes idle), restarts the whole
gang when any pod fails or is evicted (policy RestartJob), and it is what `torchx run -s
kubernetes` submits, so both paths create the same object from the same AppDef.

TorchX 0.7's renderer (torchx.schedulers.kubernetes_scheduler.app_to_resource) cannot express
node selectors, tolerations, security contexts or a /dev/shm size; `place_gang` adds them.
"""

from __future__ import annotations

import json
import warnings

import cdk8s
from constructs import Construct
from torchx.schedulers.kubernetes_scheduler import app_to_resource, sanitize_for_serialization

from app.names import CLUSTER_CONFIG, METRICS_PORT
from app.torchx_component import trainer
from charts8s.buffer import redis_credentials
from charts8s.cluster import TRAINER, WEIGHT_SOURCE_LABEL, run_config_volume, trainer_source_host
from charts8s.contract import SOURCE, TRAINER_RANKS, contract_policies
from charts8s.fsx import mount_fsx
from charts8s.kube import api_object, k8s_module
from charts8s.monitoring import metrics_port
from charts8s.netpol import port_range_sysctl
from charts8s.placement import checkov_skips, container_security, labels, on_pool, pod_security
from charts8s.volcano import VolcanoJob
from charts8s.workloads import Plan

JOB_NAME = TRAINER
SERVICE = JOB_NAME  # headless Service: pods are <task>.<SERVICE>.<namespace>.svc
QUEUE = "default"
RUN_DIR = "/tmp/moerl-run"  # the writable emptyDir; the root filesystem is read-only
UID = 10001  # the moerl user of images/*.Dockerfile (high UID: no clash with host users)


def trainer_appdef(plan: Plan):
    """The TorchX AppDef of the cluster's trainer gang (sizes from the train-gpu pool)."""
    pool = plan.pool("train-gpu")
    spec = min(pool.specs, key=lambda s: s.gpus)
    # One pod per node: it takes every hugepage the node reserves at boot (infra/cluster.py user data).
    hugepages = pool.hugepages_2mi
    return trainer(
        image=plan.images["trainer"], nnodes=plan.trainer_nodes, nproc_per_node=plan.gpus_per_trainer,
        gpus=plan.gpus_per_trainer, config=CLUSTER_CONFIG, resume=True, run_dir=RUN_DIR, efa=plan.efa_per_trainer,
        hugepages_mib=hugepages,
        # Leave room for the kubelet, system daemons and the device plugins.
        cpu=spec.vcpus - 8, mem_mb=int(spec.memory_gib * 1024 * 0.9) - hugepages,
        rdzv_port=plan.wl.trainer.rdzv_port, max_retries=plan.wl.trainer.max_retries, name=JOB_NAME,
        metrics_port=METRICS_PORT, ep=plan.run.trainer.parallel.ep,
    )


def render_job(plan: Plan) -> dict:
    """TorchX's Volcano Job for the trainer AppDef, with a fixed name (TorchX adds a random suffix)."""
    with warnings.catch_warnings():
        # TorchX warns about task-level retries of Volcano < 1.4; the gang restarts by job policy.
        warnings.simplefilter("ignore", UserWarning)
        job = app_to_resource(trainer_appdef(plan), QUEUE, plan.cfg.trainer_service_account_of(plan.run.run_id),
                              priority_class=TRAINER)
    res = sanitize_for_serialization(job)
    unique = res["metadata"]["name"]
    # The suffix also appears in labels and the rendezvous id; one name keeps dist/ reproducible.
    return json.loads(json.dumps(res).replace(unique, JOB_NAME))


def place_gang(job: dict, plan: Plan) -> dict:
    """Add what TorchX cannot express to every task: pool placement, security, DNS, volumes, env."""
    pool = plan.pool("train-gpu")
    spec = job["spec"]
    spec["minAvailable"] = plan.trainer_nodes  # the gang: all replicas or none
    # Our own headless Service replaces the svc plugin (see TrainerChart); keep the env plugin.
    spec["plugins"] = {"env": []}
    spec["policies"] = [{"event": "PodEvicted", "action": "RestartJob"}, {"event": "PodFailed", "action": "RestartJob"}]
    config_vol, config_mount = run_config_volume()
    for task in spec["tasks"]:
        pod = task["template"]["spec"]
        pod.update(on_pool(pool, spot=False))
        # NCCL's and gloo's ports in one declared range (charts8s/netpol.py NCCL_PORTS).
        pod["securityContext"] = {**pod_security(UID), "sysctls": [port_range_sysctl()]}
        # Stable DNS name per replica through the headless Service: trainer-0.moerl-trainer.
        pod["hostname"], pod["subdomain"] = task["name"], SERVICE
        pod["priorityClassName"] = TRAINER
        # No Kubernetes API token: Pod Identity (S3 checkpoints) brings its own (charts8s/cluster.py).
        pod["automountServiceAccountToken"] = False
        for vol in pod["volumes"]:
            if vol["name"] == "dshm":
                # NCCL and CUDA IPC buffers; bounded so a leak cannot take the node's memory.
                vol["emptyDir"]["sizeLimit"] = "256Gi"
        pod["volumes"] += [config_vol, {"name": "tmp", "emptyDir": {"sizeLimit": "600Gi"}}]
        (ctr,) = pod["containers"]
        ctr["securityContext"] = container_security()
        ctr["volumeMounts"] += [config_mount, {"name": "tmp", "mountPath": "/tmp"}]
        ctr["imagePullPolicy"] = "IfNotPresent"
        ctr["env"] += [{"name": "HF_HOME", "value": f"{RUN_DIR}/hf"},  # base-model download, on the tmp volume
                       # the address engines reach the weight-update group's source rank at
                       # (app/trainer/weight_sync.py: master_address)
                       {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
                       {"name": "VC_TRAINER_0_HOSTS", "value": trainer_source_host(plan.namespace)},
                       *redis_credentials(plan, "trainer")]
        mount_fsx(plan, pod)  # base weights from the shared file system, when there is one
        task["template"]["metadata"]["labels"].update(labels(JOB_NAME))
        if task["name"].endswith("-0"):  # rank 0 (replica 0) serves the run's figures (charts8s/monitoring.py)
            ctr.setdefault("ports", []).append(metrics_port())
            task["template"]["metadata"]["labels"][WEIGHT_SOURCE_LABEL] = "true"
    return job


class TrainerChart(cdk8s.Chart):
    """The Volcano Job and the headless Service its replicas rendezvous through."""

    def __init__(self, scope: Construct, plan: Plan):
        super().__init__(scope, "trainer")
        k8s = k8s_module(plan.cfg.k8s_version)
        job = place_gang(render_job(plan), plan)
        # checkov reads any kind "Job" as batch/v1 and looks for spec.template, which a Volcano Job
        # keeps under spec.tasks[*]; tests/test_charts.py asserts these settings on every task.
        not_seen = "checkov looks for batch/v1 spec.template; each Volcano task template sets it (tests/test_charts.py)"
        skips = checkov_skips(
            CKV_K8S_23=not_seen, CKV_K8S_29=not_seen, CKV_K8S_31=not_seen, CKV_K8S_40=not_seen,
            CKV_K8S_38=not_seen,
        )
        VolcanoJob(self, "job", JOB_NAME, plan.namespace, labels(JOB_NAME), job["spec"], annotations=skips)
        api_object(self, k8s.KubeService, SERVICE, plan.namespace, labels=labels(JOB_NAME), spec={
            "clusterIP": "None",
            # Rendezvous happens before any pod is ready; publish addresses at once.
            "publishNotReadyAddresses": True,
            "selector": {"volcano.sh/job-name": JOB_NAME},
            "ports": [{"name": "c10d", "port": plan.wl.trainer.rdzv_port, "targetPort": plan.wl.trainer.rdzv_port}],
        })
        # Ranks talk to each other on every port (c10d, NCCL) and take nothing else in; with
        # weight_sync.mode network replica 0 also takes the engines' weight-update groups, on
        # their ports only (charts8s/contract.py TABLE).
        contract_policies(self, k8s, plan, [TRAINER_RANKS, SOURCE])
