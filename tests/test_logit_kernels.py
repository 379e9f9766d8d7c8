"""The fused softmax passes of chunked logprobs (app/model/logit_kernels.py) against torch.

On CPU through Triton's interpreter (tests/conftest.py), on CUDA compiled. Widths cross the
kernel's 4096-column block so the online rescaling between blocks is exercised.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")
from app.model.logit_kernels import BLOCK_V, logit_grad, logit_stats  # noqa: E402 - after the importorskip
from app.model.logprobs import chunked_logprobs  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def logits(n: int, v: int, dtype: torch.dtype, scale: float, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(n, v, generator=g) * scale
    z[0, -1] = 4 * scale  # a row whose max sits in the last, partial block
    return z.to(DEVICE, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("v, temperature, scale", [(50, 1.0, 1.0), (BLOCK_V + 904, 0.7, 30.0)])
def test_logit_stats_match_the_fp32_log_softmax(dtype, v, temperature, scale) -> None:
    z = logits(6, v, dtype, scale, seed=v)
    targets = torch.randint(0, v, (6,), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    targets[0] = v - 1
    lse, target, ent = logit_stats(z, targets, temperature, with_entropy=True)
    ref = z.float() / temperature  # the kernel's input exactly: the GEMM's output, then fp32
    logp = torch.log_softmax(ref, -1)
    torch.testing.assert_close(lse, torch.logsumexp(ref, -1), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(target - lse, logp.gather(1, targets[:, None]).squeeze(1), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent, -(logp.exp() * logp).sum(-1), rtol=1e-4, atol=1e-4)
    _, _, none = logit_stats(z, targets, temperature, with_entropy=False)
    assert none is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_logit_grad_is_onehot_minus_softmax_scaled(dtype) -> None:
    v, t = BLOCK_V + 100, 0.8
    z = logits(5, v, dtype, 3.0, seed=2)
    targets = torch.tensor([0, v - 1, 7, 4096, 11], device=DEVICE)
    grad = torch.tensor([1.0, -2.0, 0.5, 0.0, 3.0], device=DEVICE)
    lse, _, _ = logit_stats(z, targets, t)
    dz = logit_grad(z, lse, targets, grad, t)
    ref = z.float().div(t).requires_grad_()
    (torch.log_softmax(ref, -1).gather(1, targets[:, None]).squeeze(1) * grad).sum().backward()
    assert dz.dtype == dtype and dz.shape == z.shape
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=2**-7, atol=1e-5)
    torch.testing.assert_close(dz.float(), ref.grad / t, **tol)
    assert torch.all(dz[3] == 0)  # a zero upstream gradient gives a zero row
    assert logit_grad(z, lse, targets, grad, t, out_dtype=torch.float32).dtype == torch.float32


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_chunked_logprobs_equal_the_torch_path_in_value_and_gradient(dtype) -> None:
    torch.manual_seed(0)
    n, h, v = 13, 32, BLOCK_V + 50
    hidden = torch.randn(n, h, device=DEVICE).to(dtype).requires_grad_()
    weight = (torch.randn(v, h, device=DEVICE) * 0.3).to(dtype).requires_grad_()
    targets = torch.randint(0, v, (n,), device=DEVICE)
    g = torch.randn(n, device=DEVICE)
    out = {}
    for fused in (False, True):
        logp, ent = chunked_logprobs(hidden, weight, targets, 0.9, chunk=5, with_entropy=True, fused=fused)
        grads = torch.autograd.grad((logp * g).sum(), (hidden, weight))
        out[fused] = (logp, ent, *grads)
    # Same GEMMs and the same fp32 softmax math; only the summation order inside a row differs.
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-3)
    for a, b, name in zip(out[True], out[False], ("logp", "entropy", "grad hidden", "grad weight")):
        assert a.dtype == b.dtype, name
        torch.testing.assert_close(a.float(), b.float(), **tol, msg=lambda m, name=name: f"{name}: {m}")


def test_bad_tensors_are_refused_by_name() -> None:
    z = torch.randn(3, 10, device=DEVICE)
    good = torch.tensor([1, 2, 3], device=DEVICE)
    with pytest.raises(ValueError, match="targets must be int64"):
        logit_stats(z, good.int())
    with pytest.raises(ValueError, match="logits must be a row-contiguous"):
        logit_stats(z.t(), torch.arange(10, device=DEVICE))
    with pytest.raises(ValueError, match="logits must be"):
        logit_stats(z.double(), good)
    with pytest.raises(ValueError, match="temperature must be > 0"):
        logit_stats(z, good, 0.0)
    lse, _, _ = logit_stats(z, good)
    with pytest.raises(ValueError, match="lse must be fp32"):
        logit_grad(z, lse.double(), good, torch.ones(3, device=DEVICE))
    with pytest.raises(ValueError, match="grad"):
        logit_grad(z, lse, good, torch.ones(4, device=DEVICE))


@pytest.mark.parametrize("temperature", [float("nan"), float("inf")])
def test_a_temperature_that_is_not_finite_is_refused(temperature) -> None:
    """NaN passed a plain "> 0" check and made every logprob NaN; infinity made them uniform."""
    z = torch.randn(3, 10, device=DEVICE)
    good = torch.tensor([1, 2, 3], device=DEVICE)
    with pytest.raises(ValueError, match="logit_stats: temperature must be > 0 and finite"):
        logit_stats(z, good, temperature)
    lse, _, _ = logit_stats(z, good)
    with pytest.raises(ValueError, match="logit_grad: temperature must be > 0 and finite"):
        logit_grad(z, lse, good, torch.ones(3, device=DEVICE), temperature)
    for fused in (False, True):
        with pytest.raises(ValueError, match="temperature must be > 0 and finite"):
            chunked_logprobs(torch.randn(3, 4, device=DEVICE), torch.randn(10, 4, device=DEVICE), good, temperature,
                             fused=fused)


def test_kernels_refuse_an_empty_vocabulary_and_a_non_float_out_dtype() -> None:
    """V = 0 made logit_stats read z[row, target] past an empty row (a segfault under the
    interpreter); an int64 out_dtype silently truncated the gradient to zeros."""
    with pytest.raises(ValueError, match="V = 0"):
        logit_stats(torch.randn(3, 0, device=DEVICE), torch.zeros(3, dtype=torch.int64, device=DEVICE))
    assert logit_stats(torch.randn(0, 0, device=DEVICE), torch.zeros(0, dtype=torch.int64, device=DEVICE))[0].numel() == 0
    z, y = torch.randn(3, 10, device=DEVICE), torch.tensor([1, 2, 3], device=DEVICE)
    lse, _, _ = logit_stats(z, y)
    with pytest.raises(ValueError, match="out_dtype"):
        logit_grad(z, lse, y, torch.ones(3, device=DEVICE), out_dtype=torch.int64)


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("bad", [10, -1, -11])
def test_chunked_logprobs_refuse_a_target_outside_the_vocabulary(fused, bad) -> None:
    """The fused kernels read z[row, target] unchecked: a target of V or -1 returned another
    logit's value as a logprob; the torch path raised an index error from gather (on CUDA, a
    device-side assert). Both now raise one ValueError naming targets, before any GEMM."""
    hidden, weight = torch.randn(3, 4, device=DEVICE), torch.randn(10, 4, device=DEVICE)
    targets = torch.tensor([1, bad, 3], device=DEVICE)
    with pytest.raises(ValueError, match=rf"targets must be token ids in \[0, V=10\), got min {min(bad, 1)}"):
        chunked_logprobs(hidden, weight, targets, fused=fused)
    with pytest.raises(ValueError, match="targets must be token ids"):  # V = 0 with rows: every target is outside
        chunked_logprobs(hidden, weight[:0], torch.zeros(3, dtype=torch.int64, device=DEVICE), fused=fused)
    logp, _ = chunked_logprobs(hidden, weight, torch.tensor([0, 9, 3], device=DEVICE), fused=fused)  # both ends are in
    assert torch.isfinite(logp).all()


def test_chunked_logprobs_refuse_integer_tensors() -> None:
    """Integer hidden states and weight ran the torch path and returned logprobs without a gradient."""
    with pytest.raises(ValueError, match="floating-point dtype"):
        chunked_logprobs(torch.ones(3, 4, dtype=torch.int64, device=DEVICE),
                         torch.ones(10, 4, dtype=torch.int64, device=DEVICE), torch.tensor([1, 2, 3], device=DEVICE))
