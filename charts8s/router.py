"""SGLang's router in front of the rollout engines (run config ``rollout.router``; app/rollout/router.py).

- Deployment ``moerl-router`` (one replica: the cache-aware tree and the per-engine load counts
  live in the process, two replicas would each see half the traffic), the rollout image (which
  installs sglang-router, images/versions.toml), on the rollout-gpu nodes' spare CPU like the
  multi-node engines' workers; Service ``moerl-router`` on ``rollout.router_port``.
- No engines at start: each worker registers its own engine (``POST /workers``, app/rollout/router.py
  `RouterRegistration`) once the engine is healthy and serves the current version, and takes it
  out when it drains; a static ``--worker-urls`` list would drop for good an engine not healthy
  within the router's startup timeout (two-node DeepSeek-V3 engines: node provisioning, a 1.34 TB
  copy, SGLang's boot). Engines are named by address, so that the router needs no Kubernetes API
  token: a multi-node engine's leader address (LeaderWorkerSet's headless Service,
  ``charts8s/rollout.py`` `leader_address`), and, with the router on, one-node engines become a
  StatefulSet with a headless Service (``moerl-rollout-<i>.moerl-rollout.<namespace>``). A pod
  replaced after a Spot loss keeps its name, and its worker registers it again.
- Keys (Secret ``rollout.api_key_secret``), what the router needs and nothing more: ``api-key``,
  which it asks of the workers on /generate (``--api-key``; it sends no key on to the engines,
  which ask for none), and ``control-plane-api-key``, the only key its /workers and /flush_cache
  take (``--control-plane-api-keys``), which the workers use to register their engines. No
  engine admin key. Its NetworkPolicy admits the workers alone.
- NetworkPolicy (charts8s/contract.py): in, the rollout workers on the router port; out, DNS and
  the engines' port.
"""

from __future__ import annotations

import cdk8s
from constructs import Construct

from app.rollout.router import rollout_router_command
from charts8s.cluster import ROLLOUT, ROUTER
from charts8s.keys import API_KEY, CONTROL_KEY, secret_env
from charts8s.kube import api_object, k8s_module
from charts8s.contract import ROUTER_POD, contract_policies
from charts8s.placement import checkov_skips, container_security, labels, on_pool, pod_security
from charts8s.workloads import Plan

NAME = ROUTER
UID = 10001  # the moerl user of images/*.Dockerfile
# The router container's variables of its two keys, which the kubelet expands in its command.
KEY_ENV = {"api-key": "SGLANG_API_KEY", "control-plane-api-key": "SGLANG_ROUTER_CONTROL_KEY"}


def router_url(plan: Plan) -> str:
    """Where the workers send /generate: the router's Service."""
    return f"http://{NAME}.{plan.namespace}:{plan.wl.rollout.router_port}"


def router_container(plan: Plan) -> dict:
    wl = plan.wl.rollout
    cmd = rollout_router_command(plan.run.rollout, host="0.0.0.0", port=wl.router_port,
                                 prometheus_port=wl.router_metrics_port, api_key=f"$({KEY_ENV[API_KEY]})",
                                 control_key=f"$({KEY_ENV[CONTROL_KEY]})", log_level="info")
    res = {"cpu": "4", "memory": "8Gi"}
    probe = {"httpGet": {"path": "/liveness", "port": wl.router_port}, "periodSeconds": 10, "failureThreshold": 6}
    return {
        "name": "router", "image": plan.images["rollout"], "imagePullPolicy": "IfNotPresent",
        "command": cmd,
        "env": secret_env(wl.api_key_secret, KEY_ENV),
        "ports": [{"name": "http", "containerPort": wl.router_port, "protocol": "TCP"},
                  {"name": "metrics", "containerPort": wl.router_metrics_port, "protocol": "TCP"}],
        "livenessProbe": probe,
        # ready once it answers: the workers register their engines with it
        "readinessProbe": {**probe, "httpGet": {"path": "/health", "port": wl.router_port}},
        "resources": {"requests": res, "limits": res},
        "securityContext": container_security(),
        "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"}],
    }


class RouterChart(cdk8s.Chart):
    """ServiceAccount, Deployment, Service and NetworkPolicy of the router."""

    def __init__(self, scope: Construct, plan: Plan):
        super().__init__(scope, "router")
        k8s, ns, lab, wl = k8s_module(plan.cfg.k8s_version), plan.namespace, labels(NAME), plan.wl.rollout
        api_object(self, k8s.KubeServiceAccount, NAME, ns, labels=lab, automountServiceAccountToken=False)
        skips = checkov_skips(
            CKV_K8S_43="ECR repositories have immutable tags (infra/): a tag names exactly one digest",
            CKV_K8S_15="immutable tags never change; IfNotPresent avoids pulling a 30 GB image again on restart",
            CKV_K8S_35="the router takes its two keys as values (command line only); read from the Secret at start",
        )
        api_object(self, k8s.KubeDeployment, NAME, ns, labels=lab, annotations=skips, spec={
            "replicas": 1, "selector": {"matchLabels": lab},
            "strategy": {"type": "Recreate"},  # one router: one view of the engines' loads
            "template": {"metadata": {"labels": lab}, "spec": {
                **on_pool(plan.pool("rollout-gpu"), spot=True),
                # its own account, with no AWS role (Pod Identity binds the rollout's) and no API token
                "serviceAccountName": NAME, "automountServiceAccountToken": False,
                "priorityClassName": ROLLOUT,
                "securityContext": pod_security(UID),
                "terminationGracePeriodSeconds": 30,
                "containers": [router_container(plan)],
                "volumes": [{"name": "tmp", "emptyDir": {"sizeLimit": "1Gi"}}],
            }},
        })
        api_object(self, k8s.KubeService, NAME, ns, labels=lab, spec={
            "selector": lab, "ports": [{"name": "http", "port": wl.router_port, "targetPort": wl.router_port}]})
        # In: the rollout workers on the router port. Out: DNS and the engines' port.
        contract_policies(self, k8s, plan, [ROUTER_POD])
