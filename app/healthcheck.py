"""NCCL all-reduce check between nodes, run by the GPU health-check Job (charts8s/healthcheck.py).

    torchrun --nnodes 2 --nproc-per-node 8 ... -m app.healthcheck --min-busbw-gbps 300

Every rank all-reduces (sum) a bf16 tensor of each size, checks the result exactly, and times
`iters` all-reduces after `warmup` ones. Bus bandwidth follows nccl-tests' definition for
all-reduce (doc/PERFORMANCE.md): algbw = bytes / time, busbw = algbw * 2 (n - 1) / n, with n the
world size. Rank 0 prints one JSON line per size and exits 1 when a result is wrong or the
largest size's busbw is below --min-busbw-gbps (GB/s, 10^9 bytes; 0 disables the floor).

On GPUs the process group is NCCL; the Job sets FI_PROVIDER=efa and NCCL_NET="AWS Libfabric",
so NCCL fails instead of falling back to TCP sockets when EFA or the aws-ofi-nccl plugin is
missing. Without CUDA (the tests) it runs on gloo with fp32.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.distributed as dist

DEFAULT_SIZES_MIB = (8, 64, 512, 2048)


def bus_bandwidth(nbytes: int, seconds: float, world_size: int) -> float:
    """nccl-tests all-reduce bus bandwidth in GB/s (10^9 bytes/s) for one all-reduce of `nbytes`.

    Raises ValueError for a non-positive time or world size.
    """
    if seconds <= 0 or world_size < 1:
        raise ValueError(f"seconds={seconds} and world_size={world_size} must be positive")
    return nbytes / seconds * 2 * (world_size - 1) / world_size / 1e9


def check_sizes(sizes_mib: list[int], iters: int, warmup: int) -> list[dict]:
    """All-reduce each size; returns one record per size (rank 0's view, same on every rank).

    Record: size_bytes, seconds (mean per all-reduce), algbw_gbps, busbw_gbps, correct (bool).
    Every rank contributes rank + 1, so each element of the sum is n (n + 1) / 2 exactly
    (representable in bf16 up to n = 31; fp32 beyond).
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    dtype = torch.bfloat16 if cuda and world <= 31 else torch.float32
    want = world * (world + 1) / 2
    out = []
    for mib in sizes_mib:
        n = mib * 2**20 // torch.tensor([], dtype=dtype).element_size()
        x = torch.full((n,), float(rank + 1), dtype=dtype, device=device)
        dist.all_reduce(x)
        correct = bool((x == want).all().item())
        for _ in range(warmup):
            dist.all_reduce(x)
        if cuda:
            torch.cuda.synchronize(device)
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(iters):
            dist.all_reduce(x)
        if cuda:
            torch.cuda.synchronize(device)
        seconds = (time.perf_counter() - t0) / iters
        nbytes = n * x.element_size()
        flags = torch.tensor([0 if correct else 1], device=device)
        dist.all_reduce(flags)  # wrong anywhere is wrong everywhere
        out.append({"size_bytes": nbytes, "seconds": seconds, "algbw_gbps": nbytes / seconds / 1e9,
                    "busbw_gbps": bus_bandwidth(nbytes, seconds, world), "correct": flags.item() == 0})
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="app.healthcheck", description=__doc__.splitlines()[0])
    p.add_argument("--sizes-mib", type=int, nargs="+", default=list(DEFAULT_SIZES_MIB))
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--min-busbw-gbps", type=float, default=0.0)
    args = p.parse_args(argv)
    if min(args.sizes_mib) < 1 or args.iters < 1 or args.warmup < 0:
        p.error("--sizes-mib must be >= 1, --iters >= 1, --warmup >= 0")
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    try:
        records = check_sizes(args.sizes_mib, args.iters, args.warmup)
        ok = all(r["correct"] for r in records) and records[-1]["busbw_gbps"] >= args.min_busbw_gbps
        if dist.get_rank() == 0:
            for r in records:
                print(json.dumps({"world_size": dist.get_world_size(), **r}), flush=True)
            print(json.dumps({"ok": ok, "min_busbw_gbps": args.min_busbw_gbps}), flush=True)
    finally:
        dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
