"""Per-GPU memory of the trainer at the peak of a step: named terms, phases, and whether it fits.

The layout is the one of app/layout.py as the trainer applies it (torchtitan's composition of
FSDP2 with expert parallelism):

- fp32 master weights, fp32 gradients (reduce-scattered in fp32) and AdamW's two fp32 moments,
  all sharded: 16 bytes per parameter over ``dp_shard`` ranks, padded as FSDP2 pads
  (`app.plan.params.rank_numel`); the router is a separate unit that stays fp32.
- Compute in bf16 (``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``): one decoder
  layer is all-gathered at a time (its non-expert tensors and this EP rank's E/ep experts), with
  the next one prefetched: 2 units live in backward, 1 in the loss. A layer's backward holds its
  unsharded bf16 gradients and the fp32 reduce-scatter input made from them (torch's
  ``foreach_reduce``: ``reduce_scatter_input`` in ``reduce_dtype``, then the bf16 gradients are
  freed). The root unit (embeddings, final norm, LM head) stays gathered through forward and
  backward; its bf16 LM-head gradient builds up from the loss backward on, the embedding's at the
  end, and both are reduce-scattered last.
- Micro-batches of whole sequences on a token budget; each rank runs ceil(sequences / sequences
  per micro-batch) of them; only one micro-batch's activations exist at a time.
- Activation checkpointing per decoder layer (`app.plan.activations.checkpoint_kept`,
  `recompute_bytes`); the LM head and log-softmax run on chunks of ``logprob_chunk_tokens``.
- PPO: a critic trunk (no LM head) with a [1, H] value head, sharded the same way, its own AdamW;
  one backward through policy and critic (app/trainer/train.py), so both sets of activations are
  alive until the critic's backward (which runs first) is done.
- The optimizer step: the trainer's ``torch.optim.AdamW(fused=True)`` on CUDA
  (app/trainer/step.py ``build_optimizer``) updates the state in place and makes no temporary;
  the default foreach implementation (``adamw="foreach"``, over one parameter group: the
  measurements below) makes one fp32 temporary per parameter (``torch._foreach_sqrt`` of
  ``exp_avg_sq``).
- FSDP2 residency (app/trainer/parallel.py): with dp_shard > 1 (or HSDP) every unit is resharded
  after its forward, so one layer unit is gathered at a time in forward, two in backward (the
  prefetch); at world 1 nothing is resharded after forward (``reshard_after_forward=False``), so
  every layer unit stays gathered from its forward to its backward.
- Expert parallelism: the busiest EP rank receives ``expert_imbalance`` times the mean T*K rows
  (`EXPERT_IMBALANCE`); its experts' activations and the dispatch transients scale with it.
- The frozen reference policy (``trainer.kl_coef`` > 0, app/trainer/models.py ``build_reference``):
  built and sharded exactly as the policy, fp32 master weights, no gradients or moments; its
  no-grad forward runs after the policy's forward (app/trainer/step.py ``_micro_step``), gathers
  its root and one unit at a time (resharded after, as the policy's) and keeps nothing; at world
  1 its gathered units stay after its first forward (no backward ever reshards them).

Phases (the peak is the largest; "units" is 1 or 2 gathered layer units, or all of them at world 1):
  layer forward                  static + gathered root + units + all saved activations + ids and
                                 rotary + one MoE layer's combine transients (with checkpointing:
                                 also that layer's forward set, bounded by its recompute)
  reference forward (kl_coef>0)  static + all saved activations + root activations + the
                                 reference's root and unit + one layer's forward set + its chunk
  loss forward / loss backward   static + gathered root + units + all saved activations
                                 + root activations + the LM-head chunk (forward or backward)
  layer backward                 static + gathered root + LM-head gradient + units (2)
                                 + one unit's bf16 + fp32 gradients + all saved activations
                                 + the residual gradient + one layer's recompute (checkpointing)
                                 + that layer's activation gradients (experts' backward)
  combine backward               the same with the combine's gradient rows instead of the
                                 experts' (the first op of a MoE layer's backward)
  recompute combine (AC)         the same with the recompute's combine transients
  root reduce-scatter            static + gathered root + root gradients in bf16 and fp32
  optimizer step                 static + the foreach temporary (fused: none) + the root's bf16
                                 copy, which FSDP2 still holds then (measured, see below)
With one micro-batch per step (and ``zero_grad(set_to_none=True)``) the fp32 gradients do not
exist yet in the loss and the top layer's backward, so those phases leave them out; with several,
the first micro-batch's backward makes them and they stay.
DeepEP's buffer (ep_backend deepep, ep > 1) is allocated once and counted in every phase.

The prediction for a measurement: the peak phase's tensors are what
``torch.cuda.max_memory_allocated`` reads (``--json``: ``tensors_peak``, and every term's bytes
with the phases it is alive in); times the fragmentation factor (`FRAGMENTATION`) what
``max_memory_reserved`` reads; plus `CUDA_OVERHEAD_GIB` and the NCCL buffers of every group
(app/plan/nccl.py; none when the ranks talk over gloo) what the device has in use. The constants
below are where a measurement calibrates the model.

Checked end to end on the H200 here (torch 2.11): the second of two FSDP2 steps (world 1, bf16
compute, fp32 master weights and foreach AdamW, full checkpointing with ``checkpoint_wrapper``,
the lead's ``chunked_logprobs`` with entropy, 2 x 8192 tokens with a padding mask),
max_memory_allocated per phase against the plan:
  Qwen3-30B-A3B widths, 4 layers: loss forward 50.60 / 50.43 GB, optimizer step (the peak)
    63.63 / 63.54 GB; backward 56.63 GB, which the plan's root reduce-scatter puts at 54.82 GB.
  DeepSeek-V3 widths, 2 layers (1 dense), 32 experts: loss forward 66.44 / 66.04 GB, layer
    backward 83.24 / 83.37 GB, optimizer step (the peak) 85.34 / 85.26 GB.
Between steps FSDP2 still held 1.33 GB beyond weights and moments (Qwen3 case): the root unit's
bf16 copy (1.245 GB) plus 0.09 GB. tests/test_plan.py carries both configurations.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from transformers import PretrainedConfig

from app.layout import Layout
from app.model.config import is_moe_layer
from app.plan import activations as act
from app.plan import deepep, nccl
from app.plan.params import ParamShape, count_params, param_shapes, rank_numel, units
from app.plan.term import Term

GIB = 1024**3

# --- Constants: calibrate these against a measured peak (bench/results/plan.md, `moerl plan` prints them).
# Device memory not available to torch's tensors, per GPU: an H200 (nominal 141 GiB) reports
# 150,109,880,320 B = 139.80 GiB as torch total_memory, and after CUDA initialisation and one
# bf16 GEMM 724,369,408 B are in use of which 100,663,296 B are torch's reserved pool, so
# 0.58 GiB belong to the CUDA context and cuBLAS. Measured on the H200 here (torch 2.11,
# driver 580.159): 141 - 139.80 + 0.58 = 1.78 GiB.
CUDA_OVERHEAD_GIB = 1.78
# Caching-allocator reserve over the peak of live tensors (blocks split across sizes and streams):
# max_memory_reserved / max_memory_allocated over two FSDP2 steps on the H200 here (world 1, full
# checkpointing, chunked logprobs, foreach AdamW, 2 x 8192 tokens): Qwen3-30B-A3B widths with 4
# layers 77.22 / 63.63 GB = 1.21; DeepSeek-V3 widths with 2 layers and 32 experts 113.79 / 85.34
# = 1.33 (1.17 after the first step alone): `FRAGMENTATION`, the worst case with the default
# allocator. With PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True, which the GPU trainer pods set
# (app/torchx_component.py GPU_ALLOC_ENV), the same case reserved 96.26 / 85.33 = 1.13 and the
# trainer's own step 1.06-1.16 (bench/results/plan.md, "bench train-step" rows; 114.0 / 98.7 GB the worst):
# `FRAGMENTATION_EXPANDABLE`, the plan's default (`fragmentation_for`).
FRAGMENTATION = 1.33
FRAGMENTATION_EXPANDABLE = 1.16
# Rows the busiest EP rank's experts receive per MoE layer and micro-batch, over the mean T*K
# (``--expert-imbalance``; exact 1.0 at EP 1). Measured here on the embedded tiny presets after their
# supervised warm-up (app/envs/warmup.py, 40 steps), on the held-out prompts of the embedded task in
# micro-batches of 16 prompts, the worst micro-batch and MoE layer: at EP 2, 1.23 (tiny-qwen3-moe)
# and 1.70 (tiny-deepseek-v3); tests/test_plan.py measures it again. The default is the larger. At
# EP 4 and 8 those 8-expert layers keep 1-2 experts per rank and reach 2.0-4.0, which is a figure
# of an 8-expert router, not of a 128- or 256-expert one with several experts per rank. No trained
# full-size router has been measured here: take the trainer's own figure (its per-rank expert rows)
# and pass it with --expert-imbalance.
EXPERT_IMBALANCE = 1.7
# The trainer passes a padding attention_mask to the model (app/trainer/train.py); without it,
# causal right-padded batches give the same logprobs, SDPA keeps Qwen3's 4 kv heads and no
# per-layer [B, 1, S, S] mask is saved.
PADDING_MASK = True

CHECKPOINTING = ("none", "full", "selective")
ALGORITHMS = ("grpo", "ppo")
BACKENDS = ("local", "alltoall", "deepep")
ADAMW = ("fused", "foreach")
COLLECTIVES = ("nccl", "gloo")
DTYPE_BYTES = {"bfloat16": 2, "float32": 4}


def fragmentation_for(alloc_conf: str | None) -> float:
    """The reserve factor of the caching allocator configured by ``alloc_conf`` (the value of
    PYTORCH_CUDA_ALLOC_CONF, None: unset): `FRAGMENTATION_EXPANDABLE` with expandable segments,
    else `FRAGMENTATION`."""
    options = dict(o.split(":", 1) for o in (alloc_conf or "").split(",") if ":" in o)
    return FRAGMENTATION_EXPANDABLE if options.get("expandable_segments") == "True" else FRAGMENTATION


def constants() -> dict[str, float | bool]:
    """The calibration constants above, by name (printed with every plan)."""
    return dict(CUDA_OVERHEAD_GIB=CUDA_OVERHEAD_GIB, FRAGMENTATION=FRAGMENTATION,
                EXPERT_IMBALANCE=EXPERT_IMBALANCE, PADDING_MASK=PADDING_MASK)


@dataclass(frozen=True)
class PlanInput:
    """What the plan is computed for.

    Attributes:
        config: the model (a Qwen3-MoE or DeepSeek-V3 config).
        layout: the checked layout (`app.layout.resolve_layout`).
        gpus_per_node: GPUs per node (NVLink domain; DeepEP's topology).
        rollouts_per_gpu: sequences each rank trains per step.
        seq_len: tokens per sequence, prompt + completion (padded length).
        micro_batch_tokens: padded tokens per micro-batch (whole sequences); None: one micro-batch.
        activation_checkpointing: ``none``, ``full`` or ``selective``.
        logprob_chunk_tokens: rows per LM-head chunk.
        algorithm: ``grpo`` or ``ppo`` (a critic).
        ep_backend: resolved dispatcher, ``local``, ``alltoall`` or ``deepep``.
        compute_dtype: ``bfloat16`` or ``float32`` (``model.dtype``).
        log_entropy: the entropy metric (``trainer.log_entropy``) widens the LM-head forward.
        gpu_memory_gib: device capacity, GiB.
        fragmentation: reserved / allocated factor (`FRAGMENTATION` by default).
        adamw: ``fused`` (the trainer on CUDA) or ``foreach`` (one parameter group).
        fused_logits: the Triton softmax passes of the LM head (the trainer on CUDA), else torch ops.
        reference: a frozen reference policy is held (``trainer.kl_coef`` > 0).
        expert_imbalance: rows of the busiest EP rank over the mean (`EXPERT_IMBALANCE`).
        collectives: ``nccl`` (GPU ranks, one per GPU) or ``gloo`` (the one-GPU test layout of
            several ranks: no NCCL buffers).
        reshard_after_forward: FSDP2's setting; None: the trainer's (True unless dp_shard and
            dp_replicate are both 1).
    """

    config: PretrainedConfig
    layout: Layout
    gpus_per_node: int
    rollouts_per_gpu: int
    seq_len: int
    micro_batch_tokens: int | None
    activation_checkpointing: str = "full"
    logprob_chunk_tokens: int = 4096
    algorithm: str = "grpo"
    ep_backend: str = "alltoall"
    compute_dtype: str = "bfloat16"
    log_entropy: bool = True
    gpu_memory_gib: float = 141.0
    fragmentation: float = FRAGMENTATION
    adamw: str = "fused"
    fused_logits: bool = True
    reference: bool = False
    expert_imbalance: float = EXPERT_IMBALANCE
    collectives: str = "nccl"
    reshard_after_forward: bool | None = None

    @property
    def reshard(self) -> bool:
        if self.reshard_after_forward is not None:
            return self.reshard_after_forward
        return self.layout.dp_shard > 1 or self.layout.dp_replicate > 1

    def check(self) -> None:
        """Raises ValueError naming the field (the CLI flag) that is out of range (NaN and infinity included)."""
        checks = [
            (self.rollouts_per_gpu >= 1, f"--rollouts-per-gpu must be >= 1, got {self.rollouts_per_gpu}"),
            (self.seq_len >= 1, f"--seq-len must be >= 1, got {self.seq_len}"),
            (self.micro_batch_tokens is None or self.micro_batch_tokens >= self.seq_len,
             (f"--micro-batch-tokens ({self.micro_batch_tokens}) is below --seq-len ({self.seq_len}): "
              f"a micro-batch holds whole sequences")),
            (self.activation_checkpointing in CHECKPOINTING,
             f"--activation-checkpointing must be one of {CHECKPOINTING}, got {self.activation_checkpointing!r}"),
            (self.logprob_chunk_tokens >= 1, f"--logprob-chunk-tokens must be >= 1, got {self.logprob_chunk_tokens}"),
            (self.algorithm in ALGORITHMS, f"--algorithm must be one of {ALGORITHMS}, got {self.algorithm!r}"),
            (self.ep_backend in BACKENDS, f"--ep-backend must resolve to one of {BACKENDS}, got {self.ep_backend!r}"),
            (self.compute_dtype in DTYPE_BYTES, f"model.dtype must be one of {tuple(DTYPE_BYTES)}"),
            (0 < self.gpu_memory_gib < math.inf, f"--gpu-memory-gib must be finite and > 0, got {self.gpu_memory_gib}"),
            (self.gpus_per_node >= 1, f"--gpus-per-node must be >= 1, got {self.gpus_per_node}"),
            (1.0 <= self.fragmentation < math.inf,
             f"--fragmentation must be finite and >= 1, got {self.fragmentation}"),
            (1.0 <= self.expert_imbalance < math.inf,
             f"--expert-imbalance must be finite and >= 1 (max/mean rows per EP rank), got {self.expert_imbalance}"),
            (self.adamw in ADAMW, f"adamw must be one of {ADAMW}, got {self.adamw!r}"),
            (self.collectives in COLLECTIVES, f"--collectives must be one of {COLLECTIVES}, got {self.collectives!r}"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)


@dataclass
class MemoryPlan:
    """The budget of one GPU.

    Attributes:
        inp: the input.
        micro_batch: one micro-batch's geometry.
        micro_batches: micro-batches per rank and step.
        terms: every term by key, in display order.
        phases: phase name -> keys of the terms alive at its peak.
        params: parameter counts (`app.plan.params.ParamCounts`).
        layer_detail: one layer's saved tensors per layer kind.
        overhead_terms: device memory outside torch's allocator (CUDA context, NCCL buffers).
    """

    inp: PlanInput
    micro_batch: act.MicroBatch
    micro_batches: int
    terms: dict[str, Term]
    phases: dict[str, list[str]]
    params: object
    layer_detail: dict[str, list[Term]] = field(default_factory=dict)
    overhead_terms: list[Term] = field(default_factory=list)

    def phase_bytes(self, phase: str) -> int:
        return sum(self.terms[k].bytes for k in self.phases[phase])

    @property
    def peak_phase(self) -> str:
        return max(self.phases, key=self.phase_bytes)

    @property
    def tensors_peak(self) -> int:
        """Live tensors at the peak (compare with ``torch.cuda.max_memory_allocated``)."""
        return self.phase_bytes(self.peak_phase)

    @property
    def reserved(self) -> int:
        """`tensors_peak` times the fragmentation factor (compare with ``max_memory_reserved``)."""
        return int(self.tensors_peak * self.inp.fragmentation)

    @property
    def overhead(self) -> int:
        """Device memory outside torch's allocator: the CUDA context and the NCCL buffers."""
        return sum(t.bytes for t in self.overhead_terms)

    @property
    def predicted(self) -> int:
        """Device memory in use at the peak: `reserved` plus the CUDA and NCCL overheads."""
        return self.reserved + self.overhead

    @property
    def capacity(self) -> int:
        return int(self.inp.gpu_memory_gib * GIB)

    @property
    def headroom(self) -> int:
        return self.capacity - self.predicted

    @property
    def fits(self) -> bool:
        return self.headroom >= 0

    def to_json(self) -> dict:
        """Everything as plain JSON types (bytes as ints)."""
        i, lay = self.inp, self.inp.layout
        peak = self.peak_phase
        return dict(
            model=dict(model_type=i.config.model_type, num_hidden_layers=i.config.num_hidden_layers,
                       params_total=self.params.total, params_experts=self.params.experts,
                       params_non_expert=self.params.non_expert, params_routers=self.params.routers),
            layout=dict(world=lay.world, gpus_per_node=i.gpus_per_node, dp_replicate=lay.dp_replicate,
                        dp_shard=lay.dp_shard, ep=lay.ep, efsdp=lay.efsdp, ep_backend=i.ep_backend,
                        collectives=i.collectives, reshard_after_forward=i.reshard),
            batch=dict(rollouts_per_gpu=i.rollouts_per_gpu, seq_len=i.seq_len,
                       micro_batch_tokens=self.micro_batch.tokens, micro_batches=self.micro_batches,
                       sequences_per_micro_batch=self.micro_batch.seqs, expert_rows=self.micro_batch.expert_rows,
                       activation_checkpointing=i.activation_checkpointing,
                       logprob_chunk_tokens=i.logprob_chunk_tokens, algorithm=i.algorithm,
                       compute_dtype=i.compute_dtype, log_entropy=i.log_entropy, adamw=i.adamw,
                       fused_logits=i.fused_logits, reference=i.reference, expert_imbalance=i.expert_imbalance),
            constants=constants() | {"FRAGMENTATION": i.fragmentation},
            terms=[dict(key=k, name=t.name, bytes=t.bytes, gib=t.bytes / GIB, formula=t.formula,
                        phases=[p for p, keys in self.phases.items() if k in keys], in_peak=k in self.phases[peak])
                   for k, t in self.terms.items()],
            phases={p: self.phase_bytes(p) for p in self.phases},
            overhead_terms=[dict(name=t.name, bytes=t.bytes, gib=t.bytes / GIB, formula=t.formula)
                            for t in self.overhead_terms],
            layer_detail={kind: [dict(name=t.name, bytes=t.bytes, formula=t.formula) for t in ts]
                          for kind, ts in self.layer_detail.items()},
            peak_phase=peak, tensors_peak=self.tensors_peak, reserved=self.reserved, overhead=self.overhead,
            predicted=self.predicted, capacity=self.capacity, headroom=self.headroom, fits=self.fits,
        )


def resolve_ep_backend(requested: str, ep: int, hidden: int, collectives: str = "nccl") -> tuple[str, str]:
    """The dispatcher the trainer would run (app/model/parallel.py ``init_ep``) and why.

    ``ep`` 1 is always ``local``. ``auto`` takes ``deepep`` only where DeepEP builds a buffer on
    every EP rank; the plan cannot build one, and on the trainer pods it would not: the
    sgl-deep-ep wheel refuses more than one rank without NCCL GIN unless ``EP_DISABLE_GIN=1``
    (DeepEP ``csrc/kernels/backend/nccl.cu:86-89``; bench/results/ep.md, "What deep_ep needs"), which
    the trainer pods do not set, so ``auto`` plans ``alltoall``; ``--ep-backend deepep`` plans
    DeepEP. Gloo ranks and widths DeepEP's kernels reject are ``alltoall`` as in ``init_ep``.

    Returns:
        ``(backend, reason)``: one of `BACKENDS` and a sentence saying why.

    Raises:
        ValueError: ``deepep`` asked for where the trainer refuses it, or ``local`` with ep > 1.
    """
    # torch: `moerl plan` runs without it
    from app.model.dispatch.deepep import hidden_size_error

    if ep == 1:
        return "local", "ep 1: every expert is local"
    if requested == "local":
        raise ValueError(f"--ep-backend local needs --ep 1, got ep={ep}")
    width = hidden_size_error(hidden)
    if requested == "deepep":
        if collectives != "nccl":
            raise ValueError("--ep-backend deepep needs NCCL ranks (--collectives nccl): DeepEP refuses a gloo group")
        if width:
            raise ValueError(f"--ep-backend deepep: config.hidden_size={width}")
        return "deepep", "--ep-backend deepep"
    if requested == "alltoall":
        return "alltoall", "--ep-backend alltoall"
    if collectives != "nccl":
        return "alltoall", "auto: the EP group uses gloo, DeepEP needs NCCL"
    if width:
        return "alltoall", f"auto: DeepEP rejects config.hidden_size={width}"
    return "alltoall", ("auto: the trainer pods do not set EP_DISABLE_GIN=1 and DeepEP refuses more than one rank "
                        "without NCCL GIN, so the trainer falls back to alltoall (pass --ep-backend deepep to plan "
                        "DeepEP)")


def _critic_shapes(shapes: list[ParamShape], hidden: int) -> list[ParamShape]:
    """The PPO critic: the policy's trunk (no LM head) and a Linear(H, 1) value head (fp32)."""
    trunk = [p for p in shapes if p.role != "lm_head"]
    return trunk + [ParamShape("value_head.weight", (1, hidden), "mlp", None),
                    ParamShape("value_head.bias", (1,), "mlp", None)]


def micro_batching(inp: PlanInput) -> tuple[int, int]:
    """(sequences per micro-batch, micro-batches per step) for whole sequences on the budget."""
    per = inp.rollouts_per_gpu if inp.micro_batch_tokens is None else min(
        inp.rollouts_per_gpu, inp.micro_batch_tokens // inp.seq_len)
    return per, math.ceil(inp.rollouts_per_gpu / per)


def plan_memory(inp: PlanInput) -> MemoryPlan:
    """The per-GPU budget of ``inp`` (see the module docstring for the model).

    Raises:
        ValueError: an input out of range (named as its CLI flag), or an expert tensor FSDP2
            cannot shard on this layout.
    """
    inp.check()
    cfg, lay, b = inp.config, inp.layout, DTYPE_BYTES[inp.compute_dtype]
    h, v = cfg.hidden_size, cfg.vocab_size
    seqs, n_micro = micro_batching(inp)
    t = seqs * inp.seq_len
    k = cfg.num_experts_per_tok
    rows = math.ceil(t * k * (inp.expert_imbalance if lay.ep > 1 else 1.0))
    mb = act.MicroBatch(seqs=seqs, seq_len=inp.seq_len, expert_rows=rows, compute_bytes=b, padding_mask=PADDING_MASK,
                        backend=inp.ep_backend, top_k=k)
    ac = inp.activation_checkpointing
    n_layers = cfg.num_hidden_layers
    shapes = param_shapes(cfg)
    local = sum(rank_numel(p, lay) for p in shapes)
    root, layer_units = units(cfg, lay)
    unit = max(layer_units, key=lambda u: b * u.compute + 4 * u.fp32)
    unit_bytes = b * unit.compute + 4 * unit.fp32
    unit_grads = (b + 4) * unit.compute + 8 * unit.fp32
    all_units = sum(b * u.compute + 4 * u.fp32 for u in layer_units)
    shard = f"/dp_shard={lay.dp_shard} (experts: /ep={lay.ep} /efsdp={lay.efsdp}), FSDP2-padded"

    terms: dict[str, Term] = {
        "master": Term("policy master weights fp32 (sharded)", 4 * local, f"4 * {local:,} params {shard}"),
        "grads": Term("policy gradients fp32 (sharded)", 4 * local, f"4 * {local:,}"),
        "adam": Term("policy AdamW exp_avg + exp_avg_sq fp32 (sharded)", 8 * local, f"8 * {local:,}"),
    }
    static = ["master", "grads", "adam"]
    if inp.reference:
        terms["ref_master"] = Term("reference policy weights fp32 (sharded as the policy; no grads, no AdamW)",
                                   4 * local, f"4 * {local:,}")
        static.append("ref_master")
        if not inp.reshard:
            terms["ref_resident"] = Term("reference units left gathered after its first forward (no reshard at "
                                         "world 1)", b * root.compute + all_units,
                                         f"{b}*{root.compute:,} + {all_units:,}")
            static.append("ref_resident")
    critic_local = 0
    if inp.algorithm == "ppo":
        critic_local = sum(rank_numel(p, lay) for p in _critic_shapes(shapes, h))
        terms |= {
            "c_master": Term("critic master weights fp32 (sharded)", 4 * critic_local, f"4 * {critic_local:,}"),
            "c_grads": Term("critic gradients fp32 (sharded)", 4 * critic_local, f"4 * {critic_local:,}"),
            "c_adam": Term("critic AdamW moments fp32 (sharded)", 8 * critic_local, f"8 * {critic_local:,}"),
        }
        static += ["c_master", "c_grads", "c_adam"]

    terms["root"] = Term(f"root unit gathered (embeddings, final norm, LM head) {inp.compute_dtype}",
                         b * root.compute, f"{b} * {root.compute:,}")
    if inp.reshard:
        terms["unit1"] = Term(f"1 layer unit gathered ({unit.name}: non-expert + E/ep local experts, router fp32)",
                              unit_bytes, f"{b}*{unit.compute:,} + 4*{unit.fp32:,}")
        terms["unit2"] = Term("2nd layer unit gathered (prefetch)", unit_bytes,
                              f"{b}*{unit.compute:,} + 4*{unit.fp32:,}")
        fwd_units, bwd_units = ["unit1"], ["unit1", "unit2"]
    else:
        terms["units_all"] = Term(f"all {n_layers} layer units gathered (no reshard after forward: world 1)",
                                  all_units, f"sum over layers of {b}*compute + 4*fp32")
        fwd_units = bwd_units = ["units_all"]
    terms["unit_grads"] = Term("one unit's unsharded gradients + fp32 reduce-scatter input",
                               unit_grads, f"({b}+4)*{unit.compute:,} + 8*{unit.fp32:,}")
    lm_head = v * h if not cfg.tie_word_embeddings else 0
    terms["lm_grad"] = Term("LM-head gradient, unsharded (held until the root reduce-scatter)",
                            b * lm_head, f"{b}*{v}*{h}")
    terms["root_grads"] = Term("root gradients unsharded + fp32 reduce-scatter input",
                               (b + 4) * root.compute, f"({b}+4)*{root.compute:,}")

    # Activations of one micro-batch.
    kinds: dict[str, int] = {}
    for i in range(n_layers):
        kinds.setdefault("moe" if is_moe_layer(cfg, i) else "dense", i)
    detail = {kind: act.layer_terms(cfg, i, mb) for kind, i in kinds.items()}
    counts = {kind: sum(1 for j in range(n_layers) if ("moe" if is_moe_layer(cfg, j) else "dense") == kind)
              for kind in kinds}
    kept = {kind: (act.layer_saved(cfg, i, mb) if ac == "none" else act.checkpoint_kept(cfg, i, mb, ac))
            for kind, i in kinds.items()}
    what = "saved tensors" if ac == "none" else ("layer input" if ac == "full" else "input + kept exchange outputs")
    for kind in kinds:
        terms[f"acts_{kind}"] = Term(f"activations, {counts[kind]} {kind} layers ({what}, T={t}, expert rows N={rows})",
                                     counts[kind] * kept[kind], f"{counts[kind]} * {kept[kind]:,}")
    acts = [f"acts_{kind}" for kind in kinds]
    roots = act.root_terms(cfg, mb)
    terms["root_acts"] = Term("root activations (ids, rotary, final norm, trunk output, scored rows)",
                              sum(x.bytes for x in roots), " + ".join(f"{x.bytes:,}" for x in roots))
    terms["root_acts_bwd"] = Term("root activations left in the layers' backward (ids, rotary)",
                                  sum(x.bytes for x in roots[:2]), f"{roots[0].bytes:,} + {roots[1].bytes:,}")
    terms["residual_grad"] = Term("residual-stream gradient [T, H]", b * t * h, f"{b}*{t}*{h}")
    worst_set = max(range(n_layers), key=lambda i: act.layer_saved(cfg, i, mb))
    if ac != "none":
        terms["recompute"] = Term(f"recomputed forward of one layer ({ac} checkpointing)",
                                  act.recompute_bytes(cfg, worst_set, mb, ac), f"layer {worst_set}")
    worst = max(range(n_layers), key=lambda i: act.backward_transient(cfg, i, mb))
    terms["bwd_transient"] = Term("activation gradients of one layer's backward (experts' backward)",
                                  act.backward_transient(cfg, worst, mb), f"layer {worst}")
    moe = next((i for i in range(n_layers) if is_moe_layer(cfg, i)), None)
    comm = moe is not None
    if comm:
        terms["comm_fwd"] = act.dispatch_forward(cfg, moe, mb)
        terms["comm_bwd"] = act.dispatch_backward(cfg, moe, mb)
    chunk = min(inp.logprob_chunk_tokens, t)
    terms["lp_fwd"] = act.logprob_forward(cfg, chunk, inp.log_entropy, t, b, inp.fused_logits)
    terms["lp_bwd"] = act.logprob_backward(cfg, chunk, t, b, inp.fused_logits)
    if inp.reference:
        terms["ref_root"] = Term("reference root unit gathered for its forward", b * root.compute,
                                 f"{b} * {root.compute:,}")
        terms["ref_unit"] = Term("reference layer unit gathered", unit_bytes, f"{b}*{unit.compute:,} + 4*{unit.fp32:,}")
        ref_set = act.layer_saved(cfg, worst_set, mb)
        terms["ref_layer"] = Term("reference no-grad forward of one layer (bounded by what its forward saves "
                                  "with grad) + its combine transients", ref_set + (terms["comm_fwd"].bytes if comm else 0),
                                  f"layer {worst_set}")
        terms["ref_lp_fwd"] = act.logprob_forward(cfg, chunk, False, t, b, inp.fused_logits)

    both = []
    if inp.algorithm == "ppo":
        c_root = b * (root.compute - lm_head) + 4 * (h + 1)
        terms["c_root"] = Term("critic root unit gathered (embeddings, final norm, value head)",
                               c_root, f"{b}*{root.compute - lm_head:,} + 4*{h + 1}")
        for kind in kinds:
            terms[f"c_acts_{kind}"] = Term(f"critic activations, {counts[kind]} {kind} layers",
                                           counts[kind] * kept[kind], f"{counts[kind]} * {kept[kind]:,}")
        terms["c_root_acts"] = Term("critic root activations (ids, rotary, final norm, trunk output)",
                                    sum(x.bytes for x in roots[:-1]), " + ".join(f"{x.bytes:,}" for x in roots[:-1]))
        both = ["c_root"] + [f"c_acts_{kind}" for kind in kinds] + ["c_root_acts"]

    if inp.ep_backend == "deepep" and lay.ep > 1:
        tokens = deepep.max_tokens_per_rank(t)
        buf = deepep.elastic_buffer_bytes(lay.ep, inp.gpus_per_node, tokens, h, cfg.num_experts_per_tok)
        terms["deepep"] = Term(f"DeepEP ElasticBuffer (EP {lay.ep}, {tokens} tokens/rank) + workspace",
                               buf + deepep.workspace_bytes(), f"{buf:,} + {deepep.workspace_bytes():,}")
        static_comm = ["deepep"]
    else:
        static_comm = []
    foreach = inp.adamw == "foreach"
    optim_temp = 4 * max(local, critic_local) if foreach else 0
    terms["optim_temp"] = Term("AdamW temporary: fused none; foreach sqrt(exp_avg_sq) fp32 over one group",
                               optim_temp, f"4 * {max(local, critic_local):,}" if foreach else "fused AdamW: 0")

    base = static + static_comm
    early = [k for k in base if n_micro > 1 or k not in ("grads", "c_grads")]  # see the module docstring
    loss = early + ["root", *fwd_units] + acts + ["root_acts"] + both
    recompute = [x for x in ("recompute",) if x in terms]
    backward = early + ["root", "lm_grad", *bwd_units, "unit_grads"] + acts + both + ["root_acts_bwd", "residual_grad"]
    phases = {
        "layer forward": early + ["root", *fwd_units] + acts + ["root_acts_bwd"] + recompute + (["comm_fwd"] if comm else []),
    }
    if inp.reference:
        # The policy's units are resharded after its forward (or all still gathered at world 1).
        policy_units = [] if inp.reshard else ["root", *fwd_units]
        phases["reference forward"] = (early + policy_units + acts + ["root_acts"] + both
                                       + ["ref_root", "ref_unit", "ref_layer"])
        phases["reference loss forward"] = (early + policy_units + acts + ["root_acts"] + both
                                            + ["ref_root", "ref_lp_fwd"])
    phases |= {
        "loss forward": loss + ["lp_fwd"],
        "loss backward": loss + ["lp_bwd"],
        "layer backward": backward + recompute + ["bwd_transient"],
    }
    if comm:
        phases["combine backward"] = backward + recompute + ["comm_bwd"]
        if recompute:
            phases["recompute combine"] = backward + recompute + ["comm_fwd"]
    phases |= {
        "root reduce-scatter": base + ["root", "root_grads"],
        "optimizer step": base + ["root", "optim_temp"],
    }
    overhead = [Term("CUDA context + cuBLAS (CUDA_OVERHEAD_GIB)", int(CUDA_OVERHEAD_GIB * GIB), f"{CUDA_OVERHEAD_GIB} GiB")]
    if inp.collectives == "nccl" and lay.world > 1:
        overhead += [g for g in nccl.trainer_groups(lay, inp.gpus_per_node, inp.ep_backend) if g.bytes]
    return MemoryPlan(inp=inp, micro_batch=mb, micro_batches=n_micro, terms=terms, phases=phases,
                      params=count_params(cfg), layer_detail=detail, overhead_terms=overhead)
