"""`moerl bench train-step`: one GRPO trainer step of a small MoE policy on one device.

The step is the trainer's own: the policy from `app.model.policy.build_policy` (transformers'
Qwen3-MoE with our MoE blocks), a batch collated by `app.trainer.batch.collate_groups` from
synthetic GRPO groups (random prompt and completion ids, 0/1 rewards, random engine logprobs),
and `app.trainer.train.train_step` (forward, `token_logprobs`, `grpo_loss` with TIS, entropy,
backward, global-norm clipping, AdamW) with the `RunConfig` defaults. Measured in the same run:

  - step: `train_step` end to end -> ms/step, tokens/s (rows x (prompt + completion) tokens, all
    of which the forward and backward process), model TFLOP/s, MFU, peak memory;
  - split: the same work done piece by piece with device timestamps between the pieces:
    forward (+ logprobs, loss, entropy) | backward | optimizer (clip + AdamW + zero_grad);
  - dense: an n x n x n matmul in the run's dtype (`torch.matmul`), the device's GEMM ceiling.

FLOPs of one step (PaLM's model-FLOPs count, Chowdhery et al. 2022, "PaLM", appendix B):
    6 x N_active x tokens  +  12 x n_layers x n_heads x head_dim x seq_len x tokens
N_active: every parameter a token's matmuls use: attention projections, routers, the top-k of the
E routed experts (expert tensors x K / E), shared experts and the LM head; not the input embedding
(a lookup) and not norms. The second term is attention's QK^T and AV, counted for the full
(non-causal) L x L square as PaLM does. The entropy pass, softmaxes and optimizer are not counted.
MFU here = model TFLOP/s / dense matmul TFLOP/s of the same run (not the datasheet peak).

Timing: after warm-up steps, `torch.cuda.Event` pairs around the timed region and one
synchronize before the timers are read (CUDA); `time.perf_counter` on CPU. Peak memory is
`torch.cuda.max_memory_allocated` over the timed steps (CUDA only).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from types import SimpleNamespace

import torch

from app.bench.common import (DTYPES, Marks, check_at_least_one, check_device, dense_matmul_tflops,
                              profile_top)
from app.bench.results import print_notes_and_write

# Qwen3-MoE-style policies built in code. "small" (~0.49 B parameters, ~0.1 B active) is the GPU
# benchmark model: Qwen3-30B-A3B's shape ratios (GQA 4:1, 8 of many narrow experts) scaled down.
MODELS: dict[str, dict] = {
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 head_dim=16, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                 vocab_size=128, max_position_embeddings=512),
    "small": dict(hidden_size=1024, num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=4,
                  head_dim=64, num_experts=64, num_experts_per_tok=8, moe_intermediate_size=256,
                  vocab_size=32768, max_position_embeddings=4096),
}


def model_config(name: str):
    """A `Qwen3MoeConfig` for preset ``name`` (see MODELS), built with `app.model.config.tiny_config`.

    Raises:
        ValueError: unknown preset name.
    """
    from app.model.config import tiny_config

    if name not in MODELS:
        raise ValueError(f"--model must be one of {sorted(MODELS)}, got {name!r}")
    return tiny_config("tiny-qwen3-moe", **MODELS[name])


def check_model_and_dtype(model: str, dtype: str) -> None:
    """Raise ValueError unless --model names a MODELS preset and --dtype a DTYPES key."""
    if model not in MODELS:
        raise ValueError(f"--model must be one of {sorted(MODELS)}, got {model!r}")
    if dtype not in DTYPES:
        raise ValueError(f"--dtype must be one of {sorted(DTYPES)}, got {dtype!r}")


def check_seq_len(model: str, seq_len: int, flags: str) -> None:
    """Raise ValueError if `seq_len` tokens (the sum of `flags`, e.g. "--prompt-len +
    --completion-len") exceed preset `model`'s max_position_embeddings."""
    limit = MODELS[model]["max_position_embeddings"]
    if seq_len > limit:
        raise ValueError(f"{flags} ({seq_len}) exceeds the model's max_position_embeddings ({limit})")


def param_counts(model: torch.nn.Module) -> dict:
    """Parameter counts of a policy from `build_policy` (EP size 1).

    Returns:
        dict with ``total`` (all parameters) and ``active`` (per token, for the FLOPs count: routed
        expert tensors scaled by top_k / num_experts; input embedding and 1-D norm weights left out).
    """
    from app.model.policy import moe_blocks

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
    groups: int = 2
    group_size: int = 4
    prompt_len: int = 16
    completion_len: int = 48
    dtype: str = "float32"
    device: str = "cpu"
    iters: int = 3
    warmup: int = 1
    dense_n: int = 0  # 0: 8192 on CUDA, 512 on CPU
    profile: bool = False  # one more step under torch.profiler: top kernels/ops by self time
    seed: int = 0

    def check(self) -> None:
        """Raise ValueError naming the first bad flag (before anything is built)."""
        check_model_and_dtype(self.model, self.dtype)
        check_at_least_one(self, ("groups", "group_size", "prompt_len", "completion_len", "iters"))
        if self.warmup < 0 or self.dense_n < 0:
            raise ValueError("--warmup and --dense-n must be >= 0")
        check_device(self.device)


def _one_rank_group() -> bool:
    """`train_step` asks torch.distributed for the world size: give it a group of one (gloo,
    in-memory store; no collective runs with one rank). Returns True if we created it."""
    import torch.distributed as dist

    if dist.is_initialized():
        return False
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    return True


def run(bench: TrainStepBench, out_dir: str = "runs/bench") -> dict:
    """Build the policy and batch, time the step and its parts, print a table, write the result.

    Returns:
        dict with ``figures``, ``ratios``, ``notes`` and ``path`` (the JSON result file).

    Raises:
        ValueError: a bad flag (see `TrainStepBench.check`), or a config the model rejects.
    """
    import torch.distributed as dist

    from app.config import RouterConfig, RunConfig
    from app.model.parallel import EPContext
    from app.model.experts import grouped_mm_supported
    from app.model.policy import build_policy, moe_blocks
    from app.trainer.batch import collate_groups
    from app.trainer.grpo import grpo_loss, token_entropy, token_logprobs
    from app.trainer.train import clip_grad_norm, train_step

    bench.check()
    device = torch.device(bench.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    dtype = DTYPES[bench.dtype]
    config = model_config(bench.model)
    seq_len = bench.prompt_len + bench.completion_len
    check_seq_len(bench.model, seq_len, "--prompt-len + --completion-len")
    cfg = RunConfig()
    torch.manual_seed(bench.seed)
    created_group = _one_rank_group()
    try:
        model = build_policy(config, RouterConfig(), EPContext.local(), device=device, dtype=dtype, seed=bench.seed)
        params = [p for p in model.parameters() if p.requires_grad]
        # lr tiny: the weights barely move, so every timed step does the same work.
        optimizer = torch.optim.AdamW(params, lr=1e-7, weight_decay=cfg.trainer.weight_decay)
        groups = synthetic_groups(bench.groups, bench.group_size, bench.prompt_len, bench.completion_len,
                                  config.vocab_size, bench.seed)
        batch = collate_groups(groups, pad_id=config.pad_token_id, scale_by_std=cfg.trainer.scale_by_std).to(device)
        n_rows = batch.input_ids.shape[0]
        counts = param_counts(model)
        first = moe_blocks(model)[0][1].experts
        experts_impl = first.implementation
        if experts_impl == "auto":
            experts_impl = "grouped_mm" if grouped_mm_supported(first.gate_up_proj) else "loop"
        flops = step_flops(config, counts["active"], n_rows, seq_len)
        tokens = n_rows * seq_len

        # 1) the trainer's step, end to end.
        for _ in range(bench.warmup):
            train_step(cfg, model, None, optimizer, batch, params, [])
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
        marks = Marks(device)
        marks.mark()
        for _ in range(bench.iters):
            applied, stats = train_step(cfg, model, None, optimizer, batch, params, [])
        marks.mark()
        step_s = marks.intervals()[0] / bench.iters
        peak_gb = torch.cuda.max_memory_allocated(device) / 1e9 if device.type == "cuda" else None

        # 2) the same work piece by piece, a timestamp between the pieces.
        t = cfg.trainer
        temp = cfg.rollout.temperature
        denominator = batch.completion_mask.sum()
        marks = Marks(device)
        for _ in range(bench.iters):
            marks.mark()
            model.train()
            logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
            logp = token_logprobs(logits, batch.input_ids, temp)
            out = grpo_loss(logp, logp.detach(), batch.advantages, batch.completion_mask,
                            clip_eps_low=t.clip_eps_low, clip_eps_high=t.clip_eps_high, loss_agg=t.loss_agg,
                            denominator=denominator, rollout_logprobs=batch.rollout_logprobs, tis_cap=t.tis_cap)
            if t.log_entropy:
                (token_entropy(logits.detach(), temp) * batch.completion_mask).sum()
            marks.mark()
            out.loss.backward()
            marks.mark()
            clip_grad_norm(params, [], t.grad_clip)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            marks.mark()
            del logits, logp, out
        iv = marks.intervals()
        # marks: [s0, f0, b0, o0, s1, ...]; the gap o_i -> s_{i+1} is host time between iterations.
        parts = {"forward": 0.0, "backward": 0.0, "optimizer": 0.0}
        for i in range(bench.iters):
            base = 4 * i
            parts["forward"] += iv[base]
            parts["backward"] += iv[base + 1]
            parts["optimizer"] += iv[base + 2]
        parts = {k: v / bench.iters for k, v in parts.items()}
        split_s = sum(parts.values())

        # 3) optionally, where one more step spends its time.
        profiled = []
        if bench.profile:
            profiled = profile_top(lambda: train_step(cfg, model, None, optimizer, batch, params, []), device)

        # 4) the dense GEMM ceiling.
        dense_n = bench.dense_n or (8192 if device.type == "cuda" else 512)
        dense_tflops = dense_matmul_tflops(device, dtype, dense_n)
    finally:
        if created_group:
            dist.destroy_process_group()

    model_tflops = flops / step_s / 1e12
    figures = [
        {"name": "train_step", "ms_per_step": step_s * 1e3, "tokens_per_s": tokens / step_s,
         "model_tflops": model_tflops, "mfu_vs_dense": model_tflops / dense_tflops,
         "peak_memory_gb": peak_gb, "applied": bool(applied), "loss": stats.get("loss")},
        *({"name": f"split:{k}", "ms_per_step": v * 1e3, "share": v / split_s} for k, v in parts.items()),
        {"name": "split:total", "ms_per_step": split_s * 1e3, "share": 1.0},
        {"name": "dense_matmul", "n": dense_n, "tflops": dense_tflops},
        *profiled,
    ]
    ratios = {
        "train_step model TFLOP/s / dense matmul TFLOP/s (MFU)": model_tflops / dense_tflops,
        "split total / train_step time": split_s / step_s,
    }
    notes = [
        "FLOPs/step = 6 x N_active x tokens + 12 x layers x heads x head_dim x seq_len x tokens "
        "(PaLM app. B; N_active excludes the input embedding and norms, routed experts x K/E)",
        "train_step = app.trainer.train.train_step with RunConfig() defaults (TIS cap, entropy on, AdamW)",
        "split = the same calls run piece by piece; forward includes logprobs, GRPO loss and entropy",
        f"attention implementation: {getattr(model.config, '_attn_implementation', None)}; experts: {experts_impl}",
    ]
    if peak_gb is None:
        notes.append("peak memory: not measured on CPU")
    shape = asdict(bench)
    shape.update(params_total=counts["total"], params_active=counts["active"], rows=n_rows, seq_len=seq_len,
                 tokens_per_step=tokens, flops_per_step=flops, hidden=config.hidden_size,
                 layers=config.num_hidden_layers, experts=config.num_experts, topk=config.num_experts_per_tok,
                 moe_intermediate=config.moe_intermediate_size, vocab=config.vocab_size)

    print(f"GRPO train step  model={bench.model} ({counts['total'] / 1e6:.1f} M params, "
          f"{counts['active'] / 1e6:.1f} M active) batch={n_rows}x{seq_len} {bench.dtype} on {device} "
          f"({bench.iters} steps after {bench.warmup} warm-up)")
    print(f"{'part':<20}{'ms/step':>12}{'share':>8}")
    for k, v in parts.items():
        print(f"{k:<20}{v * 1e3:>12.2f}{v / split_s:>8.1%}")
    print(f"{'split total':<20}{split_s * 1e3:>12.2f}")
    print(f"{'train_step':<20}{step_s * 1e3:>12.2f}   tokens/s {tokens / step_s:,.0f}   "
          f"model TFLOP/s {model_tflops:.3f}")
    print(f"dense matmul {dense_n}^3 {bench.dtype}: {dense_tflops:.3f} TFLOP/s")
    print(f"MFU vs dense: {model_tflops / dense_tflops:.1%}" + (f"   peak memory {peak_gb:.2f} GB" if peak_gb else ""))
    if profiled:
        print(f"profile of one train_step, top {len(profiled)} by self {'device' if device.type == 'cuda' else 'CPU'} time:")
        for f in profiled:
            print(f"  {f['self_ms']:>10.2f} ms {f['share']:>6.1%} {f['calls']:>6}x  {f['name'][len('profile:'):]}")
    if not math.isfinite(stats.get("loss", float("nan"))):
        notes.append("the loss was not finite")
    return print_notes_and_write("train_step", shape, figures, ratios, notes, out_dir)
