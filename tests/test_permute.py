"""permute / unpermute: same numbers as plain indexing, adjoint under autograd, partial slot maps."""

from __future__ import annotations

import pytest
import torch

from app.model.dispatch.permute import permute, row_map, unpermute
from app.model.experts import GroupedExperts


def slots(num_tokens: int, top_k: int, keep: float, seed: int) -> torch.Tensor:
    """A shuffled subset of the T*K flat slots (keep=1: all of them), like a dispatcher's row order."""
    g = torch.Generator().manual_seed(seed)
    order = torch.randperm(num_tokens * top_k, generator=g)
    return order[: int(round(keep * order.numel()))]


@pytest.mark.parametrize("keep", [1.0, 0.6, 0.0])
def test_permute_and_unpermute_match_plain_indexing(keep) -> None:
    num_tokens, top_k, hidden = 7, 3, 5
    slot_of_row = slots(num_tokens, top_k, keep, seed=1)
    rmap = row_map(slot_of_row, num_tokens, top_k)
    x = torch.randn(num_tokens, hidden, dtype=torch.float64)
    token = slot_of_row // top_k
    torch.testing.assert_close(permute(x, rmap), x[token], rtol=0, atol=0)

    rows = torch.randn(slot_of_row.numel(), hidden, dtype=torch.float64)
    expected = torch.zeros(num_tokens, hidden, dtype=torch.float64).index_add_(0, token, rows)
    torch.testing.assert_close(unpermute(rows, rmap), expected)
    # a token none of whose slots has a row sums to exactly zero
    missing = sorted(set(range(num_tokens)) - set(token.tolist()))
    assert torch.all(unpermute(rows, rmap)[missing] == 0)


@pytest.mark.parametrize("keep", [1.0, 0.6])
def test_permute_and_unpermute_gradients_are_each_other(keep) -> None:
    num_tokens, top_k, hidden = 6, 2, 4
    rmap = row_map(slots(num_tokens, top_k, keep, seed=2), num_tokens, top_k)
    x = torch.randn(num_tokens, hidden, dtype=torch.float64, requires_grad=True)
    rows = torch.randn(rmap.token_of_row.numel(), hidden, dtype=torch.float64, requires_grad=True)
    torch.autograd.gradcheck(lambda t: permute(t, rmap), (x,))
    torch.autograd.gradcheck(lambda r: unpermute(r, rmap), (rows,))
    torch.autograd.gradcheck(lambda t: unpermute(torch.tanh(permute(t, rmap)), rmap), (x,))


def test_bf16_sums_accumulate_in_fp32() -> None:
    """K rows of very different size: a bf16 running sum loses what fp32 accumulation keeps."""
    num_tokens, top_k, hidden = 4, 8, 16
    rmap = row_map(slots(num_tokens, top_k, 1.0, seed=3), num_tokens, top_k)
    rows = torch.full((num_tokens * top_k, hidden), 1.0)
    rows[rmap.rows_by_token.view(num_tokens, top_k)[:, 0]] = 256.0  # first row of each token
    rows = rows.bfloat16()
    out = unpermute(rows, rmap)
    # 256 + 7 * 1 = 263 rounds to 264 in bf16; a bf16 running sum gets stuck at 256 (256 + 1 -> 256).
    assert out.dtype == torch.bfloat16
    assert torch.all(out.float() == 264.0)

    grad = torch.randn(num_tokens, hidden).bfloat16()
    x = torch.zeros(num_tokens, hidden, dtype=torch.bfloat16, requires_grad=True)
    permute(x, rmap).backward(rows)
    assert torch.all(x.grad.float() == 264.0)
    rows_grad = torch.zeros_like(rows, requires_grad=True)
    unpermute(rows_grad, rmap).backward(grad)
    assert torch.equal(rows_grad.grad, grad[rmap.token_of_row])


def test_row_weights_scale_each_expert_output() -> None:
    """Weighting the [N, I] activation gives the weighted [N, H] output, with the weights' gradient."""
    torch.manual_seed(0)
    experts = GroupedExperts(3, 8, 6, implementation="loop").double()
    torch.nn.init.normal_(experts.gate_up_proj, std=0.3)
    torch.nn.init.normal_(experts.down_proj, std=0.3)
    counts = torch.tensor([4, 0, 3])
    x = torch.randn(7, 8, dtype=torch.float64)
    w = torch.rand(7, dtype=torch.float64, requires_grad=True)
    torch.testing.assert_close(experts(x, counts, w), experts(x, counts) * w.unsqueeze(-1))
    torch.autograd.gradcheck(lambda ww: experts(x, counts, ww), (w,))


def test_row_weights_of_the_wrong_shape_or_dtype_name_the_argument() -> None:
    experts = GroupedExperts(2, 8, 6, implementation="loop")
    x, counts = torch.randn(5, 8), torch.tensor([2, 3])
    for bad in (torch.rand(4), torch.rand(5, 1), torch.ones(5, dtype=torch.int64)):
        with pytest.raises(ValueError, match="row_weights must be a float tensor of shape"):
            experts(x, counts, bad)


def test_unpermute_of_zero_width_rows_is_zero_width() -> None:
    rmap = row_map(slots(3, 2, 1.0, seed=4), 3, 2)
    assert unpermute(torch.randn(6, 0), rmap).shape == (3, 0)
