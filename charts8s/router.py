"""SGLang's router in front of the rollout engines (run config ``rollout.router``; app/rollout/router.py).

- Deployment ``moerl-router`` (one replica: the cache-aware tree and the per-engine load counts
  live in the process, two replicas would each see half the traffic), the rollout image (which
  installs sglang-router, images/versions.toml), on the rollout-gpu nodes' spare CPU like the
  multi-node engines' workers; Service ``moerl-router`` on ``rollout.router_port``.
- Engines by name (``--worker-urls``), so that the router needs no Kubernetes API token (its
  ``--service-discovery`` would watch pods through the API): a multi-node engine's leader address
  (LeaderWorkerSet's headless Service, ``charts8s/rollout.py`` `leader_address`), and, with the
  router on, one-node engines become a StatefulSet with a headless Service for the same reason
  (``moerl-rollout-<i>.moerl-rollout.<namespace>``). A pod replaced after a Spot loss keeps its
  name; the router's health checks take it out and put it back. Engines added by scaling by hand
  are not in the list until the next synth.
- Keys: the engines serve on the pod network with SGLang's API and admin keys (Secret
  ``rollout.api_key_secret``); the router holds the API key only (its ``--api-key``, sent to the
  engines with every request) and takes no key itself: its NetworkPolicy admits the workers alone.
- NetworkPolicy (charts8s/contract.py): in, the rollout workers on the router port; out, DNS and
  the engines' port.
"""

from __future__ import annotations

import cdk8s
from constructs import Construct

from app.rollout.router import rollout_router_command
from charts8s.cluster import ROLLOUT, ROUTER
from charts8s.kube import api_object, k8s_module
from charts8s.contract import ROUTER_POD, contract_policies
from charts8s.placement import checkov_skips, container_security, labels, on_pool, pod_security
from charts8s.workloads import Plan

NAME = ROUTER
UID = 10001  # the moerl user of images/*.Dockerfile
ROUTER_API_KEY_ENV = "SGLANG_API_KEY"  # the engines' API key, expanded by the kubelet into --api-key


def router_url(plan: Plan) -> str:
    """Where the workers send /generate: the router's Service."""
    return f"http://{NAME}.{plan.namespace}:{plan.wl.rollout.router_port}"


def engine_urls(plan: Plan) -> list[str]:
    """The engines' HTTP addresses, one per engine (group leaders for multi-node engines)."""
    from charts8s.rollout import leader_address

    port, n = plan.wl.rollout.engine_port, plan.rollout_replicas
    if plan.engine.nodes > 1:
        return [f"http://{leader_address(plan, str(g))}:{port}" for g in range(n)]
    return [f"http://{ROLLOUT}-{i}.{ROLLOUT}.{plan.namespace}:{port}" for i in range(n)]


def router_container(plan: Plan) -> dict:
    wl = plan.wl.rollout
    from charts8s.rollout import API_KEY, secret_env, startup_budget_s

    cmd = rollout_router_command(plan.run.rollout, engine_urls(plan), host="0.0.0.0", port=wl.router_port,
                                 prometheus_port=wl.router_metrics_port, api_key=f"$({ROUTER_API_KEY_ENV})",
                                 log_level="info")
    # it waits for the engines at start: as long as their startup probe allows them
    cmd += ["--worker-startup-timeout-secs", str(startup_budget_s(plan))]
    res = {"cpu": "4", "memory": "8Gi"}
    probe = {"httpGet": {"path": "/liveness", "port": wl.router_port}, "periodSeconds": 10, "failureThreshold": 6}
    return {
        "name": "router", "image": plan.images["rollout"], "imagePullPolicy": "IfNotPresent",
        "command": cmd,
        "env": secret_env(wl.api_key_secret, {API_KEY: ROUTER_API_KEY_ENV}),
        "ports": [{"name": "http", "containerPort": wl.router_port, "protocol": "TCP"},
                  {"name": "metrics", "containerPort": wl.router_metrics_port, "protocol": "TCP"}],
        "livenessProbe": probe,
        # ready once it answers; with no engine healthy yet the workers' own health checks wait
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
            CKV_K8S_35="the router takes the engines' API key as a value; read from the Secret at start only",
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
