"""The policy model: stock transformers modules around our MoEBlock, meta-device build, dtypes,
seeded init, and routing replay."""

from __future__ import annotations

import pytest
import torch
from transformers import DeepseekV3ForCausalLM, Qwen3MoeForCausalLM

from app.config import RouterConfig
from app.model.config import moe_layer_ids, tiny_config
from app.model.moe import MoEBlock
from app.model.parallel import EPContext
from app.model.policy import build_policy, moe_blocks, routing_replay

PRESETS = ["tiny-qwen3-moe", "tiny-deepseek-v3"]


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)


def _ids() -> torch.Tensor:
    return torch.randint(4, 100, (2, 6), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("preset", PRESETS)
def test_build_swaps_sparse_blocks_and_keeps_stock_modules(preset):
    config = tiny_config(preset)
    model = build_policy(config, RouterConfig(), EPContext.local())
    assert isinstance(model, Qwen3MoeForCausalLM if preset == "tiny-qwen3-moe" else DeepseekV3ForCausalLM)
    assert [i for i, _ in moe_blocks(model)] == moe_layer_ids(config)
    for i, layer in enumerate(model.model.layers):
        assert isinstance(layer.mlp, MoEBlock) == (i in moe_layer_ids(config))
    if preset == "tiny-deepseek-v3":
        assert moe_layer_ids(config) == [1, 2]  # first_k_dense_replace=1: layer 0 stays dense
        assert type(model.model.layers[0].mlp).__name__ == "DeepseekV3MLP"
        assert model.model.layers[1].self_attn.q_a_proj.weight.shape == (32, 64)  # MLA
        assert moe_blocks(model)[0][1].gate.e_score_correction_bias.shape == (8,)
    assert not any(p.is_meta for p in model.parameters())
    assert not any(b.is_meta for b in model.buffers())
    rotary = model.model.rotary_emb.inv_freq
    assert torch.isfinite(rotary).all() and rotary[0] == 1.0  # theta^0, recomputed after to_empty
    logits = model(_ids()).logits
    assert logits.shape == (2, 6, 100) and torch.isfinite(logits).all()


def test_meta_build_allocates_nothing_and_init_is_seeded():
    config = tiny_config("tiny-deepseek-v3")
    meta = build_policy(config, RouterConfig(), EPContext.local(), device="meta")
    assert all(p.is_meta for p in meta.parameters())
    a = build_policy(config, RouterConfig(), EPContext.local(), seed=1)
    b = build_policy(config, RouterConfig(), EPContext.local(), seed=1)
    c = build_policy(config, RouterConfig(), EPContext.local(), seed=2)
    for (name, pa), (_, pb), (_, pc) in zip(a.named_parameters(), b.named_parameters(), c.named_parameters()):
        assert torch.equal(pa, pb), name
        if "norm" not in name:
            assert not torch.equal(pa, pc), name
    block = moe_blocks(a)[0][1]
    std = block.experts.gate_up_proj.std().item()
    assert abs(std - config.initializer_range) < 0.1 * config.initializer_range
    assert torch.equal(block.gate.e_score_correction_bias, torch.zeros(8))
    assert torch.equal(a.model.norm.weight, torch.ones(64))


def test_bf16_policy_keeps_router_in_fp32():
    model = build_policy(tiny_config("tiny-qwen3-moe"), RouterConfig(), EPContext.local(), dtype=torch.bfloat16)
    block = moe_blocks(model)[0][1]
    assert block.gate.weight.dtype == torch.float32
    assert model.model.embed_tokens.weight.dtype == torch.bfloat16
    assert block.experts.down_proj.dtype == torch.bfloat16
    assert model(_ids()).logits.dtype == torch.bfloat16


@pytest.mark.parametrize("preset", PRESETS)
def test_routing_replay_routes_by_given_indices_and_trains_the_router(preset):
    model = build_policy(tiny_config(preset), RouterConfig(), EPContext.local(), seed=4)
    ids = _ids()
    free = model(ids).logits
    own = [block.last_topk_idx.view(*ids.shape, -1).clone() for _, block in moe_blocks(model)]

    # Replaying the router's own choice reproduces the forward exactly.
    with routing_replay(model, own):
        assert all(block.replay_topk_idx is not None for _, block in moe_blocks(model))
        same = model(ids).logits
    torch.testing.assert_close(same, free, atol=1e-6, rtol=0)
    assert all(block.replay_topk_idx is None for _, block in moe_blocks(model))

    # Other indices change the output, and gate weights still get gradients from live logits.
    shifted = {layer: (idx + 1) % 8 for (layer, _), idx in zip(moe_blocks(model), own)}
    with routing_replay(model, shifted):
        replayed = model(ids).logits
        for (_, block), idx in zip(moe_blocks(model), shifted.values()):
            assert torch.equal(block.last_topk_idx.view(-1, idx.shape[-1]), idx.view(-1, idx.shape[-1]))
    assert (replayed - free).abs().max() > 1e-4
    replayed.float().pow(2).mean().backward()
    for _, block in moe_blocks(model):
        assert block.gate.weight.grad is not None and block.gate.weight.grad.abs().sum() > 0


def test_routing_replay_resets_on_error():
    model = build_policy(tiny_config("tiny-qwen3-moe"), RouterConfig(), EPContext.local())
    idx = torch.zeros(2, 6, 2, dtype=torch.long)
    with pytest.raises(RuntimeError, match="boom"):
        with routing_replay(model, [idx, idx]):
            raise RuntimeError("boom")
    assert all(block.replay_topk_idx is None for _, block in moe_blocks(model))
