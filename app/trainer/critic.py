"""The PPO critic: a transformer trunk with a scalar value head.

The trunk is, by default, a copy of the policy's own trunk (``model.path`` or the preset; the LM
head is dropped), the usual choice in RLHF (OpenRLHF and verl start the critic from the
policy / SFT weights). ``trainer.critic_path`` names a separate Hugging Face checkpoint
instead: one of our MoE families (Qwen3-MoE, DeepSeek-V3) is loaded EP-sharded like the policy,
any other model with ``AutoModel`` (every rank holds all of it). The value head is a
``Linear(hidden, 1)`` in float32, initialised to zero, so the first values are exactly 0
(advantages then start as the discounted returns).

Under EP the critic's MoE layers are collectives like the policy's: every rank runs one critic
forward and backward per step. Its expert parameters are sharded (never all-reduced); the rest
are replicated and all-reduced like the policy's (app/trainer/train.py).

The critic's weights and optimizer state live in the training state, next to the policy's
(`critic_payload` / `restore_critic`, stored in the ``extra`` of `app.trainer.state.rank_payload`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn

from app.config import RunConfig


class Critic(nn.Module):
    """``trunk`` (a transformers base model: ``forward(input_ids, attention_mask)`` returns
    ``.last_hidden_state [B, L, H]``) followed by ``value_head: Linear(H, 1)`` (float32)."""

    def __init__(self, trunk: nn.Module, hidden_size: int):
        super().__init__()
        self.trunk = trunk
        self.value_head = nn.Linear(hidden_size, 1, dtype=torch.float32)
        nn.init.zeros_(self.value_head.weight)
        nn.init.zeros_(self.value_head.bias)

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        """Values aligned like `grpo.token_logprobs`.

        Args:
            input_ids: ``[B, L]`` int64.
            attention_mask: ``[B, L]`` int64 (1 on real tokens) or None.

        Returns:
            ``[B, L]`` float32: position ``t >= 1`` holds V(s_t), the value of the state that has
            seen tokens ``< t`` (computed from the hidden state at ``t - 1``); position 0 is 0.
        """
        hidden = self.trunk(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        v = self.value_head(hidden[:, :-1].float()).squeeze(-1)
        return nn.functional.pad(v, (1, 0), value=0.0)


def _trunk_of(model: nn.Module) -> nn.Module:
    # transformers causal LMs keep the decoder stack under ``.model`` (the LM head beside it).
    return model.model if hasattr(model, "lm_head") else model


def build_critic(cfg: RunConfig, ep, device: torch.device | str = "cpu") -> Critic:
    """The critic of ``cfg`` (``trainer.critic_path``, else a copy of the policy's trunk), with
    replicated parameters broadcast from rank 0 when a process group has several ranks.

    Args:
        cfg: run config (``trainer.critic_path``, ``model``, ``router``, ``task.seed``).
        ep: this rank's `app.model.parallel.EPContext`.
        device: where to put the critic.

    Raises:
        FileNotFoundError: ``trainer.critic_path`` has no config.json.
        ValueError: the critic checkpoint's MoE layout does not fit ``ep.size``.
    """
    from app.model.checkpoint import load_policy
    from app.model.policy import MODEL_CLASSES
    from app.trainer.train import broadcast_replicated, policy_from_config

    dtype = getattr(torch, cfg.model.dtype)
    path = cfg.trainer.critic_path
    if path:
        config_file = Path(path) / "config.json"
        if not config_file.is_file():
            raise FileNotFoundError(f"trainer.critic_path: {path} has no config.json (expected an HF checkpoint)")
        model_type = json.loads(config_file.read_text()).get("model_type")
        if model_type in MODEL_CLASSES:
            model = load_policy(path, cfg.router, ep, device=device, dtype=dtype)
        else:
            from transformers import AutoModel

            model = AutoModel.from_pretrained(path, dtype=dtype).to(device)
    else:
        model = policy_from_config(cfg, ep, device)
    trunk = _trunk_of(model)
    critic = Critic(trunk, trunk.config.hidden_size).to(device)
    del model  # drops the LM head
    broadcast_replicated(critic, ep)
    return critic


def critic_payload(critic: Critic, optimizer: torch.optim.Optimizer) -> dict:
    """This rank's critic state for the training checkpoint: weights (EP: local experts only)
    and optimizer state. Goes into ``extra["critic"]`` of `app.trainer.state.rank_payload`."""
    return {"model": critic.state_dict(), "optimizer": optimizer.state_dict()}


def restore_critic(critic: Critic, optimizer: torch.optim.Optimizer, payload: dict) -> None:
    """Load a `critic_payload` into ``critic`` and ``optimizer``.

    Raises:
        ValueError: ``payload`` is not a critic payload (the training state was saved by a GRPO
            run) or its tensors do not match this critic (names or shapes differ).
    """
    if not isinstance(payload, dict) or "model" not in payload or "optimizer" not in payload:
        raise ValueError("training state has no critic (was it saved by a trainer.algorithm='grpo' run?)")
    try:
        critic.load_state_dict(payload["model"])
    except RuntimeError as e:
        raise ValueError(f"saved critic does not match this critic: {e}") from None
    optimizer.load_state_dict(payload["optimizer"])


@dataclass
class CriticParts:
    """The critic as the trainer steps it: the module, its optimizer, and its parameters split
    like the policy's (``replicated``: gradients all-reduced; ``sharded``: this rank's experts)."""

    module: Critic
    optimizer: torch.optim.Optimizer
    replicated: list[nn.Parameter]
    sharded: list[nn.Parameter]

    @property
    def base_lr(self) -> float:
        return self.optimizer.defaults["lr"]


def make_critic_parts(cfg: RunConfig, ep, device: torch.device | str = "cpu") -> CriticParts:
    """`build_critic` plus an AdamW over it (``trainer.critic_lr`` or ``trainer.lr``, the
    policy's betas and weight decay). Collective under several ranks (the broadcast)."""
    from app.trainer.train import expert_param_ids

    t = cfg.trainer
    critic = build_critic(cfg, ep, device)
    sharded_ids = expert_param_ids(critic) if ep.size > 1 else set()
    params = [p for p in critic.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=t.critic_lr or t.lr, betas=t.adam_betas, weight_decay=t.weight_decay)
    return CriticParts(
        module=critic, optimizer=optimizer,
        replicated=[p for p in params if id(p) not in sharded_ids],
        sharded=[p for p in params if id(p) in sharded_ids],
    )
