"""Workload sizes and images of one deployment, checked against the node pools before synth.

Pool names, labels, taints, instance types and sizes come from infra.config (declared once there);
this file holds only what the workloads add: how many pods of each role, the run configuration
they share, and the images. `load_workloads` applies every rule of issue 6 part 5 and raises one
`WorkloadError` naming the field before any manifest is written.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any, Literal

import yaml
from botocore.exceptions import BotoCoreError, ClientError
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from app.config import EngineProfile, RunConfig
from app.config_rules import error_line, load_yaml, strict_scalar, yaml_error_line
from app.layout import resolve_layout
from app.rollout.engine_args import EngineLayout
from app.storage import open_store
from infra.config import DeploymentConfig, NodePool

Role = Literal["trainer", "rollout", "env"]
# The run config synthesized when a workloads file names none (docs/cluster.md, "Recipes").
DEV_RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "dev-tiny-grpo.yaml"


class WorkloadError(ValueError):
    """A workload setting cannot run on the configured node pools; the message names the field."""


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")

    @field_validator("*", mode="before")
    @classmethod
    def _no_lax_scalars(cls, v: Any, info) -> Any:
        return strict_scalar(cls, v, info)


class TrainerSpec(_Model):
    """The gang of trainer pods: one pod per train-gpu node, every GPU of the node. Each pod requests
    every 2 MiB hugepage its node reserves: pools.train-gpu.hugepages_2mi (infra.config)."""

    nodes: int | None = Field(None, ge=1, description="Pods in the gang (None: the pool's max_size).")
    max_retries: int = Field(10, ge=0, description="Whole-gang restarts (each with --resume) before the job is "
                             "marked failed.")
    rdzv_port: int = Field(29500, ge=1024, le=65535, description="torchrun's c10d rendezvous port on trainer "
                           "replica 0.")


# Copies of the model on a rollout node's model volume: the base model (Hugging Face cache) and
# up to three policy versions (the worker keeps the served one and the one before it while the
# next downloads; app/rollout/worker.py `_download`).
MODEL_COPIES = 4
TMP_GI, CACHE_GI = 16, 32  # the engine's /tmp and JIT-cache (triton, flashinfer) volumes


class RolloutSpec(_Model):
    """Rollout engines: SGLang and the moerl rollout worker; the engine layout (TP/EP/DeepEP,
    nodes per engine) is the run config's ``rollout.engine`` profile."""

    replicas: int | None = Field(None, ge=1, description="Engines (None: the pool's desired_size // "
                                 "nodes_per_engine, at least 1). An engine of one node is one pod of a Deployment; "
                                 "one over several nodes is one LeaderWorkerSet group.")
    model_path: str | None = Field(None, description="The base policy SGLang loads at start and the trainer "
                                   "starts from (HF id, s3:// prefix or local path; also written to the mounted run "
                                   "config's model.path); None: the run config's model.path.")
    model_gib: float = Field(57.0, gt=0, description="Size of one checkpoint of that model, GiB (Qwen3-30B-A3B "
                             "in bf16: 57; DeepSeek-V3 in FP8: 642). The model volume holds `MODEL_COPIES` (4) of it "
                             "and must fit the node's local disk (instance-store NVMe where the type has it, else "
                             "the root volume).")
    model_quantization: Literal["fp8"] | None = Field(
        None, description="The served checkpoint's quantization_config.quant_method (None: bf16/fp32 weights). "
        "Policy versions carry unquantized weights, so an fp8 engine is refused (see `check`).")
    engine_port: int = Field(30000, ge=1024, le=65535, description="SGLang's HTTP port.")
    drain_margin_s: int = Field(15, ge=0, description="Added to rollout.drain_grace_s for the kubelet.")
    shm_gi: int = Field(64, ge=1, description="/dev/shm size limit, GiB (NCCL and CUDA IPC).")
    # The engine's startup probe budget (charts8s/rollout.py `startup_budget_s`): SGLang reads
    # the checkpoint from the node's disk, JIT-compiles its kernels (DeepGEMM) and captures CUDA
    # graphs before it answers; a Hub model it downloads first. Conservative figures for a
    # p5-class node (NVMe RAID0 read as safetensors are parsed; one S3/Hub stream per file).
    load_gib_per_s: float = Field(2.0, gt=0, description="Checkpoint read rate of SGLang's loader from local disk.")
    download_gib_per_s: float = Field(0.5, gt=0, description="Download rate of a Hub model by SGLang itself.")
    boot_s: int = Field(1200, ge=0, description="Kernel JIT, CUDA-graph capture and the rest of a start, seconds.")
    api_key_secret: str = Field("moerl-rollout-api-key", description="Secret with the SGLang keys (``api-key``, "
                                "``admin-api-key``) of engines over several nodes, which serve on the pod network; "
                                "made outside dist/ (docs/cluster.md).")
    # SGLang's router (run config rollout.router; charts8s/router.py).
    router_port: int = Field(30100, ge=1024, le=65535, description="The router's Service and container port.")
    router_metrics_port: int = Field(29000, ge=1024, le=65535, description="The router's Prometheus port.")


class EnvSpec(_Model):
    """The env pool's CPU pods: the run's environment over OpenEnv (`moerl env`) when the run
    config sets ``env.name``, else the task's verifier (`moerl reward --mode verifier`)."""

    replicas: int = Field(2, ge=1, description="Env pool pods.")
    cpu: int = Field(4, ge=1, description="vCPU per pod.")
    memory_gi: int = Field(8, ge=1, description="Memory per pod, GiB.")
    port: int = Field(8080, ge=1024, le=65535, description="The pods' and their Service's port.")


class RewardModelSpec(_Model):
    """GPU pods serving the learned reward model (`moerl reward`), deployed only when the run
    config names ``task.reward_model``. They run on the rollout-gpu pool, on nodes of their own."""

    replicas: int = Field(1, ge=1, description="Reward-model pods.")
    gpus: int = Field(1, ge=1, description="GPUs per pod.")
    port: int = Field(8080, ge=1024, le=65535, description="The pods' and their Service's port.")
    max_batch: int = Field(64, ge=1, description="Most sequences in one forward (`moerl reward --max-batch`).")
    models_gi: int = Field(200, ge=1, description="Scratch volume for a downloaded model, GiB.")


class BenchRolloutSpec(_Model):
    """`moerl bench rollout` in the cluster: per named profile, a fleet of ``engines`` SGLang
    engines (LeaderWorkerSet groups, serving on the pod network) and a Job that drives them with
    the run's prompts for ``seconds``. Two profiles (e.g. ``a2a``: kind ep, ``deepep``: kind
    ep-deepep) are the all-to-all vs DeepEP comparison; each renders to its own file."""

    profiles: dict[str, EngineProfile] = Field(description="Name -> engine profile (the run config's "
                                               "rollout.engine fields) of each fleet; one at the least.")
    engines: int = Field(2, ge=1, description="Engines of each fleet.")
    seconds: float = Field(600.0, gt=0, description="How long the Job drives each fleet.")
    concurrency: int | None = Field(None, ge=1, description="In-flight requests (prompt groups) per engine; None: "
                                    "the profile's in-flight sequences over rollout.group_size.")
    api_key_secret: str = Field("moerl-bench-api-key", description="Secret with the engines' SGLang keys "
                                "(``api-key``, ``admin-api-key``), made outside dist/ (docs/cluster.md).")

    @field_validator("profiles")
    @classmethod
    def _some_profile(cls, v: dict[str, EngineProfile]) -> dict[str, EngineProfile]:
        if not v:
            raise ValueError("no profile: name one or more (e.g. a2a: {kind: ep}), or leave bench_rollout out")
        return v


class FeedSpec(_Model):
    """The prompt source (`moerl feed`, charts8s/feed.py): one pod. With held-out evaluation
    (the run config's feed.eval_every > 0) it carries an engine and takes a rollout-gpu node of
    its own; without, it is a CPU pod beside the buffer."""

    eval_gpus: int | None = Field(None, ge=1, description="GPUs of the evaluation engine (its TP "
                                  "size); None: every GPU of a rollout node, as the rollout engines.")
    engine_port: int = Field(30000, ge=1024, le=65535, description="Port of the evaluation engine.")
    cpu: int = Field(2, ge=1, description="vCPU of the feed container.")
    memory_gi: int = Field(8, ge=1, description="Memory of the feed container (dataset, tokenizer).")


class BufferSpec(_Model):
    """The Redis experience buffer (one StatefulSet pod with an append-only file on a volume)."""

    storage_gi: int = Field(100, ge=1, description="The append-only file's volume, GiB.")
    memory_gi: int = Field(64, ge=1, description="Memory of the Redis container, GiB.")
    cpu: int = Field(4, ge=1, description="vCPU of the Redis container.")
    # 7.4.11: the 7.4 release that fixes the CVEs published since 7.4.2 (7.4.3: CVE-2025-21605;
    # 7.4.4/7.4.5: CVE-2025-27151; 7.4.6: CVE-2025-49844, -46817, -46818, -46819, Lua; 7.4.8: error
    # reply injection; 7.4.9: CVE-2026-23479, -25243, -23631; 7.4.10: stream RESTORE use-after-free;
    # 7.4.11: TLS pending-data use-after-free), pinned by the digest of its multi-arch index: a
    # role that may run Lua scripts (app/buffer/acl.py) must meet a patched server.
    image: str = Field("public.ecr.aws/docker/library/redis:7.4.11-alpine"
                       "@sha256:858f009f9709ce576febc734aa78b8f6d624b82571f9ddb6bda4377c833b3499",
                       description="The Redis image, by digest.")
    # The Prometheus exporter beside redis-server (charts8s/buffer.py). oliver006/redis_exporter's
    # release workflow pushes each tag to Docker Hub, ghcr.io and quay.io alike; ghcr.io has no
    # anonymous pull limit shared behind the cluster's NAT. Its scratch image holds the binary only.
    exporter_image: str = Field("ghcr.io/oliver006/redis_exporter:v1.88.0", description="The Redis exporter "
                                "sidecar's image.")
    password_secret: str = Field("moerl-redis-auth", description="Secret with the Redis passwords (``password`` "
                                 "of the default user, one per role's ACL user), made outside dist/ "
                                 "(docs/cluster.md).")


class Workloads(_Model):
    """Everything the charts add to the deployment config."""

    run_config: str | None = Field(str(DEV_RECIPE), description="Path of a RunConfig YAML (default: "
                                   "recipes/dev-tiny-grpo.yaml, the tiny recipe of `make run` on the cluster); the "
                                   "charts put the cluster addresses (buffer URL, engine URL, store URL) into it and "
                                   "mount it from one ConfigMap. Other recipes: recipes/*.yaml.")
    images: dict[Role, str] = Field({}, description="Full image reference per role, overriding the ECR repository "
                                    "of the deployment config (each must carry a tag or a digest).")
    trainer: TrainerSpec = Field(TrainerSpec(), description="The trainer gang.")
    rollout: RolloutSpec = Field(RolloutSpec(), description="The rollout engines and their workers.")
    env: EnvSpec = Field(EnvSpec(), description="The env pool.")
    reward_model: RewardModelSpec = Field(RewardModelSpec(), description="The reward-model pods (only with "
                                          "task.reward_model).")
    feed: FeedSpec = Field(FeedSpec(), description="The prompt source.")
    buffer: BufferSpec = Field(BufferSpec(), description="The Redis experience buffer.")
    bench_rollout: BenchRolloutSpec | None = Field(None, description="`moerl bench rollout` fleets and Jobs "
                                                   "(docs/engines.md, the A/B); None: none.")


class Plan:
    """Resolved, checked numbers the charts use (no further validation downstream).

    Attributes: cfg (DeploymentConfig), run (RunConfig as mounted), wl (Workloads), images
    (role -> reference), trainer_nodes, gpus_per_trainer (GPUs of one train-gpu node),
    efa_per_trainer, rollout_replicas (engines), engine (`EngineLayout` of rollout.engine),
    rollout_nodes (engines x nodes per engine), gpus_per_rollout (GPUs of one rollout-gpu
    node), efa_per_rollout.
    """

    def __init__(self, cfg: DeploymentConfig, wl: Workloads, run: RunConfig, read_store: bool = False):
        self.cfg, self.wl, self.run = cfg, wl, run
        self.read_store = read_store  # synth may read the served model's config.json from the store
        train, roll = cfg.pools["train-gpu"], cfg.pools["rollout-gpu"]
        self.gpus_per_trainer = _node_gpus(train)
        self.efa_per_trainer = train.efa_interfaces
        self.trainer_nodes = wl.trainer.nodes or train.max_size
        self.gpus_per_rollout = _node_gpus(roll)
        self.efa_per_rollout = roll.efa_interfaces
        self.engine = EngineLayout(run.rollout.engine, self.gpus_per_rollout)
        self.rollout_replicas = wl.rollout.replicas or max(roll.desired_size // self.engine.nodes, 1)
        self.images = {role: wl.images.get(role) or cfg.image_uri(role) for role in ("trainer", "rollout", "env")}

    @property
    def reward_model_gpus(self) -> int:
        """GPUs of the reward-model pods (0 when the run config names no reward model)."""
        return self.wl.reward_model.replicas * self.wl.reward_model.gpus if self.run.task.reward_model else 0

    @property
    def reward_model_nodes(self) -> int:
        """rollout-gpu nodes the reward-model pods need (they do not share a node with a rollout pod)."""
        if not self.run.task.reward_model:
            return 0
        per_node = self.gpus_per_rollout // self.wl.reward_model.gpus
        return -(-self.wl.reward_model.replicas // max(per_node, 1))

    @property
    def rollout_nodes(self) -> int:
        """rollout-gpu nodes the rollout engines take (one pod per node)."""
        return self.rollout_replicas * self.engine.nodes

    def bench_layouts(self) -> dict[str, EngineLayout]:
        """name -> `EngineLayout` of each `moerl bench rollout` profile (empty without bench_rollout)."""
        bench = self.wl.bench_rollout
        return {n: EngineLayout(p, self.gpus_per_rollout) for n, p in (bench.profiles.items() if bench else ())}

    @property
    def bench_nodes(self) -> int:
        """rollout-gpu nodes of every bench fleet together."""
        engines = self.wl.bench_rollout.engines if self.wl.bench_rollout else 0
        return sum(engines * lay.nodes for lay in self.bench_layouts().values())

    @property
    def models_volume_gib(self) -> int:
        """Size limit of a rollout pod's model volume: `MODEL_COPIES` checkpoints of model_gib."""
        return math.ceil(MODEL_COPIES * self.wl.rollout.model_gib)

    @property
    def feed_evaluates(self) -> bool:
        """The feed pod measures held-out reward (run config feed.eval_every > 0)."""
        return self.run.feed.eval_every > 0

    @property
    def feed_gpus(self) -> int:
        """GPUs of the feed pod's evaluation engine (0 without held-out evaluation)."""
        return (self.wl.feed.eval_gpus or self.gpus_per_rollout) if self.feed_evaluates else 0

    @property
    def feed_nodes(self) -> int:
        """rollout-gpu nodes the feed pod takes (it does not share one with a rollout pod)."""
        return 1 if self.feed_evaluates else 0

    @property
    def trainer_world_size(self) -> int:
        return self.trainer_nodes * self.gpus_per_trainer

    @property
    def namespace(self) -> str:
        return self.cfg.namespace

    def pool(self, name: str) -> NodePool:
        return self.cfg.pools[name]


def _node_gpus(pool: NodePool) -> int:
    # A pod asks for the GPUs of the smallest type so it fits on every type of the pool.
    return min(s.gpus for s in pool.specs)


# Hub checkpoints whose config.json declares block-scaled FP8 (quantization_config quant_method
# "fp8", weight_block_size [128, 128]): an engine serving one is fp8 without being told.
FP8_CHECKPOINTS = frozenset({"deepseek-ai/DeepSeek-V3", "deepseek-ai/DeepSeek-V3-0324", "deepseek-ai/DeepSeek-V3-Base",
                             "deepseek-ai/DeepSeek-R1", "deepseek-ai/DeepSeek-R1-0528", "deepseek-ai/DeepSeek-V3.1"})


def served_config(plan: "Plan") -> tuple[str, dict] | None:
    """(where, config.json) of the checkpoint the engines serve, read at synth where it can be:
    a local directory of this machine, or an s3:// prefix through the store with this machine's
    AWS credentials when ``plan.read_store`` (``charts8s.main --read-model-config``); None
    otherwise: synth calls neither the Hub nor, unasked, the store. What is checked instead: the
    Hub releases known to be FP8 by name (`FP8_CHECKPOINTS`), and at start the engine pods' copy
    of an s3:// model (``app.model.source --unquantized``) refuses a quantized config.json
    before SGLang starts.

    Raises:
        WorkloadError: the store was asked and refused, or config.json does not parse.
    """
    model = plan.wl.rollout.model_path or plan.run.model.path
    where = f"{model.rstrip('/')}/config.json"
    try:
        if model.startswith("s3://"):
            if not plan.read_store:
                return None
            text = open_store(model.rstrip("/")).get_bytes("config.json")
        elif Path(model).is_dir():
            text = (Path(model) / "config.json").read_bytes()
        else:
            return None
        return where, json.loads(text)
    except (OSError, ValueError, BotoCoreError, ClientError) as e:
        raise WorkloadError(f"{where}: cannot read the served model's config: {type(e).__name__}: {e}") from None


def engine_quantization(plan: "Plan") -> tuple[str, str] | None:
    """(field, method) when the rollout engines serve quantized weights: declared
    (rollout.model_quantization), asked of SGLang (--quantization in the profile's extra_args),
    carried by the served checkpoint's config.json (`served_config`: its quantization_config, as
    in a bf16 copy made by DeepSeek's fp8_cast_bf16.py, which keeps it), or a Hub checkpoint known
    to be FP8; None for unquantized engines."""
    wl = plan.wl.rollout
    if wl.model_quantization:
        return "rollout.model_quantization", wl.model_quantization
    extra = plan.run.rollout.engine.extra_args
    if "--quantization" in extra[:-1]:
        return "run config rollout.engine.extra_args", extra[extra.index("--quantization") + 1]
    model = wl.model_path or plan.run.model.path
    found = served_config(plan)
    if found and found[1].get("quantization_config"):
        where, config = found
        return f"{where} quantization_config", str(config["quantization_config"].get("quant_method", "quantized"))
    if model in FP8_CHECKPOINTS:
        return "rollout.model_path", "fp8"
    return None


# Where the deployment keeps what pods read (infra.config, declared once there): a recipe names a
# base model or dataset as s3://{checkpoint_bucket}/{models_prefix}/<name>, filled in at render.
STORE_FIELDS = ("checkpoint_bucket", "models_prefix", "data_prefix")


def fill_store_path(cfg: DeploymentConfig, value: str | None, field: str) -> str | None:
    """``value`` with the deployment config's `STORE_FIELDS` put in for ``{checkpoint_bucket}``,
    ``{models_prefix}`` and ``{data_prefix}`` (None and values without braces as they are).

    Raises:
        WorkloadError: another placeholder, or braces that do not parse, naming ``field``.
    """
    if value is None or "{" not in value:
        return value
    try:
        return value.format_map({k: getattr(cfg, k) for k in STORE_FIELDS})
    except (KeyError, ValueError, IndexError) as e:
        raise WorkloadError(f"{field}: {value!r}: {type(e).__name__} {e}; only "
                            f"{', '.join('{' + k + '}' for k in STORE_FIELDS)} are filled in (deployment config)") from None


def _check_store_reads(plan: Plan) -> None:
    """Raise WorkloadError unless the run's trainer may write its run's areas (trainer_runs) and
    every s3:// path the pods read at start lies where the storage layout keeps it, in the
    checkpoint bucket, where both Pod Identity roles read (infra/cluster.py): the base model under
    models_prefix/ (read-only, and linked by FSx), a JSONL dataset under data_prefix/ (read-only),
    or either under run_prefix/ (a run's published version, say)."""
    cfg, run = plan.cfg, plan.run
    if cfg.trainer_entry(run.run_id) is None:
        raise WorkloadError(
            f"run config run_id {run.run_id!r} is not covered by the deployment config's trainer_runs "
            f"{cfg.trainer_runs}: the trainer's first publish would be AccessDenied; add it (or a family such as "
            f"'{run.run_id.split('-')[0]}-*') to trainer_runs and deploy the cluster stack")
    model_field = "rollout.model_path" if plan.wl.rollout.model_path else "run config model.path"
    reads = ((model_field, plan.wl.rollout.model_path or run.model.path, cfg.models_prefix, "base models"),
             ("run config task.jsonl_path", run.task.jsonl_path, cfg.data_prefix, "datasets"))
    for field, url, prefix, kind in reads:
        want = f"s3://{cfg.checkpoint_bucket}/{prefix}/"
        if url and url.startswith("s3://") and not url.startswith((want, f"s3://{cfg.checkpoint_bucket}/{cfg.run_prefix}/")):
            raise WorkloadError(f"{field}: {url} is not under {want}, where the pods' roles read {kind} (read-only; "
                                "FSx links models_prefix/), nor under the run prefix: upload it there (deployment config "
                                "models_prefix, data_prefix)")


# OCI distribution-spec reference: lower-case repository path components, then a tag
# ([A-Za-z0-9_][A-Za-z0-9._-]{0,127}) or a digest; an optional registry host[:port] first.
_IMAGE_REF = re.compile(
    r"^(?:[a-zA-Z0-9.-]+(?::[0-9]+)?/)?[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
    r"(?:/[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*)*"
    r"(?::[A-Za-z0-9_][A-Za-z0-9._-]{0,127})?(?:@sha256:[a-f0-9]{64})?$"
)
# Kubernetes object names (Secrets included): a DNS-1123 subdomain.
_DNS1123 = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")


def _check_tag(role: str, ref: str, field: str | None = None) -> None:
    """Raise WorkloadError naming `field` (default images.<role>) unless `ref` is pinned."""
    field = field or f"images.{role}"
    if not _IMAGE_REF.fullmatch(ref):  # fullmatch: "$" alone accepts a trailing newline
        raise WorkloadError(f"{field}: {ref!r} is not a valid image reference (registry/repository:tag)")
    # A reference without ":tag" or "@sha256:" after the last "/" would pull "latest" (mutable).
    last = ref.rsplit("/", 1)[-1]
    if "@" in ref:
        return
    if ":" not in last or not last.split(":", 1)[1]:
        raise WorkloadError(f"{field}: image {ref!r} has no tag; give repository:tag or @sha256 digest")
    if last.split(":", 1)[1] == "latest":
        raise WorkloadError(f"{field}: image {ref!r} uses the mutable tag 'latest'; pin a version")


def _check_ports(plan: Plan) -> None:
    """Raise WorkloadError unless every fixed port is outside NCCL's range (the pods' ephemeral
    ports, charts8s/netpol.py) and the weight-update group's port is not torchrun's."""
    # charts8s.netpol loads cdk8s: the workloads document is read without it
    from charts8s.netpol import NCCL_PORTS, WEIGHT_GROUP_PORT

    wl = plan.wl
    group = plan.run.weight_sync.master_port or WEIGHT_GROUP_PORT
    ports = {"trainer.rdzv_port": wl.trainer.rdzv_port, "rollout.engine_port": wl.rollout.engine_port,
             "env.port": wl.env.port, "reward_model.port": wl.reward_model.port, "feed.engine_port": wl.feed.engine_port,
             "rollout.router_port": wl.rollout.router_port, "rollout.router_metrics_port": wl.rollout.router_metrics_port,
             "run config weight_sync.master_port": group}
    for field, port in ports.items():
        if NCCL_PORTS[0] <= port <= NCCL_PORTS[1]:
            raise WorkloadError(f"{field}={port} is inside NCCL's port range {NCCL_PORTS[0]}-{NCCL_PORTS[1]} "
                                "(the pods' ephemeral ports, charts8s/netpol.py); choose a port below it")
    if group == wl.trainer.rdzv_port:
        raise WorkloadError(f"run config weight_sync.master_port={group} is trainer.rdzv_port: the engines must "
                            "never reach torchrun's rendezvous")
    if wl.rollout.router_port == wl.rollout.router_metrics_port:  # one container serves both
        raise WorkloadError(f"rollout.router_port and rollout.router_metrics_port are both {wl.rollout.router_port}: "
                            "the router serves requests and metrics on two ports")


def check(plan: Plan) -> Plan:
    """Apply the capacity, EP and image rules; return `plan` or raise one WorkloadError.

    Rules: trainer nodes <= train-gpu max_size; trainer.parallel fits the trainer's GPUs (nodes x
    GPUs per node; app/layout.py); rollout engines x nodes per engine <= rollout-gpu max_size (one
    pod per node); each engine profile fits its nodes (`EngineLayout.check`), a DeepEP
    low-latency decode stays within its dispatch cap (`EngineLayout.check_dispatch`), DeepEP across
    nodes has EFA; the model volume fits a rollout node's local disk; env replicas fit the env-cpu
    pool's vCPUs at max_size; the engines serve unquantized weights, as the policy versions
    are (`engine_quantization`); every image has a tag or digest; a GPU pool has GPUs; with a reward
    model, its pods fit a rollout-gpu node and their nodes fit the pool beside the rollout pods.
    """
    cfg, wl = plan.cfg, plan.wl
    train, roll, env = cfg.pools["train-gpu"], cfg.pools["rollout-gpu"], cfg.pools["env-cpu"]
    for role, ref in plan.images.items():
        _check_tag(role, ref)
    _check_tag("buffer", wl.buffer.image, "buffer.image")
    if not re.search(r"@sha256:[a-f0-9]{64}$", wl.buffer.image):
        raise WorkloadError(f"buffer.image: {wl.buffer.image!r} has no @sha256 digest; a third-party image is "
                            "pinned by digest (a tag can be pushed again)")
    _check_tag("buffer", wl.buffer.exporter_image, "buffer.exporter_image")
    secrets = [("buffer.password_secret", wl.buffer.password_secret)]
    if plan.engine.nodes > 1:
        secrets.append(("rollout.api_key_secret", wl.rollout.api_key_secret))
    if wl.bench_rollout:
        secrets.append(("bench_rollout.api_key_secret", wl.bench_rollout.api_key_secret))
    for field, name in secrets:
        if not _DNS1123.fullmatch(name) or len(name) > 253:
            raise WorkloadError(f"{field}: {name!r} is not a valid Secret name (lower-case DNS-1123 subdomain)")
    _check_ports(plan)
    _check_store_reads(plan)
    if plan.trainer_nodes > train.max_size:
        raise WorkloadError(
            f"trainer.nodes={plan.trainer_nodes} exceeds pools.train-gpu.max_size={train.max_size}"
        )
    try:  # the trainer applies the same rule at start (app/layout.py)
        resolve_layout(plan.run.trainer.parallel, plan.trainer_world_size)
    except ValueError as e:
        raise WorkloadError(
            f"run config {e} ({plan.trainer_nodes} trainer nodes x {plan.gpus_per_trainer} GPUs)"
        ) from None
    if not roll.gpu:
        raise WorkloadError("pools.rollout-gpu has no GPU instance types")
    if plan.rollout_nodes > roll.max_size:
        per = "" if plan.engine.nodes == 1 else (
            f" engines x run config rollout.engine.nodes_per_engine={plan.engine.nodes} = {plan.rollout_nodes} nodes")
        raise WorkloadError(
            f"rollout.replicas={plan.rollout_replicas}{per} exceeds pools.rollout-gpu.max_size={roll.max_size} "
            "(one rollout pod per node)"
        )
    if not (wl.rollout.model_path or plan.run.model.path):
        raise WorkloadError("rollout.model_path: SGLang needs a checkpoint (HF id or directory); none given "
                            "and the run config's model.path is empty")
    quantized = engine_quantization(plan)
    if quantized:
        # SGLang copies an update's tensors into the engine's parameters as they are: bf16 into
        # fp8 ones, keeping the checkpoint's weight_scale_inv (default_weight_loader), so the
        # engine would serve wrong weights without an error.
        field, method = quantized
        raise WorkloadError(
            f"{field}: the rollout engines would serve {method} weights, but policy versions carry "
            f"{plan.run.model.dtype} tensors without scales, which SGLang loads into {method} parameters under the "
            "checkpoint's old scales; serve an unquantized copy of the base model (e.g. a bf16 conversion under "
            "the run's bucket) and give its size as rollout.model_gib")
    layouts = {"run config rollout.engine": plan.engine}
    layouts.update({f"bench_rollout.profiles.{n}": lay for n, lay in plan.bench_layouts().items()})
    smallest_gpu = min(s.gpu_memory_gib for s in roll.specs) if roll.gpu else 0
    for where, layout in layouts.items():
        try:
            layout.check(where)
            layout.check_dispatch(smallest_gpu, where)
        except ValueError as e:
            raise WorkloadError(str(e)) from None
        if layout.nodes > 1 and layout.profile.kind == "ep-deepep" and not roll.efa:
            raise WorkloadError(f"{where}: DeepEP across {layout.nodes} nodes needs EFA: pools.rollout-gpu.efa is off")
    if plan.wl.bench_rollout:
        for name in plan.wl.bench_rollout.profiles:
            if not _DNS1123.fullmatch(name) or "." in name or len(name) > 40:
                raise WorkloadError(f"bench_rollout.profiles: {name!r} is not a short DNS-1123 label (it names objects)")
        if plan.bench_nodes > roll.max_size:
            raise WorkloadError(f"bench_rollout: {plan.bench_nodes} engine nodes exceed pools.rollout-gpu.max_size="
                                f"{roll.max_size}")
    # The weights must fit the engine's GPUs with room left for the KV cache (SGLang's default
    # --mem-fraction-static is about 0.8-0.9 of GPU memory for weights plus KV cache).
    smallest = min(roll.specs, key=lambda s: s.gpu_memory_gib)
    gpu_gib = plan.engine.gpus * smallest.gpu_memory_gib
    if wl.rollout.model_gib > 0.8 * gpu_gib:
        raise WorkloadError(
            f"rollout.model_gib={wl.rollout.model_gib} does not fit an engine of {plan.engine.gpus} x "
            f"{smallest.gpu_memory_gib} GiB GPUs (pools.rollout-gpu's smallest) with room for the KV cache; "
            "raise rollout.engine.nodes_per_engine or use larger GPUs")
    local = min(s.instance_store_gib or roll.disk_size_gib for s in roll.specs)
    disk = "instance-store NVMe" if all(s.instance_store_gib for s in roll.specs) else "local disk"
    if plan.models_volume_gib + TMP_GI + CACHE_GI > local:
        raise WorkloadError(
            f"rollout.model_gib={wl.rollout.model_gib}: the model volume ({MODEL_COPIES} copies, "
            f"{plan.models_volume_gib} GiB) and scratch ({TMP_GI + CACHE_GI} GiB) exceed the {local} GiB {disk} of a "
            "rollout-gpu node")
    if plan.run.task.reward_model:
        rm = wl.reward_model
        if rm.gpus > plan.gpus_per_rollout:
            raise WorkloadError(f"reward_model.gpus={rm.gpus} exceeds the {plan.gpus_per_rollout} GPUs of a rollout-gpu node")
        if plan.rollout_nodes + plan.reward_model_nodes > roll.max_size:
            raise WorkloadError(
                f"reward_model.replicas={rm.replicas} needs {plan.reward_model_nodes} rollout-gpu node(s) beside "
                f"{plan.rollout_replicas} rollout pods; pools.rollout-gpu.max_size={roll.max_size}"
            )
    if plan.feed_evaluates:
        if plan.feed_gpus > plan.gpus_per_rollout:
            raise WorkloadError(f"feed.eval_gpus={plan.feed_gpus} exceeds the {plan.gpus_per_rollout} GPUs of a rollout-gpu node")
        used = plan.rollout_nodes + plan.bench_nodes + plan.reward_model_nodes + plan.feed_nodes
        if used > roll.max_size:
            raise WorkloadError(
                f"the feed pod's held-out evaluation (run config feed.eval_every={plan.run.feed.eval_every}) needs a "
                f"rollout-gpu node beside {plan.rollout_nodes} rollout-engine node(s) and {plan.reward_model_nodes} "
                f"reward-model node(s): {used} > pools.rollout-gpu.max_size={roll.max_size}"
            )
    per_node = min(s.vcpus for s in env.specs) // (wl.env.cpu + 1)  # 1 vCPU left to the kubelet and daemons
    if wl.env.replicas > env.max_size * per_node:
        raise WorkloadError(
            f"env.replicas={wl.env.replicas} exceeds the env-cpu pool's capacity: {env.max_size} nodes x "
            f"{per_node} pods of {wl.env.cpu} vCPU"
        )
    mem = min(s.memory_gib for s in cfg.pools["buffer-mem"].specs)
    if wl.buffer.memory_gi >= mem:
        raise WorkloadError(f"buffer.memory_gi={wl.buffer.memory_gi} does not fit a buffer-mem node ({mem} GiB)")
    return plan


def load_workloads(cfg: DeploymentConfig, path: str | Path | None = None, read_store: bool = False) -> Plan:
    """Read the workload YAML (None: built-in defaults) and the run config it names; check both.
    ``read_store``: read the served model's config.json from the store (`served_config`).

    Raises:
        WorkloadError: unreadable file, unknown or invalid field, or a broken rule (see `check`);
            the message names the file and the field.
    """
    data: dict = {}
    source = "workloads (defaults)"
    if path is not None:
        source = str(path)
        try:
            data = load_yaml(Path(path).read_text()) or {}
        except OSError as e:
            raise WorkloadError(f"{path}: cannot read workloads: {e}") from None
        except yaml.YAMLError as e:
            raise WorkloadError(f"{path}: not valid YAML: {yaml_error_line(e)}") from None
    try:
        wl = Workloads.model_validate(data)
    except ValidationError as e:
        raise WorkloadError(f"{source}: {error_line(e)}") from None
    try:
        run = RunConfig.load(wl.run_config) if wl.run_config else RunConfig()
    except (OSError, ValueError) as e:
        raise WorkloadError(f"{source}: run_config: {e}") from None
    try:
        run.model.path = fill_store_path(cfg, run.model.path, "run config model.path")
        run.task.jsonl_path = fill_store_path(cfg, run.task.jsonl_path, "run config task.jsonl_path")
        wl.rollout.model_path = fill_store_path(cfg, wl.rollout.model_path, "rollout.model_path")
    except WorkloadError as e:
        raise WorkloadError(f"{source}: {e}") from None
    if cfg.fsx.enabled and not (cfg.fsx.file_system_id and cfg.fsx.mount_name):  # the deployment config's, not this file's
        raise WorkloadError(f"deployment config (env {cfg.env}): fsx.file_system_id and fsx.mount_name: fsx.enabled "
                            "needs both, from the storage stack's outputs FsxFileSystemId and FsxMountName (after its "
                            "deploy)")
    try:
        return check(Plan(cfg, wl, run, read_store))
    except WorkloadError as e:
        raise WorkloadError(f"{source}: {e}") from None
