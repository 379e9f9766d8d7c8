"""The policy's parameter tensors, their FSDP2 shards and the FSDP units, from the config alone.

`param_shapes` lists every parameter as `app.model.policy.build_policy` creates it (EP 1: global
shapes), under the same name, written from transformers' modules (``Qwen3MoeAttention``,
``DeepseekV3Attention``, ``Qwen3MoeMLP`` / ``DeepseekV3MLP``, the RMSNorms, embeddings and LM head)
and moerl's MoE block (``mlp.gate.weight`` [E, H]; ``mlp.experts.gate_up_proj`` [E, 2I, H] and
``down_proj`` [E, H, I]; DeepSeek-V3's ``mlp.shared_experts``). tests/test_plan.py checks the list
against a meta-device model, name by name.

Sharding (the layout rule of app/layout.py, torch.distributed.fsdp ``fully_shard``):

- a non-expert tensor of shape [d0, ...] is split on dim 0 over ``dp_shard`` ranks; FSDP2 gives
  every rank a padded chunk of ``ceil(d0 / dp_shard)`` rows (``FSDPParam._init_sharded_param``:
  ``padded_sharded_size = chunks[0].size()``), so rank 0 holds ``ceil(d0 / dp_shard) * d1 * ...``
  elements, the most of any rank;
- an expert tensor [E, a, b] is first split over ``ep`` ranks (each holds [E/ep, a, b]), then
  FSDP2-sharded over ``efsdp = dp_shard / ep`` ranks on dim 0 when ``(E/ep) % efsdp == 0``, else
  on dim 1 (torchtitan's expert placement; FSDP2 needs dim 1 to divide evenly then).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from transformers import PretrainedConfig

from app.layout import Layout
from app.model.config import is_moe_layer, num_routed_experts

Role = Literal["embed", "lm_head", "final_norm", "norm", "attention", "mlp", "shared", "router", "experts"]


@dataclass(frozen=True)
class ParamShape:
    """One parameter tensor.

    Attributes:
        name: its name in the policy (``model.layers.3.mlp.experts.gate_up_proj``).
        shape: global shape (EP 1).
        role: what it is; ``experts`` tensors are split over EP, ``router`` stays fp32.
        layer: decoder layer index, None for the root tensors (embeddings, final norm, LM head).
    """

    name: str
    shape: tuple[int, ...]
    role: Role
    layer: int | None

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def _linear(name: str, out_f: int, in_f: int, bias: bool, role: Role, layer: int) -> list[ParamShape]:
    w = [ParamShape(f"{name}.weight", (out_f, in_f), role, layer)]
    return w + ([ParamShape(f"{name}.bias", (out_f,), role, layer)] if bias else [])


def _attention(config: PretrainedConfig, i: int) -> list[ParamShape]:
    """transformers' ``Qwen3MoeAttention`` (GQA + q_norm/k_norm) or ``DeepseekV3Attention`` (MLA)."""
    p, h, bias = f"model.layers.{i}.self_attn", config.hidden_size, bool(config.attention_bias)
    nq = config.num_attention_heads
    if config.model_type == "qwen3_moe":
        hd, nkv = config.head_dim, config.num_key_value_heads
        return (_linear(f"{p}.q_proj", nq * hd, h, bias, "attention", i)
                + _linear(f"{p}.k_proj", nkv * hd, h, bias, "attention", i)
                + _linear(f"{p}.v_proj", nkv * hd, h, bias, "attention", i)
                + _linear(f"{p}.o_proj", h, nq * hd, bias, "attention", i)
                + [ParamShape(f"{p}.q_norm.weight", (hd,), "attention", i),
                   ParamShape(f"{p}.k_norm.weight", (hd,), "attention", i)])
    qk = config.qk_nope_head_dim + config.qk_rope_head_dim
    out: list[ParamShape] = []
    if config.q_lora_rank is None:
        out += _linear(f"{p}.q_proj", nq * qk, h, False, "attention", i)
    else:
        out += _linear(f"{p}.q_a_proj", config.q_lora_rank, h, bias, "attention", i)
        out += [ParamShape(f"{p}.q_a_layernorm.weight", (config.q_lora_rank,), "attention", i)]
        out += _linear(f"{p}.q_b_proj", nq * qk, config.q_lora_rank, False, "attention", i)
    out += _linear(f"{p}.kv_a_proj_with_mqa", config.kv_lora_rank + config.qk_rope_head_dim, h, bias, "attention", i)
    out += [ParamShape(f"{p}.kv_a_layernorm.weight", (config.kv_lora_rank,), "attention", i)]
    out += _linear(f"{p}.kv_b_proj", nq * (config.qk_nope_head_dim + config.v_head_dim), config.kv_lora_rank,
                   False, "attention", i)
    out += _linear(f"{p}.o_proj", h, nq * config.v_head_dim, bias, "attention", i)
    return out


def _swiglu(prefix: str, h: int, inter: int, role: Role, i: int) -> list[ParamShape]:
    """transformers' ``Qwen3MoeMLP`` / ``DeepseekV3MLP``: gate_proj, up_proj [I, H], down_proj [H, I]."""
    return (_linear(f"{prefix}.gate_proj", inter, h, False, role, i)
            + _linear(f"{prefix}.up_proj", inter, h, False, role, i)
            + _linear(f"{prefix}.down_proj", h, inter, False, role, i))


def dense_intermediate(config: PretrainedConfig) -> int:
    """Width of a dense (non-MoE) layer's MLP: ``intermediate_size`` in both families."""
    return config.intermediate_size


def shared_intermediate(config: PretrainedConfig) -> int:
    """Width of DeepSeek-V3's shared-expert MLP (``moe_intermediate_size * n_shared_experts``), 0 if none."""
    if config.model_type != "deepseek_v3":
        return 0
    return config.moe_intermediate_size * (config.n_shared_experts or 0)


def param_shapes(config: PretrainedConfig) -> list[ParamShape]:
    """Every parameter tensor of the policy for ``config`` (EP 1), root tensors first.

    Raises:
        ValueError: ``config.model_type`` is not one of the supported families.
    """
    if config.model_type not in ("qwen3_moe", "deepseek_v3"):
        raise ValueError(f"config.model_type: {config.model_type!r} is not supported")
    h, v = config.hidden_size, config.vocab_size
    out = [ParamShape("model.embed_tokens.weight", (v, h), "embed", None)]
    e = num_routed_experts(config)
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}"
        out += _attention(config, i)
        out += [ParamShape(f"{p}.input_layernorm.weight", (h,), "norm", i),
                ParamShape(f"{p}.post_attention_layernorm.weight", (h,), "norm", i)]
        if not is_moe_layer(config, i):
            out += _swiglu(f"{p}.mlp", h, dense_intermediate(config), "mlp", i)
            continue
        moe_i = config.moe_intermediate_size
        out += [ParamShape(f"{p}.mlp.gate.weight", (e, h), "router", i),
                ParamShape(f"{p}.mlp.experts.gate_up_proj", (e, 2 * moe_i, h), "experts", i),
                ParamShape(f"{p}.mlp.experts.down_proj", (e, h, moe_i), "experts", i)]
        if shared_intermediate(config):
            out += _swiglu(f"{p}.mlp.shared_experts", h, shared_intermediate(config), "shared", i)
    out += [ParamShape("model.norm.weight", (h,), "final_norm", None)]
    if not config.tie_word_embeddings:
        out += [ParamShape("lm_head.weight", (v, h), "lm_head", None)]
    return out


@dataclass(frozen=True)
class ParamCounts:
    """Parameter counts of a policy (elements).

    Attributes:
        total: every parameter.
        experts: routed-expert tensors (``mlp.experts.*``).
        routers: ``mlp.gate.weight`` (fp32).
        embeddings: embed_tokens + lm_head (lm_head absent when tied).
        non_expert: total - experts (routers and embeddings included).
    """

    total: int
    experts: int
    routers: int
    embeddings: int

    @property
    def non_expert(self) -> int:
        return self.total - self.experts


def count_params(config: PretrainedConfig) -> ParamCounts:
    """`ParamCounts` of ``config`` (sums over `param_shapes`)."""
    shapes = param_shapes(config)
    return ParamCounts(
        total=sum(p.numel for p in shapes),
        experts=sum(p.numel for p in shapes if p.role == "experts"),
        routers=sum(p.numel for p in shapes if p.role == "router"),
        embeddings=sum(p.numel for p in shapes if p.role in ("embed", "lm_head")),
    )


def local_shape(p: ParamShape, layout: Layout) -> tuple[int, ...]:
    """The shape this EP rank holds: experts [E/ep, ...], everything else whole."""
    if p.role != "experts":
        return p.shape
    return (p.shape[0] // layout.ep, *p.shape[1:])


def shard_dim(p: ParamShape, layout: Layout) -> int:
    """The dim FSDP2 shards ``p`` on: 0, or 1 for an expert tensor whose E/ep rows do not split
    evenly over efsdp ranks.

    Raises:
        ValueError: dim 1 is needed and does not divide over efsdp either (FSDP2 refuses uneven
            sharding off dim 0; the message names the tensor and trainer.parallel).
    """
    if p.role != "experts":
        return 0
    local = local_shape(p, layout)
    if local[0] % layout.efsdp == 0:
        return 0
    if local[1] % layout.efsdp:
        raise ValueError(
            f"{p.name}: {local[0]} local experts do not split over efsdp={layout.efsdp} ranks "
            f"(trainer.parallel.dp_shard / ep) and dim 1 ({local[1]}) does not either"
        )
    return 1


def rank_numel(p: ParamShape, layout: Layout) -> int:
    """Elements of ``p``'s FSDP2 shard on rank 0 (padded; the largest of any rank)."""
    shape = local_shape(p, layout)
    world = layout.efsdp if p.role == "experts" else layout.dp_shard
    dim = shard_dim(p, layout)
    rows = -(-shape[dim] // world)
    return rows * math.prod(shape) // shape[dim]


def gathered_numel(shapes: list[ParamShape], layout: Layout) -> int:
    """Elements of these tensors once FSDP2 has all-gathered them on one rank (experts: E/ep)."""
    return sum(math.prod(local_shape(p, layout)) for p in shapes)


@dataclass(frozen=True)
class Unit:
    """One FSDP unit as it is gathered for compute.

    Attributes:
        name: ``layer 3`` or ``root``.
        compute: elements gathered in the compute dtype (non-expert tensors, local experts).
        fp32: elements gathered in fp32 (the router, its own unit under a fp32 policy).
    """

    name: str
    compute: int
    fp32: int


def units(config: PretrainedConfig, layout: Layout) -> tuple[Unit, list[Unit]]:
    """The root unit (embeddings, final norm, LM head) and one unit per decoder layer.

    Raises:
        ValueError: as `shard_dim` for an expert tensor that cannot be sharded.
    """
    shapes = param_shapes(config)
    for p in shapes:
        shard_dim(p, layout)
    # One pass over the tensors: filtering the whole list per layer is quadratic in the layers.
    by_layer: dict[int | None, list[ParamShape]] = {}
    for p in shapes:
        by_layer.setdefault(p.layer, []).append(p)
    root_unit = Unit("root", gathered_numel(by_layer.get(None, []), layout), 0)
    layers = []
    for i in range(config.num_hidden_layers):
        mine = by_layer.get(i, [])
        layers.append(Unit(
            f"layer {i}",
            gathered_numel([p for p in mine if p.role != "router"], layout),
            gathered_numel([p for p in mine if p.role == "router"], layout),
        ))
    return root_unit, layers
