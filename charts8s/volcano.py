"""The Volcano Job (batch.volcano.sh/v1alpha1) that gang-schedules the trainer, and its schema.

No CRD file is fetched at synth or test time: `JOB_SCHEMA` is the JSON schema of the Job fields
we write, transcribed from the Go API types in volcano.sh/apis (pkg/apis/batch/v1alpha1/job.go:
JobSpec, TaskSpec, LifecyclePolicy; pkg/apis/bus/v1alpha1: Event and Action values). Unknown
fields are errors, and each task's pod template is checked against the Kubernetes schema of the
configured version (the `$ref` into kubernetes-validate's definitions).
"""

from __future__ import annotations

from typing import Any

import cdk8s
from constructs import Construct

API_VERSION = "batch.volcano.sh/v1alpha1"
KIND = "Job"

EVENTS = ["*", "PodFailed", "PodEvicted", "Unknown", "TaskCompleted", "OutOfSync", "CommandIssued",
          "JobUpdated", "TaskFailed"]
ACTIONS = ["AbortJob", "RestartJob", "RestartTask", "TerminateJob", "CompleteJob", "ResumeJob"]
_POD_TEMPLATE = {"$ref": "/api/_definitions.json#/$defs/io.k8s.api.core.v1.PodTemplateSpec"}
_OBJECT_META = {"$ref": "/api/_definitions.json#/$defs/io.k8s.apimachinery.pkg.apis.meta.v1.ObjectMeta"}
_INT32 = {"type": "integer", "minimum": 0, "maximum": 2**31 - 1}
_POLICY = {
    "type": "object", "additionalProperties": False,
    "properties": {
        "action": {"enum": ACTIONS}, "event": {"enum": EVENTS},
        "events": {"type": "array", "items": {"enum": EVENTS}},
        "exitCode": {"type": "integer"}, "timeout": {"type": "string"},
    },
}
JOB_SCHEMA: dict[str, Any] = {
    # Same base URI as kubernetes-validate's schemas, so "/api/_definitions.json" resolves there.
    "$id": "https://kubernetes.io/api/volcano-job-v1alpha1.json",
    "type": "object", "additionalProperties": False, "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": API_VERSION}, "kind": {"const": KIND}, "metadata": _OBJECT_META,
        "spec": {
            "type": "object", "additionalProperties": False, "required": ["tasks"],
            "properties": {
                "schedulerName": {"type": "string"}, "minAvailable": _INT32, "queue": {"type": "string"},
                "maxRetry": _INT32, "ttlSecondsAfterFinished": _INT32, "priorityClassName": {"type": "string"},
                "minSuccess": {"type": "integer", "minimum": 1}, "runningEstimate": {"type": "string"},
                "policies": {"type": "array", "items": _POLICY},
                "plugins": {"type": "object", "additionalProperties": {"type": "array", "items": {"type": "string"}}},
                "tasks": {"type": "array", "minItems": 1, "items": {
                    "type": "object", "additionalProperties": False, "required": ["name", "replicas", "template"],
                    "properties": {
                        "name": {"type": "string", "pattern": r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"},
                        "replicas": _INT32, "minAvailable": _INT32, "maxRetry": _INT32,
                        "template": _POD_TEMPLATE, "policies": {"type": "array", "items": _POLICY},
                        "topologyPolicy": {"enum": ["none", "best-effort", "restricted", "single-numa-node"]},
                    },
                }},
            },
        },
    },
}


class VolcanoJob(cdk8s.ApiObject):
    """A batch.volcano.sh/v1alpha1 Job with `spec` as given (see JOB_SCHEMA for the fields)."""

    def __init__(self, scope: Construct, id: str, name: str, namespace: str, labels: dict, spec: dict,
                 annotations: dict | None = None):
        super().__init__(scope, id, api_version=API_VERSION, kind=KIND,
                         metadata=cdk8s.ApiObjectMetadata(name=name, namespace=namespace, labels=labels,
                                                          annotations=annotations))
        self.add_json_patch(cdk8s.JsonPatch.add("/spec", spec))
