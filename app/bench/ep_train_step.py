"""`moerl bench ep-train-step`: a multi-rank GRPO trainer step on the trainer's layout, per backend.

Launched by torchrun (one rank per GPU, NCCL; gloo ranks on CPU for tests). For each backend
(`alltoall`, and `deepep` where `deepep_unavailable_reason()` is None) in the same run, every rank:

  - builds the policy preset of `app.bench.train_step.MODELS` with `app.model.policy.build_policy`
    and this rank's experts (the init is seeded per global tensor and expert, so every layout holds
    the same global weights), then shards it as the trainer does (app/trainer/parallel.py: FSDP2
    over every rank, experts over ``--ep`` ranks, fp32 master weights);
  - collates its own synthetic GRPO groups (`app.bench.train_step.synthetic_groups`, seeded by
    rank: every rank is a data-parallel rank, as in the trainer);
  - runs `app.trainer.step.train_step` (micro-batched forward, GRPO loss, backward with FSDP's
    reduce-scatter, global-norm clipping, AdamW; `RunConfig()` defaults) for `warmup` untimed and
    `iters` timed steps.

Figures: tokens/s = world x rows x seq_len per rank (every token is forwarded and backpropagated)
/ the ranks' mean step time; and the share of step time spent in dispatch/combine. That share
comes from timestamps (CUDA events on the compute stream, or the host clock) around every
dispatcher call of every MoE layer: forward dispatch and combine directly, and their backward
(a combine and a dispatch) from the arrival of the output gradient to the departure of the input
gradient, marked by identity autograd functions around the calls (`TimedDispatcher`). Autograd may
run a little unrelated ready work inside a backward span, and the gate-weight gradient path of
dispatch is not marked (it travels with the rows). The first step's full-batch loss of each
backend is recorded: same weights and batch, so it should agree across backends up to the
floating-point order of sums.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from app.bench.common import DTYPES, check_at_least_one, clock, seconds_between
from app.bench.dispatch import check_multicast_off, world_size_from_env
from app.bench.results import print_notes_and_write
from app.bench.train_step import MODELS, check_model_and_dtype, check_seq_len, model_config, synthetic_groups
from app.config import ParallelConfig, RunConfig
from app.layout import resolve_layout
from app.model.config import num_routed_experts
from app.model.dispatch.deepep import deepep_unavailable_reason
from app.model.policy import build_policy, moe_blocks
from app.trainer.batch import collate_groups
from app.trainer.parallel import build_mesh, init_distributed, parallelize
from app.trainer.step import train_step

SPANS = ("dispatch", "combine", "dispatch_backward", "combine_backward")


class CommTimer:
    """Spans of the device timeline (CUDA events or host clock) per kind of dispatcher call."""

    def __init__(self, cuda: bool):
        self.cuda = cuda
        self.spans: dict[str, list] = {k: [] for k in SPANS}
        self._open: dict[tuple, object] = {}
        self._next = 0

    def new_id(self) -> int:
        self._next += 1
        return self._next

    def begin(self, kind: str, span: int) -> None:
        self._open[(kind, span)] = clock(self.cuda)

    def end(self, kind: str, span: int) -> None:
        start = self._open.pop((kind, span), None)
        if start is not None:  # a backward span whose gradient never arrived has no begin
            self.spans[kind].append((start, clock(self.cuda)))

    def reset(self) -> None:
        self.spans = {k: [] for k in SPANS}
        self._open.clear()

    def counts(self) -> dict[str, int]:
        """Closed spans per kind."""
        return {k: len(v) for k, v in self.spans.items()}

    def seconds(self) -> dict[str, float]:
        """Total seconds per kind (synchronizes CUDA first)."""
        if self.cuda:
            torch.cuda.synchronize()
        return {k: sum(seconds_between(a, b, self.cuda) for a, b in v) for k, v in self.spans.items()}


class _BackwardMark(torch.autograd.Function):
    """Identity whose backward opens (begin=True) or closes a span of the timer."""

    @staticmethod
    def forward(ctx, x, timer, kind, span, begin):
        ctx.args = (timer, kind, span, begin)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        timer, kind, span, begin = ctx.args
        (timer.begin if begin else timer.end)(kind, span)
        return grad, None, None, None, None


class TimedDispatcher:
    """Wraps a dispatcher (same contract, app/model/dispatch/__init__.py) and times its calls."""

    def __init__(self, inner, timer: CommTimer):
        self.inner = inner
        self.timer = timer
        self.num_experts = inner.num_experts
        self.num_local_experts = inner.num_local_experts

    def _marks(self, x: Tensor) -> bool:
        return torch.is_grad_enabled() and x.requires_grad

    def dispatch(self, x: Tensor, topk_idx: Tensor, topk_weights: Tensor):
        span = self.timer.new_id()
        graded = self._marks(x)
        if graded:  # backward reaches this mark after dispatch's backward: the span ends
            x = _BackwardMark.apply(x, self.timer, "dispatch_backward", span, False)
        self.timer.begin("dispatch", span)
        d = self.inner.dispatch(x, topk_idx, topk_weights)
        self.timer.end("dispatch", span)
        if graded:  # the gradient of the rows arrives here first: the backward span begins
            d.x = _BackwardMark.apply(d.x, self.timer, "dispatch_backward", span, True)
        return d

    def combine(self, y: Tensor, handle) -> Tensor:
        span = self.timer.new_id()
        graded = self._marks(y)
        if graded:
            y = _BackwardMark.apply(y, self.timer, "combine_backward", span, False)
        self.timer.begin("combine", span)
        out = self.inner.combine(y, handle)
        self.timer.end("combine", span)
        if graded:
            out = _BackwardMark.apply(out, self.timer, "combine_backward", span, True)
        return out


@dataclass
class EPTrainStepBench:
    """Inputs of the EP train-step benchmark (the CLI's flags); batch sizes are per rank."""

    model: str = "tiny"
    groups: int = 2
    group_size: int = 4
    prompt_len: int = 16
    completion_len: int = 48
    dtype: str = "float32"
    backends: str = "auto"  # comma list of alltoall, deepep; auto: alltoall + deepep where it runs
    ep: int = 0  # EP degree; 0: the world size (FSDP then shards only the dense part over the ranks)
    iters: int = 3
    warmup: int = 1
    seed: int = 0

    def check(self, world: int) -> list[str]:
        """Validate the flags before any work; returns the requested backend names.

        Raises:
            ValueError: naming the first bad flag, or fewer than 2 ranks.
        """
        if world < 2:
            raise ValueError(f"the EP train-step benchmark needs 2+ ranks (launch with torchrun "
                             f"--nproc-per-node N), WORLD_SIZE={world}")
        check_model_and_dtype(self.model, self.dtype)
        check_at_least_one(self, ("groups", "group_size", "prompt_len", "completion_len", "iters"))
        if self.warmup < 0:
            raise ValueError(f"--warmup must be >= 0, got {self.warmup}")
        experts = MODELS[self.model]["num_experts"]
        ep = self.ep or world
        if world % ep or experts % ep:
            raise ValueError(f"--ep {ep} must divide the {world} ranks and --model {self.model}'s {experts} experts")
        check_seq_len(self.model, self.prompt_len + self.completion_len, "--prompt-len + --completion-len")
        names = [b.strip() for b in self.backends.split(",") if b.strip()]
        if not names or any(b not in ("auto", "alltoall", "deepep") for b in names):
            raise ValueError(f"--backends must be 'auto' or a comma list of alltoall, deepep; got {self.backends!r}")
        return names


def _time_backend(backend: str, bench: EPTrainStepBench, rank: int, world: int, device: torch.device) -> dict:
    """Build the sharded policy for one backend and time its steps on this rank (collective)."""
    cuda = device.type == "cuda"
    cfg = RunConfig()
    cfg.model.dtype = bench.dtype
    config = model_config(bench.model)
    layout = resolve_layout(ParallelConfig(ep=bench.ep or world), world, num_routed_experts(config))
    mesh = build_mesh(layout, device.type)
    ep = mesh.ep_context(backend)
    # fp32 master weights, the trainer's FSDP2 x EP layout (app/trainer/parallel.py).
    model = build_policy(config, cfg.router, ep, device=device, dtype=torch.float32, seed=bench.seed)
    timer = CommTimer(cuda)
    for _, block in moe_blocks(model):
        block.dispatcher = TimedDispatcher(block.dispatcher, timer)
    parallelize(model, mesh, DTYPES[bench.dtype])
    # lr tiny: the weights barely move, so every timed step does the same work.
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-7, weight_decay=cfg.trainer.weight_decay)
    groups = synthetic_groups(bench.groups, bench.group_size, bench.prompt_len, bench.completion_len,
                              config.vocab_size, bench.seed * 1000 + rank)
    batch = collate_groups(groups, pad_id=config.pad_token_id, scale_by_std=cfg.trainer.scale_by_std)
    tokens = batch.input_ids.numel()

    def step():
        return train_step(cfg, model, optimizer, batch, pad_id=config.pad_token_id or 0, device=device)

    applied, stats = step()  # the first step: its loss is the cross-backend check
    first_loss = stats["loss"]
    for _ in range(max(bench.warmup - 1, 0)):
        step()
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    dist.barrier()
    timer.reset()
    t0 = clock(cuda)
    for _ in range(bench.iters):
        applied, stats = step()
    t1 = clock(cuda)
    comm = timer.seconds()  # synchronizes
    calls = {f"{k}_calls": n / bench.iters for k, n in timer.counts().items()}
    step_s = seconds_between(t0, t1, cuda) / bench.iters
    peak_gb = torch.cuda.max_memory_allocated(device) / 1e9 if cuda else float("nan")
    out = {"step_s": step_s, "tokens": float(tokens), "first_loss": first_loss, "loss": stats["loss"],
           "applied": float(applied), "peak_gb": peak_gb, **{k: v / bench.iters for k, v in comm.items()}, **calls}
    del model, optimizer, batch
    if cuda:
        torch.cuda.empty_cache()
    return out


def run(bench: EPTrainStepBench, out_dir: str = "runs/bench") -> dict | None:
    """Time the EP train step for each backend; rank 0 prints the table and writes the result.

    Joins (or creates, under torchrun) the process group via `app.trainer.parallel.init_distributed`.

    Returns:
        On rank 0, dict with ``figures``, ``ratios``, ``notes`` and ``path``; None elsewhere.

    Raises:
        ValueError: a bad flag, fewer than 2 ranks, or NVLink multicast not off on CUDA (before
            the process group is joined); deepep asked for where it cannot run.
    """
    world = world_size_from_env()
    names = bench.check(world)
    check_multicast_off(torch.cuda.is_available())
    rank, world, device = init_distributed(timeout_s=600)
    reason = deepep_unavailable_reason(dist.group.WORLD)
    if reason is None and bench.dtype != "bfloat16":
        reason = f"it moves bfloat16 rows, --dtype is {bench.dtype}"
    backends, notes = (["alltoall"] if {"auto", "alltoall"} & set(names) else []), []
    if {"auto", "deepep"} & set(names):
        if reason is None:
            backends.append("deepep")
        elif "deepep" in names:
            raise ValueError(f"--backends deepep cannot run here: {reason}")
        else:
            notes.append(f"deepep skipped: {reason}")

    keys = ["step_s", "tokens", "first_loss", "loss", "applied", "peak_gb", *SPANS, *(f"{k}_calls" for k in SPANS)]
    mine = []
    for backend in backends:
        r = _time_backend(backend, bench, rank, world, device)
        mine += [r[k] for k in keys]
    vec = torch.tensor(mine, dtype=torch.float64, device=device)
    gathered = [torch.zeros_like(vec) for _ in range(world)]
    dist.all_gather(gathered, vec)
    if rank != 0:
        return None

    figures, tps = [], {}
    for i, backend in enumerate(backends):
        ranks = [dict(zip(keys, g[i * len(keys):(i + 1) * len(keys)].tolist())) for g in gathered]
        step_s = sum(r["step_s"] for r in ranks) / world
        tokens = sum(r["tokens"] for r in ranks)
        shares = [sum(r[k] for k in SPANS) / r["step_s"] for r in ranks]
        tps[backend] = tokens / step_s
        fig = {"name": f"{backend}:train_step", "backend": backend, "ms_per_step": step_s * 1e3,
               "ms_per_step_max": max(r["step_s"] for r in ranks) * 1e3, "tokens_per_s": tokens / step_s,
               "tokens_per_step": tokens, "dispatch_combine_share": sum(shares) / world,
               "dispatch_combine_share_max": max(shares),
               **{f"{k}_ms": sum(r[k] for r in ranks) / world * 1e3 for k in SPANS},
               **{f"{k}_calls_per_step": ranks[0][f"{k}_calls"] for k in SPANS},
               "first_loss": ranks[0]["first_loss"], "loss": ranks[0]["loss"],
               "applied": all(r["applied"] == 1.0 for r in ranks),
               "peak_memory_gb": max(r["peak_gb"] for r in ranks) if device.type == "cuda" else None,
               "per_rank": [{"rank": j, "ms_per_step": r["step_s"] * 1e3, "dispatch_combine_share": s,
                             **{f"{k}_ms": r[k] * 1e3 for k in SPANS}} for j, (r, s) in enumerate(zip(ranks, shares))]}
        figures.append(fig)
    ratios = {}
    if {"deepep", "alltoall"} <= set(tps):
        ratios["deepep/alltoall tokens/s"] = tps["deepep"] / tps["alltoall"]
        a, b = figures[0]["first_loss"], figures[1]["first_loss"]
        notes.append(f"first-step loss alltoall {a:.6g}, deepep {b:.6g} (same weights and batch)")
    config = model_config(bench.model)
    notes += [
        f"step = app.trainer.step.train_step on the trainer's layout (FSDP2 over all {world} ranks, EP "
        f"{bench.ep or world}, fp32 master weights, {bench.dtype} compute) with RunConfig() defaults",
        "tokens/s = world x rows x seq_len per rank / mean step time over ranks",
        "dispatch_combine_share = (dispatch + combine forward + their backward spans) / step time, per "
        "rank, mean over ranks; spans from " + ("CUDA events" if device.type == "cuda" else "the host clock"),
    ]
    if device.type != "cuda":
        notes.append("CPU (gloo): shows the code runs; not a throughput")
    shape = asdict(bench)
    shape.update(world_size=world, device=str(device), hidden=config.hidden_size, layers=config.num_hidden_layers,
                 experts=config.num_experts, experts_per_rank=config.num_experts // world,
                 topk=config.num_experts_per_tok, seq_len=bench.prompt_len + bench.completion_len,
                 rows_per_rank=bench.groups * bench.group_size, backends_run=backends)

    print(f"EP train step  model={bench.model} EP={world} on {device.type}  {bench.groups}x{bench.group_size} rows "
          f"x {bench.prompt_len + bench.completion_len} tokens per rank, {bench.dtype} "
          f"({bench.iters} steps after {bench.warmup} warm-up)")
    print(f"{'backend':<10}{'ms/step':>10}{'tokens/s':>12}{'disp+comb':>11}{'disp':>9}{'comb':>9}{'disp bwd':>10}{'comb bwd':>10}")
    for f in figures:
        print(f"{f['backend']:<10}{f['ms_per_step']:>10.2f}{f['tokens_per_s']:>12,.0f}{f['dispatch_combine_share']:>11.1%}"
              + "".join(f"{f[f'{k}_ms']:>{9 if k in ('dispatch', 'combine') else 10}.2f}" for k in SPANS))
    for k, v in ratios.items():
        print(f"{k}: {v:.2f}x")
    return print_notes_and_write("ep_train_step", shape, figures, ratios, notes, out_dir)
