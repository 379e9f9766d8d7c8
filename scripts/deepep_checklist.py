"""First-run checklist of the DeepEP backend (issue 20): what must hold before a deepep figure counts.

Two parts.

`python scripts/deepep_checklist.py --preflight` (any machine, no GPU needed): the facts that decide
whether the installed `deep_ep` can load and run: torch's version and CUDA build, the `sgl-deep-ep`
wheel and its pins (Requires-Dist), the NCCL that torch pins and the nvidia-nccl wheel installed,
`EP_NCCL_ROOT_DIR`, `nvcc` (DeepEP compiles its kernels on first use; the wheel asserts NVCC >= 12.3)
under `CUDA_HOME`, the libnccl mapped into the process and its version, and
`deepep_unavailable_reason()`. It prints them and the problems it sees; it exits 0.

`torchrun --nproc-per-node N scripts/deepep_checklist.py --out DIR` (N GPUs): for each EP size k in
2, 4, 8 (those <= N), on ranks 0..k-1: build the DeepEP buffer (retrying once with EP_DISABLE_GIN=1
when DeepEP reports NCCL GIN unavailable, as it can on one node), then run a deepep MoE layer and an
alltoall one with the same weights and inputs, forward and backward in bf16 at hidden 256, and
compare outputs, input gradients, expert and router gradients (relative L2 error < 2e-2) and
tokens per expert (exactly), in these cases: natural routing, a rank with no tokens, -1 slots,
all tokens routed to one rank, and a larger batch that makes the buffer grow. It also records the
first call's time (DeepEP compiles its kernels then) against the second, the NCCL version loaded,
and run-to-run determinism: two dispatch + combine rounds of an `ElasticBuffer(deterministic=True)`
must match bit for bit (the layer itself, on the default buffer, is only reported). Rank 0 writes
DIR/deepep_checklist.json; the exit status is 1 if a check failed.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

BF16_REL = 2e-2  # bf16 keeps 8 mantissa bits; expert GEMMs see the rows in another order
HIDDEN = 256  # the smallest width DeepEP's combine accepts (app.model.dispatch.deepep.HIDDEN_MULTIPLE)


def _dist_requires(name: str) -> tuple[str | None, list[str]]:
    try:
        d = importlib.metadata.distribution(name)
    except importlib.metadata.PackageNotFoundError:
        return None, []
    return d.version, list(d.requires or [])


def _nvcc() -> dict:
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    exe = shutil.which("nvcc") or (home and shutil.which("nvcc", path=os.path.join(home, "bin")))
    if not exe:
        return {"nvcc": None}
    out = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=60).stdout
    m = re.search(r"release (\d+)\.(\d+)", out)
    release = (int(m.group(1)), int(m.group(2))) if m else None
    return {"nvcc": exe, "nvcc_release": ".".join(map(str, release)) if release else None,
            "nvcc_ok": bool(release and release >= (12, 3)), "cuda_home": home}


def preflight() -> dict:
    """The facts (dict) and the problems seen (list of sentences under "problems")."""
    from app.model.dispatch.deepep import deepep_pin_mismatch, deepep_unavailable_reason, loaded_nccl_version

    facts: dict = {"python": sys.version.split()[0], "torch": torch.__version__, "torch_cuda": torch.version.cuda}
    try:
        facts["torch_compiled_nccl"] = ".".join(map(str, torch.cuda.nccl.version()[:3]))
    except (AttributeError, RuntimeError):
        facts["torch_compiled_nccl"] = None
    deepep_version, deepep_requires = _dist_requires("sgl-deep-ep")
    torch_version, torch_requires = _dist_requires("torch")
    facts.update(sgl_deep_ep=deepep_version, sgl_deep_ep_requires=deepep_requires,
                 torch_nccl_pin=[r for r in torch_requires if r.startswith("nvidia-nccl")],
                 nvidia_nccl_cu13=_dist_requires("nvidia-nccl-cu13")[0],
                 nvidia_nvshmem_cu13=_dist_requires("nvidia-nvshmem-cu13")[0],
                 EP_NCCL_ROOT_DIR=os.environ.get("EP_NCCL_ROOT_DIR"), **_nvcc())
    loaded = loaded_nccl_version()
    facts["loaded_nccl"] = ".".join(map(str, loaded)) if loaded else None
    problems = []
    if facts["nvcc"] is None:
        problems.append("no nvcc on PATH or under CUDA_HOME/bin: DeepEP compiles its kernels on first use")
    elif not facts["nvcc_ok"]:
        problems.append(f"nvcc {facts['nvcc_release']} < 12.3 (the wheel asserts NVCC >= 12.3)")
    if deepep_version is None:
        problems.append("sgl-deep-ep is not installed")
    elif torch_version is not None:
        nccl = loaded or tuple(int(p) for p in (facts["nvidia_nccl_cu13"] or "0.0.0").split(".")[:3])
        mismatch = deepep_pin_mismatch(deepep_version, deepep_requires, torch_version, torch_requires, nccl)
        if mismatch:
            problems.append(mismatch)
    facts["deepep_unavailable_reason"] = deepep_unavailable_reason(hidden_size=HIDDEN)
    facts["problems"] = problems
    return facts


# --------------------------------------------------------------------------------------------
# GPU part (also run on CPU gloo ranks with tests/deep_ep_standin.py by tests/test_deepep.py).


def rel_error(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| in fp32 (||a|| when b is all zeros)."""
    a, b = a.float(), b.float()
    denom = float(b.norm())
    return float((a - b).norm()) / denom if denom > 0 else float(a.norm())


def _block(group, backend: str, experts: int, top_k: int, hidden: int, device):
    from transformers import Qwen3MoeConfig

    from app.config import RouterConfig
    from app.model.moe import MoEBlock
    from app.model.parallel import EPContext

    config = Qwen3MoeConfig(hidden_size=hidden, moe_intermediate_size=64, num_experts=experts,
                            num_experts_per_tok=top_k, norm_topk_prob=True)
    ep = EPContext(group=group, rank=dist.get_rank(group), size=dist.get_world_size(group), backend=backend)
    block = MoEBlock(config, RouterConfig(), ep)
    block.reset_parameters(torch.Generator().manual_seed(1234))  # the same global weights for both
    block = block.to(device)
    block.experts.to(torch.bfloat16)  # the router stays fp32, as build_policy keeps it
    return block


def _run(block, x, replay, proj):
    x = x.clone().requires_grad_(True)
    block.zero_grad(set_to_none=True)
    out = block(x.unsqueeze(0), None if replay is None else replay.unsqueeze(0))[0]
    (out.float() * proj).sum().backward()
    grads = {n: p.grad.detach().clone() for n, p in block.named_parameters() if p.grad is not None}
    return out.detach(), x.grad.detach(), grads, block.last_tokens_per_expert.clone()


def _inputs(case: str, rank: int, size: int, experts: int, top_k: int, hidden: int, device, scale: int = 1):
    """This rank's tokens x [T, H] bf16, replay ids [T, K] or None, loss projection [T, H] fp32."""
    tokens = [(5 + 3 * r) * scale for r in range(size)]
    if case == "empty-rank":
        tokens[-1] = 0
    g = torch.Generator().manual_seed(99 + scale)
    total = sum(tokens)
    x = torch.randn(total, hidden, generator=g)
    proj = torch.randn(total, hidden, generator=g)
    replay = None
    if case == "minus-one":  # every other token keeps one expert only
        replay = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(total)])
        replay[::2, 1:] = -1
    elif case == "one-rank":  # every token to rank 0's experts
        replay = torch.arange(top_k).repeat(total, 1) % (experts // size)
        replay = torch.where(torch.arange(top_k) < experts // size, replay, torch.full_like(replay, -1))
    lo, hi = sum(tokens[:rank]), sum(tokens[: rank + 1])
    pick = slice(lo, hi)
    return (x[pick].to(device, torch.bfloat16), None if replay is None else replay[pick].to(device),
            proj[pick].to(device))


def _compare(a, b) -> dict:
    (out_a, dx_a, g_a, tpe_a), (out_b, dx_b, g_b, tpe_b) = a, b
    errs = {"output": rel_error(out_a, out_b), "input_grad": rel_error(dx_a, dx_b)}
    for name in sorted(g_b):
        errs[f"grad {name}"] = rel_error(g_a.get(name, torch.zeros_like(g_b[name])), g_b[name])
    worst = max(errs, key=errs.get)
    same_tpe = torch.equal(tpe_a.cpu(), tpe_b.cpu())
    return {"ok": errs[worst] < BF16_REL and same_tpe, "worst": worst, "worst_rel_error": errs[worst],
            "tokens_per_expert_equal": same_tpe, "tokens_per_expert": tpe_a.tolist()}


def _all_ok(ok: bool, group, device) -> bool:
    """True when `ok` holds on every rank of `group`."""
    flag = torch.tensor([0 if ok else 1], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    return int(flag.item()) == 0


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def check_group(group, device, hidden: int = HIDDEN) -> list[dict]:
    """Run every check on `group` (a collective over its ranks); returns this rank's results."""
    from app.model.dispatch import deepep

    deep_ep = deepep._deep_ep()
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    experts, top_k = 4 * size, 4
    results = []

    def record(check: str, ok: bool, **detail):
        results.append({"size": size, "check": check, "ok": _all_ok(ok, group, device), **detail})

    # The buffer; NCCL GIN can be missing on one node (csrc/kernels/backend/nccl.cu:89-92).
    t0 = time.perf_counter()
    try:
        deepep.get_buffer(group, hidden, hidden * 2, 8, top_k)
        record("buffer", True, seconds=time.perf_counter() - t0, EP_DISABLE_GIN=os.environ.get("EP_DISABLE_GIN"))
    except Exception as e:  # noqa: BLE001 - reported, then retried once without GIN
        if "GIN" not in str(e) or os.environ.get("EP_DISABLE_GIN") == "1":
            record("buffer", False, error=f"{type(e).__name__}: {e}")
            return results
        os.environ["EP_DISABLE_GIN"] = "1"
        deepep.get_buffer(group, hidden, hidden * 2, 8, top_k)
        record("buffer", True, seconds=time.perf_counter() - t0, EP_DISABLE_GIN="1", first_error=str(e))
    from app.model.dispatch.deepep import loaded_nccl_version

    loaded = loaded_nccl_version()
    record("nccl loaded", True, version=".".join(map(str, loaded)) if loaded else None)

    blocks = {b: _block(group, b, experts, top_k, hidden, device) for b in ("deepep", "alltoall")}
    for case in ("natural", "empty-rank", "minus-one", "one-rank"):
        x, replay, proj = _inputs(case, rank, size, experts, top_k, hidden, device)
        _sync(device)
        t0 = time.perf_counter()
        got = _run(blocks["deepep"], x, replay, proj)
        _sync(device)
        first_s = time.perf_counter() - t0
        ref = _run(blocks["alltoall"], x, replay, proj)
        detail = _compare(got, ref)
        if case == "natural":  # the first call compiles DeepEP's kernels
            t0 = time.perf_counter()
            again = _run(blocks["deepep"], x, replay, proj)
            _sync(device)
            repeatable = all(torch.equal(p, q) for p, q in zip(again[:2], got[:2], strict=True))
            detail.update(first_call_s=first_s, second_call_s=time.perf_counter() - t0,
                          layer_bitwise_repeatable=repeatable)
        record(case, detail.pop("ok"), **detail)

    # Regrowth: more tokens than the buffer holds; the old buffer is destroyed behind a barrier,
    # never by the garbage collector.
    before = deepep._current.num_tokens
    x, replay, proj = _inputs("natural", rank, size, experts, top_k, hidden, device, scale=before // 5 + 1)
    detail = _compare(_run(blocks["deepep"], x, replay, proj), _run(blocks["alltoall"], x, replay, proj))
    grew = deepep._current.num_tokens > before
    record("regrowth", detail.pop("ok") and grew, tokens_before=before, tokens_after=deepep._current.num_tokens,
           retired_left=len(deepep._retired), **detail)

    # Determinism of DeepEP itself: V2 sorts what it receives when built with deterministic=True.
    if hasattr(deep_ep, "ElasticBuffer"):
        det = deep_ep.ElasticBuffer(group, num_max_tokens_per_rank=64, hidden=hidden, num_topk=top_k,
                                    deterministic=True, explicitly_destroy=True)
        x, _, _ = _inputs("natural", rank, size, experts, top_k, hidden, device)
        g = torch.Generator().manual_seed(7 + rank)
        idx = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(x.shape[0])])
        idx = idx.to(device, deep_ep.topk_idx_t)
        w = torch.rand(idx.shape, generator=g).to(device)
        rounds = []
        for _ in range(2):
            recv_x, _, recv_w, handle, _ = det.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=experts,
                                                       num_max_tokens_per_rank=64)
            combined, _, _ = det.combine(recv_x, handle)
            rounds.append((recv_x, recv_w, combined))
        same = all(torch.equal(a, b) for a, b in zip(*rounds, strict=True))
        _sync(device)
        dist.barrier(group=group)
        det.destroy()
        record("deterministic buffer", same)

    blocks.clear()
    deepep.release_buffers()
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preflight", action="store_true", help="print the CPU-side facts and exit")
    parser.add_argument("--out", default="runs/deepep-checklist", help="directory of deepep_checklist.json")
    parser.add_argument("--sizes", default="2,4,8", help="EP sizes to check (those <= the world size)")
    args = parser.parse_args()
    facts = preflight()
    if args.preflight or "RANK" not in os.environ:
        for k, v in facts.items():
            print(f"{k}: {v}")
        return 0
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local_rank)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
    world, rank = dist.get_world_size(), dist.get_rank()
    results = []
    for size in [int(s) for s in args.sizes.split(",") if int(s) <= world]:
        group = dist.new_group(list(range(size)))
        if rank < size:
            results += check_group(group, device)
        dist.barrier()
    dist.barrier()
    dist.destroy_process_group()
    if rank != 0:
        return 0
    doc = {"preflight": facts, "results": results, "ok": all(r["ok"] for r in results) and bool(results)}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / ".deepep_checklist.json.tmp"
    tmp.write_text(json.dumps(doc, indent=1, default=str))
    os.replace(tmp, out / "deepep_checklist.json")
    for r in results:
        print(json.dumps(r, default=str))
    print(f"deepep checklist: {'all passed' if doc['ok'] else 'FAILED'}; {out / 'deepep_checklist.json'}")
    return 0 if doc["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
