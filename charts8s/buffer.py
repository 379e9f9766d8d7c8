"""The experience buffer: Redis with append-only persistence on an EBS volume, passwords from a Secret.

One StatefulSet pod on the buffer-mem pool (on-demand). The Secret is created outside dist/
(docs/cluster.md: `kubectl create secret`) so no credential is ever written to the manifests. It holds one
password per Redis user: ``password`` for ``default`` (the administrator: this pod's probe and
exporter, an operator) and one per role, ``trainer``, ``rollout`` and ``feed``, each an ACL user
allowed its own commands on the run's keys only (app/buffer/acl.py). A pod gets its own role's
key and user name (`redis_credentials`), so a rollout pod cannot write the weight-sync push
record; the env pool and the reward model get none and are not let in (NetworkPolicy).

Beside redis-server runs oliver006/redis_exporter (flags and environment variables as its
README lists them for v1.88.0), the usual way to give Prometheus Redis's figures (memory,
clients, commands, AOF); its container port "metrics" is what the moerl-buffer PodMonitor
(charts8s/monitoring.py) scrapes. It also exports the length of the run's keys
(app.buffer.keys.buffer_keys): ``redis_key_size`` of the task and sample streams and the
sets, and for the two streams ``redis_stream_length`` and, per consumer group,
``redis_stream_group_messages_pending`` (group "rollout": the tasks leased by rollout workers;
group "trainer": the groups taken and not yet committed) and ``redis_stream_group_lag`` (group
"trainer": the finished groups not yet taken). Its /scrape endpoint, which would make it connect to any address a
caller names with the buffer's password, is off.
"""

from __future__ import annotations

import cdk8s
from constructs import Construct

from app.buffer.acl import ROLES, server_args
from app.buffer.keys import SET_KEYS, STREAM_KEYS, buffer_keys
from app.names import PASSWORD_ENV, USER_ENV
from charts8s.cluster import BUFFER_SERVICE, REDIS_DB, REDIS_EXPORTER_PORT, REDIS_PORT
from charts8s.contract import BUFFER, contract_policies
from charts8s.kube import api_object, k8s_module
from charts8s.monitoring import METRICS_PORT_NAME, metrics_port
from charts8s.placement import checkov_skips, container_security, labels, on_pool, pod_security

NAME = BUFFER_SERVICE
STORAGE_CLASS = "moerl-gp3"
UID = 10001  # any UID runs redis-server; fsGroup makes /data writable
ADMIN_KEY = "password"  # the Secret's key of the default user's password (one key per role besides)
EXPORTER = "redis-exporter"
# A few MB of Go heap for INFO and the keys below; the upstream Kubernetes example requests 100m.
EXPORTER_RESOURCES = {"cpu": "100m", "memory": "128Mi"}


def redis_credentials(plan, role: str) -> list[dict]:
    """Container env of a pod connecting as ``role`` (trainer, rollout, feed): its Redis user
    name and its password from the role's key of the buffer's Secret."""
    if role not in ROLES:
        raise ValueError(f"role must be one of {ROLES}, got {role!r}")
    return [{"name": USER_ENV, "value": role},
            {"name": PASSWORD_ENV, "valueFrom": {"secretKeyRef": {"name": plan.wl.buffer.password_secret, "key": role}}}]


def role_password_env(role: str) -> str:
    """The redis container's variable holding ``role``'s password (for its ``--user`` line)."""
    return f"MOERL_REDIS_{role.upper()}_PASSWORD"


def exporter_env(plan) -> list[dict]:
    """Environment of the exporter container: redis-server on the pod's loopback, the password
    from the buffer's Secret, the run's queue keys to measure, no /scrape endpoint."""
    run = plan.run
    keys = buffer_keys(run.run_id, run.buffer.run_prefix)
    db = lambda names: ",".join(f"db{REDIS_DB}={keys[n]}" for n in names)  # noqa: E731
    return [
        {"name": "REDIS_ADDR", "value": f"redis://localhost:{REDIS_PORT}"},
        {"name": "REDIS_PASSWORD", "valueFrom": {"secretKeyRef": {"name": plan.wl.buffer.password_secret,
                                                                   "key": ADMIN_KEY}}},
        {"name": "REDIS_EXPORTER_WEB_LISTEN_ADDRESS", "value": f":{REDIS_EXPORTER_PORT}"},
        {"name": "REDIS_EXPORTER_CHECK_SINGLE_KEYS", "value": db(STREAM_KEYS + SET_KEYS)},
        {"name": "REDIS_EXPORTER_CHECK_SINGLE_STREAMS", "value": db(STREAM_KEYS)},
        # Consumers are rollout pods: a series per pod name would outlive every replaced pod.
        {"name": "REDIS_EXPORTER_STREAMS_EXCLUDE_CONSUMER_METRICS", "value": "true"},
        {"name": "REDIS_EXPORTER_DISABLE_SCRAPE_ENDPOINT", "value": "true"},
    ]


class BufferChart(cdk8s.Chart):
    """StorageClass, StatefulSet, Service and the NetworkPolicy admitting only moerl's roles."""

    def __init__(self, scope: Construct, plan):
        super().__init__(scope, "buffer")
        k8s, ns, lab, b = k8s_module(plan.cfg.k8s_version), plan.namespace, labels(NAME), plan.wl.buffer
        api_object(self, k8s.KubeStorageClass, STORAGE_CLASS, labels=lab, provisioner="ebs.csi.aws.com",
                   parameters={"type": "gp3", "encrypted": "true"}, reclaimPolicy="Retain",
                   volumeBindingMode="WaitForFirstConsumer", allowVolumeExpansion=True)
        res = {"cpu": str(b.cpu), "memory": f"{b.memory_gi}Gi"}
        # maxmemory below the limit leaves room for the AOF rewrite's copy-on-write pages.
        maxmemory = f"{int(b.memory_gi * 0.75)}gb"
        probe = {"exec": {"command": ["sh", "-c", "redis-cli -p 6379 ping | grep -q PONG"]},
                 "periodSeconds": 10, "timeoutSeconds": 5, "failureThreshold": 3}
        secret = lambda key: {"secretKeyRef": {"name": b.password_secret, "key": key}}  # noqa: E731
        run = plan.run
        # One ACL user per role, its password expanded by the kubelet from the role's Secret key.
        users = server_args({role: f"$({role_password_env(role)})" for role in ROLES}, run.run_id, run.buffer.run_prefix)
        container = {
            "name": "redis", "image": b.image, "imagePullPolicy": "IfNotPresent",
            "command": ["redis-server"],
            "args": ["--port", str(REDIS_PORT), "--dir", "/data", "--appendonly", "yes", "--appendfsync", "everysec",
                     "--maxmemory", maxmemory, "--maxmemory-policy", "noeviction",
                     "--requirepass", "$(REDISCLI_AUTH)", *users],
            # redis-cli (the probes) reads the default user's password from REDISCLI_AUTH.
            "env": [{"name": "REDISCLI_AUTH", "valueFrom": secret(ADMIN_KEY)}]
                   + [{"name": role_password_env(role), "valueFrom": secret(role)} for role in ROLES],
            "ports": [{"name": "redis", "containerPort": REDIS_PORT}],
            "resources": {"requests": res, "limits": res},
            "securityContext": container_security(),
            "readinessProbe": probe, "livenessProbe": {**probe, "periodSeconds": 30, "failureThreshold": 5},
            "volumeMounts": [{"name": "data", "mountPath": "/data"}],
        }
        health = {"httpGet": {"path": "/health", "port": METRICS_PORT_NAME}, "periodSeconds": 30, "timeoutSeconds": 5}
        exporter = {
            # The image's entrypoint, written out (the replica, app/replica, knows it by this name).
            "name": EXPORTER, "image": b.exporter_image, "imagePullPolicy": "IfNotPresent",
            "command": ["/redis_exporter"],
            "env": exporter_env(plan),
            "ports": [metrics_port(REDIS_EXPORTER_PORT)],
            "resources": {"requests": EXPORTER_RESOURCES, "limits": EXPORTER_RESOURCES},
            "securityContext": container_security(),
            "readinessProbe": health, "livenessProbe": {**health, "failureThreshold": 5},
        }
        skips = checkov_skips(
            CKV_K8S_43="Redis is pinned by digest; the exporter by version tag only, no digest of it could be verified",
            CKV_K8S_15="a pinned version tag does not change; IfNotPresent avoids a registry round trip per start",
            CKV_K8S_35="redis-server takes requirepass as an argument and redis_exporter reads REDIS_PASSWORD "
                       "(its password file holds a URL map, not the Secret's key); both read env at start only",
        )
        api_object(self, k8s.KubeStatefulSet, NAME, ns, labels=lab, annotations=skips, spec={
            "serviceName": NAME, "replicas": 1, "selector": {"matchLabels": lab},
            "template": {"metadata": {"labels": lab}, "spec": {
                **on_pool(plan.pool("buffer-mem"), spot=False),
                "serviceAccountName": NAME, "automountServiceAccountToken": False,
                "priorityClassName": NAME, "securityContext": pod_security(UID),
                # Redis flushes the AOF on SIGTERM (SHUTDOWN); give it time.
                "terminationGracePeriodSeconds": 60,
                "containers": [container, exporter],
            }},
            "volumeClaimTemplates": [{"metadata": {"name": "data"}, "spec": {
                "accessModes": ["ReadWriteOnce"], "storageClassName": STORAGE_CLASS,
                "resources": {"requests": {"storage": f"{b.storage_gi}Gi"}}}}],
            "persistentVolumeClaimRetentionPolicy": {"whenDeleted": "Retain", "whenScaled": "Retain"},
        })
        api_object(self, k8s.KubeService, NAME, ns, labels=lab, spec={
            "selector": lab, "ports": [{"name": "redis", "port": REDIS_PORT, "targetPort": REDIS_PORT}]})
        # In: the processes with a Redis user, on 6379. Out: nothing (the exporter reads loopback).
        contract_policies(self, k8s, plan, [BUFFER])
