"""Triton kernels for the two memory-bound passes of the MoE layer (GPU only; torch fallbacks elsewhere).

On an H200 these replaced the layer's largest non-GEMM costs (profile in bench/results/moe.md):
  - `gather_sum`: each token's expert rows summed into the token ([N, H] -> [T, H]), the forward of
    combine and the backward of dispatch. One program reads a token's <= K rows once and writes
    the token once, accumulating in fp32. torch's `embedding_bag(mode="sum")` does the same
    arithmetic but ran at about 0.7 TB/s there.
  - `swiglu_forward` / `swiglu_backward`: ``h = silu(gate) * up * w`` on the grouped GEMM's
    [N, 2I] output with the row's gate weight w folded in, and its backward (including the
    weight gradient ``dw = sum_i silu(gate) * up * dh``) in one pass each, fp32 inside. Eager
    torch needs three kernels forward and about eight backward, each a full [N, I] pass.
    SiLU and its derivative: Elfwing et al. 2017, "Sigmoid-Weighted Linear Units" (silu(x) =
    x * sigmoid(x), silu'(x) = s * (1 + x * (1 - s))); SwiGLU: Shazeer 2020, "GLU Variants
    Improve Transformer".

`AVAILABLE` is False when triton cannot be imported; callers then use torch. Tests run these
kernels on CPU through Triton's interpreter (TRITON_INTERPRET=1, set before this module is
imported) and on the GPU compiled.
"""

from __future__ import annotations

import os

import torch
from torch import Tensor

try:
    import triton
    import triton.language as tl

    AVAILABLE = True
except ImportError:  # CPU-only installs: the torch paths are used
    triton = tl = None
    AVAILABLE = False

# The interpreter cannot time configurations, so autotuning is for compiled (GPU) runs only.
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def usable(t: Tensor) -> bool:
    """True when `t` lives where these kernels run compiled (CUDA), triton imports and t's dtype is
    one they compute exactly enough (fp32 inside): bf16, fp16 or fp32, never float64."""
    return AVAILABLE and t.is_cuda and t.dtype in DTYPES


def _next_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


if AVAILABLE:

    # Block width and warps for the gather-sum, tuned once per (H, K) on first use (memory-bound;
    # the best choice depends on H and on how many tokens fill the GPU).
    _GATHER_SUM_CONFIGS = [triton.Config({"BLOCK_H": b}, num_warps=w) for b, w in
                           ((256, 2), (512, 4), (1024, 4), (1024, 8), (2048, 8))]

    @triton.jit
    def _gather_sum_kernel(rows_ptr, idx_ptr, offsets_ptr, out_ptr, H, row_stride, out_stride,
                           MAX_K: tl.constexpr, BLOCK_H: tl.constexpr):
        token = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        col_ok = cols < H
        start = tl.load(offsets_ptr + token)
        count = tl.load(offsets_ptr + token + 1) - start
        ks = tl.arange(0, MAX_K)
        k_ok = ks < count
        rows = tl.load(idx_ptr + start + ks, mask=k_ok, other=0)
        tile = tl.load(rows_ptr + rows[:, None] * row_stride + cols[None, :],
                       mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        acc = tl.sum(tile.to(tl.float32), axis=0)
        tl.store(out_ptr + token * out_stride + cols, acc.to(out_ptr.dtype.element_ty), mask=col_ok)

    _gather_sum_tuned = _gather_sum_kernel if INTERPRETED else triton.autotune(
        configs=_GATHER_SUM_CONFIGS, key=["H", "MAX_K"])(_gather_sum_kernel)

    @triton.jit
    def _swiglu_forward_kernel(gate_up_ptr, w_ptr, h_ptr, I: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        w = tl.load(w_ptr + row).to(tl.float32)
        for start in range(0, I, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            ok = cols < I
            g = tl.load(gate_up_ptr + row * 2 * I + cols, mask=ok, other=0.0).to(tl.float32)
            u = tl.load(gate_up_ptr + row * 2 * I + I + cols, mask=ok, other=0.0).to(tl.float32)
            h = g * tl.sigmoid(g) * u * w
            tl.store(h_ptr + row * I + cols, h.to(h_ptr.dtype.element_ty), mask=ok)

    @triton.jit
    def _swiglu_backward_kernel(dh_ptr, gate_up_ptr, w_ptr, dgate_up_ptr, dw_ptr, I: tl.constexpr,
                                BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        w = tl.load(w_ptr + row).to(tl.float32)
        dw = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, I, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            ok = cols < I
            g = tl.load(gate_up_ptr + row * 2 * I + cols, mask=ok, other=0.0).to(tl.float32)
            u = tl.load(gate_up_ptr + row * 2 * I + I + cols, mask=ok, other=0.0).to(tl.float32)
            dh = tl.load(dh_ptr + row * I + cols, mask=ok, other=0.0).to(tl.float32)
            s = tl.sigmoid(g)
            silu = g * s
            dw += silu * u * dh
            dg = dh * w * u * s * (1.0 + g * (1.0 - s))
            du = dh * w * silu
            tl.store(dgate_up_ptr + row * 2 * I + cols, dg.to(dgate_up_ptr.dtype.element_ty), mask=ok)
            tl.store(dgate_up_ptr + row * 2 * I + I + cols, du.to(dgate_up_ptr.dtype.element_ty), mask=ok)
        tl.store(dw_ptr + row, tl.sum(dw, axis=0))


def gather_sum(rows: Tensor, rows_by_token: Tensor, bag_offsets: Tensor, max_rows: int) -> Tensor:
    """out[t] = sum of rows[rows_by_token[bag_offsets[t]:bag_offsets[t+1]]], accumulated in fp32.

    Args:
        rows: [N, H] (bf16, fp16 or fp32), rows contiguous in H.
        rows_by_token: [M] int64 row ids, token by token.
        bag_offsets: [T + 1] int64 (bag_offsets[0] = 0, non-decreasing).
        max_rows: an upper bound on any token's row count (top-k K).

    Returns:
        [T, H] in rows' dtype (a token without rows gets 0).

    Raises:
        ValueError: rows not 2-D, rows_by_token or bag_offsets not 1-D, or max_rows < 1.
    """
    if rows.dim() != 2 or rows_by_token.dim() != 1 or bag_offsets.dim() != 1 or bag_offsets.numel() < 1:
        raise ValueError(f"gather_sum: rows must be [N, H], rows_by_token [M] and bag_offsets [T + 1]; got "
                         f"{tuple(rows.shape)}, {tuple(rows_by_token.shape)}, {tuple(bag_offsets.shape)}")
    if max_rows < 1:
        raise ValueError(f"gather_sum: max_rows must be at least 1, got {max_rows}")
    num_tokens, hidden = bag_offsets.numel() - 1, rows.shape[1]
    rows, rows_by_token, bag_offsets = rows.contiguous(), rows_by_token.contiguous(), bag_offsets.contiguous()
    out = rows.new_empty(num_tokens, hidden)
    if num_tokens == 0 or hidden == 0:
        return out
    max_k = _next_pow2(max_rows)  # a bag longer than max_rows would lose rows: callers pass top-k
    if INTERPRETED:
        block_h = min(_next_pow2(hidden), 512)
        _gather_sum_kernel[(num_tokens, triton.cdiv(hidden, block_h))](
            rows, rows_by_token, bag_offsets, out, hidden, rows.stride(0), out.stride(0),
            MAX_K=max_k, BLOCK_H=block_h)
        return out

    def grid(meta):
        return (num_tokens, triton.cdiv(hidden, meta["BLOCK_H"]))

    _gather_sum_tuned[grid](rows, rows_by_token, bag_offsets, out, hidden, rows.stride(0), out.stride(0),
                            MAX_K=max_k)
    return out


def _swiglu_block(intermediate: int) -> tuple[int, int]:
    block = min(_next_pow2(intermediate), 2048)
    return block, 4 if block <= 1024 else 8


def _check_swiglu(gate_up: Tensor, w: Tensor) -> None:
    if gate_up.dim() != 2 or gate_up.shape[1] % 2:
        raise ValueError(f"swiglu: gate_up must be [N, 2I], got {tuple(gate_up.shape)}")
    if w.shape != (gate_up.shape[0],):
        raise ValueError(f"swiglu: row weights must be [N] = [{gate_up.shape[0]}], got {tuple(w.shape)}")


def swiglu_forward(gate_up: Tensor, w: Tensor) -> Tensor:
    """h = silu(gate) * up * w for gate_up [N, 2I] (gate columns first) and w [N] -> [N, I] in gate_up's dtype.

    Raises:
        ValueError: gate_up not [N, 2I] or w not [N].
    """
    _check_swiglu(gate_up, w)
    n, two_i = gate_up.shape
    intermediate = two_i // 2
    gate_up, w = gate_up.contiguous(), w.contiguous()
    h = gate_up.new_empty(n, intermediate)
    if n == 0 or intermediate == 0:
        return h
    block, warps = _swiglu_block(intermediate)
    _swiglu_forward_kernel[(n,)](gate_up, w, h, intermediate, BLOCK=block, num_warps=warps)
    return h


def swiglu_backward(dh: Tensor, gate_up: Tensor, w: Tensor) -> tuple[Tensor, Tensor]:
    """Gradients of `swiglu_forward`: dh [N, I] -> (d gate_up [N, 2I] in gate_up's dtype, dw [N] fp32).

    Raises:
        ValueError: gate_up not [N, 2I], w not [N] or dh not [N, I].
    """
    _check_swiglu(gate_up, w)
    if dh.shape != (gate_up.shape[0], gate_up.shape[1] // 2):
        raise ValueError(f"swiglu: dh must be [N, I] = {(gate_up.shape[0], gate_up.shape[1] // 2)}, got {tuple(dh.shape)}")
    n, two_i = gate_up.shape
    intermediate = two_i // 2
    dh, gate_up, w = dh.contiguous(), gate_up.contiguous(), w.contiguous()
    dgate_up = torch.empty_like(gate_up)
    dw = torch.empty(n, dtype=torch.float32, device=gate_up.device)
    if n == 0 or intermediate == 0:
        return dgate_up.zero_(), dw.zero_()
    block, warps = _swiglu_block(intermediate)
    _swiglu_backward_kernel[(n,)](dh, gate_up, w, dgate_up, dw, intermediate, BLOCK=block, num_warps=warps)
    return dgate_up, dw
