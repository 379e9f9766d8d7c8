"""Triton kernels for the softmax passes of `app.model.logprobs.chunked_logprobs` (GPU only).

At real vocabularies the loss's element-wise passes over a ``[chunk, V]`` block are a large
part of the step: the torch path casts the GEMM's bf16 output to fp32 and then reads and writes
that fp32 block several times per chunk in forward (log-sum-exp, exp, product, sum for the
entropy) and again in backward (exp, one-hot, scale, cast). On an H200 at Qwen3-30B-A3B width
(8 x 8192 tokens, V = 151936) replacing them with these kernels took about 316 ms off a 1351 ms
step (`moerl bench train-step`, bench/results/train-step.md: the step's change less fused AdamW's share).
Here each direction is one pass that reads the GEMM's output in its own dtype and keeps fp32 in
registers:

  - `logit_stats`: per row, log-sum-exp, the target's logit and (optionally) the entropy, from one
    read of ``z``. Online softmax (Milakov & Gimelshein 2018, "Online normalizer calculation for
    softmax"): a running max m, s = sum exp(z - m) and t = sum exp(z - m) z, rescaled by
    exp(m_old - m_new) when the max grows; lse = m + log s, sum_v p_v z_v = t / s, entropy =
    lse - t / s.
  - `logit_grad`: d logp(y) / d z = onehot(y) - softmax(z), times the row's upstream gradient and
    1 / T, written once in the GEMM's dtype (the dtype the torch path casts to before its GEMMs).

Both divide by the temperature T inside (z = logits / T). Tests run them on CPU through
Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1) and on CUDA compiled.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from app.model.kernels import AVAILABLE, DTYPES, triton, tl

# Columns per iteration: a multiple of the warp width that keeps the fp32 registers of a
# 151936-wide row loop small; memory-bound, so larger blocks buy little.
BLOCK_V = 4096
NUM_WARPS = 8

if AVAILABLE:

    @triton.jit
    def _logit_stats_kernel(z_ptr, targets_ptr, lse_ptr, target_ptr, ent_ptr, V, z_stride, inv_t,
                            WITH_ENTROPY: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        base = z_ptr + row * z_stride
        m = tl.full([BLOCK], float("-inf"), tl.float32)  # running max per lane
        s = tl.zeros([BLOCK], dtype=tl.float32)          # sum exp(z - m) per lane
        t = tl.zeros([BLOCK], dtype=tl.float32)          # sum exp(z - m) * z per lane
        for start in range(0, V, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            ok = cols < V
            z = tl.load(base + cols, mask=ok, other=float("-inf")).to(tl.float32) * inv_t
            m_new = tl.maximum(m, z)
            # Lanes that have seen only padding keep m = -inf: rescale by 0 there, not exp(nan).
            scale = tl.where(m_new == float("-inf"), 0.0, tl.exp(m - m_new))
            e = tl.where(ok, tl.exp(z - m_new), 0.0)
            s = s * scale + e
            if WITH_ENTROPY:
                t = t * scale + e * tl.where(ok, z, 0.0)
            m = m_new
        m_row = tl.max(m, axis=0)
        lane = tl.where(m == float("-inf"), 0.0, tl.exp(m - m_row))
        s_row = tl.sum(s * lane, axis=0)
        lse = m_row + tl.log(s_row)
        tl.store(lse_ptr + row, lse)
        y = tl.load(targets_ptr + row)
        tl.store(target_ptr + row, tl.load(base + y).to(tl.float32) * inv_t)
        if WITH_ENTROPY:
            tl.store(ent_ptr + row, lse - tl.sum(t * lane, axis=0) / s_row)

    @triton.jit
    def _logit_grad_kernel(z_ptr, lse_ptr, targets_ptr, grad_ptr, dz_ptr, V, z_stride, dz_stride, inv_t,
                           BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        lse = tl.load(lse_ptr + row)
        y = tl.load(targets_ptr + row)
        g = tl.load(grad_ptr + row).to(tl.float32) * inv_t
        for start in range(0, V, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            ok = cols < V
            z = tl.load(z_ptr + row * z_stride + cols, mask=ok, other=0.0).to(tl.float32) * inv_t
            dz = (tl.where(cols == y, 1.0, 0.0) - tl.exp(z - lse)) * g
            tl.store(dz_ptr + row * dz_stride + cols, dz.to(dz_ptr.dtype.element_ty), mask=ok)


def _check(z: Tensor, targets: Tensor, name: str) -> None:
    if not AVAILABLE:
        raise RuntimeError(f"{name}: triton is not installed")
    if z.dim() != 2 or z.dtype not in DTYPES or z.stride(1) != 1:
        raise ValueError(f"{name}: logits must be a row-contiguous [N, V] bf16/fp16/fp32 tensor, "
                         f"got {z.dtype} {tuple(z.shape)} strides {z.stride()}")
    if targets.shape != z.shape[:1] or targets.dtype != torch.int64:
        raise ValueError(f"{name}: targets must be int64 [N={z.shape[0]}], got {targets.dtype} {tuple(targets.shape)}")
    if z.shape[0] and not z.shape[1]:  # every target would read past an empty row
        raise ValueError(f"{name}: logits have V = 0 columns, got {tuple(z.shape)}")
    if targets.device != z.device:
        raise ValueError(f"{name}: targets ({targets.device}) must be on the logits' device ({z.device})")


def _check_temperature(temperature: float, name: str) -> None:
    # NaN passes "> 0" and gives NaN everywhere; infinity a uniform distribution.
    if not 0 < temperature < math.inf:
        raise ValueError(f"{name}: temperature must be > 0 and finite, got {temperature}")


def logit_stats(z: Tensor, targets: Tensor, temperature: float = 1.0,
                with_entropy: bool = False) -> tuple[Tensor, Tensor, Tensor | None]:
    """Log-sum-exp, target logit and entropy of each row of ``z / temperature``, in one read of z.

    Args:
        z: ``[N, V]`` logits (bf16, fp16 or fp32; the LM-head GEMM's output), rows contiguous.
        targets: ``[N]`` int64 token ids in ``[0, V)`` (not bounds-checked here: the caller's).
        temperature: finite, > 0; the kernel works on z / temperature.
        with_entropy: also return each row's entropy.

    Returns:
        ``(lse [N], z_target [N], entropy [N] or None)``, fp32; logp(y) = z_target - lse.

    Raises:
        ValueError: a tensor of the wrong shape, dtype, layout or device (named), V = 0 with
            rows, or a temperature not finite and > 0.
        RuntimeError: triton is not installed.
    """
    _check(z, targets, "logit_stats")
    _check_temperature(temperature, "logit_stats")
    n, v = z.shape
    out = [torch.empty(n, dtype=torch.float32, device=z.device) for _ in range(3)]
    lse, target, ent = out
    if n:
        _logit_stats_kernel[(n,)](z, targets.contiguous(), lse, target, ent, v, z.stride(0), 1.0 / temperature,
                                  WITH_ENTROPY=with_entropy, BLOCK=BLOCK_V, num_warps=NUM_WARPS)
    return lse, target, (ent if with_entropy else None)


def logit_grad(z: Tensor, lse: Tensor, targets: Tensor, grad: Tensor, temperature: float = 1.0,
               out_dtype: torch.dtype | None = None) -> Tensor:
    """``dz = (onehot(targets) - softmax(z / T)) * grad[:, None] / T``: the gradient of
    ``grad . logp(targets)`` with respect to the logits z, in one pass.

    Args:
        z: ``[N, V]`` logits as `logit_stats` took them.
        lse: ``[N]`` fp32 log-sum-exp of z / T (from `logit_stats`).
        targets: ``[N]`` int64.
        grad: ``[N]`` upstream gradient of each row's logp (any float dtype).
        temperature: finite, > 0, as in `logit_stats`.
        out_dtype: dtype of dz, bf16, fp16 or fp32 (default z's; the LM head's dtype for the GEMMs
            that follow).

    Returns:
        ``[N, V]`` dz in ``out_dtype``.

    Raises:
        ValueError: a tensor of the wrong shape, dtype, layout or device (named), V = 0 with
            rows, an out_dtype other than bf16/fp16/fp32, or a temperature not finite and > 0.
        RuntimeError: triton is not installed.
    """
    _check(z, targets, "logit_grad")
    n, v = z.shape
    if lse.shape != (n,) or grad.shape != (n,) or lse.dtype != torch.float32:
        raise ValueError(f"logit_grad: lse must be fp32 [N={n}] and grad [N], got lse {lse.dtype} "
                         f"{tuple(lse.shape)}, grad {tuple(grad.shape)}")
    if lse.device != z.device or grad.device != z.device:
        raise ValueError(f"logit_grad: lse ({lse.device}) and grad ({grad.device}) must be on the logits' "
                         f"device ({z.device})")
    if out_dtype is not None and out_dtype not in DTYPES:
        raise ValueError(f"logit_grad: out_dtype must be bf16, fp16 or fp32, got {out_dtype}")
    _check_temperature(temperature, "logit_grad")
    dz = torch.empty(n, v, dtype=out_dtype or z.dtype, device=z.device)
    if n:
        _logit_grad_kernel[(n,)](z, lse.contiguous(), targets.contiguous(), grad.contiguous(), dz, v, z.stride(0),
                                 dz.stride(0), 1.0 / temperature, BLOCK=BLOCK_V, num_warps=NUM_WARPS)
    return dz
