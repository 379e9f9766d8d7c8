"""The experience buffer: Redis with append-only persistence on an EBS volume, password from a Secret.

One StatefulSet pod on the buffer-mem pool (on-demand). The password Secret is created outside
dist/ (README: `kubectl create secret`) so no credential is ever written to the manifests.
"""

from __future__ import annotations

import cdk8s
from constructs import Construct

from charts8s.cluster import BUFFER_SERVICE, REDIS_PORT
from charts8s.kube import api_object, k8s_module
from charts8s.placement import checkov_skips, container_security, labels, on_pool, pod_security

NAME = BUFFER_SERVICE
STORAGE_CLASS = "moerl-gp3"
UID = 10001  # any UID runs redis-server; fsGroup makes /data writable
CLIENTS = ("moerl-rollout", "moerl-trainer", "moerl-env", "moerl-feed")


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
        container = {
            "name": "redis", "image": b.image, "imagePullPolicy": "IfNotPresent",
            "command": ["redis-server"],
            "args": ["--port", str(REDIS_PORT), "--dir", "/data", "--appendonly", "yes", "--appendfsync", "everysec",
                     "--maxmemory", maxmemory, "--maxmemory-policy", "noeviction",
                     "--requirepass", "$(REDISCLI_AUTH)"],
            # redis-cli (the probes) reads the password from REDISCLI_AUTH.
            "env": [{"name": "REDISCLI_AUTH", "valueFrom": {"secretKeyRef": {"name": b.password_secret, "key": "password"}}}],
            "ports": [{"name": "redis", "containerPort": REDIS_PORT}],
            "resources": {"requests": res, "limits": res},
            "securityContext": container_security(),
            "readinessProbe": probe, "livenessProbe": {**probe, "periodSeconds": 30, "failureThreshold": 5},
            "volumeMounts": [{"name": "data", "mountPath": "/data"}],
        }
        skips = checkov_skips(
            CKV_K8S_43="the Redis image is pinned by version tag from ECR Public's Docker official images",
            CKV_K8S_15="a pinned version tag does not change; IfNotPresent avoids a registry round trip per start",
            CKV_K8S_35="redis-server takes requirepass as an argument; the Secret is read from env at start only",
        )
        api_object(self, k8s.KubeStatefulSet, NAME, ns, labels=lab, annotations=skips, spec={
            "serviceName": NAME, "replicas": 1, "selector": {"matchLabels": lab},
            "template": {"metadata": {"labels": lab}, "spec": {
                **on_pool(plan.pool("buffer-mem"), spot=False),
                "serviceAccountName": "moerl-buffer", "automountServiceAccountToken": False,
                "priorityClassName": NAME, "securityContext": pod_security(UID),
                # Redis flushes the AOF on SIGTERM (SHUTDOWN); give it time.
                "terminationGracePeriodSeconds": 60,
                "containers": [container],
            }},
            "volumeClaimTemplates": [{"metadata": {"name": "data"}, "spec": {
                "accessModes": ["ReadWriteOnce"], "storageClassName": STORAGE_CLASS,
                "resources": {"requests": {"storage": f"{b.storage_gi}Gi"}}}}],
            "persistentVolumeClaimRetentionPolicy": {"whenDeleted": "Retain", "whenScaled": "Retain"},
        })
        api_object(self, k8s.KubeService, NAME, ns, labels=lab, spec={
            "selector": lab, "ports": [{"name": "redis", "port": REDIS_PORT, "targetPort": REDIS_PORT}]})
        api_object(self, k8s.KubeNetworkPolicy, NAME, ns, labels=lab, spec={
            "podSelector": {"matchLabels": lab}, "policyTypes": ["Ingress"],
            "ingress": [{"from": [{"podSelector": {"matchLabels": labels(c)}} for c in CLIENTS],
                         "ports": [{"protocol": "TCP", "port": REDIS_PORT}]}],
        })
