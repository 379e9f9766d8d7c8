"""EP sizes 1, 2 and 4 give the same MoE outputs and gradients; EP=1 matches stock transformers.

The EP runs use real processes (torch.multiprocessing spawn, gloo over TCP on a free port). Each
rank builds the EP=1 reference on the whole batch (all ranks' tokens) with the same global weights,
then its own EP shard on its slice of the tokens, and compares:
  - outputs and input gradients: its slice of the reference;
  - expert gradients: its shard of the reference (complete without any all-reduce, because the
    backward of dispatch/combine brings every rank's contributions back);
  - replicated parameters (router, shared experts): all-reduced (SUM) over ranks, like the trainer.
Cases include skewed routing where some experts and whole ranks receive no tokens, -1 top-k
slots, and a rank with no tokens at all.

Tolerance: fp32 with rtol=1e-5, atol=1e-6. The arithmetic is the same on every EP size except
the order of floating-point sums (per-expert GEMM rows arrive grouped by source rank, and the
replicated-parameter gradients are summed across ranks), which changes results by a few ulps.
"""

from __future__ import annotations

import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from transformers import DeepseekV3Config, Qwen3MoeConfig

from app.config import ParallelConfig, RouterConfig
from app.model.moe import MoEBlock
from app.model.parallel import EPContext, init_ep

RTOL, ATOL = 1e-5, 1e-6
HIDDEN = 16


def qwen_config(hidden: int = HIDDEN) -> Qwen3MoeConfig:
    return Qwen3MoeConfig(hidden_size=hidden, moe_intermediate_size=8, num_experts=8,
                          num_experts_per_tok=2, norm_topk_prob=True)


def deepseek_config(hidden: int = HIDDEN) -> DeepseekV3Config:
    return DeepseekV3Config(hidden_size=hidden, moe_intermediate_size=8, n_routed_experts=8,
                            num_experts_per_tok=3, n_group=4, topk_group=2, n_shared_experts=1,
                            routed_scaling_factor=2.5, norm_topk_prob=True)


# name -> (config factory, tokens per rank for EP sizes 2 and 4, routing mode)
CASES = {
    "qwen3": (qwen_config, [5, 7, 3, 6], "natural"),
    "deepseek-v3": (deepseek_config, [6, 4, 5, 7], "natural"),
    # every token replays to experts 0 and 1 (some slots -1): experts 2..7 and ranks 1.. idle
    "qwen3-replay-skewed": (qwen_config, [4, 6, 5, 3], "replay-skewed"),
    # a huge correction bias on experts 0..2 sends every token there (selection only; the weights
    # still come from the unbiased scores); the last rank also has no tokens of its own
    "deepseek-v3-skewed-empty-rank": (deepseek_config, [6, 5, 4, 0], "bias-skewed"),
}


def build(config, ep: EPContext, mode: str) -> MoEBlock:
    block = MoEBlock(config, RouterConfig(), ep)
    block.reset_parameters(torch.Generator().manual_seed(1234))
    if block.gate.e_score_correction_bias is not None:
        bias = torch.randn(block.num_experts, generator=torch.Generator().manual_seed(7)) * 0.05
        if mode == "bias-skewed":
            bias[:3] += 100.0
        block.gate.e_score_correction_bias.copy_(bias)
    return block


def batch(total: int, top_k: int, mode: str, hidden: int = HIDDEN):
    """Global inputs: x [total, H], replay ids [total, K] or None, loss projection [total, H]."""
    g = torch.Generator().manual_seed(99)
    x = torch.randn(total, hidden, generator=g)
    proj = torch.randn(total, hidden, generator=g)
    replay = None
    if mode == "replay-skewed":
        replay = torch.tensor([0, 1] + [-1] * (top_k - 2)).repeat(total, 1)
        replay[::3, 1] = -1
    return x, replay, proj


def run_case(block: MoEBlock, x: torch.Tensor, replay, proj: torch.Tensor):
    device = block.gate.weight.device
    x, proj = x.to(device), proj.to(device)
    replay = None if replay is None else replay.to(device)
    x = x.clone().requires_grad_(True)
    out = block(x.unsqueeze(0)) if replay is None else block(x.unsqueeze(0), replay.unsqueeze(0))
    out = out[0]
    (out * proj).sum().backward()
    grads = {n: p.grad.clone() if p.grad is not None else torch.zeros_like(p) for n, p in block.named_parameters()}
    return out.detach().cpu(), x.grad.cpu(), {n: g.cpu() for n, g in grads.items()}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, size: int, port: int, backend: str = "gloo") -> None:
    torch.set_num_threads(1)
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size)
    try:
        ep = init_ep(ParallelConfig(ep=size, ep_backend="auto" if backend == "gloo" else "alltoall"))
        assert (ep.backend, ep.rank, ep.size) == ("alltoall", rank, size), ep
        try:
            init_ep(ParallelConfig(ep=size + 1))
            raise AssertionError("init_ep accepted ep.size different from the group size")
        except ValueError as e:
            assert f"trainer.parallel.ep={size + 1} but the EP process group has {size} ranks" in str(e)
        for name, (make_config, tokens, mode) in CASES.items():
            config = make_config()
            tokens = tokens[:size]
            if mode == "bias-skewed":
                tokens = tokens[:-1] + [0]  # the last rank of every EP size has no tokens
            x, replay, proj = batch(sum(tokens), config.num_experts_per_tok, mode)
            start, stop = sum(tokens[:rank]), sum(tokens[: rank + 1])

            ref = build(config, EPContext.local(), mode).to(device)
            ref_out, ref_dx, ref_grads = run_case(ref, x, replay, proj)

            block = build(config, ep, mode).to(device)
            local = slice(start, stop)
            out, dx, grads = run_case(block, x[local], None if replay is None else replay[local], proj[local])

            where = f"case {name}, EP={size}, rank {rank}"
            torch.testing.assert_close(out, ref_out[local], rtol=RTOL, atol=ATOL, msg=lambda m: f"{where}: output\n{m}")
            torch.testing.assert_close(dx, ref_dx[local], rtol=RTOL, atol=ATOL, msg=lambda m: f"{where}: input grad\n{m}")
            shard = slice(block.local_expert_offset, block.local_expert_offset + block.num_local_experts)
            for pname, grad in grads.items():
                if pname.startswith("experts."):
                    expected = ref_grads[pname][shard]
                else:
                    grad = grad.to(device)
                    dist.all_reduce(grad)
                    grad = grad.cpu()
                    expected = ref_grads[pname]
                torch.testing.assert_close(grad, expected, rtol=RTOL, atol=ATOL,
                                           msg=lambda m: f"{where}: grad of {pname}\n{m}")
            if mode in ("replay-skewed", "bias-skewed"):
                # the skew really leaves experts idle (and, for EP>1, every expert of the last rank)
                assert (ref.last_tokens_per_expert[2:] == 0).sum() >= 4, ref.last_tokens_per_expert
                if rank == size - 1:
                    assert int(block.last_tokens_per_expert.sum()) == 0, block.last_tokens_per_expert
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("size", [2, 4])
def test_ep_matches_ep1(size: int) -> None:
    mp.spawn(_worker, args=(size, free_port()), nprocs=size, join=True)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="the NCCL all-to-all run needs 2+ CUDA GPUs")
def test_ep_matches_ep1_on_gpus_with_nccl() -> None:
    """The same cases, fp32, one process per GPU, NCCL (the GPU fallback when DeepEP is missing)."""
    mp.spawn(_worker, args=(2, free_port(), "nccl"), nprocs=2, join=True)


@pytest.mark.parametrize("name", ["qwen3", "deepseek-v3"])
def test_ep1_matches_stock_transformers(name: str) -> None:
    """Our EP=1 block equals transformers' own sparse MoE block (eager experts) in fp32."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    make_config, _, mode = CASES[name]
    config = make_config()
    config._experts_implementation = "eager"
    ours = build(config, EPContext.local(), mode)
    stock = (Qwen3MoeSparseMoeBlock if name == "qwen3" else DeepseekV3MoE)(config)
    stock.load_state_dict(ours.state_dict(), strict=True)
    x, _, proj = batch(9, config.num_experts_per_tok, mode)
    out, dx, grads = run_case(ours, x, None, proj)
    ref_out, ref_dx, ref_grads = run_case(stock, x, None, proj)
    torch.testing.assert_close(out, ref_out, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(dx, ref_dx, rtol=RTOL, atol=ATOL)
    assert grads.keys() == ref_grads.keys()
    for pname in grads:
        torch.testing.assert_close(grads[pname], ref_grads[pname], rtol=RTOL, atol=ATOL, msg=pname)
