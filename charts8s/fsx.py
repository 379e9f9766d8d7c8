"""The shared FSx for Lustre file system in the pods (DeploymentConfig.fsx; infra/storage.py makes
it, linked to the checkpoint bucket's models_prefix/).

A static PersistentVolume (CSI driver fsx.csi.aws.com, the file system's id and mount name from
the storage stack's outputs) bound to one PersistentVolumeClaim in the workloads' namespace, read
only; no StorageClass, since nothing is provisioned. Where each read comes from with fsx.enabled:

- base weights (an s3:// model under s3://<checkpoint bucket>/<models_prefix>/): the rollout
  engines load them from the mount (`served_model_path`, no init-container copy), and the trainer
  and the rollout workers resolve model.path to the mount (app/model/source.py MIRROR_ENV, which
  falls back to S3 while the file system has not imported the files yet). The first read of a
  file imports it from S3 once for every node;
- published policy versions and training state: from S3 through the store, as without FSx. They
  are written while the run goes; the file system's import of a new object lags the write, where
  the store's commit markers are read at once, and the trainer writes only through S3 (its per-run
  IAM scope, trainer_runs), so S3 stays the source of truth;
- datasets (task.jsonl_path): from S3, read once by the feed, on a pool without the mount.

Only pods of infra/cluster.py FSX_POOLS (train-gpu, rollout-gpu) mount it: the file system admits
Lustre from those nodes' EFA security group, and the CSI node plugin runs there only.
"""

from __future__ import annotations

import cdk8s
from constructs import Construct

from app.model.source import MIRROR_ENV
from charts8s.kube import api_object, k8s_module

MOUNT = "/fsx"
VOLUME = "fsx"
CLAIM = "moerl-fsx"
DRIVER = "fsx.csi.aws.com"  # aws-fsx-csi-driver's CSIDriver name


def volume_name(plan) -> str:
    """The PersistentVolume's (cluster-wide) name: one per workloads namespace."""
    return f"{plan.namespace}-fsx"


def fsx_model_path(plan, url: str) -> str | None:
    """The mounted directory of ``s3://`` `url` when fsx is on and `url` lies under the checkpoint
    bucket's models_prefix/ (the linked prefix), else None."""
    cfg = plan.cfg
    linked = f"s3://{cfg.checkpoint_bucket}/{cfg.models_prefix}/"
    if not (cfg.fsx.enabled and url.rstrip("/").startswith(linked)):
        return None
    return f"{MOUNT}/{cfg.models_prefix}/{url.rstrip('/')[len(linked):]}"


def mount_fsx(plan, pod: dict) -> dict:
    """Add the read-only volume to pod spec `pod`, and its mount and MIRROR_ENV to every container
    and init container; `pod` unchanged when fsx is off. Returns `pod`."""
    cfg = plan.cfg
    if not cfg.fsx.enabled:
        return pod
    pod.setdefault("volumes", []).append({"name": VOLUME, "persistentVolumeClaim": {"claimName": CLAIM, "readOnly": True}})
    mirror = f"s3://{cfg.checkpoint_bucket}/{cfg.models_prefix}/={MOUNT}/{cfg.models_prefix}/"
    for ctr in [*pod.get("initContainers", []), *pod["containers"]]:
        ctr.setdefault("volumeMounts", []).append({"name": VOLUME, "mountPath": MOUNT, "readOnly": True})
        ctr["env"] = [*ctr.get("env", []), {"name": MIRROR_ENV, "value": mirror}]
    return pod


class FsxChart(cdk8s.Chart):
    """The PersistentVolume of the file system and its claim (fsx.enabled only; charts8s/main.py)."""

    def __init__(self, scope: Construct, plan):
        super().__init__(scope, "fsx")
        cfg, k8s = plan.cfg, k8s_module(plan.cfg.k8s_version)
        lab = {"app.kubernetes.io/name": "fsx", "app.kubernetes.io/part-of": "moerl"}
        size = f"{cfg.fsx.storage_gib}Gi"
        # accessModes: the driver's capability is MULTI_NODE_MULTI_WRITER (aws-fsx-csi-driver
        # pkg/driver/controller.go); csi.readOnly makes every node mount it "ro" (node.go).
        api_object(self, k8s.KubePersistentVolume, volume_name(plan), labels=lab, spec={
            "capacity": {"storage": size}, "volumeMode": "Filesystem", "accessModes": ["ReadWriteMany"],
            "persistentVolumeReclaimPolicy": "Retain", "storageClassName": "",
            "claimRef": {"namespace": plan.namespace, "name": CLAIM},
            "csi": {"driver": DRIVER, "volumeHandle": cfg.fsx.file_system_id, "readOnly": True,
                    "volumeAttributes": {"dnsname": f"{cfg.fsx.file_system_id}.fsx.{cfg.region}.amazonaws.com",
                                         "mountname": cfg.fsx.mount_name}},
        })
        api_object(self, k8s.KubePersistentVolumeClaim, CLAIM, plan.namespace, labels=lab, spec={
            "accessModes": ["ReadWriteMany"], "storageClassName": "", "volumeName": volume_name(plan),
            "resources": {"requests": {"storage": size}},
        })
