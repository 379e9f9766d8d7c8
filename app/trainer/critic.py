"""The PPO critic: a transformer trunk with a scalar value head.

The trunk is, by default, a copy of the policy's own trunk (``model.path`` or the preset; the LM
head is dropped), the usual choice in RLHF (OpenRLHF and verl start the critic from the
policy / SFT weights). ``trainer.critic_path`` names a separate Hugging Face checkpoint of one
of our MoE families (Qwen3-MoE, DeepSeek-V3) instead. The value head is a
``Linear(hidden, 1)`` in float32, initialised to zero, so the first values are exactly 0
(advantages then start as the discounted returns).

The critic is built and sharded like the policy (app/trainer/models.py, parallel.py): under EP its
MoE layers are collectives, so every rank runs the same critic forwards and backwards per step.
Its weights and optimizer state are a module of the training state beside the policy's
(app/trainer/state.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn



class Critic(nn.Module):
    """``trunk`` (a transformers base model: ``forward(input_ids, attention_mask)`` returns
    ``.last_hidden_state [B, L, H]``) followed by ``value_head: Linear(H, 1)`` (float32)."""

    def __init__(self, trunk: nn.Module, hidden_size: int):
        super().__init__()
        self.trunk = trunk
        self.value_head = nn.Linear(hidden_size, 1, dtype=torch.float32)
        self.zero_value_head()

    @torch.no_grad()
    def zero_value_head(self) -> None:
        """Value head weights and bias to 0 (the first values are exactly 0)."""
        self.value_head.weight.zero_()
        self.value_head.bias.zero_()

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
        # In the head's dtype (fp32, or bf16 under FSDP's mixed precision), then fp32 values.
        v = self.value_head(hidden[:, :-1].to(self.value_head.weight.dtype)).float().squeeze(-1)
        return nn.functional.pad(v, (1, 0), value=0.0)


@dataclass
class CriticParts:
    """The critic as the trainer steps it: the (sharded) module and its optimizer."""

    module: Critic
    optimizer: torch.optim.Optimizer

    @property
    def base_lr(self) -> float:
        return self.optimizer.defaults["lr"]
