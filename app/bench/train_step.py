"""`moerl bench train-step`: one GRPO trainer step on one device, at real model widths, against a
stock transformers step measured in the same run.

Ours is the trainer's own step (app/trainer/step.py) on the trainer's own layout: a one-rank
process group, app/trainer/parallel.py (FSDP2 with fp32 master weights, ``model.dtype`` compute,
fp32 gradient reduction, the router in fp32, activation checkpointing per decoder layer), AdamW
on the fp32 master weights, micro-batches on a token budget and chunked logprobs through the LM
head (no [B, L, V] tensor). The batch is synthetic GRPO groups (random prompt and completion ids,
0/1 rewards, random engine logprobs) collated by `app.trainer.batch.collate_groups`.

The peers (``--peer``) are stock transformers: its own ``Qwen3MoeForCausalLM`` /
``DeepseekV3ForCausalLM`` with its ``grouped_mm`` experts (``config._experts_implementation``),
the same micro-batches, the same activation checkpointing (transformers' own), and the simplest
GRPO loss on its full logits (``log_softmax`` in fp32, gather, advantage-weighted token mean). It
does less than ours (no TIS, no entropy, no clipping) on purpose: the figure is ours against what
a user would write with the stock model. Two of them:

- ``stock_fsdp2``, the peer that learns: fp32 parameters under FSDP2 (``fully_shard`` per decoder
  layer and the root, on the same one-rank group) with ``MixedPrecisionPolicy(param_dtype=
  <compute dtype>, reduce_dtype=float32)`` and fused fp32 AdamW: the precision ours keeps;
- ``stock_transformers``: parameters and AdamW in the compute dtype, as a plain bf16 fine-tuning loop
  holds them; at RL learning rates (1e-6) its AdamW loses ~99 % of each update
  (tests/test_sharded_trainer.py), so it is the speed of a step that does not train.

Models (``--model``): ``tiny``/``small`` built in code; ``qwen3-30b-a3b`` and ``deepseek-v3`` are
the published configs (app/model/config.real_config) with ``--layers`` decoder layers;
``--experts`` keeps fewer routed experts, e.g. DeepSeek-V3's 32 = what one GPU holds at EP 8 (a
full 256-expert layer's fp32 training state, 181 GB, does not fit one H200).

FLOPs of one step (PaLM's model-FLOPs count, Chowdhery et al. 2022, "PaLM", appendix B):
    6 x N_active x tokens  +  12 x n_layers x n_heads x head_dim x seq_len x tokens
N_active: every parameter a token's matmuls use: attention projections, routers, the top-k of the
E routed experts (expert tensors x K / E), shared experts and the LM head; not the input embedding
(a lookup) and not norms. Recomputation (activation checkpointing, the chunked LM head's
backward) is not counted. MFU = model TFLOP/s / dense matmul TFLOP/s of the same run.

Timing: after warm-up steps, `torch.cuda.Event` pairs around the timed steps and one synchronize
(CUDA); `time.perf_counter` on CPU. Peak memory is `torch.cuda.max_memory_allocated` of the timed
steps (CUDA only), printed beside `moerl plan`'s prediction for the same layout.
"""

from __future__ import annotations

import copy
import gc
import math
import os
from dataclasses import asdict, dataclass
from types import SimpleNamespace

import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from transformers import AutoModelForCausalLM

from app.bench.common import (DTYPES, Marks, check_at_least_one, check_device, dense_matmul_tflops,
                              profile_top)
from app.bench.results import check_out_dir, print_notes_and_write
from app.config import ParallelConfig, RunConfig
from app.layout import resolve_layout
from app.model.config import deepseek_v3_config, num_routed_experts, qwen3_30b_a3b_config, tiny_config, validate_config
from app.model.experts import grouped_mm_supported, local
from app.model.parallel import EPContext
from app.model.policy import build_policy, moe_blocks
from app.plan.memory import PlanInput, plan_memory
from app.trainer.batch import collate_groups, plan_micro_batches, select_rows
from app.trainer.parallel import build_mesh, init_distributed, parallelize
from app.trainer.step import build_optimizer, train_step

# Qwen3-MoE-style policies built in code (tests and quick runs).
MODELS: dict[str, dict] = {
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 head_dim=16, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                 vocab_size=128, max_position_embeddings=512),
    "small": dict(hidden_size=1024, num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=4,
                  head_dim=64, num_experts=64, num_experts_per_tok=8, moe_intermediate_size=256,
                  vocab_size=32768, max_position_embeddings=4096),
}
REAL = ("qwen3-30b-a3b", "deepseek-v3")
# The peers: (figure name, under FSDP2 with fp32 parameters), their profile prefixes and ratios.
PEERS = (("stock_fsdp2", True), ("stock_transformers", False))
PROFILE = {"stock_fsdp2": "fsdp2_peer_profile", "stock_transformers": "peer_profile"}
RATIO = {"stock_fsdp2": "ours tokens/s / stock FSDP2 tokens/s",
         "stock_transformers": "ours tokens/s / stock transformers tokens/s"}
_DIST_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def model_config(name: str, layers: int | None = None, experts: int | None = None):
    """The transformers config of ``--model`` (see MODELS and REAL).

    Args:
        name: a MODELS preset or a REAL model.
        layers: decoder layers for a REAL model (None: all); for DeepSeek-V3 the first layer stays
            dense (``first_k_dense_replace`` = 1) so that the rest are MoE layers.
        experts: routed experts per layer for a REAL model (None: all); DeepSeek-V3 keeps its
            8 groups when they divide the count, else one group.

    Raises:
        ValueError: unknown name, counts above the real model's, or counts the config rejects.
    """
    if name in MODELS:
        return tiny_config("tiny-qwen3-moe", **MODELS[name])
    if name not in REAL:
        raise ValueError(f"--model must be one of {sorted(MODELS) + list(REAL)}, got {name!r}")

    # The flags cut the real model down; more than it has would build (or fail to allocate) a
    # model that is not the one named.
    full = qwen3_30b_a3b_config() if name == "qwen3-30b-a3b" else deepseek_v3_config()
    if layers is not None and layers > full.num_hidden_layers:
        raise ValueError(f"--layers {layers} exceeds {name}'s {full.num_hidden_layers} decoder layers")
    if experts and experts > num_routed_experts(full):
        raise ValueError(f"--experts {experts} exceeds {name}'s {num_routed_experts(full)} routed experts")
    if name == "qwen3-30b-a3b":
        config = qwen3_30b_a3b_config(layers, **({"num_experts": experts} if experts else {}))
    else:
        over: dict = {"first_k_dense_replace": min(1, layers)} if layers is not None else {}
        if experts:
            # Keep DeepSeek-V3's 8 groups (top 4) when they still hold >= 2 experts each.
            groups = dict(n_group=8, topk_group=4) if experts % 8 == 0 and experts // 8 >= 2 else dict(n_group=1, topk_group=1)
            over.update(n_routed_experts=experts, **groups)
        config = deepseek_v3_config(layers, **over)
    validate_config(config, 1)
    return config


def check_model_and_dtype(model: str, dtype: str, real: bool = False) -> None:
    """Raise ValueError unless --model names a MODELS preset (or, with ``real``, a REAL model)
    and --dtype a DTYPES key."""
    names = sorted(MODELS) + (list(REAL) if real else [])
    if model not in names:
        raise ValueError(f"--model must be one of {names}, got {model!r}")
    if dtype not in DTYPES:
        raise ValueError(f"--dtype must be one of {sorted(DTYPES)}, got {dtype!r}")


def check_seq_len(model: str, seq_len: int, flags: str) -> None:
    """Raise ValueError if `seq_len` tokens (the sum of `flags`, e.g. "--prompt-len +
    --completion-len") exceed MODELS preset `model`'s max_position_embeddings."""
    limit = MODELS[model]["max_position_embeddings"] if model in MODELS else None
    if limit is not None and seq_len > limit:
        raise ValueError(f"{flags} ({seq_len}) exceeds the model's max_position_embeddings ({limit})")


def param_counts(model: torch.nn.Module) -> dict:
    """Parameter counts of a policy from `build_policy` (EP size 1).

    Returns:
        dict with ``total`` (all parameters) and ``active`` (per token, for the FLOPs count: routed
        expert tensors scaled by top_k / num_experts; input embedding and 1-D norm weights left out).
    """
    expert = {}
    for _, block in moe_blocks(model):
        for p in block.experts.parameters():
            expert[id(p)] = block.top_k / block.num_local_experts
    embed = id(model.get_input_embeddings().weight)
    total = active = 0.0
    for p in model.parameters():
        total += p.numel()
        if id(p) == embed or p.dim() < 2:
            continue
        active += p.numel() * expert.get(id(p), 1.0)
    lm_head = model.get_output_embeddings().weight
    if lm_head is model.get_input_embeddings().weight:  # tied: the head's matmul still happens
        active += lm_head.numel()
    return {"total": int(total), "active": int(round(active))}


def step_flops(config, active_params: int, batch: int, seq_len: int) -> float:
    """Model FLOPs of one training step (forward + backward), PaLM appendix B (module docstring)."""
    tokens = batch * seq_len
    if config.model_type == "deepseek_v3":
        d_qk = config.num_attention_heads * (config.qk_nope_head_dim + config.qk_rope_head_dim)
        d_v = config.num_attention_heads * config.v_head_dim
        d_attn = (d_qk + d_v) / 2  # QK^T over the qk width, AV over the v width
    else:
        d_attn = config.num_attention_heads * config.head_dim
    return 6.0 * active_params * tokens + 12.0 * config.num_hidden_layers * d_attn * seq_len * tokens


def synthetic_groups(groups: int, group_size: int, prompt_len: int, completion_len: int, vocab: int,
                     seed: int) -> list:
    """GRPO groups shaped like the buffer's (`app.buffer.records.Group`/`Sample` fields that
    `collate_groups` reads), without importing the buffer (it needs redis-py).

    Token ids are drawn from [4, vocab) (0..3 are the special ids), rewards are 0/1, engine
    logprobs lie in [-3, 0).
    """
    gen = torch.Generator().manual_seed(seed)
    out = []
    for g in range(groups):
        prompt = torch.randint(4, vocab, (prompt_len,), generator=gen).tolist()
        samples = []
        for i in range(group_size):
            samples.append(SimpleNamespace(
                sample_id=f"bench/{g}/{i}", prompt_ids=prompt,
                completion_ids=torch.randint(4, vocab, (completion_len,), generator=gen).tolist(),
                logprobs=(-3.0 * torch.rand(completion_len, generator=gen)).tolist(),
                reward=float(torch.randint(0, 2, (), generator=gen)), policy_version=0,
            ))
        out.append(SimpleNamespace(task_id=f"bench-{g}", samples=samples))
    return out


@dataclass
class TrainStepBench:
    """Inputs of the train-step benchmark (the CLI's flags)."""

    model: str = "tiny"
    layers: int = 0  # 0: the model's own count
    experts: int = 0  # 0: the model's own count
    groups: int = 2
    group_size: int = 4
    prompt_len: int = 16
    completion_len: int = 48
    micro_batch_tokens: int = 0  # 0: one micro-batch
    activation_checkpointing: str = "none"
    logprob_chunk_tokens: int = 4096
    dtype: str = "float32"
    device: str = "cpu"
    iters: int = 3
    warmup: int = 1
    dense_n: int = 0  # 0: 8192 on CUDA, 512 on CPU
    peer: bool = True
    profile: bool = False  # one more step under torch.profiler: top kernels/ops by self time
    seed: int = 0

    def check(self) -> None:
        """Raise ValueError naming the first bad flag (before anything is built)."""
        check_model_and_dtype(self.model, self.dtype, real=True)
        if self.activation_checkpointing not in ("none", "full", "selective"):
            raise ValueError(f"--activation-checkpointing must be none, full or selective, got "
                             f"{self.activation_checkpointing!r}")
        check_at_least_one(self, ("groups", "group_size", "prompt_len", "completion_len", "iters",
                                  "logprob_chunk_tokens"))
        for name in ("warmup", "dense_n", "layers", "experts", "micro_batch_tokens"):
            if getattr(self, name) < 0:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 0")
        if (self.layers or self.experts) and self.model in MODELS:
            raise ValueError("--layers and --experts apply to qwen3-30b-a3b and deepseek-v3 only")
        check_seq_len(self.model, self.prompt_len + self.completion_len, "--prompt-len + --completion-len")
        check_device(self.device)

    def run_config(self):
        """The RunConfig of our step: defaults plus the flags that shape the step."""
        cfg = RunConfig()
        t = cfg.trainer
        t.micro_batch_tokens = self.micro_batch_tokens or None
        t.activation_checkpointing = self.activation_checkpointing
        t.logprob_chunk_tokens = self.logprob_chunk_tokens
        cfg.model.dtype = self.dtype
        return cfg


def _ours(bench: TrainStepBench, config, device: torch.device):
    """The trainer's model and optimizer on a one-rank layout; returns (step(), model)."""
    cfg = bench.run_config()
    mesh = build_mesh(resolve_layout(cfg.trainer.parallel, 1), device.type)
    model = build_policy(config, cfg.router, EPContext.local(), device=device, dtype=torch.float32, seed=bench.seed)
    parallelize(model, mesh, DTYPES[bench.dtype], bench.activation_checkpointing)
    # lr tiny: the weights barely move, so every timed step does the same work.
    optimizer = build_optimizer(model.parameters(), 1e-7, cfg.trainer.adam_betas, cfg.trainer.weight_decay, device)
    batch = _batch(bench, config, cfg)

    def step():
        return train_step(cfg, model, optimizer, batch, pad_id=config.pad_token_id or 0, device=device)

    return step, model


def _batch(bench: TrainStepBench, config, cfg):
    groups = synthetic_groups(bench.groups, bench.group_size, bench.prompt_len, bench.completion_len,
                              config.vocab_size, bench.seed)
    return collate_groups(groups, pad_id=config.pad_token_id or 0, scale_by_std=cfg.trainer.scale_by_std)


def _peer(bench: TrainStepBench, config, device: torch.device, fsdp2: bool = False):
    """Stock transformers' model and a plain GRPO step (module docstring): bf16 parameters, or
    with ``fsdp2`` fp32 parameters under FSDP2 mixed precision; returns step()."""
    cfg = bench.run_config()
    config = copy.deepcopy(config)
    config._experts_implementation = "grouped_mm" if device.type == "cuda" else "eager"
    dtype = DTYPES[bench.dtype]
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32 if fsdp2 else dtype)
    if bench.activation_checkpointing != "none":
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    if fsdp2:  # the same one-rank group ours runs on
        mp = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
        for layer in model.model.layers:
            fully_shard(layer, mp_policy=mp)
        fully_shard(model, mp_policy=mp)
    model.train()
    # Fused on CUDA, as transformers' Trainer defaults to (optim="adamw_torch_fused").
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-7, betas=tuple(cfg.trainer.adam_betas),
                                  weight_decay=cfg.trainer.weight_decay, fused=device.type == "cuda" or None)
    batch = _batch(bench, config, cfg)
    plan = plan_micro_batches(batch, cfg.trainer.micro_batch_tokens)
    tokens = batch.completion_mask.sum()

    def step():
        for rows, length in plan:
            mb = select_rows(batch, rows, length).to(device)
            logits = model(input_ids=mb.input_ids, attention_mask=mb.attention_mask).logits[:, :-1]
            logp = torch.log_softmax(logits.float(), -1).gather(-1, mb.input_ids[:, 1:, None]).squeeze(-1)
            mask = mb.completion_mask[:, 1:]
            loss = -(logp * mb.advantages[:, None] * mask).sum() / tokens
            loss.backward()
            del logits, logp, loss
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def _time(step, bench: TrainStepBench, device: torch.device) -> tuple[float, tuple | None, object]:
    """(seconds per step, (peak allocated GB, peak reserved GB) or None, the last step's result)
    after ``bench.warmup`` steps."""
    out = None
    for _ in range(bench.warmup):
        out = step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()  # reserved memory of the timed steps only
        torch.cuda.reset_peak_memory_stats(device)
    marks = Marks(device)
    marks.mark()
    for _ in range(bench.iters):
        out = step()
    marks.mark()
    seconds = marks.intervals()[0] / bench.iters
    peak = ((torch.cuda.max_memory_allocated(device) / 1e9, torch.cuda.max_memory_reserved(device) / 1e9)
            if device.type == "cuda" else None)
    return seconds, peak, out


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _predicted(bench: TrainStepBench, config) -> dict:
    """`moerl plan`'s prediction for this step's one-GPU layout (app/plan/memory.py): live tensors
    at the peak (compare with max_memory_allocated) and device memory (with the allocator's
    fragmentation and CUDA's overhead; compare with max_memory_reserved), GB."""
    try:
        plan = plan_memory(PlanInput(
        config=config, layout=resolve_layout(ParallelConfig(), 1), gpus_per_node=1,
        rollouts_per_gpu=bench.groups * bench.group_size, seq_len=bench.prompt_len + bench.completion_len,
        micro_batch_tokens=bench.micro_batch_tokens or None, activation_checkpointing=bench.activation_checkpointing,
        logprob_chunk_tokens=bench.logprob_chunk_tokens, algorithm="grpo", ep_backend="local",
        compute_dtype=bench.dtype, log_entropy=True))
    except ValueError as e:  # a layout the plan does not model (e.g. a row longer than the micro-batch)
        return {"tensors_gb": float("nan"), "device_gb": float("nan"), "phase": f"not planned: {e}"}
    return {"tensors_gb": plan.tensors_peak / 1e9, "device_gb": plan.predicted / 1e9, "phase": plan.peak_phase}


def run(bench: TrainStepBench, out_dir: str = "runs/bench") -> dict:
    """Build both steps, time them, print a table, write the result.

    Returns:
        dict with ``figures``, ``ratios``, ``notes`` and ``path`` (the JSON result file).

    Raises:
        ValueError: a bad flag (see `TrainStepBench.check`), or a config the model rejects.
    """
    bench.check()
    check_out_dir(out_dir)
    device = torch.device(bench.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    dtype = DTYPES[bench.dtype]
    config = model_config(bench.model, bench.layers or None, bench.experts or None)
    seq_len = bench.prompt_len + bench.completion_len
    if seq_len > config.max_position_embeddings:
        raise ValueError(f"--prompt-len + --completion-len ({seq_len}) exceeds the model's "
                         f"max_position_embeddings ({config.max_position_embeddings})")
    torch.manual_seed(bench.seed)
    created = not dist.is_initialized()
    saved_env = {k: os.environ.get(k) for k in _DIST_ENV}
    if created:
        init_distributed(timeout_s=600)  # a group of one: the layout and FSDP2 need one
    try:
        step, model = _ours(bench, config, device)
        n_rows = bench.groups * bench.group_size
        counts = param_counts(model)
        blocks = moe_blocks(model)
        experts_impl = "grouped_mm" if blocks and grouped_mm_supported(local(blocks[0][1].experts.gate_up_proj).to(dtype)) else "loop"
        ours_s, ours_peak, (applied, stats) = _time(step, bench, device)
        profiled = profile_top(step, device, top=20, families=True) if bench.profile else []
        del step, model
        _free(device)
        peers: dict[str, tuple] = {}  # name -> (seconds, peak)
        peer_notes = []
        for name, fsdp2 in PEERS if bench.peer else ():
            try:
                peer_step = _peer(bench, config, device, fsdp2=fsdp2)
                peer_s, peer_peak, _ = _time(peer_step, bench, device)
                peers[name] = (peer_s, peer_peak)
                if bench.profile:
                    profiled += profile_top(peer_step, device, top=20, prefix=PROFILE[name], families=True)
                del peer_step
            except torch.cuda.OutOfMemoryError as e:  # the stock step may not fit where ours does
                peer_notes.append(f"{name} ran out of memory: {str(e).splitlines()[0][:160]}")
            _free(device)
        dense_n = bench.dense_n or (8192 if device.type == "cuda" else 512)
        dense_tflops = dense_matmul_tflops(device, dtype, dense_n)
    finally:
        if created:
            dist.destroy_process_group()
            for k, v in saved_env.items():  # leave the caller's environment as it was
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v

    flops = step_flops(config, counts["active"], n_rows, seq_len)
    tokens = n_rows * seq_len
    ours_tflops = flops / ours_s / 1e12
    predicted = _predicted(bench, config)
    figures = [
        {"name": "ours", "ms_per_step": ours_s * 1e3, "tokens_per_s": tokens / ours_s, "model_tflops": ours_tflops,
         "mfu_vs_dense": ours_tflops / dense_tflops, "peak_memory_gb": ours_peak[0] if ours_peak else None,
         "peak_reserved_gb": ours_peak[1] if ours_peak else None,
         "plan_tensors_gb": predicted["tensors_gb"], "plan_device_gb": predicted["device_gb"],
         "plan_peak_phase": predicted["phase"],
         "applied": bool(applied), "loss": stats.get("loss"), "micro_batches": stats.get("micro_batches")},
        {"name": "dense_matmul", "n": dense_n, "tflops": dense_tflops},
        *profiled,
    ]
    ratios = {"ours model TFLOP/s / dense matmul TFLOP/s (MFU)": ours_tflops / dense_tflops}
    for k, (name, (peer_s, peer_peak)) in enumerate(peers.items()):
        peer_tflops = flops / peer_s / 1e12
        figures.insert(1 + k, {"name": name, "ms_per_step": peer_s * 1e3, "tokens_per_s": tokens / peer_s,
                               "model_tflops": peer_tflops, "mfu_vs_dense": peer_tflops / dense_tflops,
                               "peak_memory_gb": peer_peak[0] if peer_peak else None})
        ratios[RATIO[name]] = peer_s / ours_s
    if ours_peak is not None:
        ratios["moerl plan tensors / measured max_memory_allocated"] = predicted["tensors_gb"] / ours_peak[0]
        ratios["moerl plan device memory / measured max_memory_reserved"] = predicted["device_gb"] / ours_peak[1]
    notes = [
        "FLOPs/step = 6 x N_active x tokens + 12 x layers x heads x head_dim x seq_len x tokens "
        "(PaLM app. B; N_active excludes the input embedding and norms, routed experts x K/E; recompute not counted)",
        "ours = app.trainer.step.train_step on the trainer's layout (FSDP2, fp32 master weights, "
        f"{bench.dtype} compute, AdamW on fp32, chunked logprobs, TIS, entropy)",
        "stock_fsdp2 = transformers' model (grouped_mm experts on CUDA) under FSDP2, fp32 parameters and fused "
        f"AdamW, {bench.dtype} compute, fp32 reduce; stock_transformers = the same model with parameters and AdamW in "
        f"{bench.dtype}; both: full-vocabulary log_softmax, the same micro-batches and activation checkpointing",
        f"experts: {experts_impl}; routed experts {config.num_experts if config.model_type == 'qwen3_moe' else config.n_routed_experts}"
        f" top-{config.num_experts_per_tok}",
    ]
    notes.extend(peer_notes)
    if ours_peak is None:
        notes.append("peak memory: not measured on CPU")
    if not math.isfinite(stats.get("loss", float("nan"))):
        notes.append("the loss was not finite")
    shape = asdict(bench)
    shape.update(params_total=counts["total"], params_active=counts["active"], rows=n_rows, seq_len=seq_len,
                 tokens_per_step=tokens, flops_per_step=flops, hidden=config.hidden_size,
                 layers=config.num_hidden_layers, vocab=config.vocab_size)

    print(f"GRPO train step  model={bench.model} ({counts['total'] / 1e9:.2f} B params, "
          f"{counts['active'] / 1e9:.2f} B active, {config.num_hidden_layers} layers) batch={n_rows}x{seq_len} "
          f"{bench.dtype} on {device}, micro-batch tokens {bench.micro_batch_tokens or 'all'}, AC "
          f"{bench.activation_checkpointing} ({bench.iters} steps after {bench.warmup} warm-up)")
    print(f"{'':<20}{'ms/step':>10}{'tokens/s':>12}{'TFLOP/s':>10}{'MFU':>8}{'peak GB':>10}")
    for f in figures[: 1 + len(peers)]:
        peak = f"{f['peak_memory_gb']:.1f}" if f["peak_memory_gb"] is not None else "-"
        print(f"{f['name']:<20}{f['ms_per_step']:>10.1f}{f['tokens_per_s']:>12,.0f}{f['model_tflops']:>10.1f}"
              f"{f['mfu_vs_dense']:>8.1%}{peak:>10}")
    print(f"dense matmul {dense_n}^3 {bench.dtype}: {dense_tflops:.1f} TFLOP/s")
    print(f"moerl plan: {predicted['tensors_gb']:.1f} GB of tensors at its peak ({predicted['phase']}), "
          f"{predicted['device_gb']:.1f} GB of device memory"
          + (f"; measured {ours_peak[0]:.1f} GB allocated, {ours_peak[1]:.1f} GB reserved" if ours_peak else ""))
    if profiled:
        unit = "device" if device.type == "cuda" else "CPU"
        for prefix, who in (("profile", "ours"), *((PROFILE[n], n) for n in peers)):
            rows = [f for f in profiled if f["name"].split(":", 1)[0] == prefix]
            if not rows:
                continue
            print(f"profile of one step of {who}, top {len(rows)} by self {unit} time:")
            for f in rows:
                print(f"  {f['self_ms']:>10.2f} ms {f['share']:>6.1%} {f['calls']:>6}x  {f['name'].split(':', 1)[1]}")
            split = [f for f in profiled if f["name"].split(":", 1)[0] in (f"{prefix}_family", f"{prefix}_total")]
            print(f"  by kernel family: " + ", ".join(f"{f['name'].split(':', 1)[1]} {f['self_ms']:.1f} ms" for f in split))
    return print_notes_and_write("train_step", shape, figures, ratios, notes, out_dir)
