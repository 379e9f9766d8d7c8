"""Model configurations: the tiny presets built in code, and checks of a config against EP.

Two Hugging Face families are supported, told apart by ``config.model_type`` exactly as
``AutoConfig`` does when it reads a checkpoint's config.json:

- ``qwen3_moe`` (transformers ``Qwen3MoeConfig``): softmax router, top-k, optional
  renormalisation of the top-k weights; every layer sparse unless listed in ``mlp_only_layers``
  or skipped by ``decoder_sparse_step``.
- ``deepseek_v3`` (transformers ``DeepseekV3Config``): sigmoid router with
  ``e_score_correction_bias``, group-limited top-k (``n_group``, ``topk_group``), shared
  experts, ``routed_scaling_factor``, the first ``first_k_dense_replace`` layers dense, and MLA
  attention (``q_lora_rank``, ``kv_lora_rank``, ``qk_nope_head_dim``, ``qk_rope_head_dim``,
  ``v_head_dim``).

Nothing here downloads anything: the presets are plain config objects.
"""

from __future__ import annotations

from typing import Any

from transformers import DeepseekV3Config, PretrainedConfig, Qwen3MoeConfig

from app.envs.tokenizer import BOS_ID, EOS_ID, PAD_ID, VOCAB_SIZE

SUPPORTED_MODEL_TYPES = ("qwen3_moe", "deepseek_v3")
PRESETS = ("tiny-qwen3-moe", "tiny-deepseek-v3")

# Shared by both presets: the character tokenizer's vocabulary (app/envs/tokenizer.py) and a
# size that keeps a forward+backward of a short batch in milliseconds on one CPU core.
_COMMON: dict[str, Any] = dict(
    vocab_size=VOCAB_SIZE,
    pad_token_id=PAD_ID,
    bos_token_id=BOS_ID,
    eos_token_id=EOS_ID,
    hidden_size=64,
    intermediate_size=128,  # dense MLP layers
    moe_intermediate_size=32,  # each routed expert
    num_attention_heads=4,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    initializer_range=0.02,
    tie_word_embeddings=False,
    num_experts_per_tok=2,
    norm_topk_prob=True,
)


def tiny_config(preset: str, **overrides: Any) -> PretrainedConfig:
    """Build a tiny config of one family in code.

    Args:
        preset: ``"tiny-qwen3-moe"`` (2 layers, hidden 64, 8 experts of width 32, top-2, GQA
            4 query / 2 kv heads of dim 16) or ``"tiny-deepseek-v3"`` (3 layers, the first dense;
            hidden 64; 8 routed experts in 4 groups, top-2 from the best 2 groups; 1 shared
            expert; routed_scaling_factor 2.5; MLA with q_lora_rank 32, kv_lora_rank 16,
            qk_nope 16 + qk_rope 8, v_head_dim 16).
        overrides: any config field, applied last (e.g. ``num_hidden_layers=4``).

    Returns:
        A ``Qwen3MoeConfig`` or ``DeepseekV3Config`` with ``architectures`` set, so a saved
        config.json names the causal-LM class stock transformers and SGLang load.

    Raises:
        ValueError: unknown preset, or the result fails `validate_config` (ep_size 1).
    """
    if preset == "tiny-qwen3-moe":
        fields = dict(
            _COMMON,
            num_hidden_layers=2,
            num_key_value_heads=2,
            head_dim=16,
            num_experts=8,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            architectures=["Qwen3MoeForCausalLM"],
        )
        fields.update(overrides)
        config = Qwen3MoeConfig(**fields)
    elif preset == "tiny-deepseek-v3":
        fields = dict(
            _COMMON,
            num_hidden_layers=3,
            num_key_value_heads=4,
            n_routed_experts=8,
            n_group=4,
            topk_group=2,
            n_shared_experts=1,
            first_k_dense_replace=1,
            routed_scaling_factor=2.5,
            q_lora_rank=32,
            kv_lora_rank=16,
            qk_nope_head_dim=16,
            qk_rope_head_dim=8,
            v_head_dim=16,
            num_nextn_predict_layers=0,  # no multi-token-prediction layer in our checkpoints
            architectures=["DeepseekV3ForCausalLM"],
        )
        fields.update(overrides)
        config = DeepseekV3Config(**fields)
    else:
        raise ValueError(f"model.preset: unknown preset {preset!r}; expected one of {PRESETS}")
    validate_config(config, ep_size=1)
    return config


def num_routed_experts(config: PretrainedConfig) -> int:
    """Routed experts per MoE layer (``num_experts`` / ``n_routed_experts``)."""
    return int(config.num_experts if config.model_type == "qwen3_moe" else config.n_routed_experts)


def is_moe_layer(config: PretrainedConfig, layer_idx: int) -> bool:
    """Whether decoder layer ``layer_idx`` has a sparse MoE block (same rule as transformers).

    Qwen3-MoE: ``modeling_qwen3_moe.Qwen3MoeDecoderLayer``; DeepSeek-V3:
    ``modeling_deepseek_v3.DeepseekV3DecoderLayer`` (layers >= first_k_dense_replace).
    """
    if config.model_type == "qwen3_moe":
        return (
            layer_idx not in config.mlp_only_layers
            and config.num_experts > 0
            and (layer_idx + 1) % config.decoder_sparse_step == 0
        )
    return layer_idx >= config.first_k_dense_replace


def moe_layer_ids(config: PretrainedConfig) -> list[int]:
    """Indices of the decoder layers that hold a sparse MoE block, ascending."""
    return [i for i in range(config.num_hidden_layers) if is_moe_layer(config, i)]


# Router settings a config.json may carry and the only values app/model/router.py implements.
# transformers' config classes do not declare these fields but keep every key of config.json as
# an attribute, and their own routers ignore them; absent means the family's own routing.
# DeepSeek-V3's config.json has scoring_func "sigmoid" and topk_method "noaux_tc" (DeepSeek's
# modeling_deepseek.py also knows "softmax", "greedy" and "group_limited_greedy", DeepSeek-V2's
# routing). Qwen3-MoE routes by softmax top-k over all experts: no groups, no scaling.
ROUTER_SETTINGS: dict[str, dict[str, tuple[Any, ...]]] = {
    "deepseek_v3": {"scoring_func": ("sigmoid",), "topk_method": ("noaux_tc",)},
    "qwen3_moe": {
        "scoring_func": ("softmax",),
        "topk_method": ("greedy",),
        "n_group": (None, 1),
        "topk_group": (None, 1),
        "routed_scaling_factor": (None, 1.0),
    },
}


def validate_config(config: PretrainedConfig, ep_size: int) -> None:
    """Check that a config can be built with ``ep_size`` expert-parallel ranks.

    Run before any weight is allocated or file opened, so a bad config fails at start.

    Raises:
        ValueError: one message naming the first offending field, e.g.
            ``config.num_experts (8) is not divisible by trainer.parallel.ep (3)``. Checked: model_type is
            supported; ep.size >= 1; experts divisible by ep.size; 1 <= num_experts_per_tok <=
            experts; attention heads divisible by kv heads; for DeepSeek-V3 also n_group divides
            n_routed_experts with >= 2 experts per group (the group score is the sum of the top 2),
            1 <= topk_group <= n_group, the selected groups hold >= num_experts_per_tok experts,
            0 <= first_k_dense_replace <= num_hidden_layers, routed_scaling_factor > 0; and every
            router setting in `ROUTER_SETTINGS` that the config carries has a value the router
            implements (e.g. ``config.scoring_func: 'softmax' is not implemented ...``), so a
            config is refused rather than routed another way than it says.
    """
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"config.model_type: {model_type!r} is not supported; expected one of {SUPPORTED_MODEL_TYPES}"
        )
    if not isinstance(ep_size, int) or ep_size < 1:
        raise ValueError(f"trainer.parallel.ep: must be a positive integer, got {ep_size!r}")
    for field, implemented in ROUTER_SETTINGS[model_type].items():
        value = getattr(config, field, implemented[0])
        if value not in implemented:
            raise ValueError(
                f"config.{field}: {value!r} is not implemented by the {model_type} router "
                f"(app/model/router.py); it implements {' or '.join(repr(v) for v in implemented)}"
            )
    experts_field = "num_experts" if model_type == "qwen3_moe" else "n_routed_experts"
    experts = num_routed_experts(config)
    if experts < 1:
        raise ValueError(f"config.{experts_field}: must be >= 1, got {experts}")
    if experts % ep_size:
        raise ValueError(f"config.{experts_field} ({experts}) is not divisible by trainer.parallel.ep ({ep_size})")
    top_k = config.num_experts_per_tok
    if not 1 <= top_k <= experts:
        raise ValueError(
            f"config.num_experts_per_tok ({top_k}) must be between 1 and config.{experts_field} ({experts})"
        )
    kv_heads = config.num_key_value_heads
    if kv_heads < 1 or config.num_attention_heads % kv_heads:
        raise ValueError(
            f"config.num_key_value_heads ({kv_heads}) must divide config.num_attention_heads "
            f"({config.num_attention_heads})"
        )
    if model_type == "qwen3_moe":
        if config.decoder_sparse_step < 1:
            raise ValueError(f"config.decoder_sparse_step: must be >= 1, got {config.decoder_sparse_step}")
        return

    n_group, topk_group = config.n_group, config.topk_group
    if n_group is None or n_group < 1 or experts % n_group:
        raise ValueError(f"config.n_group ({n_group}) does not divide config.n_routed_experts ({experts})")
    if experts // n_group < 2:
        raise ValueError(
            f"config.n_group ({n_group}) leaves {experts // n_group} expert per group; the group "
            f"score sums the top 2, so each group needs >= 2 experts"
        )
    if topk_group is None or not 1 <= topk_group <= n_group:
        raise ValueError(f"config.topk_group ({topk_group}) must be between 1 and config.n_group ({n_group})")
    if topk_group * (experts // n_group) < top_k:
        raise ValueError(
            f"config.num_experts_per_tok ({top_k}) exceeds the experts in the config.topk_group "
            f"({topk_group}) selected groups ({topk_group * (experts // n_group)})"
        )
    if not 0 <= config.first_k_dense_replace <= config.num_hidden_layers:
        raise ValueError(
            f"config.first_k_dense_replace ({config.first_k_dense_replace}) must be between 0 and "
            f"config.num_hidden_layers ({config.num_hidden_layers})"
        )
    if not config.routed_scaling_factor > 0:
        raise ValueError(f"config.routed_scaling_factor: must be > 0, got {config.routed_scaling_factor}")
