"""Typed deployment configuration for dev, staging and prod (shared by infra/ and charts8s/).

Node pools (name, labels, taints, instance types, capacity type, sizes) are declared here once;
the CDK stacks build node groups from them and the cdk8s charts build node selectors and
tolerations from the same objects. Defaults are built in code (`default_config(env)`); an
optional YAML file overrides any field (nested mappings merge key by key, lists replace).

Every rule is checked when the config is loaded, so a bad config fails before any synth work
with one message that names the field: `ConfigError`.
"""

from __future__ import annotations

import argparse
import hashlib
import ipaddress
import re
import sys
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from app.config_rules import error_line, load_yaml, strict_scalar, yaml_error_line
from infra.charts import VOLCANO_KUBERNETES, VOLCANO_UNLISTED_KUBERNETES
from infra.instances import INSTANCE_TABLE, InstanceSpec

Env = Literal["dev", "staging", "prod"]
ENVS: tuple[str, ...] = ("dev", "staging", "prod")

# The node label every pool carries; charts8s selects pools with it. Declared once.
POOL_LABEL = "moerl.dev/pool"
# Taint key of every non-system pool (value = pool name) and of GPU pools (value "present").
POOL_TAINT_KEY = POOL_LABEL
GPU_TAINT_KEY = "nvidia.com/gpu"
# Labels the device-plugin DaemonSets select on.
ACCELERATOR_LABEL = "moerl.dev/accelerator"
EFA_LABEL = "moerl.dev/efa"
# Node health (app/nodehealth.py, charts8s/nodehealth.py): the quarantine taint of a node that
# failed a GPU or EFA check (NoSchedule, value = the failed checks; no moerl pod tolerates it), the
# taint held while DCGM diagnostics run on an idle node, the pass/fail label and the results.
UNHEALTHY_TAINT_KEY = "moerl.dev/unhealthy"
DIAG_TAINT_KEY = "moerl.dev/diag-running"
HEALTH_LABEL = "moerl.dev/health"
HEALTH_ANNOTATION = "moerl.dev/health-results"

POOL_NAMES: tuple[str, ...] = ("train-gpu", "rollout-gpu", "env-cpu", "buffer-mem", "system")
# Most nodes of one managed node group: EKS's quota "Nodes per managed node group", 450 by default
# (EKS user guide, "Amazon EKS service quotas"; adjustable: an account with a raised quota raises this).
MAX_NODES_PER_NODE_GROUP = 450
# The VPC: an RFC 1918 block of /16 (65,536 addresses) to /28 (16), the sizes CreateVpc accepts
# (EC2 API reference, CreateVpc). infra/network.py cuts a public /22 and a private /18 per
# control-plane AZ out of it, in that order, each aligned to its size (as the CDK Vpc does).
VPC_PRIVATE_RANGES = ("10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16")
VPC_PREFIXES = (16, 28)
PUBLIC_SUBNET_MASK = 22
PRIVATE_SUBNET_MASK = 18
# ECR pull-through cache rules (infra/storage.py): upstream registry host -> ECR repository prefix.
# Upstreams that ECR caches without credentials (ECR API CreatePullThroughCacheRule:
# upstreamRegistryUrl; Docker Hub and ghcr.io need a Secrets Manager secret, nvcr.io is not an
# upstream ECR supports). `cached_image` rewrites an image reference to its cached copy.
PULL_THROUGH_CACHE = {"registry.k8s.io": "k8s", "quay.io": "quay", "public.ecr.aws": "ecr-public"}
# Upstreams ECR caches only with the account's credentials for them, in a Secrets Manager secret
# whose name starts with "ecr-pullthroughcache/" (ECR user guide, "Creating a pull through cache
# rule"): upstream URL -> prefix, and the names images use for the registry.
CREDENTIALED_CACHE = {"registry-1.docker.io": "docker-hub", "ghcr.io": "github"}
_REGISTRY_ALIASES = {"docker.io": "registry-1.docker.io", "index.docker.io": "registry-1.docker.io",
                     "registry-1.docker.io": "registry-1.docker.io", "ghcr.io": "ghcr.io"}
MIN_K8S_VERSION = (1, 31)
# The newest Kubernetes version in EKS standard support (EKS user guide, "Kubernetes versions
# standard support": 1.36 released on EKS 2026-06, standard support to 2027-08). nodeadm enables
# graceful node shutdown (kubelet shutdownGracePeriod 150 s) only from 1.34 (amazon-eks-ami
# nodeadm/internal/kubelet/config.go, withVersionToggles), which a Spot interruption needs.
DEFAULT_K8S_VERSION = "1.36"
# The documentation's placeholder accounts of the built-in defaults: synth works with them, a
# deploy cannot (infra/app.py refuses to build a pipeline that targets them).
PLACEHOLDER_ACCOUNTS = ("111111111111", "222222222222", "333333333333")

# A run id as RunConfig.run_id accepts it (app/config.py), optionally a family prefix ending in '*'.
_RUN_ID_RE = re.compile(r"^[a-z0-9][a-z0-9-]{0,62}\*?$")
# The principal tag that lets a principal of the account assume the created admin role when
# admin_principals names none (IAM trust policy condition aws:PrincipalTag/<key> = moerl-<env>).
ADMIN_PRINCIPAL_TAG = "moerl-cluster-admin"
# S3 general-purpose bucket naming rules (S3 user guide, "Bucket naming rules").
_BUCKET_RE = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")
_BUCKET_BAD_PREFIXES = ("xn--", "sthree-", "amzn-s3-demo-")
_BUCKET_BAD_SUFFIXES = ("-s3alias", "--ol-s3", ".mrap", "--x-s3", "--table-s3")


class ConfigError(ValueError):
    """A deployment config broke a rule; the message names the source and the field."""


def check_bucket_name(name: str) -> str:
    """Return `name` if it follows the S3 bucket naming rules, else raise ValueError saying which rule."""
    if not _BUCKET_RE.match(name):
        raise ValueError(
            f"bucket name {name!r} breaks S3 naming rules: 3-63 characters of lowercase letters, "
            "digits, '.' and '-', beginning and ending with a letter or digit"
        )
    if ".." in name:
        raise ValueError(f"bucket name {name!r} breaks S3 naming rules: two adjacent periods")
    try:
        ipaddress.IPv4Address(name)
    except ValueError:
        pass
    else:
        raise ValueError(f"bucket name {name!r} breaks S3 naming rules: formatted as an IP address")
    for p in _BUCKET_BAD_PREFIXES:
        if name.startswith(p):
            raise ValueError(f"bucket name {name!r} breaks S3 naming rules: reserved prefix {p!r}")
    for s in _BUCKET_BAD_SUFFIXES:
        if name.endswith(s):
            raise ValueError(f"bucket name {name!r} breaks S3 naming rules: reserved suffix {s!r}")
    return name


class Model(BaseModel):
    model_config = ConfigDict(extra="forbid")

    @field_validator("*", mode="before")
    @classmethod
    def _no_lax_scalars(cls, v: Any, info) -> Any:
        return strict_scalar(cls, v, info)


class Taint(Model):
    """A Kubernetes node taint, applied by the node group and tolerated by the pods of the pool."""

    key: str = Field(description="Taint key.")
    value: str = Field(description="Taint value.")
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] = Field(description="Taint effect.")


class NodePool(Model):
    """One EKS managed node group (the rollout pool may become several; see infra/cluster.py).

    A Capacity Block and a placement group are refused together: EC2 places a Capacity Block's
    instances in an UltraCluster itself, and no AWS document or sample launches one into a
    placement group (EC2 user guide, "Launch instances using Capacity Blocks": the requirements
    are the block's AZ and platform; the EKS Capacity Block template holds the market type, the
    reservation and the instance type only).
    """

    name: str = Field(description="The pool's name: its `moerl.dev/pool` label value and the node group's name.")
    instance_types: list[str] = Field(min_length=1, description="EC2 instance types of the group, each in "
                                      "infra/instances.py, all with the same EFA network-card count.")
    capacity_type: Literal["ON_DEMAND", "SPOT", "CAPACITY_BLOCK"] = Field(description="How the nodes are bought.")
    min_size: int = Field(ge=0, description="Fewest nodes of the group.")
    max_size: int = Field(ge=1, description="Most nodes of the group (charts8s refuses workloads that need more); "
                          "at most 450, EKS's default quota of nodes per managed node group.")
    desired_size: int = Field(ge=0, description="Nodes the group scales to (`python -m infra.scale` for GPU pools).")
    labels: dict[str, str] = Field(description="Kubernetes labels of the nodes; pods select their pool by them.")
    taints: list[Taint] = Field([], description="Taints of the nodes; only the pool's own pods tolerate them.")
    disk_size_gib: int = Field(100, ge=20, le=16384, description="gp3 root volume size in GiB (set in the launch "
                               "template).")
    efa: bool = Field(False, description="Attach EFA interfaces on every network card of the instance type "
                      "(from INSTANCE_TABLE).")
    placement_group: bool = Field(False, description="Launch into a cluster placement group (training only).")
    capacity_reservation_id: str | None = Field(None, pattern=r"^cr-[0-9a-f]{8,17}$", description="On-Demand "
                                                "Capacity Reservation or Capacity Block id (cr-...).")
    hugepages_2mi: int = Field(0, ge=0, description="MiB of 2 MiB hugepages reserved on every node at boot "
                               "(launch-template user data sets vm.nr_hugepages before the kubelet starts); a "
                               "multiple of 2, 0 for none. The trainer pod (one per train-gpu node) requests all "
                               "of them as hugepages-2Mi (charts8s).")
    placement_group_name: str | None = Field(None, pattern=r"^[A-Za-z0-9_.+=@,-]{1,255}$", description="An "
                                             "existing cluster placement group to launch into instead of a new one "
                                             "(placement_group must be true). An On-Demand Capacity Reservation made "
                                             "in a cluster placement group is used only by instances launched into "
                                             "that group (EC2 user guide, \"Capacity Reservations in cluster "
                                             "placement groups\").")
    local_storage: Literal["RAID0", "none"] = Field("none", description="nodeadm's NodeConfig "
                                                   "`instance.localStorage.strategy` (RAID0 stripes every NVMe "
                                                   "instance-store disk into one XFS volume and bind-mounts "
                                                   "/var/lib/kubelet, /var/lib/containerd and /var/log/pods onto it, "
                                                   "so images and emptyDir volumes such as the model volumes live on "
                                                   "local NVMe, not on the gp3 root); \"none\" leaves the disks unused. "
                                                   "Types without instance store are left alone by nodeadm "
                                                   "(setup-local-disks exits 0).")
    create_size: int | None = Field(None, ge=0, description="Nodes the group is created with (CloudFormation's "
                                    "DesiredSize; MinSize is lowered to it). None: desired_size. GPU pools default "
                                    "to 0, so a stack completes without waiting for GPU capacity; `python -m "
                                    "infra.scale` prints the commands that scale them to min/desired/max afterwards.")
    max_unavailable_percent: int | None = Field(None, ge=1, le=100, description="Nodes replaced at once by a node "
                                                "group update, as a percentage of the group (None: one node at a "
                                                "time, EKS's default). 32 Spot rollout nodes one at a time take "
                                                "hours; a percentage replaces them in a few rounds.")
    az: str | None = Field(None, description="Leave empty; every pool must run in the deployment's single AZ "
                           "(validated).")

    @field_validator("max_size")
    @classmethod
    def _node_group_quota(cls, v: int) -> int:
        if v > MAX_NODES_PER_NODE_GROUP:
            raise ValueError(f"{v} exceeds {MAX_NODES_PER_NODE_GROUP}, EKS's default quota of nodes per managed "
                             "node group (MAX_NODES_PER_NODE_GROUP, infra/config.py)")
        return v

    @field_validator("instance_types")
    @classmethod
    def _known_types(cls, types: list[str]) -> list[str]:
        for t in types:
            if t not in INSTANCE_TABLE:
                raise ValueError(
                    f"instance type {t!r} has no EFA table entry in INSTANCE_TABLE (infra/instances.py)"
                )
        if len(set(types)) != len(types):
            raise ValueError(f"instance types repeat: {types}")
        return types

    @model_validator(mode="after")
    def _rules(self) -> "NodePool":
        if not self.min_size <= self.desired_size <= self.max_size:
            raise ValueError(
                f"pool {self.name!r}: need min_size <= desired_size <= max_size, got "
                f"{self.min_size} <= {self.desired_size} <= {self.max_size}"
            )
        if self.labels.get(POOL_LABEL) != self.name:
            raise ValueError(f"pool {self.name!r}: labels must contain {POOL_LABEL}={self.name}")
        specs = self.specs
        if len({s.gpus > 0 for s in specs}) != 1 or len({s.arch for s in specs}) != 1:
            raise ValueError(f"pool {self.name!r}: mixes GPU and CPU types or CPU architectures")
        if self.efa and not all(s.has_efa for s in specs):
            no_efa = [t for t, s in zip(self.instance_types, specs) if not s.has_efa]
            raise ValueError(f"pool {self.name!r}: efa=true but {no_efa} have no EFA")
        if self.efa and len({s.efa_interfaces for s in specs}) > 1:
            # One launch template per node group: fewer interfaces than cards leaves EFA bandwidth
            # unused, more than a type has fails its launch.
            cards = {t: s.efa_interfaces for t, s in zip(self.instance_types, specs)}
            raise ValueError(f"pool {self.name!r}: EFA network-card counts differ {cards}; one launch "
                             "template serves the whole node group, so use types with the same count")
        if self.placement_group_name and not self.placement_group:
            raise ValueError(f"pool {self.name!r}: placement_group_name needs placement_group=true")
        if self.create_size is not None and self.create_size > self.max_size:
            raise ValueError(f"pool {self.name!r}: create_size={self.create_size} exceeds max_size={self.max_size}")
        if self.capacity_type == "CAPACITY_BLOCK" and not self.capacity_reservation_id:
            raise ValueError(f"pool {self.name!r}: CAPACITY_BLOCK needs capacity_reservation_id")
        if self.capacity_type == "CAPACITY_BLOCK" and self.placement_group:
            raise ValueError(f"pool {self.name!r}: a CAPACITY_BLOCK pool cannot also launch into a placement group "
                             "(set placement_group: false; EC2 places a Capacity Block's instances itself)")
        if self.capacity_type == "SPOT" and self.capacity_reservation_id:
            raise ValueError(f"pool {self.name!r}: a Spot pool cannot target a capacity reservation")
        if self.capacity_reservation_id and len(self.instance_types) != 1:
            raise ValueError(f"pool {self.name!r}: a capacity reservation holds one instance type")
        if self.hugepages_2mi % 2:
            raise ValueError(f"pool {self.name!r}: hugepages_2mi={self.hugepages_2mi} MiB is not a whole "
                             "number of 2 MiB pages")
        mem_mib = min(s.memory_gib for s in specs) * 1024
        if self.hugepages_2mi > mem_mib // 2:
            raise ValueError(f"pool {self.name!r}: hugepages_2mi={self.hugepages_2mi} MiB exceeds half the "
                             f"memory of the smallest instance type ({mem_mib} MiB)")
        return self

    @property
    def specs(self) -> list[InstanceSpec]:
        return [INSTANCE_TABLE[t] for t in self.instance_types]

    @property
    def gpu(self) -> bool:
        """True when the pool's instances carry NVIDIA GPUs."""
        return self.specs[0].gpus > 0

    @property
    def efa_interfaces(self) -> int:
        """EFA interfaces per node: the network cards of the pool's types (0 if efa is off).

        One launch template serves every type of a node group, so the validator allows only types
        with the same card count; min() is that count.
        """
        return min(s.efa_interfaces for s in self.specs) if self.efa else 0

    @property
    def capacity_block(self) -> bool:
        return self.capacity_type == "CAPACITY_BLOCK"

    @property
    def fixed_capacity(self) -> bool:
        """True when the pool cannot launch extra nodes for an update's surge: a Capacity Block, an
        On-Demand Capacity Reservation or a cluster placement group holds exactly its nodes.

        A managed node group update launches max(2 x AZs, maxUnavailable) nodes before it drains
        old ones (EKS user guide, "Understand each phase of node updates", scale-up phase); such
        pools use the MINIMAL update strategy instead, which terminates old nodes first (EKS API,
        NodegroupUpdateConfig.updateStrategy), and `python -m infra.scale --before-update` scales
        them to 0 before a deploy that replaces their nodes.
        """
        return self.capacity_block or bool(self.capacity_reservation_id) or self.placement_group

    @property
    def scaled_after_create(self) -> bool:
        """True when the pool is created below its configured size and `infra.scale` sets the rest."""
        return self.initial_sizes != (self.min_size, self.desired_size, self.max_size)

    @property
    def initial_sizes(self) -> tuple[int, int, int]:
        """(MinSize, DesiredSize, MaxSize) the node group is created with (see create_size)."""
        want = self.desired_size if self.create_size is None else self.create_size
        return min(self.min_size, want), want, self.max_size


# FSx for Lustre PERSISTENT_2 (SSD): per-unit storage throughput, MB/s per TiB, and storage
# capacity: 1200 GiB, or a multiple of 2400 GiB (FSx API CreateFileSystem StorageCapacity and
# LustreConfiguration.PerUnitStorageThroughput). app/plan/traffic.py estimates with the same values.
FSX_PER_UNIT_MBPS = (125, 250, 500, 1000)
FSX_CAPACITY_STEP_GIB = 2400
FSX_MIN_CAPACITY_GIB = 1200


def fsx_capacity_error(gib: float) -> str | None:
    """Why `gib` GiB is not a PERSISTENT_2 capacity, or None when it is. (FSx's documentation
    writes 1200 GiB as "1.2 TiB": `moerl plan --fsx-tib` converts at 1000 GiB per TiB.)"""
    if gib == FSX_MIN_CAPACITY_GIB or (gib > 0 and gib == int(gib) and int(gib) % FSX_CAPACITY_STEP_GIB == 0):
        return None
    return (f"{gib:g} GiB is not a PERSISTENT_2 capacity: {FSX_MIN_CAPACITY_GIB} GiB or a multiple of "
            f"{FSX_CAPACITY_STEP_GIB} GiB")


class FsxConfig(Model):
    """The shared FSx for Lustre file system (infra/storage.py), linked to the checkpoint bucket's
    models_prefix/ and mounted read-only at /fsx by trainer and rollout pods (charts8s/fsx.py)."""

    enabled: bool = Field(False, description="Off by default: it costs per provisioned GiB whether read or not, "
                          "and `moerl plan --traffic` shows when it beats reading S3 directly (many nodes reading "
                          "the same base model).")
    storage_gib: int = Field(2400, ge=FSX_MIN_CAPACITY_GIB, description="Capacity, 1200 or a multiple of 2400 "
                             "(PERSISTENT_2 SSD).")
    mbps_per_tib: int = Field(1000, description="Per-unit throughput, one of FSX_PER_UNIT_MBPS (125, 250, 500, "
                              "1000); the file system serves storage_gib / 1024 x mbps_per_tib MB/s, shared by "
                              "every reader.")
    file_system_id: str | None = Field(None, pattern=r"^fs-[0-9a-f]{8,21}$", description="The storage stack's "
                                       "output FsxFileSystemId, set after its first deploy; charts8s needs it and "
                                       "mount_name to render the PersistentVolume.")
    mount_name: str | None = Field(None, pattern=r"^[a-z0-9]{1,16}$", description="The storage stack's output "
                                   "FsxMountName, set after its first deploy (with file_system_id).")

    @field_validator("storage_gib")
    @classmethod
    def _capacity(cls, v: int) -> int:
        if why := fsx_capacity_error(v):
            raise ValueError(why)
        return v

    @field_validator("mbps_per_tib")
    @classmethod
    def _throughput(cls, v: int) -> int:
        if v not in FSX_PER_UNIT_MBPS:
            raise ValueError(f"{v} MB/s/TiB is not a PERSISTENT_2 throughput: one of {list(FSX_PER_UNIT_MBPS)}")
        return v

    @model_validator(mode="after")
    def _both_outputs(self) -> "FsxConfig":
        if (self.file_system_id is None) != (self.mount_name is None):
            given, missing = ("file_system_id", "mount_name") if self.mount_name is None else ("mount_name", "file_system_id")
            raise ValueError(f"fsx.{given} is set but fsx.{missing} is not: the PersistentVolume needs both "
                             "(the storage stack's outputs FsxFileSystemId and FsxMountName)")
        return self


class PipelineConfig(Model):
    """Where the promotion pipeline runs and which repository it builds (`-c env=pipeline -c
    config=pipeline.yaml`, see `load_pipeline_config`)."""

    account: str = Field(pattern=r"^\d{12}$", description="The tooling account; required, no default (a "
                         "placeholder would deploy a pipeline that never runs).")
    region: str = Field("us-east-2", pattern=r"^[a-z]{2}(-gov)?-[a-z]+-\d$", description="The tooling account's "
                        "region.")
    repository: str = Field("moerl-org/moerl", pattern=r"^[\w.-]+/[\w.-]+$", description="owner/name of the "
                            "repository the pipeline builds.")
    branch: str = Field("main", description="The branch the pipeline builds.")
    connection_arn: str = Field(pattern=r"^arn:aws[a-z-]*:(codestar-connections|codeconnections):[a-z0-9-]+:\d{12}:connection/[0-9a-f-]{36}$",
                                description="The tooling account's CodeConnections connection to the repository; "
                                "required, no default.")
    synth_compute: Literal["BUILD_GENERAL1_MEDIUM", "BUILD_GENERAL1_LARGE", "BUILD_GENERAL1_XLARGE"] = Field(
        "BUILD_GENERAL1_LARGE", description="CodeBuild compute type of the synth and test steps "
        "(BUILD_GENERAL1_LARGE: 15 GB, 8 vCPU; the default SMALL has 3 GB). The synth step installs only locked "
        "packages and synthesizes; the test step runs `make test-infra` (infra and ops-chart tests), not `make test`.")

    @model_validator(mode="after")
    def _real(self) -> "PipelineConfig":
        if self.account in PLACEHOLDER_ACCOUNTS:
            raise ValueError(f"account {self.account} is a placeholder of the built-in defaults; give the tooling account")
        if set(self.connection_arn.rsplit("/", 1)[-1]) <= {"0", "-"}:
            raise ValueError("connection_arn is the all-zero placeholder; give the CodeConnections connection ARN")
        return self


class DeploymentConfig(Model):
    """Everything one environment's stacks and charts need. `load_config(env)` starts from the
    env's built-in defaults (`default_config`), not from the field defaults alone."""

    env: Env = Field(description="Which environment: dev, staging or prod (the `-c env=` of cdk, `--env` of "
                     "the other commands).")
    account: str = Field(pattern=r"^\d{12}$", description="The AWS account; the built-in ones are placeholders, "
                         "and bucket names and the default admin role follow it.")
    region: str = Field(pattern=r"^[a-z]{2}(-gov)?-[a-z]+-\d$", description="The AWS region.")
    az: str = Field(description="The ONE availability zone of every node group.")
    control_plane_azs: list[str] = Field(min_length=2, description="Subnets for the EKS control plane (two or "
                                         "more, including `az`).")
    vpc_cidr: str = Field("10.0.0.0/16", description="The VPC's address range: an IPv4 block of /16 to /28 inside "
                          "10.0.0.0/8, 172.16.0.0/12 or 192.168.0.0/16 that holds a public /22 and a private /18 "
                          "subnet per control-plane AZ (a /16 holds three AZs).")
    k8s_version: str = Field(pattern=r"^1\.\d+$", description="The cluster's Kubernetes version (1.31 at the "
                             "least; one with add-on pins in infra/addons.py and a Volcano decision in "
                             "infra/charts.py).")
    pools: dict[str, NodePool] = Field(description="The node pools by name (train-gpu, rollout-gpu, env-cpu, "
                                       "buffer-mem, system); a file's entry is merged over the built-in pool of "
                                       "that name.")
    checkpoint_bucket: str = Field(description="S3 bucket of runs, base models and datasets (each of the three "
                                   "buckets has a name of its own).")
    artifacts_bucket: str = Field(description="S3 bucket of build and pipeline artifacts.")
    logs_bucket: str = Field(description="S3 bucket of the other buckets' access logs.")
    namespace: str = Field("moerl", pattern=r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$", description="Kubernetes "
                           "namespace of the workloads.")
    trainer_service_account: str = Field("moerl-trainer", description="Prefix of the trainer pods' service "
                                         "accounts: one per trainer_runs entry, <this>-<h> (trainer_identity), whose "
                                         "Pod Identity role writes that entry's runs.")
    rollout_service_account: str = Field("moerl-rollout", description="Service account of the rollout and feed "
                                         "pods (its Pod Identity role reads).")
    run_prefix: str = Field("runs", pattern=r"^[A-Za-z0-9!_.*'()-]+(/[A-Za-z0-9!_.*'()-]+)*$", description="Key "
                            "prefix in the checkpoint bucket under which runs live (Pod Identity scope).")
    image_repos: dict[Literal["trainer", "rollout", "env"], str] = Field({
        "trainer": "moerl/trainer",
        "rollout": "moerl/rollout",
        "env": "moerl/env",
    }, description="ECR repository name per image role (trainer, rollout, env).")
    image_tag: str = Field("0.1.0", pattern=r"^[\w][\w.-]{0,127}$", description="Tag of the three images the "
                           "manifests run; a new one per build (the repositories refuse to overwrite a tag).")
    admin_role_arns: list[str] = Field([], description="IAM roles given cluster-admin through EKS access entries; "
                                       "staging and prod need at least one (the API endpoint is private: without "
                                       "one nobody can run kubectl). Default: arn:aws:iam::<account>:role/"
                                       "moerl-<env>-admin (`default_admin_role_arn`).")
    create_admin_role: bool = Field(True, description="The cluster stack creates the role of admin_role_arns "
                                    "named moerl-<env>-admin (trusted as admin_principals says), so its access "
                                    "entry never names a missing principal (EKS rejects one). Every other role in "
                                    "admin_role_arns must already exist: `python -m infra.preflight` checks them "
                                    "before a deploy. Turn it off when the account already has a role of that name.")
    admin_principals: list[str] = Field([], description="The IAM roles or users that may assume the created admin "
                                        "role. Empty: any principal of this account that carries the tag "
                                        "moerl-cluster-admin = moerl-<env> (ADMIN_PRINCIPAL_TAG) and whose own policy "
                                        "allows sts:AssumeRole on it; never the whole account. Each must exist before "
                                        "the deploy (IAM refuses a trust policy naming a missing principal; `python -m "
                                        "infra.preflight` checks them).")
    pull_through_secrets: dict[Literal["registry-1.docker.io", "ghcr.io"], str] = Field(
        {}, description="Upstream (registry-1.docker.io, ghcr.io) -> ARN of the Secrets Manager secret (name "
        "ecr-pullthroughcache/...) holding this account's credentials for it; each gets a pull-through cache rule "
        "beside the credential-free ones (PULL_THROUGH_CACHE).")
    node_groups_exist: bool = Field(False, description="Set true once the first deploy has created the node "
                                    "groups. The template then leaves DesiredSize out of every pool that "
                                    "`infra.scale` sizes (GPU pools), so a later change to a node group's scaling "
                                    "config never resets a running gang to the created size (EKS API "
                                    "NodegroupScalingConfig: CloudFormation takes no action when DesiredSize is "
                                    "removed from the template; creating a group needs all of min, max and desired "
                                    "or none).")
    models_prefix: str = Field("models", pattern=r"^[A-Za-z0-9!_.*'()-]+(/[A-Za-z0-9!_.*'()-]+)*$", description="Key "
                               "prefix of the checkpoint bucket holding base models: both Pod Identity roles read "
                               "it and neither may write there (operators upload). Outside run_prefix.")
    data_prefix: str = Field("data", pattern=r"^[A-Za-z0-9!_.*'()-]+(/[A-Za-z0-9!_.*'()-]+)*$", description="Key "
                             "prefix of the checkpoint bucket holding datasets, read-only for both roles as "
                             "models_prefix is. Outside run_prefix.")
    trainer_runs: list[str] = Field(["dev"], min_length=1, description="The runs whose areas a trainer may write: "
                                    "run ids (RunConfig.run_id: the trainer writes runs/<run_id>/{policy,train,"
                                    "trainer,metrics,tensorboard}/), or a family ending in '*' ('grpo-*'); a bare '*' "
                                    "(every run) only in dev. Each entry gets a Pod Identity role and service account "
                                    "of its own (trainer_identities) that writes that entry's runs only, and the "
                                    "trainer of a run uses the entry that names it (trainer_service_account_of), so "
                                    "one run's credentials cannot overwrite another run's versions or training state; "
                                    "the runs of one family share theirs. A run no entry names is refused when its "
                                    "manifests are rendered: add it and deploy the cluster stack (IAM and Pod "
                                    "Identity only; no node changes).")
    fsx: FsxConfig = Field(FsxConfig(), description="The shared FSx for Lustre file system (off by default).")
    public_endpoint_cidrs: list[str] = Field([], description="Empty keeps the API endpoint private (reach it from "
                                             "inside the VPC); otherwise the endpoint is also public, open only to "
                                             "these CIDR blocks.")
    retain_data: bool = Field(True, description="Keep buckets and repositories when the stack is deleted "
                              "(required in prod).")

    @field_validator("trainer_runs")
    @classmethod
    def _runs(cls, v: list[str]) -> list[str]:
        for run in v:
            if run != "*" and not _RUN_ID_RE.fullmatch(run):
                raise ValueError(f"{run!r} is neither a run id (lower-case letters, digits, '-'; as RunConfig.run_id) "
                                 "nor such a prefix followed by '*'")
        return v

    @field_validator("admin_role_arns", "admin_principals")
    @classmethod
    def _arns(cls, v: list[str], info) -> list[str]:
        # access entries name roles; the admin role's trust policy may also name users
        kinds, what = ("role", "an IAM role ARN") if info.field_name == "admin_role_arns" else \
            ("role|user", "the ARN of an IAM role or user")
        for arn in v:
            if not re.match(rf"^arn:aws[a-z-]*:iam::\d{{12}}:({kinds})/[\w+=,.@/-]+$", arn):
                raise ValueError(f"{arn!r} is not {what}")
        return v

    @field_validator("pull_through_secrets")
    @classmethod
    def _secrets(cls, v: dict[str, str]) -> dict[str, str]:
        for upstream, arn in v.items():
            if not re.match(r"^arn:aws[a-z-]*:secretsmanager:[a-z0-9-]+:\d{12}:secret:ecr-pullthroughcache/[\w/+=.@-]+$", arn):
                raise ValueError(f"{upstream}: {arn!r} is not the ARN of a Secrets Manager secret named "
                                 "ecr-pullthroughcache/... (ECR reads pull-through credentials only from such secrets)")
        return v

    @field_validator("public_endpoint_cidrs")
    @classmethod
    def _cidrs(cls, v: list[str]) -> list[str]:
        for c in v:
            try:
                ipaddress.ip_network(c)
            except ValueError:
                raise ValueError(f"{c!r} is not a CIDR block") from None
        return v

    @field_validator("checkpoint_bucket", "artifacts_bucket", "logs_bucket")
    @classmethod
    def _bucket(cls, v: str) -> str:
        return check_bucket_name(v)

    @field_validator("vpc_cidr")
    @classmethod
    def _vpc_cidr(cls, v: str) -> str:
        try:
            net = ipaddress.IPv4Network(v)
        except ValueError as e:
            raise ValueError(f"{v!r} is not an IPv4 network ({e})") from None
        if not any(net.subnet_of(ipaddress.IPv4Network(r)) for r in VPC_PRIVATE_RANGES):
            raise ValueError(f"{v} is not inside a private range {list(VPC_PRIVATE_RANGES)}")
        lo, hi = VPC_PREFIXES
        if not lo <= net.prefixlen <= hi:
            raise ValueError(f"/{net.prefixlen}: a VPC's block is /{lo} to /{hi}")
        return v

    @model_validator(mode="before")
    @classmethod
    def _known_pools(cls, data: Any) -> Any:
        # Before the pools are validated: a misspelled name would otherwise read as a new pool
        # missing every required field.
        pools = data.get("pools") if isinstance(data, dict) else None
        if isinstance(pools, dict):
            for name in pools:
                if name not in POOL_NAMES:
                    raise ValueError(f"pools.{name}: not a pool; the pools are {list(POOL_NAMES)}")
        return data

    @field_validator("k8s_version")
    @classmethod
    def _k8s(cls, v: str) -> str:
        if tuple(int(x) for x in v.split(".")) < MIN_K8S_VERSION:
            raise ValueError(f"Kubernetes version {v} is below the minimum 1.31")
        line, listed = VOLCANO_KUBERNETES
        if v not in listed and v not in VOLCANO_UNLISTED_KUBERNETES:
            raise ValueError(f"Kubernetes {v}: Volcano {line} (infra/charts.py VOLCANO) lists {listed[0]}-{listed[-1]} "
                             f"in its compatibility matrix, and {v} is not among VOLCANO_UNLISTED_KUBERNETES")
        return v

    @field_validator("image_tag")
    @classmethod
    def _tag(cls, v: str) -> str:
        if v == "latest":
            raise ValueError("image_tag 'latest' cannot be used: ECR repositories have immutable tags")
        return v

    @model_validator(mode="after")
    def _rules(self) -> "DeploymentConfig":
        if set(self.pools) != set(POOL_NAMES):
            raise ValueError(f"pools must be exactly {list(POOL_NAMES)}, got {sorted(self.pools)}")
        for key, pool in self.pools.items():
            if pool.name != key:
                raise ValueError(f"pools.{key}: name is {pool.name!r}; it must equal its key")
            if pool.az is not None and pool.az != self.az:
                raise ValueError(
                    f"pools.{key}: az {pool.az} differs from the deployment az {self.az}; "
                    "every node group must use subnets of one AZ"
                )
        for name, az in [("az", self.az), *(("control_plane_azs", a) for a in self.control_plane_azs)]:
            if not az.startswith(self.region) or len(az) != len(self.region) + 1:
                raise ValueError(f"{name}: {az!r} is not an AZ of region {self.region}")
        if self.az not in self.control_plane_azs or len(set(self.control_plane_azs)) < 2:
            raise ValueError("control_plane_azs must hold two or more distinct AZs, including az")
        train = self.pools["train-gpu"]
        if train.capacity_type == "SPOT":
            raise ValueError(
                "pools.train-gpu: capacity_type SPOT is not allowed for training "
                "(use ON_DEMAND or CAPACITY_BLOCK; an interruption stops every trainer rank)"
            )
        if not train.gpu:
            raise ValueError("pools.train-gpu: instance types must have GPUs")
        if self.env != "dev" and any(ipaddress.ip_network(c).prefixlen == 0 for c in self.public_endpoint_cidrs):
            raise ValueError("public_endpoint_cidrs: an open API endpoint (/0) is allowed in dev only")
        if self.env != "dev" and not self.admin_role_arns:
            raise ValueError(f"admin_role_arns: {self.env} needs at least one IAM role with cluster-admin access "
                             "(the API endpoint is private; see docs/deploy-aws.md, 'Reaching the cluster')")
        if self.fsx.enabled:
            no_efa = [p for p in ("train-gpu", "rollout-gpu") if not self.pools[p].efa]
            if no_efa:
                raise ValueError(f"fsx.enabled: the file system admits Lustre from the EFA security group, which "
                                 f"only EFA pools carry; {no_efa} have efa off")
        if self.env != "dev" and "*" in self.trainer_runs:
            raise ValueError("trainer_runs: '*' (every run writable by every trainer) is allowed in dev only; "
                             "list the run ids, or families such as 'grpo-*'")
        if self.env == "prod" and not self.retain_data:
            raise ValueError("retain_data must be true in prod")
        prefixes = {"run_prefix": self.run_prefix, "models_prefix": self.models_prefix, "data_prefix": self.data_prefix}
        for a, pa in prefixes.items():
            for b, pb in prefixes.items():
                if a < b and (pa == pb or pa.startswith(pb + "/") or pb.startswith(pa + "/")):
                    raise ValueError(f"{a} {pa!r} and {b} {pb!r} overlap; the trainer writes under run_prefix only, "
                                     "so models and data need prefixes of their own")
        buckets = {"checkpoint_bucket": self.checkpoint_bucket, "artifacts_bucket": self.artifacts_bucket,
                   "logs_bucket": self.logs_bucket}
        names = list(buckets)
        for i, a in enumerate(names):
            for b in names[i + 1:]:
                if buckets[a] == buckets[b]:
                    raise ValueError(f"{b}: {buckets[b]!r} is also {a}; the storage stack creates each bucket, "
                                     "and S3 bucket names are unique")
        # Every control-plane AZ gets a public and a private subnet (infra/network.py), aligned as the CDK Vpc cuts them.
        vpc, end, azs = ipaddress.IPv4Network(self.vpc_cidr), 0, len(self.control_plane_azs)
        for mask in [PUBLIC_SUBNET_MASK] * azs + [PRIVATE_SUBNET_MASK] * azs:
            size = 2 ** (32 - mask)
            end = -(-end // size) * size + size
        if end > vpc.num_addresses:
            raise ValueError(f"vpc_cidr: {self.vpc_cidr} holds {vpc.num_addresses} addresses; a public /"
                             f"{PUBLIC_SUBNET_MASK} and a private /{PRIVATE_SUBNET_MASK} subnet in each of the "
                             f"{azs} control_plane_azs need {end}")
        if len(set(self.image_repos.values())) != 3:
            raise ValueError("image_repos: trainer, rollout and env need three distinct repositories")
        return self

    def image_uri(self, role: Literal["trainer", "rollout", "env"]) -> str:
        """ECR image URI of `role` at `image_tag`."""
        return f"{self.account}.dkr.ecr.{self.region}.amazonaws.com/{self.image_repos[role]}:{self.image_tag}"

    @property
    def name_prefix(self) -> str:
        """Stack and resource name prefix, e.g. 'moerl-dev'."""
        return f"moerl-{self.env}"

    def pod_role_name(self, role: Literal["trainer", "rollout"]) -> str:
        """IAM role name of a Pod Identity role (infra/cluster.py), e.g. 'moerl-prod-rollout'; named so
        that the bucket policies (infra/storage.py) can refer to it without a cross-stack cycle.
        The trainer's roles are per trainer_runs entry: this is their common prefix."""
        return f"{self.name_prefix}-{role}"

    def trainer_identity(self, entry: str) -> tuple[str, str]:
        """(IAM role name, service account name) of the trainer of trainer_runs entry `entry`:
        moerl-<env>-trainer-<h> and <trainer_service_account>-<h>, <h> the first 8 hex digits of the
        entry's SHA-256 (valid as a role name, at most 64 characters, and as a service account name
        for any entry; a '*' can be in neither)."""
        h = hashlib.sha256(entry.encode()).hexdigest()[:8]
        return f"{self.pod_role_name('trainer')}-{h}", f"{self.trainer_service_account}-{h}"

    @property
    def trainer_identities(self) -> dict[str, tuple[str, str]]:
        """trainer_runs entry -> trainer_identity(entry): the roles and associations the cluster stack makes."""
        return {entry: self.trainer_identity(entry) for entry in self.trainer_runs}

    def trainer_entry(self, run_id: str) -> str | None:
        """The trainer_runs entry that names `run_id`: the run id itself, else the longest family
        prefix ('grpo-*'), else '*'; None when no entry does."""
        if run_id in self.trainer_runs:
            return run_id
        families = [e for e in self.trainer_runs if e.endswith("*") and run_id.startswith(e[:-1])]
        return max(families, key=len) if families else None

    def trainer_service_account_of(self, run_id: str) -> str:
        """The service account of run `run_id`'s trainer: its trainer_runs entry's. A run no entry
        names gets the one it would have as an entry of its own, which has no Pod Identity
        association (and so no AWS credentials) until the run is added to trainer_runs and the
        cluster stack deployed."""
        return self.trainer_identity(self.trainer_entry(run_id) or run_id)[1]

    @property
    def boundary_arn(self) -> str:
        """The permissions boundary every role of the stacks carries (moerl-<env>-boundary; its
        document: infra/execution_policy.py boundary_policy, created with the execution policy)."""
        return f"arn:aws:iam::{self.account}:policy/{self.name_prefix}-boundary"

    @property
    def cache_prefixes(self) -> dict[str, str]:
        """Upstream registry URL -> ECR repository prefix of every pull-through cache rule of this deployment."""
        return {**PULL_THROUGH_CACHE, **{u: CREDENTIALED_CACHE[u] for u in self.pull_through_secrets}}

    def cached_image(self, ref: str) -> str:
        """`ref` through this account's ECR pull-through cache when its registry has a rule
        ('quay.io/prometheus/prometheus:v3' ->
        '<account>.dkr.ecr.<region>.amazonaws.com/quay/prometheus/prometheus:v3'; a Docker Hub
        official image 'docker.io/redis:7' -> '.../docker-hub/library/redis:7'); else unchanged."""
        host, _, rest = ref.partition("/")
        upstream = _REGISTRY_ALIASES.get(host, host)
        prefix = self.cache_prefixes.get(upstream)
        if not (prefix and rest):
            return ref
        if upstream == "registry-1.docker.io" and "/" not in rest:
            rest = f"library/{rest}"
        return f"{self.account}.dkr.ecr.{self.region}.amazonaws.com/{prefix}/{rest}"

    @property
    def default_admin_role_arn(self) -> str:
        """arn:aws:iam::<account>:role/moerl-<env>-admin, the role `create_admin_role` creates."""
        return f"arn:aws:iam::{self.account}:role/{self.name_prefix}-admin"

    @property
    def created_admin_roles(self) -> list[str]:
        """The admin_role_arns the cluster stack creates (see create_admin_role)."""
        return [a for a in self.admin_role_arns if self.create_admin_role and a == self.default_admin_role_arn]


def _pool(name: str, types: list[str], capacity: str, sizes: tuple[int, int, int], **kw: Any) -> dict:
    gpu = INSTANCE_TABLE[types[0]].gpus > 0
    labels = {POOL_LABEL: name}
    taints = []
    if name != "system":
        taints.append({"key": POOL_TAINT_KEY, "value": name, "effect": "NoSchedule"})
    if gpu:
        labels[ACCELERATOR_LABEL] = "nvidia"
        taints.append({"key": GPU_TAINT_KEY, "value": "present", "effect": "NoSchedule"})
    if kw.get("efa"):
        labels[EFA_LABEL] = "true"
    lo, want, hi = sizes
    if gpu:
        # Created empty (the stack does not wait for GPU capacity), scaled with `python -m infra.scale`;
        # every GPU type in INSTANCE_TABLE carries NVMe instance store: stripe it (nodeadm RAID0).
        kw = {"create_size": 0, "local_storage": "RAID0", **kw}
    return dict(name=name, instance_types=types, capacity_type=capacity, min_size=lo,
                desired_size=want, max_size=hi, labels=labels, taints=taints, **kw)


# Node counts per environment: (min, desired, max). prod is the reference deployment.
_SIZES = {
    "dev": {"train-gpu": (0, 0, 2), "rollout-gpu": (0, 0, 2), "env-cpu": (0, 1, 4), "buffer-mem": (1, 1, 1), "system": (2, 2, 3)},
    "staging": {"train-gpu": (0, 2, 2), "rollout-gpu": (0, 4, 8), "env-cpu": (1, 2, 8), "buffer-mem": (1, 1, 2), "system": (2, 2, 4)},
    "prod": {"train-gpu": (16, 16, 16), "rollout-gpu": (8, 32, 48), "env-cpu": (2, 8, 32), "buffer-mem": (1, 1, 2), "system": (2, 3, 6)},
}
_ACCOUNTS = {"dev": "111111111111", "staging": "222222222222", "prod": "333333333333"}


def default_config(env: str, account: str | None = None) -> dict:
    """The built-in defaults of `env` as a plain dict (validated by `load_config`).

    account: the AWS account (default: the env's placeholder); bucket names and the default
    admin role are built from it, so an override of `account` alone moves them along.
    """
    if env not in ENVS:
        raise ConfigError(f"env {env!r} is not one of {list(ENVS)}")
    s, region = _SIZES[env], "us-east-2"
    account = account if isinstance(account, str) else _ACCOUNTS[env]
    pools = {
        "train-gpu": _pool("train-gpu", ["p5en.48xlarge"], "ON_DEMAND", s["train-gpu"],
                           efa=True, placement_group=True, disk_size_gib=1024,
                           # libfabric's EFA provider registers its buffers in 2 MiB hugepages.
                           hugepages_2mi=5120),
        # Spot GPU types with the same EFA layout (32 network cards); p5en (16 cards) would need
        # a node group of its own.
        # 25 %: 32 rollout nodes are replaced in 4 rounds instead of 32; each round only lowers the
        # fleet's throughput (engines are independent, the buffer absorbs it).
        "rollout-gpu": _pool("rollout-gpu", ["p5e.48xlarge", "p5.48xlarge"], "SPOT",
                             s["rollout-gpu"], efa=True, disk_size_gib=512, max_unavailable_percent=25),
        "env-cpu": _pool("env-cpu", ["c7i.4xlarge", "c6i.4xlarge", "c7a.4xlarge", "c6a.4xlarge",
                                     "c5.4xlarge", "m7i.4xlarge"], "SPOT", s["env-cpu"]),
        "buffer-mem": _pool("buffer-mem", ["r7i.4xlarge", "r6i.4xlarge"], "ON_DEMAND", s["buffer-mem"]),
        "system": _pool("system", ["m7i.xlarge", "m6i.xlarge"], "ON_DEMAND", s["system"]),
    }
    return dict(
        env=env, account=account, region=region, az=f"{region}a",
        control_plane_azs=[f"{region}a", f"{region}b"],
        k8s_version=DEFAULT_K8S_VERSION, pools=pools,
        checkpoint_bucket=f"moerl-{env}-checkpoints-{account}",
        artifacts_bucket=f"moerl-{env}-artifacts-{account}",
        logs_bucket=f"moerl-{env}-access-logs-{account}",
        admin_role_arns=[] if env == "dev" else [f"arn:aws:iam::{account}:role/moerl-{env}-admin"],
        retain_data=env != "dev",
    )


def _merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
        out[k] = _merge(base[k], v) if isinstance(v, dict) and isinstance(base.get(k), dict) else v
    return out


def load_config(env: str, overrides: str | Path | None = None) -> DeploymentConfig:
    """Build and validate the config of `env` ("dev" | "staging" | "prod").

    overrides: optional YAML file whose mapping is merged over the built-in defaults.
    Raises ConfigError (one message naming the source and the field) on any broken rule.
    """
    if overrides is None:
        return validate_config(default_config(env), f"config {env}")
    path = Path(overrides)
    return config_from_mapping(env, _read_mapping(path), f"{path} (env {env})")


def config_parser(prog: str, description: str) -> argparse.ArgumentParser:
    """The argument parser of an infra/ command: ``--env`` and ``--config`` (as for ``cdk -c config=``)."""
    p = argparse.ArgumentParser(prog=prog, description=description)
    p.add_argument("--env", required=True)
    p.add_argument("--config", default=None, help="deployment overrides YAML, as for cdk -c config=")
    return p


def config_of_args(args: argparse.Namespace, prog: str) -> DeploymentConfig | None:
    """`load_config` of a `config_parser`'s arguments; None after one line on stderr, naming
    ``prog``, for a bad config (the command then exits 2)."""
    try:
        return load_config(args.env, args.config)
    except ConfigError as e:
        print(f"{prog}: {e}", file=sys.stderr)
        return None


def _read_mapping(path: Path) -> dict:
    try:
        over = load_yaml(path.read_text()) or {}
    except OSError as e:
        raise ConfigError(f"{path}: cannot read overrides: {e}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {yaml_error_line(e)}") from None
    if not isinstance(over, dict):
        raise ConfigError(f"{path}: overrides must be a YAML mapping")
    return over


def config_from_mapping(env: str, over: dict, source: str) -> DeploymentConfig:
    """Merge the mapping `over` over the defaults of `env` (built for `over`'s account) and validate."""
    if not isinstance(over, dict):
        raise ConfigError(f"{source}: overrides must be a mapping")
    if over.get("env", env) != env:
        raise ConfigError(f"{source}: env is {over['env']!r} but {env!r} was asked for")
    return validate_config(_merge(default_config(env, over.get("account")), over), source)


def load_pipeline_config(path: str | Path | None) -> tuple[PipelineConfig, list[DeploymentConfig]]:
    """Read the pipeline's YAML: `pipeline:` (PipelineConfig fields) and `environments:` (a mapping
    env -> overrides, as for a single environment). Every env of ENVS is deployed, in order.

    Raises ConfigError naming the file and the field: no file given, a missing pipeline account or
    connection, or an environment that still targets a placeholder account.
    """
    if path is None:
        raise ConfigError("-c env=pipeline needs -c config=<pipeline.yaml> with pipeline.account, "
                          "pipeline.connection_arn and environments.<env>.account (see docs/deploy-aws.md)")
    path = Path(path)
    data = _read_mapping(path)
    unknown = set(data) - {"pipeline", "environments"}
    if unknown:
        raise ConfigError(f"{path}: unknown keys {sorted(unknown)}; expected 'pipeline' and 'environments'")
    try:
        pcfg = PipelineConfig.model_validate(data.get("pipeline") or {})
    except ValidationError as e:
        raise ConfigError(f"{path}: pipeline.{error_line(e)}") from None
    envs = data.get("environments") or {}
    if not isinstance(envs, dict) or set(envs) - set(ENVS):
        raise ConfigError(f"{path}: environments must map some of {list(ENVS)} to overrides")
    configs = [config_from_mapping(e, envs.get(e) or {}, f"{path} (environments.{e})") for e in ENVS]
    for cfg in configs:
        if cfg.account in PLACEHOLDER_ACCOUNTS:
            raise ConfigError(f"{path}: environments.{cfg.env}.account: {cfg.account} is a placeholder of the "
                              "built-in defaults; give the account this stage deploys to")
    return pcfg, configs


def validate_config(data: dict, source: str = "config") -> DeploymentConfig:
    """Validate a plain dict; raise ConfigError with one message on failure."""
    try:
        return DeploymentConfig.model_validate(data)
    except ValidationError as e:
        raise ConfigError(f"{source}: {error_line(e)}") from None
