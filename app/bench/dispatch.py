"""`moerl bench dispatch`: expert-parallel dispatch + combine bandwidth, one process per EP rank.

Launched by torchrun (one rank per GPU, NCCL; or gloo ranks on CPU for tests). Every rank routes
`tokens` random tokens of width `hidden` to `topk` of `experts` experts (uniform random top-k, as
DeepEP's tests/test_intranode.py does), then times, for each backend in the same run:

  - `alltoall` and `deepep`: `dispatch` + `combine` of `app.model.dispatch.make_dispatcher`, the
    calls the MoE layer makes (routing layout, host syncs and regrouping included), under no_grad,
    with the dispatched rows handed straight back to combine (an identity expert);
  - `deepep-fp8` (DeepEP V1 `Buffer` only): `get_dispatch_layout` + `Buffer.dispatch` of FP8 e4m3
    rows with one fp32 scale per 128 channels (DeepSeek-V3's FP8 dispatch; the cast to FP8 is not
    timed), then BF16 `Buffer.combine` of the received rows. Our dispatcher contract has no FP8 path,
    so this variant calls the DeepEP buffer directly.

Algorithm bandwidth (per rank, GB/s = 1e9 bytes/s), one definition for every backend:

    dispatch_GBps[r] = bytes_out[r] / t_dispatch[r]      combine_GBps[r] = bytes_in[r] / t_combine[r]
    bytes_out[r] = bytes_in[r] = row_bytes x #{(token t of rank r, rank d != r) : t has >= 1 of its
                                 top-k experts on rank d}

i.e. the hidden-state bytes of this rank's tokens that must cross to other ranks, one copy per
destination rank (what DeepEP sends; the copies a rank keeps for its own experts are not counted),
in dispatch out of the rank and in combine back into it. row_bytes = hidden x 2 for bf16, and
hidden + 4 x hidden / 128 for FP8 with its scales. Top-k ids, gate weights and counts are not
counted. This is an algorithm figure: `alltoall` sends one row per (token, expert) pair instead
of one per (token, rank) pair, so it puts more bytes on the wire (reported as ``wire_bytes``) for
the same algorithm bytes. DeepEP's README counts the rows a rank *receives*, its own included; the
``recv_rows_incl_self`` figure allows that comparison. The reference limit is NVLink on an H200:
450 GB/s per direction (18 links x 25 GB/s); ``vs_nvlink`` = per-rank mean GB/s / 450.

Timing: per iteration, a barrier and (CUDA) a synchronize, then timestamps (CUDA events, or
`time.perf_counter` on CPU) before dispatch, between dispatch and combine and after combine;
after `warmup` untimed iterations, each rank's median over `iters` iterations is its time.
Rank 0 gathers every rank's figures and writes the result (app/bench/results.py).

NVLink multicast must stay off on the shared GPU machines: on CUDA the benchmark refuses to start
unless NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1 and NVSHMEM_DISABLE_NVLS=1 are set.
"""

from __future__ import annotations

import os
import statistics
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from app.bench.common import DTYPES, clock, seconds_between
from app.bench.results import print_notes_and_write
from app.model.dispatch import make_dispatcher
from app.model.dispatch.deepep import deepep_unavailable_reason, get_buffer
from app.model.parallel import EPContext
from app.trainer.parallel import init_distributed

NVLINK_GBPS = 450.0  # H200 NVLink 4: 18 links x 25 GB/s per direction
MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
FP8_BLOCK = 128  # channels per FP8 scale (DeepSeek-V3's per-token 1x128 blocks)


def check_multicast_off(cuda: bool, env: dict | None = None) -> None:
    """Refuse to run on CUDA unless NVLink multicast is switched off (the shared machines' rule).

    Raises:
        ValueError: naming every variable of MULTICAST_OFF that is unset or set otherwise.
    """
    if not cuda:
        return
    env = os.environ if env is None else env
    wrong = [f"{k}={v}" for k, v in MULTICAST_OFF.items() if env.get(k) != v]
    if wrong:
        raise ValueError("NVLink multicast must be off on these machines; set " + " ".join(wrong)
                         + " (scripts/gpu_ep_bench.sh does)")


def world_size_from_env() -> int:
    """WORLD_SIZE as torchrun sets it (1 outside torchrun)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def rank_bytes(topk_idx: Tensor, rank: int, num_ranks: int, num_experts: int, row_bytes: float) -> dict:
    """Byte counts of one rank's dispatch (see the module docstring), from its routing alone.

    Args:
        topk_idx: [T, K] int64 global expert ids of this rank's tokens (-1 = no expert).
        rank: this rank; experts [rank * E / R, (rank + 1) * E / R) are local.
        num_ranks: R. num_experts: E (divisible by R). row_bytes: bytes of one hidden row.

    Returns:
        dict with ``tokens_to_rank`` (list of R ints: tokens with >= 1 expert on each rank),
        ``algorithm_bytes`` (row_bytes x tokens sent to ranks other than ``rank``) and
        ``slot_rows_to_others`` (the (token, expert) pairs whose expert is on another rank).
    """
    per_rank = num_experts // num_ranks
    valid = topk_idx >= 0
    dest = torch.where(valid, topk_idx // per_rank, torch.full_like(topk_idx, num_ranks))
    hit = torch.zeros(topk_idx.shape[0], num_ranks + 1, dtype=torch.bool, device=topk_idx.device)
    hit.scatter_(1, dest, True)
    tokens_to_rank = hit[:, :num_ranks].sum(0).tolist()
    to_others = sum(n for d, n in enumerate(tokens_to_rank) if d != rank)
    slots_to_others = int((valid & (dest != rank)).sum())
    return {"tokens_to_rank": tokens_to_rank, "algorithm_bytes": to_others * row_bytes,
            "slot_rows_to_others": slots_to_others}


def uniform_topk(tokens: int, experts: int, topk: int, generator: torch.Generator, device) -> Tensor:
    """[tokens, topk] int64: each token's top-k of random scores, i.e. k distinct uniform experts."""
    scores = torch.rand(tokens, experts, generator=generator)
    return torch.topk(scores, topk, dim=-1).indices.to(device)


def per_token_cast_to_fp8(x: Tensor) -> tuple[Tensor, Tensor]:
    """x [T, H] bf16 (H divisible by 128) -> (x_fp8 [T, H] float8_e4m3fn, scales [T, H/128] fp32).

    Each 1x128 block is scaled so its absolute maximum maps to 448, e4m3's largest normal
    (DeepSeek-V3 report, section 3.3.2; the layout DeepEP's FP8 dispatch takes).
    """
    t, h = x.shape
    blocks = x.view(t, h // FP8_BLOCK, FP8_BLOCK).float()
    amax = blocks.abs().amax(dim=-1).clamp(min=1e-4)
    x_fp8 = (blocks * (448.0 / amax).unsqueeze(-1)).to(torch.float8_e4m3fn).view(t, h)
    return x_fp8, amax / 448.0


def per_token_cast_back(x_fp8: Tensor, scales: Tensor) -> Tensor:
    """Inverse of `per_token_cast_to_fp8` (up to FP8 rounding) -> [T, H] bf16."""
    t, h = x_fp8.shape
    blocks = x_fp8.float().view(t, h // FP8_BLOCK, FP8_BLOCK) * scales.unsqueeze(-1)
    return blocks.view(t, h).to(torch.bfloat16)


@dataclass
class DispatchBench:
    """Inputs of the dispatch benchmark (the CLI's flags); defaults are DeepSeek-V3's settings."""

    hidden: int = 7168
    topk: int = 8
    experts: int = 256
    tokens: int = 4096  # per rank
    dtype: str = "bfloat16"
    backends: str = "auto"  # comma list of alltoall, deepep; auto: alltoall + deepep where it runs
    fp8: bool = True  # add deepep-fp8 where the installed DeepEP has the V1 Buffer
    iters: int = 20
    warmup: int = 5
    seed: int = 0

    def check(self, world: int) -> list[str]:
        """Validate the flags before any work; returns the requested backends (auto unresolved).

        Raises:
            ValueError: naming the first bad flag, or a world size below 2.
        """
        if world < 2:
            raise ValueError(f"the dispatch benchmark needs 2+ ranks (launch with torchrun --nproc-per-node N), "
                             f"WORLD_SIZE={world}")
        for name in ("hidden", "topk", "experts", "tokens", "iters"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name} must be at least 1, got {getattr(self, name)}")
        if self.warmup < 0:
            raise ValueError(f"--warmup must be >= 0, got {self.warmup}")
        if self.dtype not in DTYPES:
            raise ValueError(f"--dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        if self.topk > self.experts:
            raise ValueError(f"--topk={self.topk} is larger than --experts={self.experts}")
        if self.experts % world:
            raise ValueError(f"--experts={self.experts} is not divisible by the {world} ranks")
        names = [b.strip() for b in self.backends.split(",") if b.strip()]
        bad = [b for b in names if b not in ("auto", "alltoall", "deepep")]
        if not names or bad:
            raise ValueError(f"--backends must be 'auto' or a comma list of alltoall, deepep; got {self.backends!r}")
        return names


class _Fp8DeepEP:
    """deepep-fp8: DeepEP V1 Buffer calls with FP8 rows (module docstring); dispatch/combine pair."""

    def __init__(self, group, hidden: int, topk: int, num_experts: int, max_tokens: int):
        self.buffer = get_buffer(group, hidden, hidden * 2, max_tokens, topk)  # sized for bf16 rows
        self.num_experts = num_experts

    def dispatch(self, x_fp8: tuple[Tensor, Tensor], topk_idx: Tensor, topk_weights: Tensor):
        per_rank, per_rdma_rank, per_expert, in_rank, _ = self.buffer.get_dispatch_layout(topk_idx, self.num_experts)
        (recv_x, recv_scales), _, _, _, handle, _ = self.buffer.dispatch(
            x_fp8, topk_idx=topk_idx, topk_weights=topk_weights, num_tokens_per_rank=per_rank,
            num_tokens_per_rdma_rank=per_rdma_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
        )
        return recv_x, recv_scales, handle

    def combine(self, y: Tensor, handle) -> Tensor:
        return self.buffer.combine(y, handle)[0]


def _time_backend(name: str, bench: DispatchBench, group, x: Tensor, topk_idx: Tensor, topk_weights: Tensor,
                  cuda: bool) -> dict:
    """Warm up, check one round trip, then time `iters` dispatch + combine rounds of one backend.

    Returns:
        dict with this rank's median ``dispatch_s`` and ``combine_s`` and the round trip's
        ``max_abs_err`` (combined rows vs topk x the input; the identity expert sums each token's
        topk copies).

    Raises:
        RuntimeError: the round trip did not give back topk x the input (a broken backend).
    """
    if name == "deepep-fp8":
        fp8 = _Fp8DeepEP(group, bench.hidden, bench.topk, bench.experts, bench.tokens)
        x_in = per_token_cast_to_fp8(x)

        def round_trip():
            recv_x, recv_scales, handle = fp8.dispatch(x_in, topk_idx, topk_weights)
            t1 = clock(cuda)
            y = per_token_cast_back(recv_x, recv_scales)  # not timed: stands for the expert
            t2 = clock(cuda)
            return t1, t2, fp8.combine(y, handle)

        # DeepEP combine sums one row per (token, rank): each token comes back (#ranks it visited) x.
        ranks_of = topk_idx // (bench.experts // dist.get_world_size(group))
        hits = torch.zeros(x.shape[0], dist.get_world_size(group), dtype=torch.bool, device=x.device)
        hits.scatter_(1, ranks_of, True)
        expected = per_token_cast_back(*x_in).float() * hits.sum(1, keepdim=True)
        tol = 0.1  # FP8 e4m3 keeps 3 mantissa bits; scales differ between the in- and output
    else:
        ep = EPContext(group=group, rank=dist.get_rank(group), size=dist.get_world_size(group), backend=name)
        dispatcher = make_dispatcher(ep, bench.experts)

        def round_trip():
            d = dispatcher.dispatch(x, topk_idx, topk_weights)
            t1 = clock(cuda)
            return t1, t1, dispatcher.combine(d.x, d.handle)

        expected = x.float() * bench.topk
        tol = 0.02 if x.dtype == torch.bfloat16 else 1e-5

    with torch.no_grad():
        for _ in range(bench.warmup):
            round_trip()
        _, _, out = round_trip()
        err = float((out.float() - expected).abs().max()) if out.numel() else 0.0
        scale = float(expected.abs().max()) if expected.numel() else 1.0
        if err > tol * max(scale, 1.0):
            raise RuntimeError(f"backend {name}: the dispatch+combine round trip is off by {err:.3g} "
                               f"(largest expected value {scale:.3g})")
        disp, comb = [], []
        for _ in range(bench.iters):
            dist.barrier(group)
            if cuda:
                torch.cuda.synchronize()
            t0 = clock(cuda)
            t1, t2, _ = round_trip()
            t3 = clock(cuda)
            if cuda:
                torch.cuda.synchronize()
            disp.append(seconds_between(t0, t1, cuda))
            comb.append(seconds_between(t2, t3, cuda))
    return {"dispatch_s": statistics.median(disp), "combine_s": statistics.median(comb), "max_abs_err": err}


def resolve_backends(names: list[str], fp8: bool, group) -> tuple[list[str], list[str]]:
    """Backends to time, in order, and notes on the ones left out and why."""
    reason = deepep_unavailable_reason(group)
    out, notes = ["alltoall"] if "auto" in names or "alltoall" in names else [], []
    if "auto" in names or "deepep" in names:
        if reason is None:
            out.append("deepep")
        elif "deepep" in names:
            raise ValueError(f"--backends deepep cannot run here: {reason}")
        else:
            notes.append(f"deepep skipped: {reason}")
    if fp8 and "deepep" in out:
        import deep_ep  # noqa: PLC0415 - importable: deepep_unavailable_reason said so

        if hasattr(deep_ep, "ElasticBuffer"):
            notes.append("deepep-fp8 skipped: the installed deep_ep is V2 (ElasticBuffer); FP8 dispatch is "
                         "benchmarked on the V1 Buffer API only")
        else:
            out.append("deepep-fp8")
    elif fp8:
        notes.append("deepep-fp8 skipped: deepep does not run here")
    return out, notes


def run(bench: DispatchBench, out_dir: str = "runs/bench") -> dict | None:
    """Time every backend on this rank; rank 0 prints the table and writes the result.

    Joins (or creates, under torchrun) the process group via `app.trainer.parallel.init_distributed`
    (NCCL on CUDA, gloo on CPU) and leaves it in place for the caller.

    Returns:
        On rank 0, dict with ``figures``, ``ratios``, ``notes`` and ``path``; None elsewhere.

    Raises:
        ValueError: a bad flag, fewer than 2 ranks, or multicast not switched off on CUDA (all
            before the process group is joined); deepep asked for where it cannot run.
        RuntimeError: a backend's round trip gave wrong rows.
    """
    world = world_size_from_env()
    names = bench.check(world)
    check_multicast_off(torch.cuda.is_available())
    rank, world, device = init_distributed(timeout_s=600)
    cuda = device.type == "cuda"
    group = dist.group.WORLD
    backends, notes = resolve_backends(names, bench.fp8, group)
    if bench.dtype != "bfloat16" and any(b.startswith("deepep") for b in backends):
        backends = [b for b in backends if not b.startswith("deepep")]
        notes.append(f"deepep skipped: it moves bfloat16 rows, --dtype is {bench.dtype}")
    if "deepep-fp8" in backends and bench.hidden % FP8_BLOCK:
        backends.remove("deepep-fp8")
        notes.append(f"deepep-fp8 skipped: --hidden={bench.hidden} is not a multiple of {FP8_BLOCK}")
    dtype = DTYPES[bench.dtype]

    gen = torch.Generator().manual_seed(bench.seed * 1000 + rank)
    x = torch.randn(bench.tokens, bench.hidden, generator=gen).to(device=device, dtype=dtype)
    topk_idx = uniform_topk(bench.tokens, bench.experts, bench.topk, gen, device)
    topk_weights = torch.rand(bench.tokens, bench.topk, generator=gen).to(device)
    row_bytes = {"x": bench.hidden * torch.finfo(dtype).bits / 8,
                 "fp8": bench.hidden + 4 * bench.hidden / FP8_BLOCK}
    counts = rank_bytes(topk_idx, rank, world, bench.experts, 1.0)  # rows; x row_bytes per backend

    # Per rank: [rows to others, slot rows to others, rows received incl. own] then per backend
    # [dispatch_s, combine_s, max_abs_err].
    to_rank = torch.tensor(counts["tokens_to_rank"], dtype=torch.float64, device=device)
    all_to_rank = [torch.zeros_like(to_rank) for _ in range(world)]
    dist.all_gather(all_to_rank, to_rank)
    recv_incl_self = float(sum(t[rank] for t in all_to_rank))
    mine = [counts["algorithm_bytes"], counts["slot_rows_to_others"], recv_incl_self]
    for name in backends:
        timed = _time_backend(name, bench, group, x, topk_idx, topk_weights, cuda)
        mine += [timed["dispatch_s"], timed["combine_s"], timed["max_abs_err"]]
    vec = torch.tensor(mine, dtype=torch.float64, device=device)
    gathered = [torch.zeros_like(vec) for _ in range(world)]
    dist.all_gather(gathered, vec)
    if rank != 0:
        return None
    table = [g.tolist() for g in gathered]

    figures, mean_gbps = [], {}
    for i, name in enumerate(backends):
        for j, op in enumerate(("dispatch", "combine")):
            rb = row_bytes["fp8" if name == "deepep-fp8" and op == "dispatch" else "x"]  # combine: --dtype
            per_rank = []
            for r, row in enumerate(table):
                rows_out, slot_rows, recv_rows = row[:3]
                secs = row[3 + 3 * i + j]
                wire_rows = slot_rows if name == "alltoall" else rows_out
                per_rank.append({"rank": r, "ms": secs * 1e3, "gbps": rows_out * rb / secs / 1e9,
                                 "algorithm_bytes": rows_out * rb, "wire_bytes": wire_rows * rb,
                                 "recv_rows_incl_self": recv_rows})
            gbps = [p["gbps"] for p in per_rank]
            mean = sum(gbps) / world
            mean_gbps[(name, op)] = mean
            figures.append({
                "name": f"{name}:{op}", "backend": name, "op": op, "row_bytes": rb,
                "gbps_per_rank_mean": mean, "gbps_per_rank_min": min(gbps), "gbps_per_rank_max": max(gbps),
                "ms_mean": sum(p["ms"] for p in per_rank) / world, "ms_max": max(p["ms"] for p in per_rank),
                "vs_nvlink": mean / NVLINK_GBPS,
                "algorithm_bytes_per_rank_mean": sum(p["algorithm_bytes"] for p in per_rank) / world,
                "wire_bytes_per_rank_mean": sum(p["wire_bytes"] for p in per_rank) / world,
                "round_trip_max_abs_err": max(row[5 + 3 * i] for row in table),
                "per_rank": per_rank,
            })
    ratios = {}
    for other in ("deepep", "deepep-fp8"):
        if other in backends and "alltoall" in backends:
            for op in ("dispatch", "combine"):
                ratios[f"{other}/alltoall {op} GB/s"] = mean_gbps[(other, op)] / mean_gbps[("alltoall", op)]
    notes += [
        "GB/s per rank = bytes of this rank's tokens that cross to other ranks, one row per (token, "
        "destination rank != own) with >= 1 top-k expert there (dispatch: out of the rank, combine: "
        "back in) / that rank's median time; ids, weights and counts not counted; 1 GB = 1e9 bytes",
        f"row bytes: {bench.dtype} {row_bytes['x']:.0f}, fp8 {row_bytes['fp8']:.0f} (e4m3 + one fp32 scale per "
        f"{FP8_BLOCK} channels); combine moves --dtype rows for every backend",
        "wire_bytes: alltoall sends one row per (token, expert on another rank), deepep one per (token, rank)",
        f"vs_nvlink = per-rank mean GB/s / {NVLINK_GBPS:.0f} (H200 NVLink, per direction)",
        "routing: uniform random top-k (DeepEP tests/test_intranode.py), seeded per rank",
        f"timing: median of {bench.iters} iterations after {bench.warmup} warm-up, barrier before each; "
        + ("CUDA events" if cuda else "host clock (CPU: shows the code runs, not a bandwidth)"),
    ]
    if cuda:
        notes.append("multicast off: " + " ".join(f"{k}={os.environ.get(k)}" for k in MULTICAST_OFF))
    shape = asdict(bench)
    shape.update(world_size=world, device=str(device), experts_per_rank=bench.experts // world,
                 backends_run=backends)

    print(f"dispatch+combine  {world} ranks on {device.type}  T={bench.tokens}/rank H={bench.hidden} "
          f"E={bench.experts} K={bench.topk} {bench.dtype}  ({bench.iters} iters after {bench.warmup} warm-up)")
    print(f"{'backend':<12}{'op':<10}{'ms (mean)':>11}{'GB/s/rank':>11}{'min':>9}{'vs NVLink':>11}")
    for f in figures:
        print(f"{f['backend']:<12}{f['op']:<10}{f['ms_mean']:>11.3f}{f['gbps_per_rank_mean']:>11.3g}"
              f"{f['gbps_per_rank_min']:>9.3g}{f['vs_nvlink']:>11.1%}")
    for k, v in ratios.items():
        print(f"{k}: {v:.2f}x")
    return print_notes_and_write("dispatch", shape, figures, ratios, notes, out_dir)
