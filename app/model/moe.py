"""The sparse MoE block: router -> dispatch -> grouped experts -> combine (+ shared experts).

Drop-in for transformers 5's `Qwen3MoeSparseMoeBlock` and `DeepseekV3MoE`: same forward
signature and return, same parameter names, same numerics in fp32 (router in fp32, top-k
selection by the same torch ops), but the experts of this EP rank only, with tokens moved by
the dispatcher of `ep.backend`.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from transformers import PretrainedConfig
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MLP

from app.config import RouterConfig
from app.model.dispatch import make_dispatcher
from app.model.dispatch.deepep import check_hidden_size
from app.model.experts import GroupedExperts
from app.model.parallel import BACKENDS, EPContext
from app.model.router import Router, load_balancing_loss


def moe_settings(config: PretrainedConfig) -> dict:
    """Family and routing fields of a Qwen3-MoE or DeepSeek-V3 config, validated.

    Returns:
        dict with family, num_experts, top_k, norm_topk_prob, n_group, topk_group,
        routed_scaling_factor, n_shared_experts.

    Raises:
        ValueError: unsupported `model_type`, or a routing field out of range; the message names
            the config field.
    """
    model_type = getattr(config, "model_type", None)
    if model_type == "qwen3_moe":
        s = dict(family=model_type, num_experts=config.num_experts, experts_field="num_experts",
                 n_group=1, topk_group=1, routed_scaling_factor=1.0, n_shared_experts=0)
    elif model_type == "deepseek_v3":
        s = dict(family=model_type, num_experts=config.n_routed_experts, experts_field="n_routed_experts",
                 n_group=config.n_group or 1, topk_group=config.topk_group or 1,
                 routed_scaling_factor=float(config.routed_scaling_factor),
                 n_shared_experts=config.n_shared_experts or 0)
    else:
        raise ValueError(f"config.model_type must be 'qwen3_moe' or 'deepseek_v3', got {model_type!r}")
    s["top_k"] = config.num_experts_per_tok
    s["norm_topk_prob"] = bool(config.norm_topk_prob)
    e, k, field = s["num_experts"], s["top_k"], s["experts_field"]
    if not isinstance(e, int) or e < 1:
        raise ValueError(f"config.{field} must be a positive integer, got {e!r}")
    if not isinstance(k, int) or k < 1:
        raise ValueError(f"config.num_experts_per_tok must be a positive integer, got {k!r}")
    if k > e:
        raise ValueError(f"config.num_experts_per_tok={k} is larger than config.{field}={e}")
    if s["family"] == "deepseek_v3":
        g, tg = s["n_group"], s["topk_group"]
        if e % g:
            raise ValueError(f"config.n_group={g} does not divide config.n_routed_experts={e}")
        if e // g < 2:
            raise ValueError(f"config.n_group={g} leaves {e // g} expert per group; the group score needs 2")
        if not 1 <= tg <= g:
            raise ValueError(f"config.topk_group={tg} must be between 1 and config.n_group={g}")
        if k > tg * (e // g):
            raise ValueError(
                f"config.num_experts_per_tok={k} exceeds the {tg * (e // g)} experts of the "
                f"config.topk_group={tg} selected groups"
            )
    return s


class MoEBlock(nn.Module):
    """One sparse MoE layer on one EP rank.

    Parameters (HF names):
        gate.weight [E, H]; gate.e_score_correction_bias [E] fp32 buffer (DeepSeek-V3);
        experts.gate_up_proj [E_local, 2*I, H]; experts.down_proj [E_local, H, I];
        shared_experts.{gate_proj,up_proj,down_proj}.weight (DeepSeek-V3, transformers' DeepseekV3MLP).

    Attributes:
        num_experts, num_local_experts, local_expert_offset (= ep.rank * num_local_experts).
        replay_topk_idx: [B, S, K] int64 or None; routing replay used when forward gets none.
        last_topk_idx: [T, K] int64 of the last forward (detached).
        token_mask: [B, S] bool or None: which tokens of the next forwards are real (set by
            `app.model.policy.real_tokens`; None: every token). Padding and dummy rows count in
            neither the aux loss nor the expert loads.
        last_aux_loss: scalar fp32 `router.aux_loss_coef * load-balancing loss` of the last forward,
            summed over its sequences (`app.model.router.load_balancing_loss`; in the graph: the
            trainer adds it to the loss divided by the step's sequence count), or None when the
            coefficient is 0.
        last_tokens_per_expert: [E_local] int64 rows each local expert processed in the last forward.
        last_replay_mismatch: [2] fp32 of the last replayed forward: tokens whose replayed experts
            differ from this router's own choice, and replayed tokens (routing replay metric).
    """

    def __init__(self, config: PretrainedConfig, router: RouterConfig, ep: EPContext,
                 experts_implementation: str = "auto"):
        """Build the layer; all validation happens here, before any tensor is allocated.

        Raises:
            ValueError: naming the field: unsupported model_type, num_experts not divisible by
                ep.size, num_experts_per_tok > num_experts, n_group not dividing the experts,
                topk_group out of range, bias updates asked for a router without bias, unknown backend,
                config.hidden_size not a multiple of 256 with the deepep backend.
        """
        super().__init__()
        s = moe_settings(config)
        if ep.backend not in BACKENDS:
            raise ValueError(f"ep.backend must be resolved to one of {BACKENDS} (use init_ep), got {ep.backend!r}")
        if s["num_experts"] % ep.size:
            raise ValueError(
                f"config.{s['experts_field']}={s['num_experts']} is not divisible by trainer.parallel.ep={ep.size}"
            )
        if router.bias_update_rate > 0 and s["family"] != "deepseek_v3":
            raise ValueError("router.bias_update_rate > 0 needs a DeepSeek-V3 router (e_score_correction_bias)")
        if ep.backend == "deepep":
            check_hidden_size(config.hidden_size, "config.hidden_size")
        self.config = config
        self.router_cfg = router
        self.ep = ep
        self.family = s["family"]
        self.num_experts = s["num_experts"]
        self.top_k = s["top_k"]
        self.num_local_experts = self.num_experts // ep.size
        self.local_expert_offset = ep.rank * self.num_local_experts

        self.gate = Router(
            self.family, self.num_experts, config.hidden_size, self.top_k, s["norm_topk_prob"],
            n_group=s["n_group"], topk_group=s["topk_group"],
            routed_scaling_factor=s["routed_scaling_factor"],
        )
        self.experts = GroupedExperts(
            self.num_local_experts, config.hidden_size, config.moe_intermediate_size,
            config.hidden_act, experts_implementation,
        )
        if s["n_shared_experts"] > 0:
            self.shared_experts = DeepseekV3MLP(
                config, intermediate_size=config.moe_intermediate_size * s["n_shared_experts"]
            )
        else:
            self.shared_experts = None
        self.dispatcher = make_dispatcher(ep, self.num_experts)
        self.replay_topk_idx: Tensor | None = None
        self.last_topk_idx: Tensor | None = None
        self.last_aux_loss: Tensor | None = None
        self.last_tokens_per_expert: Tensor | None = None
        self.last_replay_mismatch: Tensor | None = None
        self.token_mask: Tensor | None = None

    @torch.no_grad()
    def reset_parameters(self, generator: torch.Generator | None = None) -> None:
        """Initialize like transformers' `_init_weights`: normal(0, config.initializer_range), bias 0.

        Local experts take rows [local_expert_offset, +E_local) of a full [E, ...] draw, so every EP
        size gives the same global weights for the same generator state.
        """
        std = self.config.initializer_range
        self.gate.weight.normal_(0.0, std, generator=generator)
        if self.gate.e_score_correction_bias is not None:
            self.gate.e_score_correction_bias.zero_()
        for p in (self.experts.gate_up_proj, self.experts.down_proj):
            full = torch.empty((self.num_experts, *p.shape[1:]), dtype=p.dtype, device=p.device)
            full.normal_(0.0, std, generator=generator)
            p.copy_(full[self.local_expert_offset : self.local_expert_offset + self.num_local_experts])
        if self.shared_experts is not None:
            for lin in (self.shared_experts.gate_proj, self.shared_experts.up_proj, self.shared_experts.down_proj):
                lin.weight.normal_(0.0, std, generator=generator)

    def forward(self, hidden_states: Tensor, replay_topk_idx: Tensor | None = None) -> Tensor:
        """hidden_states [B, S, H] (or [T, H]) -> same shape and dtype.

        Args:
            hidden_states: input of the MoE layer.
            replay_topk_idx: optional [B, S, K] int64 global expert ids to route by (routing
                replay; -1 = no expert). Defaults to `self.replay_topk_idx`.

        Raises:
            ValueError: replay_topk_idx has the wrong shape or ids outside [-1, num_experts).
        """
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1])
        replay = replay_topk_idx if replay_topk_idx is not None else self.replay_topk_idx
        if replay is not None:
            replay = self._check_replay(replay, shape)
        routing = self.gate(x, replay)
        self.last_topk_idx = routing.topk_idx.detach()
        if replay is not None:
            self.last_replay_mismatch = self._replay_mismatch(routing)
        if self.router_cfg.aux_loss_coef > 0:
            sequences = shape[0] if len(shape) == 3 else 1
            mask = self.token_mask
            if mask is not None and mask.numel() != x.shape[0]:
                raise ValueError(f"token_mask has {mask.numel()} entries, the input {x.shape[0]} tokens")
            self.last_aux_loss = self.router_cfg.aux_loss_coef * load_balancing_loss(
                routing.scores, routing.topk_idx, self.family, sequences, mask
            )

        d = self.dispatcher.dispatch(x, routing.topk_idx, routing.topk_weights)
        # The experts scale each row by its gate weight on the [N, I] activation, in the weights'
        # dtype (no fp32 round trip of [N, H]; profile in bench/results/moe.md).
        y = self.experts(d.x, d.tokens_per_expert, d.weights)
        out = self.dispatcher.combine(y.to(x.dtype), d.handle)
        self.last_tokens_per_expert = d.tokens_per_expert.detach()
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out.view(shape)

    @torch.no_grad()
    def update_expert_bias(self, tokens_per_expert: Tensor) -> None:
        """Apply the aux-loss-free bias update (DeepSeek-V3 report §2.1.2) for a step's loads.

        Args:
            tokens_per_expert: [E] slots routed to each expert by the step's real tokens, summed
                over EVERY trainer rank (app/trainer/step.py), so that every replica of the bias
                (a buffer FSDP does not shard or sync) takes the same update.

        No-op when `router.bias_update_rate` is 0 (the default for RL).
        """
        rate = self.router_cfg.bias_update_rate
        if rate > 0:
            self.gate.update_bias(tokens_per_expert.to(self.gate.e_score_correction_bias.device), rate)

    @torch.no_grad()
    def _replay_mismatch(self, routing) -> Tensor:
        """[2] float: tokens whose replayed top-k set differs from the one this router would
        choose now, and replayed tokens (slots all >= 0; -1 rows are padding or the unfed last token)."""
        own = self.gate.own_topk(routing.scores)
        valid = (routing.topk_idx >= 0).all(-1)
        differs = (own.sort(-1).values != routing.topk_idx.sort(-1).values).any(-1) & valid
        return torch.stack([differs.sum(), valid.sum()]).float()

    def _check_replay(self, idx: Tensor, shape: torch.Size) -> Tensor:
        expected = (*shape[:-1], self.top_k)
        if tuple(idx.shape) != expected:
            raise ValueError(f"replay_topk_idx has shape {tuple(idx.shape)}, expected {expected}")
        if idx.dtype.is_floating_point or idx.dtype == torch.bool:
            raise ValueError(f"replay_topk_idx must be an integer tensor, got {idx.dtype}")
        idx = idx.to(device=self.gate.weight.device, dtype=torch.int64).reshape(-1, self.top_k)
        if idx.numel() and (int(idx.min()) < -1 or int(idx.max()) >= self.num_experts):
            raise ValueError(f"replay_topk_idx has expert ids outside [-1, {self.num_experts})")
        return idx
