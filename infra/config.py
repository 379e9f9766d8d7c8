"""Typed deployment configuration for dev, staging and prod (shared by infra/ and charts8s/).

Node pools (name, labels, taints, instance types, capacity type, sizes) are declared here once;
the CDK stacks build node groups from them and the cdk8s charts build node selectors and
tolerations from the same objects. Defaults are built in code (`default_config(env)`); an
optional YAML file overrides any field (nested mappings merge key by key, lists replace).

Every rule is checked when the config is loaded, so a bad config fails before any synth work
with one message that names the field: `ConfigError`.
"""

from __future__ import annotations

import ipaddress
import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

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

POOL_NAMES: tuple[str, ...] = ("train-gpu", "rollout-gpu", "env-cpu", "buffer-mem", "system")
MIN_K8S_VERSION = (1, 31)

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


class Taint(Model):
    """A Kubernetes node taint, applied by the node group and tolerated by the pods of the pool."""

    key: str
    value: str
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"]


class NodePool(Model):
    """One EKS managed node group (the rollout pool may become several; see infra/cluster.py).

    disk_size_gib: gp3 root volume size in GiB (set in the launch template).
    efa: attach EFA interfaces on every network card of the instance type (from INSTANCE_TABLE).
    placement_group: launch into a cluster placement group (training only).
    capacity_reservation_id: On-Demand Capacity Reservation or Capacity Block id (cr-...).
    hugepages_2mi: MiB of 2 MiB hugepages reserved on every node at boot (launch-template user
        data sets vm.nr_hugepages before the kubelet starts); a multiple of 2, 0 for none. The
        trainer pod (one per train-gpu node) requests all of them as hugepages-2Mi (charts8s).
    az: leave empty; every pool must run in the deployment's single AZ (validated).
    """

    name: str
    instance_types: list[str] = Field(min_length=1)
    capacity_type: Literal["ON_DEMAND", "SPOT", "CAPACITY_BLOCK"]
    min_size: int = Field(ge=0)
    max_size: int = Field(ge=1)
    desired_size: int = Field(ge=0)
    labels: dict[str, str]
    taints: list[Taint] = []
    disk_size_gib: int = Field(100, ge=20, le=16384)
    efa: bool = False
    placement_group: bool = False
    capacity_reservation_id: str | None = Field(None, pattern=r"^cr-[0-9a-f]{8,17}$")
    hugepages_2mi: int = Field(0, ge=0)
    az: str | None = None

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
        if self.capacity_type == "CAPACITY_BLOCK" and not self.capacity_reservation_id:
            raise ValueError(f"pool {self.name!r}: CAPACITY_BLOCK needs capacity_reservation_id")
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
        """EFA interfaces per node: the fewest network cards over the pool's types (0 if efa is off).

        One launch template serves every type of a node group, and an interface on a network card
        the type lacks fails the launch, so a mixed pool uses the common count.
        """
        return min(s.efa_interfaces for s in self.specs) if self.efa else 0


class PipelineConfig(Model):
    """Where the promotion pipeline runs and which repository it builds."""

    account: str = Field("111111111111", pattern=r"^\d{12}$")
    region: str = "us-east-2"
    repository: str = Field("moerl-org/moerl", pattern=r"^[\w.-]+/[\w.-]+$")
    branch: str = "main"
    connection_arn: str = Field(
        "arn:aws:codeconnections:us-east-2:111111111111:connection/00000000-0000-0000-0000-000000000000",
        pattern=r"^arn:aws:(codestar-connections|codeconnections):",
    )


class DeploymentConfig(Model):
    """Everything one environment's stacks and charts need.

    az: the ONE availability zone of every node group.
    control_plane_azs: subnets for the EKS control plane (two or more, including `az`).
    run_prefix: key prefix in the checkpoint bucket under which runs live (Pod Identity scope).
    image_repos: ECR repository name per image role (trainer, rollout, env).
    admin_role_arns: IAM roles given cluster-admin through EKS access entries.
    public_endpoint_cidrs: empty keeps the API endpoint private (reach it from inside the VPC);
        otherwise the endpoint is also public, open only to these CIDR blocks.
    retain_data: keep buckets and repositories when the stack is deleted (required in prod).
    """

    env: Env
    account: str = Field(pattern=r"^\d{12}$")
    region: str = Field(pattern=r"^[a-z]{2}(-gov)?-[a-z]+-\d$")
    az: str
    control_plane_azs: list[str] = Field(min_length=2)
    vpc_cidr: str = "10.0.0.0/16"
    k8s_version: str = Field(pattern=r"^1\.\d+$")
    pools: dict[str, NodePool]
    checkpoint_bucket: str
    artifacts_bucket: str
    logs_bucket: str
    namespace: str = Field("moerl", pattern=r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")
    trainer_service_account: str = "moerl-trainer"
    rollout_service_account: str = "moerl-rollout"
    run_prefix: str = Field("runs", pattern=r"^[A-Za-z0-9!_.*'()-]+(/[A-Za-z0-9!_.*'()-]+)*$")
    image_repos: dict[Literal["trainer", "rollout", "env"], str] = {
        "trainer": "moerl/trainer",
        "rollout": "moerl/rollout",
        "env": "moerl/env",
    }
    image_tag: str = Field("0.1.0", pattern=r"^[\w][\w.-]{0,127}$")
    admin_role_arns: list[str] = []
    public_endpoint_cidrs: list[str] = []
    retain_data: bool = True

    @field_validator("admin_role_arns")
    @classmethod
    def _arns(cls, v: list[str]) -> list[str]:
        for arn in v:
            if not re.match(r"^arn:aws[a-z-]*:iam::\d{12}:role/[\w+=,.@/-]+$", arn):
                raise ValueError(f"{arn!r} is not an IAM role ARN")
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

    @field_validator("k8s_version")
    @classmethod
    def _k8s(cls, v: str) -> str:
        if tuple(int(x) for x in v.split(".")) < MIN_K8S_VERSION:
            raise ValueError(f"Kubernetes version {v} is below the minimum 1.31")
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
        if self.env == "prod" and not self.retain_data:
            raise ValueError("retain_data must be true in prod")
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
    return dict(name=name, instance_types=types, capacity_type=capacity, min_size=lo,
                desired_size=want, max_size=hi, labels=labels, taints=taints, **kw)


# Node counts per environment: (min, desired, max). prod is the reference deployment.
_SIZES = {
    "dev": {"train-gpu": (0, 0, 2), "rollout-gpu": (0, 0, 2), "env-cpu": (0, 1, 4), "buffer-mem": (1, 1, 1), "system": (2, 2, 3)},
    "staging": {"train-gpu": (0, 2, 2), "rollout-gpu": (0, 4, 8), "env-cpu": (1, 2, 8), "buffer-mem": (1, 1, 2), "system": (2, 2, 4)},
    "prod": {"train-gpu": (16, 16, 16), "rollout-gpu": (8, 32, 48), "env-cpu": (2, 8, 32), "buffer-mem": (1, 1, 2), "system": (2, 3, 6)},
}
_ACCOUNTS = {"dev": "111111111111", "staging": "222222222222", "prod": "333333333333"}


def default_config(env: str) -> dict:
    """The built-in defaults of `env` as a plain dict (validated by `load_config`)."""
    if env not in ENVS:
        raise ConfigError(f"env {env!r} is not one of {list(ENVS)}")
    s, account, region = _SIZES[env], _ACCOUNTS[env], "us-east-2"
    pools = {
        "train-gpu": _pool("train-gpu", ["p5en.48xlarge"], "ON_DEMAND", s["train-gpu"],
                           efa=True, placement_group=True, disk_size_gib=1024,
                           # libfabric's EFA provider registers its buffers in 2 MiB hugepages.
                           hugepages_2mi=5120),
        # Spot GPU types of one family share an EFA layout; p5en's 16 cards set the common count.
        "rollout-gpu": _pool("rollout-gpu", ["p5en.48xlarge", "p5e.48xlarge", "p5.48xlarge"], "SPOT",
                             s["rollout-gpu"], efa=True, disk_size_gib=512),
        "env-cpu": _pool("env-cpu", ["c7i.4xlarge", "c6i.4xlarge", "c7a.4xlarge", "c6a.4xlarge",
                                     "c5.4xlarge", "m7i.4xlarge"], "SPOT", s["env-cpu"]),
        "buffer-mem": _pool("buffer-mem", ["r7i.4xlarge", "r6i.4xlarge"], "ON_DEMAND", s["buffer-mem"]),
        "system": _pool("system", ["m7i.xlarge", "m6i.xlarge"], "ON_DEMAND", s["system"]),
    }
    return dict(
        env=env, account=account, region=region, az=f"{region}a",
        control_plane_azs=[f"{region}a", f"{region}b"],
        k8s_version="1.33", pools=pools,
        checkpoint_bucket=f"moerl-{env}-checkpoints-{account}",
        artifacts_bucket=f"moerl-{env}-artifacts-{account}",
        logs_bucket=f"moerl-{env}-access-logs-{account}",
        retain_data=env != "dev",
    )


def _merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
        out[k] = _merge(base[k], v) if isinstance(v, dict) and isinstance(base.get(k), dict) else v
    return out


def _error_text(err: ValidationError) -> str:
    parts = []
    for e in err.errors():
        loc = ".".join(str(x) for x in e["loc"])
        msg = e["msg"].removeprefix("Value error, ")
        parts.append(f"{loc}: {msg}" if loc else msg)
    return "; ".join(parts)


def load_config(env: str, overrides: str | Path | None = None) -> DeploymentConfig:
    """Build and validate the config of `env` ("dev" | "staging" | "prod").

    overrides: optional YAML file whose mapping is merged over the built-in defaults.
    Raises ConfigError (one message naming the source and the field) on any broken rule.
    """
    data = default_config(env)
    source = f"config {env}"
    if overrides is not None:
        path = Path(overrides)
        source = f"{path} (env {env})"
        try:
            over = yaml.safe_load(path.read_text()) or {}
        except (OSError, yaml.YAMLError) as e:
            raise ConfigError(f"{path}: cannot read overrides: {e}") from None
        if not isinstance(over, dict):
            raise ConfigError(f"{path}: overrides must be a YAML mapping")
        if over.get("env", env) != env:
            raise ConfigError(f"{path}: env is {over['env']!r} but {env!r} was asked for")
        data = _merge(data, over)
    return validate_config(data, source)


def validate_config(data: dict, source: str = "config") -> DeploymentConfig:
    """Validate a plain dict; raise ConfigError with one message on failure."""
    try:
        return DeploymentConfig.model_validate(data)
    except ValidationError as e:
        raise ConfigError(f"{source}: {_error_text(e)}") from None
