"""Bad configurations fail in MoEBlock.__init__ / init_ep with one error naming the field."""

from __future__ import annotations

import pytest
import torch
from transformers import DeepseekV3Config, LlamaConfig, Qwen3MoeConfig

from app.config import ParallelConfig, RouterConfig
from app.model.moe import MoEBlock
from app.model.dispatch.deepep import deepep_unavailable_reason
from app.model.parallel import EPContext, init_ep

QWEN = dict(hidden_size=16, moe_intermediate_size=8, num_experts=8, num_experts_per_tok=2)
DEEPSEEK = dict(hidden_size=16, moe_intermediate_size=8, n_routed_experts=8, num_experts_per_tok=2,
                n_group=4, topk_group=2, n_shared_experts=1)


def ep(size: int) -> EPContext:
    # No process group is needed: validation must fail before any communication is set up.
    return EPContext(group=None, rank=0, size=size, backend="alltoall")


def make(cls, base, **overrides):
    # Fields are set after construction, as a hand-edited config.json would arrive, so that our
    # check (not transformers' own config validation) is the one under test.
    config = cls(**base)
    for k, v in overrides.items():
        setattr(config, k, v)
    return config


@pytest.mark.parametrize(
    "cls, base, overrides, ep_size, match",
    [
        (Qwen3MoeConfig, QWEN, {}, 3, r"config\.num_experts=8 is not divisible by trainer\.parallel\.ep=3"),
        (DeepseekV3Config, DEEPSEEK, {}, 3, r"config\.n_routed_experts=8 is not divisible by trainer\.parallel\.ep=3"),
        (Qwen3MoeConfig, QWEN, {"num_experts_per_tok": 9}, 1, r"config\.num_experts_per_tok=9 is larger than config\.num_experts=8"),
        (DeepseekV3Config, DEEPSEEK, {"n_group": 3}, 1, r"config\.n_group=3 does not divide config\.n_routed_experts=8"),
        (DeepseekV3Config, DEEPSEEK, {"topk_group": 5}, 1, r"config\.topk_group=5 must be between 1 and config\.n_group=4"),
        (DeepseekV3Config, DEEPSEEK, {"n_group": 8}, 1, r"config\.n_group=8 leaves 1 expert per group"),
        (DeepseekV3Config, DEEPSEEK, {"num_experts_per_tok": 5}, 1, r"config\.num_experts_per_tok=5 exceeds the 4 experts"),
        (LlamaConfig, dict(hidden_size=64, num_attention_heads=4), {}, 1,
         r"config\.model_type must be 'qwen3_moe' or 'deepseek_v3', got 'llama'"),
    ],
)
def test_bad_config_raises_before_any_work(cls, base, overrides, ep_size, match) -> None:
    config = make(cls, base, **overrides)
    with pytest.raises(ValueError, match=match):
        MoEBlock(config, RouterConfig(), EPContext.local() if ep_size == 1 else ep(ep_size))


def test_bias_updates_need_a_biased_router() -> None:
    with pytest.raises(ValueError, match=r"router\.bias_update_rate"):
        MoEBlock(Qwen3MoeConfig(**QWEN), RouterConfig(bias_update_rate=0.001), EPContext.local())


def test_unresolved_backend_is_rejected() -> None:
    with pytest.raises(ValueError, match=r"ep\.backend must be resolved"):
        MoEBlock(Qwen3MoeConfig(**QWEN), RouterConfig(), EPContext(None, 0, 1, "auto"))


def test_bad_replay_indices_name_the_tensor() -> None:
    block = MoEBlock(Qwen3MoeConfig(**QWEN), RouterConfig(), EPContext.local())
    block.reset_parameters()
    x = torch.randn(1, 3, 16)
    with pytest.raises(ValueError, match=r"replay_topk_idx has shape \(1, 3, 3\), expected \(1, 3, 2\)"):
        block(x, torch.zeros(1, 3, 3, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"replay_topk_idx has expert ids outside \[-1, 8\)"):
        block(x, torch.full((1, 3, 2), 8))
    with pytest.raises(ValueError, match=r"replay_topk_idx must be an integer tensor"):
        block(x, torch.zeros(1, 3, 2))


def test_init_ep_errors_and_local_default() -> None:
    assert init_ep(ParallelConfig(ep=1)).backend == "local"
    assert init_ep(ParallelConfig(ep=1, ep_backend="alltoall")).backend == "local"
    with pytest.raises(ValueError, match=r"trainer\.parallel\.ep_backend='local' needs trainer\.parallel\.ep=1"):
        init_ep(ParallelConfig(ep=2, ep_backend="local"))
    with pytest.raises(RuntimeError, match=r"trainer\.parallel\.ep=2 needs torch\.distributed initialized"):
        init_ep(ParallelConfig(ep=2, ep_backend="auto"))


def test_deepep_reason_is_given_where_it_cannot_run() -> None:
    reason = deepep_unavailable_reason()
    if reason is None:
        pytest.skip("deep_ep can run here")
    assert "deep_ep" in reason or "CUDA" in reason or "capability" in reason
