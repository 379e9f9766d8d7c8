"""`moerl bench moe`: one MoE layer, forward + backward, ours vs transformers' sparse MoE block.

Measured in the same run, on the same device, dtype, weights and tokens:
  - ours: `app.model.moe.MoEBlock` at EP size 1 (local dispatcher; `torch._grouped_mm` experts on
    CUDA sm90+ with bf16, the per-expert loop elsewhere);
  - transformers' own block (`Qwen3MoeSparseMoeBlock` / `DeepseekV3MoE`) with every experts
    implementation that runs here, chosen through `config._experts_implementation`
    (transformers 5 `ExpertsInterface`: "eager" loop, "grouped_mm");
  - dense-mlp: the same expert GEMMs on the same number of rows without routing (one SwiGLU MLP
    of width I over T*K rows, plus the shared experts for DeepSeek-V3), in plain torch;
  - dense_matmul: one large n x n x n matmul (n = 8192 on CUDA, 512 on CPU) in the run's dtype,
    the device's GEMM ceiling (issue 7's "dense figure").

FLOPs counted (the expert GEMMs only; the router's T*E*H GEMM and elementwise work are not):
    per forward  = 3 GEMMs x 2 flops x T x (K + n_shared) x H x I
    per backward = 2 x forward (input and weight gradients)
    TFLOP/s = 3 x forward FLOPs x iterations / seconds / 1e12
Accuracy (bf16 runs): each implementation against an fp32 copy of itself on the same input:
relative L2 error of the output and the fraction of tokens whose top-k experts differ
(`accuracy_vs_fp32`), so the bf16 figures say what they cost.
Timing: `torch.cuda.Event` pairs around the timed iterations on CUDA (after warm-up, one
synchronize at the end), `time.perf_counter` on CPU.
With `--profile`, one more forward+backward of ours runs under `torch.profiler`; its top 20
kernels (ops on CPU) by self time go into the result as `profile:<name>` figures.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import DeepseekV3Config, Qwen3MoeConfig
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

from app.bench.common import DTYPES, Marks, check_at_least_one, check_device, dense_matmul_tflops, profile_top
from app.bench.results import print_notes_and_write
from app.config import RouterConfig
from app.model.moe import MoEBlock
from app.model.parallel import EPContext


@dataclass
class Shape:
    family: str = "qwen3"
    hidden: int = 256
    intermediate: int = 128
    experts: int = 16
    topk: int = 4
    tokens: int = 512
    dtype: str = "float32"
    device: str = "cpu"
    iters: int = 5
    warmup: int = 2
    seed: int = 0
    profile: bool = False  # one more fwd+bwd of ours under torch.profiler: top kernels by self time


def make_config(shape: Shape):
    """A transformers config for one MoE layer of the given shape.

    DeepSeek-V3 gets one shared expert and the largest n_group in (8, 4, 2, 1) that divides the
    experts into groups of at least 2 with top-k reachable from half the groups.
    """
    common = dict(hidden_size=shape.hidden, moe_intermediate_size=shape.intermediate,
                  num_experts_per_tok=shape.topk, norm_topk_prob=True, hidden_act="silu",
                  num_attention_heads=1, num_key_value_heads=1)
    if shape.family == "qwen3":
        return Qwen3MoeConfig(num_experts=shape.experts, **common)
    if shape.family == "deepseek-v3":
        for n_group in (8, 4, 2, 1):
            per_group = shape.experts // n_group
            topk_group = max(1, n_group // 2)
            if shape.experts % n_group == 0 and per_group >= 2 and topk_group * per_group >= shape.topk:
                break
        else:
            raise ValueError(f"--experts={shape.experts} cannot be grouped for DeepSeek-V3 routing")
        return DeepseekV3Config(n_routed_experts=shape.experts, n_group=n_group, topk_group=topk_group,
                                n_shared_experts=1, routed_scaling_factor=2.5, **common)
    raise ValueError(f"--family must be qwen3 or deepseek-v3, got {shape.family!r}")


class DenseBaseline(nn.Module):
    """The same expert GEMMs without routing: SwiGLU of width I over T*K rows (+ shared experts)."""

    def __init__(self, hidden: int, intermediate: int, top_k: int, shared_intermediate: int):
        super().__init__()
        self.top_k = top_k
        self.gate_up = nn.Linear(hidden, 2 * intermediate, bias=False)
        self.down = nn.Linear(intermediate, hidden, bias=False)
        self.shared = None
        if shared_intermediate:
            self.shared = nn.ModuleList([nn.Linear(hidden, 2 * shared_intermediate, bias=False),
                                         nn.Linear(shared_intermediate, hidden, bias=False)])

    def forward(self, x):
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        rows = x.repeat(self.top_k, 1)
        gate, up = self.gate_up(rows).chunk(2, dim=-1)
        out = self.down(F.silu(gate) * up).view(self.top_k, *x.shape).sum(0)
        if self.shared is not None:
            gate, up = self.shared[0](x).chunk(2, dim=-1)
            out = out + self.shared[1](F.silu(gate) * up)
        return out.view(shape)


def time_fwd_bwd(module: nn.Module, x: torch.Tensor, grad: torch.Tensor, iters: int, warmup: int) -> float:
    """Seconds per forward+backward iteration (input and parameter gradients)."""

    def step():
        for p in module.parameters():
            p.grad = None
        x.grad = None
        module(x).backward(grad)

    for _ in range(warmup):
        step()
    if x.is_cuda:
        torch.cuda.synchronize(x.device)
    marks = Marks(x.device)
    marks.mark()
    for _ in range(iters):
        step()
    marks.mark()
    return marks.intervals()[0] / iters


def compare_outputs(ours: nn.Module, stock: nn.Module, x: torch.Tensor, grad: torch.Tensor) -> dict:
    """Relative max-abs differences (ours vs stock) of the output, the input gradient and the expert
    weight gradients, from one forward+backward on the same input. Differences in bf16 come from
    rounding (fp32 router in ours, other summation order), not from different routing.
    """
    results = {}
    outs = []
    for module in (ours, stock):
        for p in module.parameters():
            p.grad = None
        x.grad = None
        out = module(x)
        out.backward(grad)
        outs.append((out.detach().float(), x.grad.detach().float(),
                     module.experts.gate_up_proj.grad.float(), module.experts.down_proj.grad.float()))
    for name, a, b in zip(("out", "input_grad", "gate_up_grad", "down_grad"), *outs):
        results[f"rel_err_{name}"] = float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))
    return results


def _topk_of(module: nn.Module):
    """A forward hook on ``module.gate`` that keeps the last [T, K] integer tensor it returns
    (our Router's ``topk_idx``; transformers' routers return their indices in a tuple)."""
    seen: dict = {}

    def find(out):
        if isinstance(out, torch.Tensor):
            return out if not out.is_floating_point() and out.dim() == 2 else None
        if isinstance(out, (tuple, list)):
            return next((t for t in map(find, out) if t is not None), None)
        return find(getattr(out, "topk_idx", None)) if hasattr(out, "topk_idx") else None

    handle = module.gate.register_forward_hook(lambda _m, _i, out: seen.__setitem__("idx", find(out)))
    return seen, handle


@torch.no_grad()
def accuracy_vs_fp32(module: nn.Module, x: torch.Tensor) -> dict:
    """How a low-precision layer departs from the same layer in fp32 on the same input: relative
    L2 error of the output, ||y - y_fp32|| / ||y_fp32||, and the fraction of tokens whose top-k
    expert set differs (a flipped expert changes a token's output by far more than rounding).

    Args:
        module: the layer in the run's dtype (bf16); copied to fp32 for the reference.
        x: [1, T, H] input in the run's dtype.
    """
    ref = copy.deepcopy(module).float()
    got_idx, h1 = _topk_of(module)
    ref_idx, h2 = _topk_of(ref)
    try:
        y = module(x.detach()).float()
        y_ref = ref(x.detach().float())
    finally:
        h1.remove()
        h2.remove()
    if isinstance(y, tuple):  # transformers' DeepseekV3MoE returns a tensor; guard for tuples
        y, y_ref = y[0], y_ref[0]
    out = {"rel_err_vs_fp32": float((y - y_ref).norm() / y_ref.norm().clamp_min(1e-30))}
    a, b = got_idx.get("idx"), ref_idx.get("idx")
    if a is not None and b is not None and a.shape == b.shape:
        out["topk_differs_frac"] = float((a.sort(-1).values != b.sort(-1).values).any(-1).float().mean())
    return out


def stock_block(config, implementation: str) -> nn.Module:
    config = copy.deepcopy(config)
    config._experts_implementation = implementation
    return (Qwen3MoeSparseMoeBlock if config.model_type == "qwen3_moe" else DeepseekV3MoE)(config)


def run(shape: Shape, out_dir: str = "runs/bench") -> dict:
    """Measure every variant, print the table and ratios, write the result file. Returns the result dict.

    Raises:
        ValueError: an unknown --dtype/--family/--device, or a shape MoEBlock rejects.
    """
    if shape.dtype not in DTYPES:
        raise ValueError(f"--dtype must be one of {sorted(DTYPES)}, got {shape.dtype!r}")
    check_at_least_one(shape, ("iters", "tokens", "hidden", "intermediate"))
    if shape.warmup < 0:
        raise ValueError(f"--warmup must be at least 0, got {shape.warmup}")
    check_device(shape.device)
    device = torch.device(shape.device)
    dtype = DTYPES[shape.dtype]
    config = make_config(shape)
    torch.manual_seed(shape.seed)

    ours = MoEBlock(config, RouterConfig(), EPContext.local())
    ours.reset_parameters()
    ours.to(device=device, dtype=dtype)
    n_shared = 1 if shape.family == "deepseek-v3" else 0
    dense = DenseBaseline(shape.hidden, shape.intermediate, shape.topk, n_shared * shape.intermediate)
    dense.to(device=device, dtype=dtype)
    variants: list[tuple[str, nn.Module]] = [("ours", ours)]
    notes = []
    for impl in ("eager", "grouped_mm"):
        stock = stock_block(config, impl)
        stock.load_state_dict({k: v.float() for k, v in ours.state_dict().items()}, strict=True)
        stock.to(device=device, dtype=dtype)
        variants.append((f"transformers-{impl}", stock))
    variants.append(("dense-mlp", dense))

    x = torch.randn(1, shape.tokens, shape.hidden, device=device, dtype=dtype, requires_grad=True)
    grad = torch.randn_like(x)
    fwd_flops = 3 * 2 * shape.tokens * (shape.topk + n_shared) * shape.hidden * shape.intermediate
    figures = []
    for name, module in variants:
        try:
            seconds = time_fwd_bwd(module, x, grad, shape.iters, shape.warmup)
        except (RuntimeError, NotImplementedError, KeyError) as e:
            notes.append(f"{name} skipped: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
            continue
        figures.append({
            "name": name,
            "ms_per_iter": seconds * 1e3,
            "tokens_per_s": shape.tokens / seconds,
            "tflops": 3 * fwd_flops / seconds / 1e12,
        })
    if shape.profile:
        def one_step():
            for p in ours.parameters():
                p.grad = None
            x.grad = None
            ours(x).backward(grad)

        figures.extend(profile_top(one_step, device, top=20))
    if dtype != torch.float32:  # what bf16 costs each implementation against its own fp32 self
        for name, module in variants:
            if name == "ours" or name in ("transformers-eager", "transformers-grouped_mm") and name in {
                    f["name"] for f in figures}:
                figures.append({"name": f"accuracy:{name}", **accuracy_vs_fp32(module, x)})
    agreement = compare_outputs(variants[0][1], variants[1][1], x, grad)
    notes.append("ours vs transformers-eager on the same input: " + ", ".join(f"{k}={v:.3g}" for k, v in agreement.items()))
    timed = [f for f in figures if not f["name"].startswith("profile:")]
    by_name = {f["name"]: f for f in timed}
    ratios = {}
    if "ours" in by_name:
        for f in timed:
            if f["name"] != "ours" and "tokens_per_s" in f:
                ratios[f"ours/{f['name']} tokens_per_s"] = by_name["ours"]["tokens_per_s"] / f["tokens_per_s"]
    matmul_n = 8192 if device.type == "cuda" else 512
    matmul = {"name": "dense_matmul", "n": matmul_n, "tflops": dense_matmul_tflops(device, dtype, matmul_n)}
    figures.append(matmul)
    if "ours" in by_name:
        ratios["ours TFLOP/s / dense_matmul TFLOP/s"] = by_name["ours"]["tflops"] / matmul["tflops"]
    notes.append("FLOPs = 3 (fwd+2x bwd) x 3 GEMMs x 2 x T x (K + n_shared) x H x I; router GEMM not counted")
    notes.append(f"ours experts implementation: {ours.experts.implementation} "
                 f"(auto -> grouped_mm on CUDA sm90+ bf16, else loop)")

    print(f"MoE layer fwd+bwd  family={shape.family} H={shape.hidden} I={shape.intermediate} "
          f"E={shape.experts} K={shape.topk} T={shape.tokens} {shape.dtype} on {device} "
          f"({shape.iters} iters after {shape.warmup} warm-up)")
    print(f"{'variant':<26}{'ms/iter':>12}{'tokens/s':>14}{'TFLOP/s':>10}")
    for f in timed:
        if f["name"].startswith("accuracy:"):
            print(f"{f['name']:<26} rel. error vs fp32 {f['rel_err_vs_fp32']:.3g}, top-k differs on "
                  f"{f.get('topk_differs_frac', float('nan')):.2%} of tokens")
            continue
        print(f"{f['name']:<26}{f['ms_per_iter']:>12.2f}{f['tokens_per_s']:>14.0f}{f['tflops']:>10.3f}")
    print(f"{'dense_matmul ' + str(matmul_n) + '^3':<26}{'':>12}{'':>14}{matmul['tflops']:>10.3f}")
    for f in figures:
        if f["name"].startswith("profile:"):
            print(f"{f['share']:>6.1%} {f['self_ms']:>9.3f} ms {f['calls']:>4}x  {f['name'][8:]}")
    for k, v in ratios.items():
        print(f"ratio {k}: {v:.2f}x")
    return print_notes_and_write("moe", shape.__dict__.copy(), figures, ratios, notes, out_dir)
