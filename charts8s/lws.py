"""LeaderWorkerSet (leaderworkerset.x-k8s.io/v1): one group of pods per multi-node engine.

The Kubernetes convention for an SGLang server over several nodes (kubernetes-sigs/lws
docs/examples/sglang/lws.yaml; SGLang docs/references/multi_node_deployment): a group of
``size`` pods, pod 0 the leader (node rank 0, the HTTP server), the others workers; each pod
gets ``LWS_LEADER_ADDRESS`` (``<name>-<group>.<name>.<namespace>``, through the headless Service
the controller makes), ``LWS_GROUP_SIZE`` and ``LWS_WORKER_INDEX``.

Restart policy ``RecreateGroupAfterStart`` (LWS v0.10 ``pkg/controllers/pod_controller.go``
``handleRestartPolicy``): once every pod of a group has started, a restart of any container,
init containers included (``ContainerRestarted``), or a lost pod (a Spot node) recreates the
whole group, as a torch.distributed world cannot take a member back; while a pod of the group
is still Pending (a node not there yet) a restart leaves the group alone instead of deleting the
pods that did start, which ``RecreateGroupOnPodRestart`` does, over and over on a slow first
boot. So nothing may run in a group's pods that restarts for reasons of its own: the rollout
worker runs in a pod of its own (charts8s/rollout.py).

The controller is installed by infra/ (a pinned Helm chart); the CRD schema of that version is
in tests/data and every object here is validated against it.
"""

from __future__ import annotations

from types import SimpleNamespace

from charts8s.kube import api_object

API_VERSION = "leaderworkerset.x-k8s.io/v1"
KIND = "LeaderWorkerSet"
# Lets `charts8s.kube.api_object` write the kind like a generated class.
LeaderWorkerSet = SimpleNamespace(GVK=SimpleNamespace(api_version=API_VERSION, kind=KIND))
ROLE_LABEL = "moerl.dev/engine-role"  # leader | worker: the probes, worker and Service target leaders
RESTART_POLICY = "RecreateGroupAfterStart"  # see the module doc


def leader_worker_set(scope, name: str, namespace: str, *, labels: dict, annotations: dict | None, replicas: int,
                      size: int, leader_pod: dict, worker_pod: dict) -> None:
    """Add a LeaderWorkerSet of ``replicas`` groups of ``size`` pods.

    Workers start with their leader (startupPolicy LeaderCreated: the leader cannot become ready
    before every node rank has joined); updates replace one group at a time, no surge (the
    groups fill whole GPU nodes).
    """
    def template(role: str, pod: dict) -> dict:
        return {"metadata": {"labels": {**labels, ROLE_LABEL: role}}, "spec": pod}

    api_object(scope, LeaderWorkerSet, name, namespace, labels=labels, annotations=annotations, spec={
        "replicas": replicas,
        "startupPolicy": "LeaderCreated",
        "rolloutStrategy": {"type": "RollingUpdate",
                            "rollingUpdateConfiguration": {"maxUnavailable": 1, "maxSurge": 0}},
        "leaderWorkerTemplate": {
            "size": size,
            "restartPolicy": RESTART_POLICY,
            "leaderTemplate": template("leader", leader_pod),
            "workerTemplate": template("worker", worker_pod),
        },
    })
