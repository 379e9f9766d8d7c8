"""The run configuration: one typed document that every role reads.

The embedded default builds it in code (`RunConfig()`); in the cluster the same document is
mounted from a ConfigMap as YAML and read with `RunConfig.load(path)`. Unknown keys are errors,
so a typo in a field name fails at start with the field's path instead of being ignored.

Each section belongs to the package that uses it; add a field to your own section only.
"""

from __future__ import annotations

import math
import os
import re
import tempfile
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from app.config_rules import error_line, load_yaml, strict_scalar, yaml_error_line

# The --policy choices of SGLang's router (rollout.router_policy; app/rollout/router.py runs it).
ROUTER_POLICIES = ("cache_aware", "power_of_two", "round_robin", "random")


class Section(BaseModel):
    """Base of every config section: unknown keys are rejected, and so is a bool where a number
    is wanted (pydantic would read ``publish_every: true`` as 1) and anything but true or false
    where a bool is (pydantic would read ``"yes"``, ``"off"`` or ``1`` as one)."""

    model_config = ConfigDict(extra="forbid", frozen=False, allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _no_lax_scalars(cls, v: Any, info) -> Any:
        return strict_scalar(cls, v, info)


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
    """Router settings used in MoE RL (see app/model/router.py)."""

    aux_loss_coef: float = Field(0.0, ge=0.0, description="Load-balancing loss weight; 0 for RL.")
    bias_update_rate: float = Field(0.0, ge=0.0, description="Aux-loss-free bias update; off.")
    routing_replay: bool = Field(False, description="Deprecated alias of rollout.routing_replay (where the engine "
                                 "is asked for the routed experts); a run config that sets it here turns that on.")


class ModelConfig(Section):
    """The policy: a preset built in code or a Hugging Face checkpoint directory."""

    preset: Literal["tiny-qwen3-moe", "tiny-deepseek-v3", "gpu-qwen3-moe"] = Field(
        "tiny-qwen3-moe", description="The model built in code when path is None (app/model/config.py): the tiny "
        "ones for the CPU, gpu-qwen3-moe (424 M parameters) for one GPU.")
    path: str | None = Field(None, description="Base checkpoint: a local HF directory, an s3:// "
                             "prefix or a Hugging Face Hub id (owner/name); overrides preset.")
    cache_dir: str = Field("runs/model-cache", description="Node-local directory where an s3:// or "
                           "Hub model.path is downloaded (once per host; app/model/source.py).")
    dtype: Literal["float32", "bfloat16"] = Field(
        "float32", description="Compute and published dtype. Master weights and optimizer state "
        "are always float32; bfloat16 computes in bf16 and reduces gradients in fp32.")


class BufferConfig(Section):
    """Experience buffer and task queue (Redis Streams)."""

    redis_url: str = Field("redis://127.0.0.1:6379/0", description="The buffer's Redis: redis://, rediss:// or "
                           "unix:// (charts8s sets the buffer Service's; `moerl run` its own redis-server's).")
    run_prefix: str = Field("moerl", description="First part of every Redis key of the run, "
                            "{run_prefix}:{run_id}:... (app/buffer/keys.py).")
    max_staleness: int = Field(1, ge=0, description="Policy versions a sample may lag.")
    stale_policy: Literal["drop", "requeue"] = Field("drop", description="A group older than max_staleness: "
                                                     "drop (count and discard it) or requeue (discard it and queue "
                                                     "its task again).")
    capacity_groups: int = Field(64, ge=1, description="Back-pressure: finished groups the trainer has not "
                                 "taken yet plus leased tasks (taken groups wait in Redis for the next save "
                                 "without counting); fewer while an engine lags so far that more would be "
                                 "trained over max_staleness. At least trainer.groups_per_step.")
    lease_ms: int = Field(60_000, ge=100, description="A task lease expires after this idle time.")
    max_failures: int = Field(3, ge=1, description="Failed rollouts of one task (a reward or environment "
                              "call that raised, timed out or answered malformed) before it is dropped, "
                              "counted in failed_dropped; never trained.")

    @field_validator("redis_url")
    @classmethod
    def _redis_scheme(cls, v: str) -> str:
        # The schemes redis-py's Redis.from_url reads; anything else fails only when a role connects.
        parts = urlsplit(v)
        if parts.scheme not in ("redis", "rediss", "unix") or not (parts.hostname or parts.path.strip("/")):
            raise ValueError(f"{v!r} is not a redis://, rediss:// or unix:// URL, e.g. redis://127.0.0.1:6379/0")
        return v


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

    kind: Literal["tp", "ep", "ep-deepep"] = Field("tp", description="tp, ep (SGLang's all-to-all) or ep-deepep "
                                                  "(DeepEP), as above.")
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
    cuda_graph_max_bs: int | None = Field(None, ge=1, description="--cuda-graph-max-bs-decode (requests per "
                                          "attention-DP rank in the largest decode CUDA graph); ep-deepep "
                                          "profiles get max_running_requests / attn_dp_size when None.")
    deepep_max_dispatch_tokens: int | None = Field(
        None, ge=1, le=1024, description="SGLANG_DEEPEP_NUM_MAX_DISPATCH_TOKENS_PER_RANK of ep-deepep profiles: the "
        "tokens one rank may send in a low-latency dispatch (DeepEP's own bound is 1024); None: the decode "
        "batch per rank, at least SGLang's default 128 (app/rollout/engine_args.py).")
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


# An import path package.module:attr (rollout.reward_fn; env.name for a class of the user's).
IMPORT_PATH = re.compile(r"^[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*:[A-Za-z_][\w]*$")

# The lowest sampling temperature. Logits are divided by it: at 1e-45 (a subnormal) any logit
# above 3.4e-7 becomes inf in float32 and bfloat16 (max 3.4e38) and the softmax NaN; at 1e-6 a
# logit must pass 3.4e32 to overflow. SGLang decodes greedily below the same 1e-6
# (sglang/srt/sampling/sampling_params.py, _SAMPLING_EPS), so nothing lower is a temperature.
MIN_TEMPERATURE = 1e-6


class RolloutConfig(Section):
    """Rollout workers and their engine."""

    engine_url: str = Field("http://127.0.0.1:30000", description="The worker's own engine (charts8s sets it).")
    engine: EngineProfile = Field(EngineProfile(), description="The engine's layout (docs/engines.md).")
    group_size: int = Field(8, ge=1, description="G completions per prompt (GRPO group).")
    max_new_tokens: int = Field(32, ge=1, description="Most tokens of a completion (of each turn in an episode).")
    temperature: float = Field(1.0, ge=MIN_TEMPERATURE, description="Sampling temperature; at least "
                               "MIN_TEMPERATURE, below which logits / temperature overflow.")
    publish_every_groups: int = Field(1, ge=1, description="Groups per published portion.")
    drain_grace_s: float = Field(30.0, gt=0.0, description="SIGTERM drain budget, seconds.")
    request_timeout_s: float = Field(60.0, gt=0.0, description="Deadline of one HTTP request to the engine, "
                                     "seconds.")
    reward_timeout_s: float = Field(5.0, gt=0.0, description="Deadline of one reward call, seconds; a timeout "
                                    "fails the group (never a training signal).")
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
    flush_timeout_s: float = Field(30.0, gt=0.0, description="How long the worker retries /flush_cache "
                                   "(a second apart) on a paused engine before a weight update; still "
                                   "refused, the update waits for the next poll with the weights untouched.")
    pause_mode: Literal["abort", "retract", "in_place"] = Field(
        "retract", description="SGLang /pause_generation mode around a weight update (the worker "
        "waits for its own requests first, so none is cut either way).")
    router: bool = Field(False, description="Send /generate through SGLang's router (app/rollout/router.py) "
                         "to any engine instead of the worker's own; control calls still go to the own engine. "
                         "Needs pause_mode abort. Off by default: on the 2-core VM it did not reliably pay "
                         "(bench/results/rollout-router.md); engines that own a GPU each are where it should.")
    router_url: str = Field("", description="The router's base URL (the cluster's router Service; `moerl run` "
                            "starts one and passes it); used when router is on.")
    router_policy: Literal[ROUTER_POLICIES] = Field(
        "cache_aware", description="The router's --policy.")
    routing_replay: bool = Field(False, description="Ask the engine for the experts each token was "
                                 "routed to and store them with every sample (R3).")
    partial_rollout: bool = Field(
        False, description="At a weight update, abort the worker's in-flight generations (SGLang "
        "/abort_request) instead of waiting for them, keep each one's tokens and logprobs with their "
        "weight version, and resume it on the new weights (Miles/slime --partial-rollout); the sample "
        "records its version segments and is as stale as its oldest token. Off: every sequence comes "
        "from one version, the update waits for them to finish.")
    policy_cache_dir: str = Field("runs/policy-cache", description="Local copies of policy versions.")
    reward_fn: str = Field("app.envs.rewards:score", description="package.module:attr of score(task, text), "
                           "importable where the workers run (moerl run checks it before it starts).")
    overlong_reward: float | None = Field(
        0.0, description="A fixed overlong penalty: the reward of a completion cut at max_new_tokens, "
        "in place of the verifier's (None: score it normally). Not DAPO's overlong filtering "
        "(trainer.overlong_filter) nor its soft penalty (trainer.overlong_buffer_tokens)."
    )
    reward_url: str = Field("http://127.0.0.1:8080", description="`moerl reward` server; used when "
                            "task.reward_model is set.")
    reward_range: tuple[float, float] = Field(
        (0.0, 1.0), description="[low, high] of the rewards the verifier, rollout.reward_fn or the environment "
        "may give, both paths alike: a reward outside it fails its group (never trained, counted with its "
        "reason). Declare a wider range here to train on one, e.g. [-1, 10].")

    @field_validator("reward_fn")
    @classmethod
    def _reward_fn_is_an_import_path(cls, v: str) -> str:
        if not IMPORT_PATH.match(v):
            raise ValueError(f"{v!r} is not an import path package.module:attr, e.g. app.envs.rewards:score")
        return v

    @field_validator("reward_range")
    @classmethod
    def _range_ordered(cls, v: tuple[float, float]) -> tuple[float, float]:
        if not v[0] < v[1]:
            raise ValueError(f"[{v[0]:g}, {v[1]:g}]: low must be below high")
        return v

    def reward_in_range(self, reward: float) -> bool:
        """Whether ``reward`` is a finite number within ``reward_range``."""
        return math.isfinite(reward) and self.reward_range[0] <= reward <= self.reward_range[1]

    def reward_range_text(self) -> str:
        return f"rollout.reward_range [{self.reward_range[0]:g}, {self.reward_range[1]:g}]"

    @model_validator(mode="before")
    @classmethod
    def _renamed_fields(cls, data: Any) -> Any:
        if isinstance(data, dict) and "truncated_reward" in data:
            raise ValueError("truncated_reward was renamed rollout.overlong_reward (a fixed reward for a "
                             "completion cut at max_new_tokens)")
        return data

    @model_validator(mode="after")
    def _router_aborts(self) -> "RolloutConfig":
        # A paused engine behind the router also holds other workers' requests: retract or in_place
        # would resume them on the new weights (two versions in one sequence); abort ends them and
        # their workers send them again (app/rollout/router.py).
        if self.router and self.pause_mode != "abort":
            given = "pause_mode" in self.model_fields_set
            raise ValueError(f"rollout.pause_mode must be abort with rollout.router on (got {self.pause_mode!r}"
                             f"{'' if given else ', the default: set rollout.pause_mode: abort'}): a paused "
                             "engine would resume requests other workers routed to it on the new weights")
        return self

    def inflight_tasks(self) -> int:
        """Prompt groups a worker generates at once: the in-flight sequences in whole groups (>= 1)."""
        sequences = self.inflight_sequences or self.engine.default_inflight_sequences()
        return max(1, sequences // self.group_size)


class TrainerConfig(Section):
    """GRPO or PPO trainer (app/trainer/)."""

    algorithm: Literal["grpo", "ppo"] = Field("grpo", description="grpo (group advantages) or ppo (a critic "
                                              "and GAE).")
    parallel: ParallelConfig = Field(ParallelConfig(), description="The trainer's layout: EP, FSDP shard, HSDP "
                                     "replicas (app/layout.py).")
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
    steps: int = Field(60, ge=1, description="Optimizer steps of the run.")
    groups_per_step: int = Field(8, ge=1, description="GRPO groups trained per step (the batch).")
    lr: float = Field(1e-5, gt=0.0, description="AdamW learning rate.")
    lr_warmup_steps: int = Field(10, ge=0, description="Linear lr warm-up; early Adam steps are noisy.")
    adam_betas: tuple[float, float] = Field((0.9, 0.99), description="AdamW betas, each in [0, 1).")

    @field_validator("adam_betas")
    @classmethod
    def _betas_in_range(cls, v: tuple[float, float]) -> tuple[float, float]:
        if not all(0.0 <= b < 1.0 for b in v):
            raise ValueError(f"each beta must be in [0, 1), got {list(v)}")
        return v
    weight_decay: float = Field(0.0, ge=0.0, description="AdamW weight decay.")
    grad_clip: float = Field(1.0, gt=0.0, description="Gradients clipped to this global norm.")
    clip_eps_low: float = Field(0.2, ge=0.0, description="Clipped surrogate: ratios below 1 - this are clipped.")
    clip_eps_high: float = Field(0.28, ge=0.0, description="Clipped surrogate: ratios above 1 + this are clipped "
                                 "(DAPO's clip-higher).")
    kl_coef: float = Field(0.0, ge=0.0, description="Weight of the k3 KL penalty against a frozen reference "
                           "policy; 0: no reference policy.")
    scale_by_std: bool = Field(True, description="Divide advantages by the group's reward std (false: Dr. GRPO).")
    loss_agg: Literal["token-mean", "seq-mean", "seq-mean-token-sum-norm"] = Field(
        "token-mean", description="token-mean (DAPO), seq-mean (GRPO) or seq-mean-token-sum-norm (Dr. GRPO: "
        "token sums over sequences x the most policy tokens a completion may have).")
    tis_cap: float | None = Field(2.0, gt=0.0, description="Truncated IS cap (C_max of rollout_is); None "
                                  "disables the importance weights against the engine.")
    # Objectives (app/trainer/grpo.py; docs/trainer.md's table names each one's paper and TRL/verl option).
    ratio_level: Literal["token", "sequence"] = Field(
        "token", description="sequence: GSPO's ratio, the geometric mean of the token ratios, clipped per sequence.")
    rollout_is: Literal["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"] = Field(
        "token_truncate", description="Importance weights against the engine's logprobs (with tis_cap): "
        "per token or per sequence (product of the token ratios), truncated to [rollout_is_min, tis_cap] "
        "or zeroed outside it.")
    rollout_is_min: float | None = Field(None, gt=0.0, description="C_min of rollout_is; None: no lower bound.")
    dual_clip: float | None = Field(None, gt=1.0, description="Dual-clip bound c: the loss of a token with a "
                                    "negative advantage A is at most -c * A. None: off.")
    entropy_coef: float = Field(0.0, ge=0.0, description="Entropy bonus: the loss minus this x the mean token "
                                "entropy (back-propagated through it).")
    dynamic_sampling: bool = Field(False, description="DAPO dynamic sampling: skip groups whose rewards are all "
                                   "equal (no advantage); taken from the buffer and committed all the same.")
    dynamic_sampling_max_skipped: int = Field(8, ge=0, description="Groups without signal skipped per step at "
                                              "most; after that they fill the batch (the trainer never starves).")
    overlong_filter: bool = Field(False, description="DAPO overlong filtering: completions cut at max_new_tokens "
                                  "are masked out of the loss (they still count in their group's advantages).")
    overlong_buffer_tokens: int | None = Field(None, ge=1, description="DAPO soft overlong penalty: the last this "
                                               "many tokens before max_new_tokens ramp a penalty from 0 to "
                                               "-overlong_penalty_factor, added to the reward. None: off.")
    overlong_penalty_factor: float = Field(1.0, gt=0.0, description="The soft overlong penalty at max_new_tokens.")
    # Mini-batches and epochs per rollout batch (verl's actor.ppo_mini_batch_size, ppo_epochs and
    # use_rollout_log_probs; TRL's steps_per_generation and num_iterations): app/trainer/step.py.
    ppo_mini_batch_size: int | None = Field(
        None, ge=1, description="Groups (prompts) per mini-batch: a step's groups_per_step groups are cut, in the "
        "order taken, into mini-batches of this many, one optimizer step each (verl's ppo_mini_batch_size, in "
        "prompts). None: groups_per_step, one mini-batch.")
    ppo_epochs: int = Field(1, ge=1, description="Passes over a step's mini-batches (verl's ppo_epochs, TRL's "
                            "num_iterations). Every optimizer step after a batch's first is off-policy: the clip binds.")
    use_rollout_log_probs: bool = Field(
        False, description="The clip's old policy. false: the trainer's own logprobs of the batch, computed once "
        "before its first optimizer step (not computed with one step per batch: they equal the current ones). "
        "true: the engine's logprobs (the behaviour policy; verl's use_rollout_log_probs, AReaL without "
        "recompute): the clip binds from the first step, and tis_cap must be null.")
    publish_every: int = Field(1, ge=1, description="Steps between policy versions.")
    keep_versions: int = Field(3, ge=1, description="Published policy versions kept in the store; older ones "
                               "are pruned.")
    batch_timeout_s: float = Field(600.0, gt=0.0, description="Max wait for one step's groups.")
    max_bad_steps: int = Field(3, ge=1, description="Non-finite steps in a row before stopping.")
    log_entropy: bool = Field(True, description="Token entropy metric; one extra [B,L,V] pass.")
    save_every: int = Field(1, ge=1, description="Steps between saved training states. Taken groups "
                            "leave Redis only at a save (they do not count against buffer.capacity_groups).")
    keep_states: int = Field(2, ge=1, description="Complete training states kept in the store.")

    @field_validator("dynamic_sampling_max_skipped")
    @classmethod
    def _skips_some(cls, v: int) -> int:
        if v == 0:
            raise ValueError("0 skips no group, so dynamic sampling would be off; set trainer.dynamic_sampling: "
                             "false instead")
        return v

    def mini_batch_groups(self) -> int:
        """Groups per mini-batch: ``ppo_mini_batch_size``, or every group of the step."""
        return self.ppo_mini_batch_size or self.groups_per_step

    def objective(self) -> str:
        """The objective's name for metrics.jsonl: ``grpo``, ``gspo``, ``dr_grpo``, ``gspo+dr_grpo`` or
        ``ppo``; then ``agg=<loss_agg>`` (always: token-mean, seq-mean or seq-mean-token-sum-norm, the
        constant normaliser); then ``+`` each modifier that is on (``no_std`` when advantages are not
        divided by the std outside Dr. GRPO, ``is=<rollout_is>`` when not the default, ``dual_clip``,
        ``entropy_bonus``, ``dynamic_sampling``, ``overlong_filter``, ``soft_overlong``,
        ``mini_batches=<n>`` and ``epochs=<n>`` above 1, ``old=engine`` with use_rollout_log_probs)."""
        dr = self.loss_agg == "seq-mean-token-sum-norm" and not self.scale_by_std
        if self.algorithm == "ppo":
            parts = ["ppo"]
        else:
            parts = ["gspo"] if self.ratio_level == "sequence" else ([] if dr else ["grpo"])
            parts += ["dr_grpo"] if dr else []
        parts.append(f"agg={self.loss_agg}")
        if self.algorithm == "grpo" and not self.scale_by_std and not dr:
            parts.append("no_std")
        if self.tis_cap is not None and self.rollout_is != "token_truncate":
            parts.append(f"is={self.rollout_is}")
        parts += [name for name, on in (("dual_clip", self.dual_clip is not None), ("entropy_bonus", self.entropy_coef > 0),
                                        ("dynamic_sampling", self.dynamic_sampling),
                                        ("overlong_filter", self.overlong_filter),
                                        ("soft_overlong", self.overlong_buffer_tokens is not None)) if on]
        mini_batches = self.groups_per_step // self.mini_batch_groups()
        parts += [f"mini_batches={mini_batches}"] if mini_batches > 1 else []
        parts += [f"epochs={self.ppo_epochs}"] if self.ppo_epochs > 1 else []
        parts += ["old=engine"] if self.use_rollout_log_probs else []
        return "+".join(parts)


class WeightSyncConfig(Section):
    """How policy versions reach the engines (protocol: app/trainer/weight_sync.py).

    ``store``: every version goes to the object store and each rollout worker downloads it and
    has its engine load it from disk. ``network``: the trainer also pushes every version to the
    registered engines over a torch.distributed group (SGLang's weight-update routes), and every
    ``store_every``-th version (and the first and last) still goes to the store, ``latest``
    last: the durable copy engines that start or miss a push load from. The trainer and the
    rollout workers both read this section, so their timeouts agree.
    """

    mode: Literal["store", "network"] = Field("store", description="store or network, as above "
                                              "(docs/weight-sync.md).")
    store_every: int = Field(1, ge=1, description="network: versions between store copies (1: every one).")
    bucket_bytes: int = Field(512 * 1024**2, ge=1, description="Most bytes one broadcast carries (a bucket); "
                              "a single larger tensor travels alone. Miles' default is 512 MiB.")
    backend: Literal["auto", "gloo", "nccl", "cuda:gloo"] = Field(
        "auto", description="Group backend: auto is nccl when the trainer runs on CUDA (cuda:gloo when "
        "ranks share a GPU, MOERL_SHARED_GPU=1), else gloo.")
    master_address: str | None = Field(None, description="Address engines reach the trainer's source rank "
                                       "at; None: $POD_IP, else this host's name resolved.")
    master_port: int = Field(0, ge=0, le=65535, description="Rendezvous port on the source rank, served once "
                             "for every weight-update group (0: a free one).")
    engines_per_group: int = Field(1, ge=0, description="Engines sharing one weight-update group. 1: a group "
                                   "per engine, so an engine that dies mid-push fails only its own group; the "
                                   "source then sends each bucket once per engine. 0: every engine in one group "
                                   "(one broadcast tree, but one dead member fails the push for all).")
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

    source: Literal["reasoning-gym", "jsonl", "env"] = Field(
        "reasoning-gym", description="Where problems come from: a reasoning-gym dataset, a JSONL of "
        "{prompt, answer} rows, or (env) the environment's own episodes, numbered: each reset gets "
        'spec {"source": "env", "split": "train" | "heldout", "index": i, "seed": task.seed}.')
    name: str = Field("spell_backward", description="reasoning-gym dataset name.")
    params: dict[str, Any] = Field(
        default_factory=lambda: {"min_word_len": 3, "max_word_len": 6},
        description="Config fields of the reasoning-gym dataset (difficulty).",
    )
    jsonl_path: str | None = Field(None, description='JSONL of {"prompt","answer"} rows (source jsonl).')
    seed: int = Field(0, description="Seed of the task's problems (dataset, JSONL shuffle, env episodes).")
    train_size: int = Field(2000, ge=1, description="Training prompts.")
    eval_size: int = Field(200, ge=1, description="Held-out prompts for evaluation.")
    warmup_steps: int = Field(150, ge=1, description="Supervised warm-up steps (moerl warmup).")
    warmup_lr: float = Field(3e-3, gt=0.0, description="Peak AdamW lr of the warm-up (cosine to 10%).")
    warmup_batch_size: int = Field(64, ge=1, description="Examples per step of the supervised warm-up.")
    warmup_done: bool = Field(False, description="model.path is already this task's warm-up checkpoint "
                              "(moerl run records it in run.yaml): re-used as --config, no second warm-up.")
    reward_model: str | None = Field(None, description="HF sequence-classification checkpoint that scores "
                                     "completions (`moerl reward`) instead of the task's verifier.")
    verify_timeout_s: float = Field(4.0, gt=0.0, description="Deadline of one math-verify call (source "
                                    "jsonl), seconds: it runs in a worker process that is killed after it, "
                                    "and the reward counts as failed (app/envs/process_pool.py).")


# The environments moerl ships (app/envs/environments.py ENVIRONMENTS), and what else env.name
# may be: an OpenEnv Environment class of the user's, package.module:Class.
BUILTIN_ENVIRONMENTS = ("spell-retry", "calculator")


class EnvConfig(Section):
    """Multi-turn environments served over OpenEnv's protocol (app/envs/openenv_server.py).

    With ``name`` set, rollout workers run episodes against the environment server at ``url``
    (`moerl env`; the env pool's Service in the cluster) instead of scoring single completions:
    generate, send the action, append the observation, generate again, up to ``max_turns`` or
    done (app/rollout/episodes.py). ``name`` None keeps the single-turn verifier path.
    """

    name: str | None = Field(
        None, description="The environment: spell-retry or calculator (app/envs/environments.py), an "
        "OpenEnv Environment class of your own as an import path package.module:Class (served by "
        "`moerl env`), or, with url set, any label of an environment served elsewhere; None: single-turn.")
    url: str | None = Field(None, description="An environment server of your own (OpenEnv's WebSocket "
                            "protocol, http(s)://host:port): moerl starts none and the workers use it. None: "
                            "moerl serves env.name itself (`moerl run`: a `moerl env` process; the "
                            "cluster: the env pool's Service).")
    demos_path: str | None = Field(None, description="JSONL of warm-up demonstrations for an environment "
                                   'of your own: {"spec": ..., "actions": ["turn", ...]} per line, played '
                                   "against it (docs/environments.md); None: the built-in environments' scripted ones.")
    demos_from_env: bool = Field(False, description="Warm-up demonstrations from the environment's own "
                                 "training episodes: each one's reset observation carries the turns that solve "
                                 'it in OpenEnv\'s metadata, {"demonstration": ["turn", ...]}, played against it '
                                 "as a demos_path row is (docs/environments.md); instead of demos_path.")
    max_turns: int = Field(3, ge=1, description="Policy turns per episode at most.")
    step_timeout_s: float = Field(10.0, gt=0.0, description="Wait for one reset/step answer, seconds.")
    episode_timeout_s: float = Field(120.0, gt=0.0, description="The server closes an episode's session "
                                     "(WebSocket) this long after it opened.")
    max_sessions: int = Field(256, ge=1, description="Concurrent episodes one env server holds.")
    attempts: int = Field(2, ge=1, description="spell-retry: answers accepted, the first and each retry after feedback.")

    @field_validator("url")
    @classmethod
    def _url_parses(cls, v: str | None) -> str | None:
        # A malformed address fails here, at load, not after a wait for a server that cannot answer.
        if v is None:
            return v
        parts = urlsplit(v)
        try:
            port = parts.port
        except ValueError:
            raise ValueError(f"{v!r}: the port is not a number in 1-65535") from None
        if parts.scheme not in ("http", "https", "ws", "wss") or not parts.hostname:
            raise ValueError(f"{v!r} is not an http(s):// or ws(s):// URL with a host, e.g. http://127.0.0.1:8091")
        if port == 0 or parts.query or parts.fragment:
            raise ValueError(f"{v!r}: give the server's base URL, http(s)://host:port (moerl adds /ws itself)")
        return v

    def builtin(self) -> bool:
        """Whether ``name`` is one of the environments moerl ships (played in process when
        moerl evaluates or demonstrates them)."""
        return self.name in BUILTIN_ENVIRONMENTS

    def served_by_moerl(self) -> bool:
        """Whether moerl runs the environment's server (no ``url`` given)."""
        return self.name is not None and self.url is None


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
    """'invalid run config: <field path>: <why>; ...' (`error_line`)."""
    return "invalid run config: " + error_line(e, "(run config)")


class LocalConfig(Section):
    """`moerl run` on one machine (app/local/machine.py sizes the roles from its cores and GPUs)."""

    trainer_gpus: int | None = Field(
        None, ge=1, description="GPUs the trainer takes, one rank on each (NCCL); the built-in engines take the "
        "others, or share the trainer's when it takes every GPU. None: the one GPU of a one-GPU machine "
        "(shared with the engines), else half of them. Must be unset where there is no GPU.")


class RunConfig(Section):
    """Everything one run needs, shared by the trainer, rollout workers and the buffer."""

    run_id: str = Field("dev", pattern=r"^[a-z0-9][a-z0-9-]{0,62}$", description="The run's name: its prefix in "
                        "the store and in Redis (and in the deployment config's trainer_runs).")
    store_url: str = Field("file://runs/store", description="file:// or s3:// root of artifacts (`moerl run`: "
                           "its run directory's store/).")
    router: RouterConfig = Field(RouterConfig(), description="The MoE routers' training settings.")
    model: ModelConfig = Field(ModelConfig(), description="The policy.")
    buffer: BufferConfig = Field(BufferConfig(), description="The experience buffer and task queue.")
    rollout: RolloutConfig = Field(RolloutConfig(), description="Rollout workers and their engines.")
    trainer: TrainerConfig = Field(TrainerConfig(), description="The trainer and its objective.")
    task: TaskConfig = Field(TaskConfig(), description="Prompts, rewards and the warm-up.")
    env: EnvConfig = Field(EnvConfig(), description="Multi-turn environments (docs/environments.md).")
    feed: FeedConfig = Field(FeedConfig(), description="The prompt source and its held-out evaluation.")
    weight_sync: WeightSyncConfig = Field(WeightSyncConfig(), description="How policy versions reach the engines.")
    local: LocalConfig = Field(LocalConfig(), description="`moerl run` on one machine: how the trainer and the "
                               "engines split its GPUs (app/local/machine.py).")

    @field_validator("store_url")
    @classmethod
    def _store_scheme(cls, v: str) -> str:
        # The stores app/storage/__init__.py opens; anything else fails only when a role publishes.
        scheme, sep, rest = v.partition("://")
        if not sep or scheme not in ("file", "s3") or not rest.strip("/"):
            raise ValueError(f"{v!r} is not a file://PATH or s3://BUCKET[/PREFIX] URL")
        return v

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
        if self.buffer.capacity_groups < t.groups_per_step:
            raise ValueError(
                f"buffer.capacity_groups={self.buffer.capacity_groups} must be >= trainer.groups_per_step = "
                f"{t.groups_per_step}: the fleet could never have one step's groups ready"
            )
        if t.algorithm == "grpo" and self.rollout.group_size < 2:
            # TRL refuses it too (GRPOConfig: num_generations >= 2).
            raise ValueError(f"rollout.group_size={self.rollout.group_size}: GRPO needs at least 2 completions "
                             "per prompt (advantages are relative to the prompt's group; one gives none)")
        if t.dynamic_sampling:
            # One step may take groups_per_step + max_skipped groups, and back-pressure holds the
            # fleet at capacity_groups finished groups not yet taken (app/buffer/experience.py).
            need = t.groups_per_step + t.dynamic_sampling_max_skipped
            if self.buffer.capacity_groups < need:
                raise ValueError(
                    f"buffer.capacity_groups={self.buffer.capacity_groups} must be >= trainer.groups_per_step + "
                    f"trainer.dynamic_sampling_max_skipped = {need} with trainer.dynamic_sampling: a step may "
                    "take that many groups")
            if t.algorithm == "ppo":
                raise ValueError("trainer.dynamic_sampling: GRPO only (PPO's advantages come from its critic, "
                                 "so a group of equal rewards still carries signal)")
        if t.algorithm == "ppo" and t.ratio_level != "token":
            raise ValueError("trainer.ratio_level=sequence (GSPO): needs one advantage per sequence; use grpo")
        if t.algorithm == "ppo" and t.rollout_is.startswith("sequence"):
            raise ValueError(f"trainer.rollout_is={t.rollout_is}: PPO supports the token-level modes only")
        if t.rollout_is_min is not None and t.tis_cap is not None and t.rollout_is_min >= t.tis_cap:
            raise ValueError(f"trainer.rollout_is_min={t.rollout_is_min} must be < trainer.tis_cap={t.tis_cap}")
        unused = ([f"trainer.rollout_is={t.rollout_is}"] if t.rollout_is != "token_truncate" else []) + (
            [f"trainer.rollout_is_min={t.rollout_is_min}"] if t.rollout_is_min is not None else [])
        if t.tis_cap is None and unused:
            raise ValueError(f"trainer.tis_cap is null (no importance weights against the engine), so {' and '.join(unused)} "
                             "would do nothing: set trainer.tis_cap, or remove them")
        if t.groups_per_step % t.mini_batch_groups():
            raise ValueError(f"trainer.ppo_mini_batch_size={t.ppo_mini_batch_size} must divide trainer.groups_per_step="
                             f"{t.groups_per_step} (a step's groups are cut into mini-batches of that many)")
        if t.use_rollout_log_probs and t.tis_cap is not None:
            raise ValueError("trainer.use_rollout_log_probs: the clip's old policy is then the engine's, so the "
                             f"importance weights against the engine (trainer.tis_cap={t.tis_cap}) would all be 1; "
                             "set trainer.tis_cap: null")
        if t.overlong_buffer_tokens is not None:
            if t.overlong_buffer_tokens > self.rollout.max_new_tokens:
                raise ValueError(f"trainer.overlong_buffer_tokens={t.overlong_buffer_tokens} must be <= "
                                 f"rollout.max_new_tokens={self.rollout.max_new_tokens}")
            if self.env.name:
                raise ValueError("trainer.overlong_buffer_tokens: not supported with env.name (an episode's "
                                 "length is not one generation's)")
        if self.router.routing_replay:  # the deprecated spelling: one switch, read from rollout
            self.rollout.routing_replay = True
        if self.env.name and self.rollout.routing_replay:
            raise ValueError("rollout.routing_replay: not supported with env.name (multi-turn episodes) yet")
        if self.rollout.partial_rollout and self.rollout.routing_replay:
            # A resumed sequence's prefix would be re-routed by the new weights in the resume's prefill.
            raise ValueError("rollout.partial_rollout: not supported with rollout.routing_replay (a resumed "
                             "prefix is routed again by the new weights)")
        if self.rollout.partial_rollout and self.env.name:
            raise ValueError("rollout.partial_rollout: not supported with env.name (multi-turn episodes) yet")
        if self.rollout.partial_rollout and self.rollout.router:
            # The worker aborts and resumes its own requests on its own engine; behind the router they
            # may be on any engine, and the router's resend would restart them from the prompt.
            raise ValueError("rollout.partial_rollout: not supported with rollout.router (a worker's requests "
                             "may be on any engine)")
        if self.rollout.routing_replay and self.rollout.router:
            # Sending these requests around the router would route every request of the run around it.
            raise ValueError("rollout.routing_replay: not supported with rollout.router (sglang-router 0.3.2 "
                             "re-serialises /generate and drops return_routed_experts and "
                             "routed_experts_start_len); turn one of them off")
        if self.env.name and self.feed.eval_every:
            raise ValueError("feed.eval_every: the feed's held-out evaluation scores single completions; with "
                             "env.name it is not supported yet (moerl run evaluates episodes in process)")
        e = self.env
        if e.name is not None and e.url is None and e.name not in BUILTIN_ENVIRONMENTS and not IMPORT_PATH.match(e.name):
            raise ValueError(f"env.name: {e.name!r} is not a built-in environment ({', '.join(BUILTIN_ENVIRONMENTS)}) "
                             "nor an import path package.module:Class; or set env.url to a server of your own")
        if self.task.source == "env" and not self.env.name:
            raise ValueError("task.source=env: the environment's own episodes need env.name")
        if self.env.demos_path and not self.env.name:
            raise ValueError("env.demos_path: demonstrations need env.name")
        if self.env.demos_from_env and (not self.env.name or self.env.builtin() or self.env.demos_path):
            raise ValueError("env.demos_from_env: needs env.name an environment of your own (the built-in ones "
                             "have scripted demonstrations) and no env.demos_path (one source of demonstrations)")
        if self.env.name and t.algorithm == "ppo":
            # GAE (app/trainer/ppo.py) stops at masked tokens: it would not carry the episode's
            # reward back across the environment's observations to earlier turns.
            raise ValueError("trainer.algorithm=ppo: not supported with env.name (multi-turn episodes) yet; use grpo")
        if t.algorithm == "ppo" and t.loss_agg != "token-mean":
            raise ValueError(f"trainer.loss_agg={t.loss_agg!r}: PPO's per-token advantages need 'token-mean'")
        return self

    def max_policy_tokens(self) -> int:
        """The most policy tokens one sample can hold: ``rollout.max_new_tokens``, times
        ``env.max_turns`` for episodes (Dr. GRPO's constant normaliser)."""
        return self.rollout.max_new_tokens * (self.env.max_turns if self.env.name else 1)

    def soft_overlong(self) -> tuple[int, int, float] | None:
        """``(max_tokens, buffer_tokens, factor)`` of DAPO's soft overlong penalty, or None when off."""
        t = self.trainer
        if t.overlong_buffer_tokens is None:
            return None
        return self.rollout.max_new_tokens, t.overlong_buffer_tokens, t.overlong_penalty_factor

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
    def load(cls, path: str | os.PathLike, sets: list[str] | None = None) -> "RunConfig":
        """Read a YAML run configuration, then apply ``--set key=value`` overrides (`with_sets`).

        A key given twice in one mapping is refused (PyYAML would keep the last silently), and
        so is a file with no fields: it would run the built-in default task, which a run that
        meant its own config did not ask for (leave out ``--config`` for the default).

        Raises:
            FileNotFoundError: the file does not exist.
            ValueError: the YAML does not parse, repeats a key, is empty, or a field is invalid;
                the message names the file and the line or the field path (e.g. ``trainer.lr``).
        """
        path = Path(path)
        if path.is_dir():
            raise ValueError(f"{path}: is a directory, not a run config file")
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            raise ValueError(f"{path}: not a text (UTF-8) YAML file") from None
        try:
            data = load_yaml(text)
        except yaml.YAMLError as e:
            raise ValueError(f"{path}: not valid YAML: {yaml_error_line(e)}") from None
        if data is None or data == {}:
            raise ValueError(f"{path}: the run config is empty (no field set); for the default task leave out "
                             "--config, or write the fields to change")
        if not isinstance(data, dict):
            raise ValueError(f"{path}: a run config is a YAML mapping of sections, not a {type(data).__name__}")
        try:
            cfg = cls.model_validate(data)
        except ValidationError as e:
            raise ValueError(f"{path}: {_describe(e)}") from None
        return cfg.with_sets(sets) if sets else cfg

    def with_sets(self, sets: list[str]) -> "RunConfig":
        """This config with ``key=value`` overrides (``trainer.lr=1e-4``, ``env.max_turns=3``,
        ``task.params={min_word_len: 4}``): the key is a field's dotted path, the value YAML (as
        in a run config file), and the result is validated by this same model.

        Raises:
            ValueError: ``--set`` without ``=``, a path through a field that is not a section, or
                an invalid result; the message names ``--set`` and the field.
        """
        data = self.model_dump()
        for item in sets:
            key, eq, text = item.partition("=")
            key = key.strip()
            if not eq or not key:
                raise ValueError(f"--set {item!r}: expected key=value, e.g. --set trainer.lr=1e-4")
            try:
                value = load_yaml(text)  # empty: null, as ``key:`` in a file
            except yaml.YAMLError as e:
                raise ValueError(f"--set {key}: the value is not valid YAML: {yaml_error_line(e)}") from None
            node, parts = data, key.split(".")
            for i, part in enumerate(parts[:-1]):
                node = node.setdefault(part, {}) if isinstance(node, dict) else None
                if not isinstance(node, dict):
                    raise ValueError(f"--set {key}: {'.'.join(parts[:i + 1])} is not a section of the run config")
            if not isinstance(node, dict):
                raise ValueError(f"--set {key}: not a field of the run config")
            node[parts[-1]] = value
        try:
            return type(self).model_validate(data)
        except ValidationError as e:
            raise ValueError(f"--set: {_describe(e)}") from None

    def changed_fields(self, other: "RunConfig") -> list[str]:
        """Dotted paths of the fields whose value differs in ``other`` (sections compared field by
        field; a field holding a mapping or list, e.g. ``task.params``, as one value)."""
        def walk(a: BaseModel, b: BaseModel, prefix: str) -> list[str]:
            out = []
            for name in type(a).model_fields:
                x, y = getattr(a, name), getattr(b, name)
                if isinstance(x, Section):
                    out += walk(x, y, f"{prefix}{name}.")
                elif x != y:
                    out.append(prefix + name)
            return out

        return walk(self, other, "")

    def save(self, path: str | os.PathLike) -> None:
        """Write this configuration as YAML atomically (temporary name, then rename)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
        with os.fdopen(fd, "w") as f:
            yaml.safe_dump(self.model_dump(mode="json"), f, sort_keys=False)
        os.replace(tmp, path)
