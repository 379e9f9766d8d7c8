"""Image prepull on the GPU pools (dist-ops/prepull.k8s.yaml): a DaemonSet per pool whose init
containers are the 10+ GB images that pool's pods run, so each node pulls them once when it joins
(onto the striped NVMe instance store that holds /var/lib/containerd, infra/cluster.py
node_config), not when the trainer gang or an engine is placed on it. A gang restarted on a
replacement node and a rollout node scaled up before its pod then start from local images
(imagePullPolicy IfNotPresent; ECR tags are immutable, so a tag is one image).

Each init container runs `sh -c true` in its image and exits; the pod then holds the pause image
(registry.k8s.io through the ECR pull-through cache, DeploymentConfig.cached_image), a few MiB.
"""

from __future__ import annotations

import cdk8s
from constructs import Construct

from charts8s.kube import api_object, k8s_module
from charts8s.placement import checkov_skips, container_security, labels
from charts8s.workloads import Plan
from infra.config import POOL_LABEL

NAME = "moerl-prepull"
PAUSE_IMAGE = "registry.k8s.io/pause:3.10"
PREPULL_UID = 65532  # an unprivileged uid every image accepts; nothing is written
# pool -> the plan's image roles its pods run (charts8s/trainer.py: trainer; rollout.py: rollout
# engines and workers; feed.py with evaluation and rewardmodel.py: rollout image on rollout-gpu).
POOL_IMAGES = {"train-gpu": ("trainer",), "rollout-gpu": ("rollout",)}


class PrepullChart(cdk8s.Chart):
    """One DaemonSet per pool of POOL_IMAGES, in the workloads' namespace."""

    def __init__(self, scope: Construct, plan: Plan):
        super().__init__(scope, "prepull")
        k8s, ns = k8s_module(plan.cfg.k8s_version), plan.namespace
        pinned = "images pinned by tag in the repository (ECR tags are immutable); IfNotPresent is intended"
        small = {"requests": {"cpu": "10m", "memory": "16Mi"}, "limits": {"cpu": "100m", "memory": "64Mi"}}
        for pool_name, roles in POOL_IMAGES.items():
            pool = plan.pool(pool_name)
            lab = {**labels(NAME), POOL_LABEL: pool_name}
            inits = [{"name": f"pull-{role}", "image": plan.images[role], "imagePullPolicy": "IfNotPresent",
                      "command": ["sh", "-c", "true"], "resources": small, "securityContext": container_security()}
                     for role in roles]
            spec = {
                "selector": {"matchLabels": lab},
                "updateStrategy": {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": "100%"}},
                "template": {"metadata": {"labels": lab}, "spec": {
                    "automountServiceAccountToken": False, "nodeSelector": {POOL_LABEL: pool_name},
                    "tolerations": [{"key": t.key, "operator": "Equal", "value": t.value, "effect": t.effect}
                                    for t in pool.taints],
                    "securityContext": {"runAsNonRoot": True, "runAsUser": PREPULL_UID, "runAsGroup": PREPULL_UID,
                                        "seccompProfile": {"type": "RuntimeDefault"}},
                    "initContainers": inits,
                    "containers": [{"name": "pause", "image": plan.cfg.cached_image(PAUSE_IMAGE),
                                    "imagePullPolicy": "IfNotPresent", "resources": small,
                                    "securityContext": container_security()}],
                }},
            }
            api_object(self, k8s.KubeDaemonSet, f"{NAME}-{pool_name}", ns, labels=lab, spec=spec,
                       annotations=checkov_skips(
                           CKV_K8S_15=pinned, CKV_K8S_43=pinned,
                           CKV_K8S_8="the pause container does nothing a liveness probe could check",
                           CKV_K8S_9="the pause container serves nothing a readiness probe could check"))
        # The pods take no traffic.
        api_object(self, k8s.KubeNetworkPolicy, NAME, ns, labels=labels(NAME), spec={
            "podSelector": {"matchLabels": labels(NAME)}, "policyTypes": ["Ingress"], "ingress": []})
