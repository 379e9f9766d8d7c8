"""The Triton kernels against torch references: on CPU through Triton's interpreter, on CUDA compiled.

Without triton installed the module skips. On CPU, conftest.py sets TRITON_INTERPRET=1 before
triton is first imported.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")
from app.model import kernels  # noqa: E402 - after the importorskip

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"


def test_kernels_run_compiled_on_cuda_or_interpreted_on_cpu() -> None:
    assert kernels.AVAILABLE
    assert CUDA or os.environ.get("TRITON_INTERPRET") == "1"


def bags(num_tokens: int, top_k: int, keep: float, seed: int):
    """rows_by_token / bag_offsets of a shuffled subset of the T*K slots (as permute.row_map builds them)."""
    from app.model.dispatch.permute import row_map

    g = torch.Generator().manual_seed(seed)
    order = torch.randperm(num_tokens * top_k, generator=g)[: int(round(keep * num_tokens * top_k))]
    return row_map(order.to(DEVICE), num_tokens, top_k)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens, top_k, hidden, keep", [
    (5, 8, 48, 1.0),     # full bags, hidden not a power of two
    (6, 3, 1030, 0.5),   # K not a power of two, partial bags (some tokens empty), two column blocks
    (4, 2, 16, 0.0),     # no rows at all
])
def test_gather_sum_matches_fp32_reference(dtype, num_tokens, top_k, hidden, keep) -> None:
    rmap = bags(num_tokens, top_k, keep, seed=hidden)
    n = rmap.token_of_row.numel()
    rows = torch.randn(max(n, 1), hidden, device=DEVICE).to(dtype)[:n]
    if n == 0:
        rows = torch.randn(1, hidden, device=DEVICE).to(dtype)  # a table with a row nobody takes
    out = kernels.gather_sum(rows, rmap.rows_by_token, rmap.bag_offsets, top_k)
    expected = torch.zeros(num_tokens, hidden, device=DEVICE)
    if n:
        expected.index_add_(0, rmap.token_of_row, rows.float())
    assert out.dtype == dtype and out.shape == (num_tokens, hidden)
    # the fp32 sum, rounded once to the output dtype (at most one bf16 ulp: 2**-7 relative; the
    # interpreter rounds toward zero, CUDA to nearest)
    torch.testing.assert_close(out.float(), expected, rtol=1e-6 if dtype == torch.float32 else 2**-7, atol=1e-5)


def test_gather_sum_accumulates_in_fp32() -> None:
    """256 + seven 1s: fp32 accumulation gives 263 (264 or 262 after one bf16 rounding); a bf16
    running sum stays at 256 because 256 + 1 rounds back to 256."""
    rmap = bags(3, 8, 1.0, seed=0)
    rows = torch.ones(24, 32, device=DEVICE)
    rows[rmap.rows_by_token.view(3, 8)[:, 0]] = 256.0
    out = kernels.gather_sum(rows.bfloat16(), rmap.rows_by_token, rmap.bag_offsets, 8).float()
    assert torch.all((out == 264.0) | (out == 262.0)), out.unique()


def swiglu_reference(gate_up: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.float().chunk(2, dim=-1)
    return F.silu(gate) * up * w.float().unsqueeze(-1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows, intermediate", [(7, 24), (3, 2600), (0, 8)])
def test_swiglu_forward_and_backward_match_autograd(dtype, rows, intermediate) -> None:
    g = torch.Generator().manual_seed(intermediate)
    gate_up = (2 * torch.randn(rows, 2 * intermediate, generator=g)).to(DEVICE, dtype)
    w = torch.rand(rows, generator=g).to(DEVICE)
    dh = torch.randn(rows, intermediate, generator=g).to(DEVICE, dtype)

    h = kernels.swiglu_forward(gate_up, w)
    ref_in = gate_up.float().requires_grad_(True)
    ref_w = w.clone().requires_grad_(True)
    ref = swiglu_reference(ref_in, ref_w)
    ref.backward(dh.float())
    dgate_up, dw = kernels.swiglu_backward(dh, gate_up, w)

    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    assert h.dtype == dtype and dgate_up.dtype == dtype and dw.dtype == torch.float32
    torch.testing.assert_close(h.float(), ref.detach().to(dtype).float(), **tol)
    torch.testing.assert_close(dgate_up.float(), ref_in.grad.to(dtype).float(), **tol)
    # dw is a length-I dot product accumulated in fp32 from rounded inputs
    torch.testing.assert_close(dw, ref_w.grad, rtol=1e-4 if dtype == torch.float32 else 2e-2,
                               atol=1e-4 if dtype == torch.float32 else 2e-2 * intermediate ** 0.5)


@pytest.mark.skipif(not CUDA, reason="the fused path is taken on CUDA only")
def test_moe_block_fused_path_matches_torch_path_on_cuda(monkeypatch) -> None:
    """The same MoE layer with and without the Triton kernels: same output and gradients (bf16)."""
    from transformers import Qwen3MoeConfig

    from app.config import RouterConfig
    from app.model.moe import MoEBlock
    from app.model.parallel import EPContext

    config = Qwen3MoeConfig(hidden_size=256, moe_intermediate_size=128, num_experts=16, num_experts_per_tok=4,
                            norm_topk_prob=True, num_attention_heads=1, num_key_value_heads=1)
    torch.manual_seed(0)
    block = MoEBlock(config, RouterConfig(), EPContext.local())
    block.reset_parameters()
    block.to(device="cuda", dtype=torch.bfloat16)
    x = torch.randn(1, 300, 256, device="cuda", dtype=torch.bfloat16)
    grad = torch.randn_like(x)

    def run():
        for p in block.parameters():
            p.grad = None
        xi = x.clone().requires_grad_(True)
        out = block(xi)
        out.backward(grad)
        return out.float(), xi.grad.float(), block.experts.gate_up_proj.grad.float(), block.gate.weight.grad.float()

    fused = run()
    monkeypatch.setattr(kernels, "AVAILABLE", False)
    plain = run()
    for a, b in zip(fused, plain):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2 * float(b.abs().max()))


def test_kernels_reject_bad_shapes_before_launching() -> None:
    rows, idx, offsets = torch.randn(4, 8), torch.arange(4), torch.tensor([0, 2, 4])
    with pytest.raises(ValueError, match="rows_by_token"):
        kernels.gather_sum(rows, idx.view(2, 2), offsets, 2)
    with pytest.raises(ValueError, match="max_rows"):
        kernels.gather_sum(rows, idx, offsets, 0)
    with pytest.raises(ValueError, match=r"row weights must be \[N\] = \[6\]"):
        kernels.swiglu_forward(torch.randn(6, 8), torch.rand(2))
    with pytest.raises(ValueError, match=r"gate_up must be \[N, 2I\]"):
        kernels.swiglu_forward(torch.randn(4, 7), torch.rand(4))
    with pytest.raises(ValueError, match="dh must be"):
        kernels.swiglu_backward(torch.randn(4, 3), torch.randn(4, 8), torch.rand(4))


def test_gather_sum_reads_strided_index_tensors() -> None:
    rmap = bags(3, 4, 1.0, seed=5)
    rows = torch.randn(12, 16, device=DEVICE)
    strided = torch.stack([rmap.rows_by_token, torch.zeros_like(rmap.rows_by_token)], 1)[:, 0]
    assert not strided.is_contiguous()
    out = kernels.gather_sum(rows, strided, rmap.bag_offsets, 4)
    torch.testing.assert_close(out, kernels.gather_sum(rows, rmap.rows_by_token, rmap.bag_offsets, 4))


@pytest.mark.skipif(not CUDA, reason="usable() is True only for CUDA tensors")
def test_float64_on_cuda_takes_the_torch_paths() -> None:
    """The kernels compute in fp32: float64 (gradcheck) must not lose its precision to them."""
    assert kernels.usable(torch.zeros(1, device="cuda", dtype=torch.bfloat16))
    assert not kernels.usable(torch.zeros(1, device="cuda", dtype=torch.float64))
