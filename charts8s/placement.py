"""Where pods run and what they may do: node selectors, tolerations, security contexts.

Node labels and taints come from infra.config (POOL_LABEL, NodePool.taints), declared once there.
The capacity-type label is set by EKS managed node groups on every node
(eks.amazonaws.com/capacityType: ON_DEMAND | SPOT | CAPACITY_BLOCK, EKS user guide "Managed node groups").
"""

from __future__ import annotations

from infra.config import POOL_LABEL, NodePool

CAPACITY_LABEL = "eks.amazonaws.com/capacityType"
APP_LABEL = "app.kubernetes.io/name"
PART_LABEL = "app.kubernetes.io/part-of"


def labels(component: str) -> dict[str, str]:
    """Labels of every object and pod of one component (also the NetworkPolicy selectors)."""
    return {APP_LABEL: component, PART_LABEL: "moerl"}


def on_pool(pool: NodePool, spot: bool) -> dict:
    """Pod-spec fields that put a pod on `pool` only: node selector, tolerations, capacity affinity.

    spot: True tolerates Spot capacity (rollout, env pool); False requires a non-Spot node, so a
    pod can never land on Spot even if a pool's labels were copied by mistake (trainer, buffer).
    """
    tolerations = [
        {"key": t.key, "operator": "Equal", "value": t.value, "effect": t.effect} for t in pool.taints
    ]
    if spot:
        match = {"key": CAPACITY_LABEL, "operator": "In", "values": ["SPOT", "ON_DEMAND"]}
    else:
        match = {"key": CAPACITY_LABEL, "operator": "NotIn", "values": ["SPOT"]}
    return {
        "nodeSelector": {POOL_LABEL: pool.name},
        "tolerations": tolerations,
        "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
            "nodeSelectorTerms": [{"matchExpressions": [match]}]}}},
    }


def pod_security(uid: int) -> dict:
    """Pod securityContext: non-root `uid`, volumes group-owned by it, default seccomp profile."""
    return {
        "runAsNonRoot": True, "runAsUser": uid, "runAsGroup": uid, "fsGroup": uid,
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def container_security() -> dict:
    """Container securityContext: no privilege, no escalation, read-only root, all capabilities dropped.

    This meets Pod Security Admission "restricted", which the namespace enforces. EFA needs no
    capability: the EKS accelerated AMIs run containerd with an unlimited memlock limit, so
    libfabric can pin its registered memory without IPC_LOCK.
    """
    return {
        "privileged": False, "allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"]},
    }


def checkov_skips(**reasons: str) -> dict[str, str]:
    """Annotations that tell checkov to skip a check on one object, each with its reason.

    checkov reads `checkov.io/skipN: CHECK_ID=reason` on Kubernetes objects (checkov docs,
    "Suppressing and skipping policies"). Call as checkov_skips(CKV_K8S_43="why").
    """
    return {f"checkov.io/skip{i}": f"{check}={why}" for i, (check, why) in enumerate(reasons.items(), 1)}
