"""Routers against transformers' own, routing replay, aux loss and the expert-bias update."""

from __future__ import annotations

import pytest
import torch
from transformers import DeepseekV3Config, Qwen3MoeConfig
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter, load_balancing_loss_func

from app.config import RouterConfig
from app.model.moe import MoEBlock
from app.model.parallel import EPContext
from app.model.router import Router

QWEN = dict(hidden_size=16, moe_intermediate_size=8, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True)
DEEPSEEK = dict(hidden_size=16, moe_intermediate_size=8, n_routed_experts=16, num_experts_per_tok=4, n_group=4,
                topk_group=2, n_shared_experts=1, routed_scaling_factor=2.5, norm_topk_prob=True)


def sorted_routing(idx, weights):
    order = idx.argsort(dim=-1)
    return idx.gather(1, order), weights.gather(1, order)


def test_qwen_router_matches_transformers() -> None:
    torch.manual_seed(0)
    config = Qwen3MoeConfig(**QWEN)
    stock = Qwen3MoeTopKRouter(config)
    torch.nn.init.normal_(stock.weight, std=0.5)
    ours = Router("qwen3_moe", 8, 16, 2, True)
    ours.load_state_dict(stock.state_dict())
    x = torch.randn(20, 16)
    _, ref_w, ref_idx = stock(x)
    r = ours(x)
    assert torch.equal(r.topk_idx, ref_idx)
    torch.testing.assert_close(r.topk_weights, ref_w)
    torch.testing.assert_close(r.topk_weights.sum(-1), torch.ones(20))


def test_deepseek_router_matches_transformers_with_bias_and_groups() -> None:
    torch.manual_seed(0)
    config = DeepseekV3Config(**DEEPSEEK)
    stock = DeepseekV3TopkRouter(config)
    torch.nn.init.normal_(stock.weight, std=0.5)
    stock.e_score_correction_bias.normal_(0, 0.3)
    ours = Router("deepseek_v3", 16, 16, 4, True, n_group=4, topk_group=2, routed_scaling_factor=2.5)
    ours.load_state_dict(stock.state_dict())
    x = torch.randn(30, 16)
    _, ref_w, ref_idx = stock(x)
    r = ours(x)
    a_idx, a_w = sorted_routing(r.topk_idx, r.topk_weights)
    b_idx, b_w = sorted_routing(ref_idx, ref_w)
    assert torch.equal(a_idx, b_idx)
    torch.testing.assert_close(a_w, b_w)
    # group limit: the chosen experts span at most topk_group of the n_group groups
    assert all(len(set((row // 4).tolist())) <= 2 for row in r.topk_idx)
    # weights come from the unbiased scores: sum to routed_scaling_factor after normalization
    torch.testing.assert_close(r.topk_weights.sum(-1), torch.full((30,), 2.5))


def test_routing_replay_routes_by_given_ids_and_still_trains_the_router() -> None:
    torch.manual_seed(0)
    block = MoEBlock(Qwen3MoeConfig(**QWEN), RouterConfig(routing_replay=True), EPContext.local())
    block.reset_parameters()
    x = torch.randn(1, 5, 16)
    replay = torch.tensor([[[7, 3], [0, -1], [5, 6], [1, 2], [4, -1]]])
    block.replay_topk_idx = replay  # set by a model-level context
    out = block(x)
    assert torch.equal(block.last_topk_idx, replay[0])
    # weights: live softmax at the replayed ids, renormalized over the valid slots
    probs = torch.softmax(x[0] @ block.gate.weight.T, dim=-1)
    w = torch.where(replay[0] >= 0, probs.gather(1, replay[0].clamp(min=0)), torch.zeros(5, 2))
    w = w / w.sum(-1, keepdim=True)
    routed = block.gate(x[0], replay[0])
    torch.testing.assert_close(routed.topk_weights, w)
    out.square().sum().backward()
    assert block.gate.weight.grad is not None and block.gate.weight.grad.abs().sum() > 0
    # the explicit argument wins over the attribute, and differs from live routing
    live = MoEBlock(Qwen3MoeConfig(**QWEN), RouterConfig(), EPContext.local())
    live.load_state_dict(block.state_dict())
    assert not torch.allclose(live(x), out.detach())


def test_aux_loss_matches_transformers_load_balancing_loss_per_sequence() -> None:
    """The aux loss is transformers' load_balancing_loss_func of each sequence's real tokens,
    summed over the sequences (the trainer divides by the step's sequence count): padding counts
    nowhere, and a batch split into any micro-batches of whole sequences sums to the same."""
    from app.model.policy import real_tokens

    torch.manual_seed(0)
    block = MoEBlock(Qwen3MoeConfig(**QWEN), RouterConfig(aux_loss_coef=0.01), EPContext.local())
    block.reset_parameters()
    torch.nn.init.normal_(block.gate.weight, std=0.5)
    x = torch.randn(3, 6, 16)
    lengths = [6, 4, 2]  # right padding after these
    mask = torch.arange(6)[None, :] < torch.tensor(lengths)[:, None]

    class Holder(torch.nn.Module):  # real_tokens finds MoE blocks in model.model.layers[i].mlp
        def __init__(self):
            super().__init__()
            self.model = torch.nn.Module()
            self.model.layers = torch.nn.ModuleList([torch.nn.Module()])
            self.model.layers[0].mlp = block

    with real_tokens(Holder(), mask):
        block(x)
    logits = x @ block.gate.weight.T
    expected = sum(0.01 * load_balancing_loss_func((logits[b, :n],), num_experts=8, top_k=2)
                   for b, n in enumerate(lengths))
    torch.testing.assert_close(block.last_aux_loss, expected)
    whole = block.last_aux_loss.detach()
    block.last_aux_loss.backward()
    assert block.gate.weight.grad.abs().sum() > 0
    parts = []
    for rows in ([0], [1, 2]):  # another split of the same sequences
        with real_tokens(Holder(), mask[rows]):
            block(x[rows])
        parts.append(block.last_aux_loss.detach())
    torch.testing.assert_close(sum(parts), whole)
    block(x)  # outside real_tokens: every token is real (the padding now counts)
    assert not torch.allclose(block.last_aux_loss.detach(), whole)
    off = MoEBlock(Qwen3MoeConfig(**QWEN), RouterConfig(), EPContext.local())
    off.reset_parameters()
    off(x)
    assert off.last_aux_loss is None


def test_expert_bias_update_moves_load_toward_balance() -> None:
    from app.model.router import expert_counts

    torch.manual_seed(0)
    block = MoEBlock(DeepseekV3Config(**DEEPSEEK), RouterConfig(bias_update_rate=0.01), EPContext.local())
    block.reset_parameters()
    with torch.no_grad():
        block.gate.e_score_correction_bias[:4] = 1.0  # overload group 0
    x = torch.randn(1, 32, 16)
    block(x)
    real = torch.ones(32, dtype=torch.bool)
    real[28:] = False  # padding is no load
    load = expert_counts(block.last_topk_idx, 16, real)
    assert load.sum() == 28 * block.top_k
    block.update_expert_bias(load)
    delta = block.gate.e_score_correction_bias - torch.tensor([1.0] * 4 + [0.0] * 12)
    over, under = load > load.mean(), load < load.mean()
    assert over.any() and under.any()
    assert torch.all(delta[over] < 0) and torch.all(delta[under] > 0)
    # off by default: the bias never moves
    default = MoEBlock(DeepseekV3Config(**DEEPSEEK), RouterConfig(), EPContext.local())
    default.reset_parameters()
    default(x)
    default.update_expert_bias(expert_counts(default.last_topk_idx, 16))
    assert torch.all(default.gate.e_score_correction_bias == 0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the bf16 tensor-core logits path is taken on CUDA only")
def test_bf16_logits_on_cuda_match_the_fp32_gemm() -> None:
    """bf16 x and weight on CUDA: fp32 logits equal the fp32 GEMM of the same values up to summation
    order; gradients equal the fp32 path's to bf16 precision."""
    from app.model.router import router_logits

    torch.manual_seed(0)
    x = torch.randn(512, 1024, device="cuda").bfloat16().requires_grad_(True)
    w = (0.02 * torch.randn(64, 1024, device="cuda")).bfloat16().requires_grad_(True)
    logits = router_logits(x, w)
    assert logits.dtype == torch.float32
    reference = torch.nn.functional.linear(x.float(), w.float())
    torch.testing.assert_close(logits, reference, rtol=1e-5, atol=1e-5)

    grad = torch.randn_like(logits)
    gx, gw = torch.autograd.grad(logits, (x, w), grad)
    rx, rw = torch.autograd.grad(reference, (x, w), grad)
    assert gx.dtype == torch.bfloat16 and gw.dtype == torch.bfloat16
    torch.testing.assert_close(gx.float(), rx.float(), rtol=2e-2, atol=2e-2 * float(rx.abs().max()))
    torch.testing.assert_close(gw.float(), rw.float(), rtol=2e-2, atol=2e-2 * float(rw.abs().max()))
