"""The MoE policy: a stock transformers causal LM whose sparse MoE blocks are ours.

`build_policy` instantiates transformers' own ``Qwen3MoeForCausalLM`` or ``DeepseekV3ForCausalLM``
(embeddings, attention incl. MLA, norms, rotary embeddings, LM head all unchanged) on the meta
device, swaps every sparse ``mlp`` for `app.model.moe.MoEBlock`, and only then allocates memory on
the target device. Because the MoEBlock of EP rank r holds only its local experts, each rank
materialises ``E / ep.size`` experts per layer and never the full set.

Parameter names stay those of transformers (``model.layers.L.mlp.experts.gate_up_proj`` ...), so
`app.model.checkpoint` maps them one to one onto Hugging Face checkpoint keys.
"""

from __future__ import annotations

import copy
import zlib
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager

import torch
from torch import Tensor, nn
from transformers import DeepseekV3ForCausalLM, PretrainedConfig, PreTrainedModel, Qwen3MoeForCausalLM

from app.config import RouterConfig
from app.model.logprobs import sequence_logprobs
from app.model.config import moe_layer_ids, num_routed_experts, validate_config
from app.model.moe import MoEBlock
from app.model.parallel import EPContext

class _ScoresTokens:
    """The trainer's forward, as a method of the root module so that FSDP2 can wrap it
    (`torch.distributed.fsdp.register_fsdp_forward_method`): it reads the LM-head weight directly,
    which FSDP has gathered only inside a forward of the root."""

    def sequence_logprobs(self, input_ids: Tensor, attention_mask: Tensor, mask: Tensor,
                          temperature: float = 1.0, chunk: int = 4096, with_entropy: bool = False,
                          entropy_grad: bool = False):
        """`app.model.logprobs.sequence_logprobs` of this model (see there for shapes)."""
        return sequence_logprobs(self, input_ids, attention_mask, mask, temperature, chunk, with_entropy,
                                 entropy_grad)


class Qwen3MoePolicy(_ScoresTokens, Qwen3MoeForCausalLM):
    """transformers' Qwen3MoeForCausalLM plus `sequence_logprobs`; saved as the stock class."""


class DeepseekV3Policy(_ScoresTokens, DeepseekV3ForCausalLM):
    """transformers' DeepseekV3ForCausalLM plus `sequence_logprobs`; saved as the stock class."""


MODEL_CLASSES: dict[str, type[PreTrainedModel]] = {
    "qwen3_moe": Qwen3MoePolicy,
    "deepseek_v3": DeepseekV3Policy,
}


def stock_architecture(model: nn.Module | type) -> str:
    """The transformers class name a saved config.json must name (stock transformers and SGLang
    load it): the first class in the policy's MRO that transformers defines."""
    for cls in (model if isinstance(model, type) else type(model)).__mro__:
        if cls.__module__.startswith("transformers."):
            return cls.__name__
    raise ValueError(f"{model!r} has no transformers base class")


def build_policy(
    config: PretrainedConfig,
    router: RouterConfig,
    ep: EPContext,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    init: bool = True,
) -> PreTrainedModel:
    """Build the policy for ``config`` with this rank's share of the experts.

    Args:
        config: a ``Qwen3MoeConfig`` or ``DeepseekV3Config`` (family from ``config.model_type``);
            it is copied, not modified.
        router: router settings passed to every MoEBlock.
        ep: this process's EP place; each MoEBlock holds experts
            ``[ep.rank * E / ep.size, (ep.rank + 1) * E / ep.size)``.
        device: where parameters are allocated (``"meta"`` gives a shape-only model).
        dtype: parameter dtype (float32 or bfloat16). Router parameters (``mlp.gate.*``) stay
            float32: routing decisions are computed in fp32 (issue 2, part 4), as transformers
            does for DeepSeek-V3 (``_keep_in_fp32_modules_strict``).
        seed: weight-init seed. Every tensor (and every expert of an expert tensor) is drawn from
            its own generator seeded by (seed, parameter name, global expert id), so the same
            seed gives the same global model at any EP size.
        init: False leaves parameters uninitialised (``torch.empty``) for a loader to fill.

    Returns:
        The ``transformers`` causal-LM model; ``forward(input_ids[B,S] int64)`` returns
        ``.logits[B,S,V]`` in ``dtype``. Initialised like transformers does: normal(0,
        initializer_range) for linear/embedding/router/expert weights, zeros for biases and
        ``e_score_correction_bias``, ones for RMSNorm weights.

    Raises:
        ValueError: the config is invalid for ``ep.size`` (see `validate_config`).
    """
    validate_config(config, ep.size)
    config = copy.deepcopy(config)
    cls = MODEL_CLASSES[config.model_type]
    config.architectures = [stock_architecture(cls)]
    with torch.device("meta"):
        model = cls(config)
        for idx in moe_layer_ids(config):
            model.model.layers[idx].mlp = MoEBlock(config, router, ep)
    # Casting and allocating happen after the swap, so no stock expert tensor is ever allocated.
    model.to(dtype)
    for _, block in moe_blocks(model):
        block.gate.float()
    model.to_empty(device=device)
    _rebuild_rotary(model, device)
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if "rotary_emb" not in name:
                buf.zero_()  # e_score_correction_bias starts at 0 (as in transformers); loaders overwrite
        if init:
            init_policy_weights(model, seed)
    if config.tie_word_embeddings:
        model.tie_weights()  # to_empty gives tied modules separate tensors; share them again
    return model


def _rebuild_rotary(model: nn.Module, device: str | torch.device) -> None:
    """Recompute rotary ``inv_freq`` buffers, which to_empty leaves uninitialised.

    They are non-persistent (not in checkpoints), so the module is built again on ``device``.
    """
    for name, module in list(model.named_modules()):
        if type(module).__name__.endswith("RotaryEmbedding"):
            with torch.device(device):
                fresh = type(module)(config=model.config)
            parent_name, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent_name) if parent_name else model, child, fresh)


def _normal_(t: torch.Tensor, std: float, key: str) -> None:
    """Fill ``t`` with N(0, std) from a CPU generator seeded by the string ``key``."""
    gen = torch.Generator(device="cpu").manual_seed(zlib.crc32(key.encode()))
    t.copy_(torch.randn(t.shape, generator=gen, dtype=torch.float32) * std)


@torch.no_grad()
def init_policy_weights(model: PreTrainedModel, seed: int = 0) -> None:
    """Initialise every parameter of a built policy, independently of the EP layout.

    Expert tensors ``[E_local, ...]`` are drawn expert by expert with the global expert id in
    the seed, so EP rank r's slice equals rows ``[offset, offset + E_local)`` of the EP=1 model.
    """
    std = model.config.initializer_range
    expert_params: dict[int, tuple[MoEBlock, str]] = {}
    for layer, block in moe_blocks(model):
        for pname, p in block.experts.named_parameters():
            expert_params[id(p)] = (block, f"model.layers.{layer}.mlp.experts.{pname}")
    for mname, module in model.named_modules():
        for pname, p in module.named_parameters(recurse=False):
            name = f"{mname}.{pname}" if mname else pname
            if id(p) in expert_params:
                block, ename = expert_params[id(p)]
                for i in range(p.shape[0]):
                    _normal_(p[i], std, f"{seed}/{ename}/{block.local_expert_offset + i}")
            elif type(module).__name__.endswith("RMSNorm"):
                p.fill_(1.0)
            elif pname.endswith("bias"):
                p.zero_()
            else:
                _normal_(p, std, f"{seed}/{name}")


def moe_blocks(model: nn.Module) -> list[tuple[int, MoEBlock]]:
    """The policy's MoE blocks as ``(decoder layer index, block)``, ascending by layer."""
    return [(i, layer.mlp) for i, layer in enumerate(model.model.layers) if isinstance(layer.mlp, MoEBlock)]


@contextmanager
def routing_replay(
    model: nn.Module, topk_per_layer: Sequence[torch.Tensor] | Mapping[int, torch.Tensor] | torch.Tensor
) -> Iterator[None]:
    """Route every MoE layer by given expert indices inside the ``with`` block.

    The indices are those the engine chose when it generated the sample (routing replay); gate
    weights still come from the live router logits, so the router gets gradients (see
    `app.model.moe.MoEBlock`). On exit every block's ``replay_topk_idx`` is reset to None, also
    when the body raises.

    Args:
        model: a policy from `build_policy` / `load_policy`.
        topk_per_layer: one integer tensor ``[B, S, K]`` of global expert ids per MoE layer
            (B, S of the ``input_ids`` the model is then called with), ``-1`` for an empty slot: a sequence in MoE-layer order (a stacked
            ``[L_moe, B, S, K]`` tensor works), or a mapping from decoder layer index.

    Raises:
        ValueError: wrong number of layers, wrong K, or an id outside ``[-1, E)``; nothing is set.
    """
    blocks = moe_blocks(model)
    if isinstance(topk_per_layer, Mapping):
        want = sorted(i for i, _ in blocks)
        if sorted(topk_per_layer) != want:
            raise ValueError(
                f"topk_per_layer: keys {sorted(topk_per_layer)} must be the MoE layer indices {want}"
            )
        per_block = [topk_per_layer[i] for i, _ in blocks]
    else:
        per_block = list(topk_per_layer)
        if len(per_block) != len(blocks):
            raise ValueError(f"topk_per_layer: got {len(per_block)} layers, the model has {len(blocks)} MoE layers")
    config = model.config
    top_k, experts = config.num_experts_per_tok, num_routed_experts(config)
    prepared = []
    for (layer, block), idx in zip(blocks, per_block):
        if not isinstance(idx, torch.Tensor) or idx.dtype.is_floating_point or idx.dtype == torch.bool:
            raise ValueError(f"topk_per_layer[{layer}]: must be an integer tensor")
        if idx.ndim != 3 or idx.shape[-1] != top_k:
            raise ValueError(f"topk_per_layer[{layer}]: shape {tuple(idx.shape)} must be [B, S, {top_k}]")
        if idx.numel() and (int(idx.min()) < -1 or int(idx.max()) >= experts):
            raise ValueError(f"topk_per_layer[{layer}]: expert ids must lie in [-1, {experts})")
        prepared.append(idx.to(device=block.gate.weight.device, dtype=torch.long))
    try:
        for (_, block), idx in zip(blocks, prepared):
            block.replay_topk_idx = idx
        yield
    finally:
        for _, block in blocks:
            block.replay_topk_idx = None


@contextmanager
def real_tokens(model: nn.Module, mask: torch.Tensor) -> Iterator[None]:
    """Tell every MoE layer which tokens are real inside the ``with`` block (forward and any
    recompute in backward): padding and dummy rows then count in neither the aux loss nor the
    expert loads (`app.model.moe.MoEBlock.token_mask`). Reset to None on exit, also on error.

    Args:
        model: a policy from `build_policy` / `load_policy` (sharded or not).
        mask: ``[B, S]`` bool (or 0/1) of the ``input_ids`` the model is then called with.
    """
    blocks = moe_blocks(model)
    try:
        for _, block in blocks:
            block.token_mask = mask.to(device=block.gate.weight.device, dtype=torch.bool)
        yield
    finally:
        for _, block in blocks:
            block.token_mask = None
