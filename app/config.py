"""The run configuration: one typed document that every role reads.

The embedded default builds it in code (`RunConfig()`); in the cluster the same document is
mounted from a ConfigMap as YAML and read with `RunConfig.load(path)`. Unknown keys are errors,
so a typo in a field name fails at start with the field's path instead of being ignored.

Each section belongs to the package that uses it; add a field to your own section only.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator


class Section(BaseModel):
    """Base of every config section: unknown keys are rejected."""

    model_config = ConfigDict(extra="forbid", frozen=False, allow_inf_nan=False)


class ParallelConfig(Section):
    """The trainer's parallel layout (the rule: app/layout.py; torchtitan's ParallelDims).

    World = dp_replicate x dp_shard ranks. Non-expert parameters are FSDP2-sharded over
    dp_shard; experts are split over ``ep`` ranks and FSDP2-sharded over dp_shard / ep.
    """

    ep: int = Field(1, ge=1, description="Expert-parallel degree; must divide dp_shard and the experts.")
    ep_backend: Literal["auto", "local", "alltoall", "deepep"] = Field(
        "auto", description="Token dispatcher of the MoE layers (app/model/dispatch/).")
    dp_shard: int = Field(-1, ge=-1, description="FSDP shard degree; -1: world / dp_replicate.")
    dp_replicate: int = Field(1, ge=1, description="HSDP replicas of the sharded model.")

    @field_validator("dp_shard")
    @classmethod
    def _shard_not_zero(cls, v: int) -> int:
        if v == 0:
            raise ValueError("must be >= 1, or -1 for world / dp_replicate")
        return v


class RouterConfig(Section):
    """Router settings used in MoE RL (see app/model/router.py).

    routing_replay: deprecated alias of ``rollout.routing_replay`` (where the engine is asked for
    the routed experts); a run config that sets it here turns that on.
    """

    aux_loss_coef: float = Field(0.0, ge=0.0, description="Load-balancing loss weight; 0 for RL.")
    bias_update_rate: float = Field(0.0, ge=0.0, description="Aux-loss-free bias update; off.")
    routing_replay: bool = False


class ModelConfig(Section):
    """The policy: a preset built in code or a Hugging Face checkpoint directory."""

    preset: Literal["tiny-qwen3-moe", "tiny-deepseek-v3"] = "tiny-qwen3-moe"
    path: str | None = Field(None, description="Base checkpoint: a local HF directory, an s3:// "
                             "prefix or a Hugging Face Hub id (owner/name); overrides preset.")
    cache_dir: str = Field("runs/model-cache", description="Node-local directory where an s3:// or "
                           "Hub model.path is downloaded (once per host; app/model/source.py).")
    dtype: Literal["float32", "bfloat16"] = Field(
        "float32", description="Compute and published dtype. Master weights and optimizer state "
        "are always float32; bfloat16 computes in bf16 and reduces gradients in fp32.")


class BufferConfig(Section):
    """Experience buffer and task queue (Redis Streams)."""

    redis_url: str = "redis://127.0.0.1:6379/0"
    run_prefix: str = "moerl"
    max_staleness: int = Field(1, ge=0, description="Policy versions a sample may lag.")
    stale_policy: Literal["drop", "requeue"] = "drop"
    capacity_groups: int = Field(64, ge=1, description="Finished groups held before back-pressure.")
    lease_ms: int = Field(60_000, ge=100, description="A task lease expires after this idle time.")
    max_failures: int = Field(3, ge=1, description="Failed rollouts of one task (a reward or environment "
                              "call that raised, timed out or answered malformed) before it is dropped, "
                              "counted in failed_dropped; never trained.")


# In-flight sequences per data-parallel attention rank of an SGLang engine when the profile
# sets no max_running_requests: the slime DeepSeek-R1 recipe runs 128 per DP rank
# (THUDM/slime scripts, --sglang-server-concurrency 1024 over 8 ranks).
SEQUENCES_PER_DP_RANK = 128


class EngineProfile(Section):
    """The layout of one rollout engine (an SGLang server, possibly spanning nodes).

    Profiles (SGLang 0.5.23 server arguments, ``sglang/srt/arg_groups/fields/``):
      - ``tp``: tensor parallel over every GPU of the engine (``--tp-size``);
      - ``ep``: expert parallel with SGLang's own all-to-all (``--ep-size``,
        ``--moe-a2a-backend none``);
      - ``ep-deepep``: expert parallel through DeepEP (``--moe-a2a-backend deepep``,
        ``--deepep-mode``); SGLang then requires ``ep_size == tp_size``.
    Sizes left at None are derived where the GPUs are known (charts8s: the node's GPUs x
    ``nodes_per_engine``): tp_size = every GPU, ep_size = tp_size for the EP profiles.
    ``extra_args`` are appended verbatim (each flag is still checked against SGLang's own
    argument definitions in the tests).
    """

    kind: Literal["tp", "ep", "ep-deepep"] = "tp"
    nodes_per_engine: int = Field(1, ge=1, description="Nodes one engine spans (LeaderWorkerSet group size).")
    tp_size: int | None = Field(None, ge=1, description="--tp-size; None: every GPU of the engine.")
    ep_size: int | None = Field(None, ge=1, description="--ep-size of the ep profiles; None: tp_size.")
    attn_dp_size: int = Field(1, ge=1, description="--attn-dp-size (data-parallel attention ranks).")
    enable_dp_lm_head: bool = Field(False, description="--enable-dp-lm-head (with attn_dp_size > 1).")
    moe_dense_tp_size: int | None = Field(None, ge=1, description="--moe-dense-tp-size.")
    moe_runner_backend: str | None = Field(None, description="--moe-runner-backend, e.g. deep_gemm.")
    deepep_mode: Literal["auto", "normal", "low_latency"] = Field("auto", description="--deepep-mode (ep-deepep).")
    max_running_requests: int | None = Field(None, ge=1, description="--max-running-requests (built-in: "
                                             "--max-batch); also the worker's default in-flight sequences.")
    chunked_prefill_size: int | None = Field(None, description="--chunked-prefill-size (-1 disables).")
    mem_fraction_static: float | None = Field(None, gt=0.0, lt=1.0, description="--mem-fraction-static.")
    extra_args: list[str] = Field(default_factory=list, description="More SGLang flags, appended as given.")

    @model_validator(mode="after")
    def _own_rules(self) -> "EngineProfile":
        # Rules that need the GPUs (sizes dividing each other, DeepEP's ep == tp) are checked
        # where they are known: app.rollout.engine_args.EngineLayout.check.
        if self.kind == "tp" and self.ep_size not in (None, 1):
            raise ValueError(f"ep_size={self.ep_size} needs kind 'ep' or 'ep-deepep' (kind is 'tp')")
        if self.enable_dp_lm_head and self.attn_dp_size == 1:
            raise ValueError("enable_dp_lm_head needs attn_dp_size > 1 (it splits the LM head over DP attention)")
        return self

    def default_inflight_sequences(self) -> int:
        """Sequences a worker keeps in flight on one engine: ``max_running_requests`` when set,
        else `SEQUENCES_PER_DP_RANK` x ``attn_dp_size``."""
        return self.max_running_requests or SEQUENCES_PER_DP_RANK * self.attn_dp_size


class RolloutConfig(Section):
    """Rollout workers and their engine."""

    engine_url: str = "http://127.0.0.1:30000"
    engine: EngineProfile = EngineProfile()
    group_size: int = Field(8, ge=1, description="G completions per prompt (GRPO group).")
    max_new_tokens: int = Field(32, ge=1)
    temperature: float = Field(1.0, gt=0.0)
    publish_every_groups: int = Field(1, ge=1, description="Groups per published portion.")
    drain_grace_s: float = Field(30.0, gt=0.0, description="SIGTERM drain budget, seconds.")
    request_timeout_s: float = Field(60.0, gt=0.0)
    reward_timeout_s: float = Field(5.0, gt=0.0)
    reward_threads: int = Field(8, ge=1, description="Threads running reward functions (shared pool).")
    reward_warmup_timeout_s: float = Field(
        300.0, gt=0.0, description="The reward function's (or environment's) warm-up before the first "
        "lease: imports, verifier set-up, the env server's health; the worker exits if it fails.")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling mass.")
    inflight_sequences: int | None = Field(
        None, ge=1, description="Sequences a worker keeps in flight on its engine (whole groups of "
        "group_size); None: engine.default_inflight_sequences().")
    engine_retries: int = Field(3, ge=0, description="Retries of a failed engine request (not of weight updates).")
    retry_backoff_s: float = Field(0.5, gt=0.0, description="First retry backoff; doubles.")
    policy_poll_s: float = Field(2.0, gt=0.0, description="Seconds between policy-version checks.")
    weight_update_timeout_s: float = Field(300.0, gt=0.0, description="One engine weight load.")
    pause_mode: Literal["abort", "retract", "in_place"] = Field(
        "retract", description="SGLang /pause_generation mode around a weight update (the worker "
        "waits for its own requests first, so none is cut either way).")
    routing_replay: bool = Field(False, description="Ask the engine for the experts each token was "
                                 "routed to and store them with every sample (R3).")
    policy_cache_dir: str = Field("runs/policy-cache", description="Local copies of policy versions.")
    reward_fn: str = Field("app.envs.rewards:score", description="module:attr of score(task, text).")
    truncated_reward: float | None = Field(
        0.0, description="Reward of a completion cut at max_new_tokens (None: score it normally)."
    )
    reward_url: str = Field("http://127.0.0.1:8080", description="`moerl reward` server; used when "
                            "task.reward_model is set.")

    def inflight_tasks(self) -> int:
        """Prompt groups a worker generates at once: the in-flight sequences in whole groups (>= 1)."""
        sequences = self.inflight_sequences or self.engine.default_inflight_sequences()
        return max(1, sequences // self.group_size)


class TrainerConfig(Section):
    """GRPO or PPO trainer (app/trainer/)."""

    algorithm: Literal["grpo", "ppo"] = "grpo"
    parallel: ParallelConfig = ParallelConfig()
    micro_batch_tokens: int | None = Field(
        None, ge=1, description="Padded tokens per micro-batch (whole sequences, packed by length; "
        "gradient accumulation). None: one micro-batch per rank and step.")
    activation_checkpointing: Literal["none", "full", "selective"] = Field(
        "none", description="Per decoder layer: none, full (recompute everything) or selective "
        "(keep the dispatch/combine outputs, recompute the rest).")
    logprob_chunk_tokens: int = Field(
        4096, ge=1, description="Completion tokens per chunk of the LM head + log-softmax; no "
        "[B, L, V] fp32 tensor is ever built.")
    # PPO (algorithm: ppo): critic, GAE and value loss (app/trainer/ppo.py, critic.py).
    gamma: float = Field(1.0, ge=0.0, le=1.0, description="PPO discount per token.")
    gae_lambda: float = Field(0.95, ge=0.0, le=1.0, description="PPO GAE lambda.")
    whiten_advantages: bool = Field(True, description="PPO: normalise advantages over the batch.")
    value_clip: float | None = Field(0.2, gt=0.0, description="PPO value-loss clip range; None disables.")
    critic_path: str | None = Field(None, description="HF checkpoint of the critic trunk; None: a copy "
                                    "of the policy's trunk.")
    critic_lr: float | None = Field(None, gt=0.0, description="Critic AdamW lr; None: trainer.lr.")
    steps: int = Field(60, ge=1)
    groups_per_step: int = Field(8, ge=1)
    lr: float = Field(1e-5, gt=0.0)
    lr_warmup_steps: int = Field(10, ge=0, description="Linear lr warm-up; early Adam steps are noisy.")
    adam_betas: tuple[float, float] = (0.9, 0.99)

    @field_validator("adam_betas")
    @classmethod
    def _betas_in_range(cls, v: tuple[float, float]) -> tuple[float, float]:
        if not all(0.0 <= b < 1.0 for b in v):
            raise ValueError(f"each beta must be in [0, 1), got {list(v)}")
        return v
    weight_decay: float = Field(0.0, ge=0.0)
    grad_clip: float = Field(1.0, gt=0.0)
    clip_eps_low: float = Field(0.2, ge=0.0)
    clip_eps_high: float = Field(0.28, ge=0.0)
    kl_coef: float = Field(0.0, ge=0.0)
    scale_by_std: bool = True
    loss_agg: Literal["token-mean", "seq-mean"] = "token-mean"
    tis_cap: float | None = Field(2.0, gt=0.0, description="Truncated IS cap; None disables.")
    publish_every: int = Field(1, ge=1, description="Steps between policy versions.")
    keep_versions: int = Field(3, ge=1)
    batch_timeout_s: float = Field(600.0, gt=0.0, description="Max wait for one step's groups.")
    max_bad_steps: int = Field(3, ge=1, description="Non-finite steps in a row before stopping.")
    log_entropy: bool = Field(True, description="Token entropy metric; one extra [B,L,V] pass.")
    save_every: int = Field(1, ge=1, description="Steps between saved training states. Taken groups "
                            "leave Redis only at a save: capacity_groups must hold save_every + 1 steps.")
    keep_states: int = Field(2, ge=1, description="Complete training states kept in the store.")


class WeightSyncConfig(Section):
    """How policy versions reach the engines (protocol: app/trainer/weight_sync.py).

    ``store``: every version goes to the object store and each rollout worker downloads it and
    has its engine load it from disk. ``network``: the trainer also pushes every version to the
    registered engines over a torch.distributed group (SGLang's weight-update routes), and every
    ``store_every``-th version (and the first and last) still goes to the store, ``latest``
    last: the durable copy engines that start or miss a push load from. The trainer and the
    rollout workers both read this section, so their timeouts agree.
    """

    mode: Literal["store", "network"] = "store"
    store_every: int = Field(1, ge=1, description="network: versions between store copies (1: every one).")
    bucket_bytes: int = Field(512 * 1024**2, ge=1, description="Most bytes one broadcast carries (a bucket); "
                              "a single larger tensor travels alone. Miles' default is 512 MiB.")
    backend: Literal["auto", "gloo", "nccl"] = Field(
        "auto", description="Group backend: auto is nccl when the trainer runs on CUDA, else gloo.")
    master_address: str | None = Field(None, description="Address engines reach the trainer's source rank "
                                       "at; None: $POD_IP, else this host's name resolved.")
    master_port: int = Field(0, ge=0, le=65535, description="Rendezvous port on the source rank (0: a free one).")
    trainer_host: str | None = Field(None, description="Host name (or address) of the trainer's source rank "
                                     "as the rollout workers resolve it: a push record whose master_address "
                                     "resolves elsewhere (or whose master_port is not master_port, when set) is "
                                     "refused and no engine joins. None: master_address, else this host's name.")
    ready_timeout_s: float = Field(30.0, gt=0.0, description="How long the trainer waits for engines to "
                                   "pause for a push; those not ready are left out of it.")
    timeout_s: float = Field(120.0, gt=0.0, description="Bound of the group's join and of each bucket "
                             "(every live rank fails the push after it, none hangs).")
    poll_s: float = Field(0.2, gt=0.0, description="How often a rollout worker reads the push record.")
    engine_ttl_s: float = Field(15.0, gt=0.0, description="A registration not renewed for this long is ignored.")


class TaskConfig(Section):
    """Where prompts and rewards come from, and the supervised warm-up of the tiny policy.

    Defaults are the recipe proven to be learnable on one CPU core (see app/envs/__init__.py):
    reasoning-gym ``spell_backward`` on 3-6 letter words, compact prompts ``word=``.
    """

    source: Literal["reasoning-gym", "jsonl"] = "reasoning-gym"
    name: str = Field("spell_backward", description="reasoning-gym dataset name.")
    params: dict[str, Any] = Field(
        default_factory=lambda: {"min_word_len": 3, "max_word_len": 6},
        description="Config fields of the reasoning-gym dataset (difficulty).",
    )
    jsonl_path: str | None = Field(None, description='JSONL of {"prompt","answer"} rows (source jsonl).')
    seed: int = 0
    train_size: int = Field(2000, ge=1)
    eval_size: int = Field(200, ge=1, description="Held-out prompts for evaluation.")
    warmup_steps: int = Field(150, ge=1, description="Supervised warm-up steps (moerl warmup).")
    warmup_lr: float = Field(3e-3, gt=0.0, description="Peak AdamW lr of the warm-up (cosine to 10%).")
    warmup_batch_size: int = Field(64, ge=1)
    reward_model: str | None = Field(None, description="HF sequence-classification checkpoint that scores "
                                     "completions (`moerl reward`) instead of the task's verifier.")
    verify_timeout_s: float = Field(4.0, gt=0.0, description="Deadline of one math-verify call (source "
                                    "jsonl), seconds: it runs in a worker process that is killed after it, "
                                    "and the reward counts as failed (app/envs/process_pool.py).")


class EnvConfig(Section):
    """Multi-turn environments served over OpenEnv's protocol (app/envs/openenv_server.py).

    With ``name`` set, rollout workers run episodes against the environment server at ``url``
    (`moerl env`; the env pool's Service in the cluster) instead of scoring single completions:
    generate, send the action, append the observation, generate again, up to ``max_turns`` or
    done (app/rollout/episodes.py). ``name`` None keeps the single-turn verifier path.
    """

    name: Literal["spell-retry", "calculator"] | None = Field(
        None, description="Environment served to the workers (app/envs/environments.py); None: single-turn.")
    url: str = Field("http://127.0.0.1:8090", description="Base URL of the `moerl env` server (ws://.../ws).")
    max_turns: int = Field(3, ge=1, description="Policy turns per episode at most.")
    step_timeout_s: float = Field(10.0, gt=0.0, description="Wait for one reset/step answer, seconds.")
    episode_timeout_s: float = Field(120.0, gt=0.0, description="The server closes an episode's session "
                                     "(WebSocket) this long after it opened.")
    max_sessions: int = Field(256, ge=1, description="Concurrent episodes one env server holds.")
    attempts: int = Field(2, ge=1, description="spell-retry: answers accepted, the first and each retry after feedback.")


class FeedConfig(Section):
    """The prompt source and the cluster's held-out evaluator (`moerl feed`, app/feed.py)."""

    low_water: int | None = Field(None, ge=1, description="Queue more prompt groups when fewer "
                                  "than this wait; None: 4 x trainer.groups_per_step.")
    poll_s: float = Field(1.0, gt=0.0, description="Seconds between queue checks.")
    eval_every: int = Field(0, ge=0, description="Policy versions between held-out evaluations "
                            "through the feeder's engine (0: none); the final version is always "
                            "measured when > 0.")
    eval_samples: int = Field(4, ge=1, description="Completions per held-out prompt (sampled "
                              "at rollout.temperature).")


def _describe(e: ValidationError) -> str:
    """A pydantic error as 'invalid run config' plus one line per field path."""
    lines = [f"{'.'.join(map(str, err['loc'])) or '(run config)'}: {err['msg']}" for err in e.errors()]
    return "invalid run config:\n  " + "\n  ".join(lines)


class RunConfig(Section):
    """Everything one run needs, shared by the trainer, rollout workers and the buffer."""

    run_id: str = Field("dev", pattern=r"^[a-z0-9][a-z0-9-]{0,62}$")
    store_url: str = Field("file://runs/store", description="file:// or s3:// root of artifacts.")
    router: RouterConfig = RouterConfig()
    model: ModelConfig = ModelConfig()
    buffer: BufferConfig = BufferConfig()
    rollout: RolloutConfig = RolloutConfig()
    trainer: TrainerConfig = TrainerConfig()
    task: TaskConfig = TaskConfig()
    env: EnvConfig = EnvConfig()
    feed: FeedConfig = FeedConfig()
    weight_sync: WeightSyncConfig = WeightSyncConfig()

    @model_validator(mode="before")
    @classmethod
    def _moved_fields(cls, data: Any) -> Any:
        if isinstance(data, dict) and "ep" in data:
            raise ValueError("ep: the trainer's EP settings moved to trainer.parallel "
                             "(ep.size -> trainer.parallel.ep, ep.backend -> trainer.parallel.ep_backend)")
        return data

    @model_validator(mode="after")
    def _cross_field_rules(self) -> "RunConfig":
        t = self.trainer
        need = (t.save_every + 1) * t.groups_per_step
        if self.buffer.capacity_groups < need:
            raise ValueError(
                f"buffer.capacity_groups={self.buffer.capacity_groups} must be >= (trainer.save_every + 1) "
                f"* trainer.groups_per_step = {need}: taken groups stay in Redis until the next save"
            )
        if self.router.routing_replay:  # the deprecated spelling: one switch, read from rollout
            self.rollout.routing_replay = True
        if self.env.name and self.rollout.routing_replay:
            raise ValueError("rollout.routing_replay: not supported with env.name (multi-turn episodes) yet")
        if self.env.name and self.feed.eval_every:
            raise ValueError("feed.eval_every: the feed's held-out evaluation scores single completions; with "
                             "env.name it is not supported yet (moerl run evaluates episodes in process)")
        if self.env.name and t.algorithm == "ppo":
            # GAE (app/trainer/ppo.py) stops at masked tokens: it would not carry the episode's
            # reward back across the environment's observations to earlier turns.
            raise ValueError("trainer.algorithm=ppo: not supported with env.name (multi-turn episodes) yet; use grpo")
        if t.algorithm == "ppo" and t.loss_agg != "token-mean":
            raise ValueError(f"trainer.loss_agg={t.loss_agg!r}: PPO's per-token advantages need 'token-mean'")
        return self

    def validated(self) -> "RunConfig":
        """This config validated again (after fields were set in code).

        Raises:
            ValueError: a field or a cross-field rule is violated (field path named).
        """
        try:
            return type(self).model_validate(self.model_dump())
        except ValidationError as e:
            raise ValueError(_describe(e)) from None

    @classmethod
    def load(cls, path: str | os.PathLike) -> "RunConfig":
        """Read a YAML run configuration.

        Raises:
            FileNotFoundError: the file does not exist.
            ValueError: the YAML does not parse or a field is invalid; the message names the
                file and the field path (e.g. ``trainer.lr``).
        """
        path = Path(path)
        if path.is_dir():
            raise ValueError(f"{path}: is a directory, not a run config file")
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            raise ValueError(f"{path}: not a text (UTF-8) YAML file") from None
        try:
            data = yaml.safe_load(text) or {}
        except yaml.YAMLError as e:
            raise ValueError(f"{path}: not valid YAML: {e}") from None
        try:
            return cls.model_validate(data)
        except ValidationError as e:
            raise ValueError(f"{path}: {_describe(e)}") from None

    def save(self, path: str | os.PathLike) -> None:
        """Write this configuration as YAML atomically (temporary name, then rename)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
        with os.fdopen(fd, "w") as f:
            yaml.safe_dump(self.model_dump(mode="json"), f, sort_keys=False)
        os.replace(tmp, path)
