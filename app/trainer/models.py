"""The trainer's modules built on the device mesh: the policy, the frozen reference and PPO's critic.

Each is built with this rank's EP share of the experts, in fp32 (master weights), then sharded by
app/trainer/parallel.py. A checkpoint (``model.path``) is built on the meta device, sharded,
materialised and filled with only this rank's blocks (app/model/checkpoint.load_policy_shards);
a preset is built materialised with its EP-invariant seeded init and then sharded (presets are
small; a real model always starts from a checkpoint).
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import AutoModel, PretrainedConfig

from app.config import RunConfig
from app.model.checkpoint import load_policy_shards, read_config
from app.model.config import tiny_config, validate_config
from app.model.parallel import EPContext
from app.model.policy import MODEL_CLASSES, _rebuild_rotary, build_policy
from app.trainer.critic import Critic, CriticParts
from app.trainer.parallel import TrainerMesh, parallelize
from app.trainer.step import build_optimizer


def policy_config(cfg: RunConfig, path: str | None) -> PretrainedConfig:
    """The policy's transformers config: ``path``'s config.json, else the preset's.

    Raises:
        FileNotFoundError, ValueError: naming the file or field.
    """
    return read_config(path) if path else tiny_config(cfg.model.preset)


def _built(cfg: RunConfig, config: PretrainedConfig, path: str | None, ep: EPContext, mesh: TrainerMesh,
           device: torch.device, critic: bool = False) -> nn.Module:
    """Build (on the meta device for a checkpoint), wrap as a critic if asked, shard, materialise, fill."""
    validate_config(config, ep.size)
    compute = getattr(torch, cfg.model.dtype)
    where = "meta" if path else device
    model = build_policy(config, cfg.router, ep, device=where, dtype=torch.float32, seed=cfg.task.seed,
                         init=not path)
    outer = model
    if critic:
        outer = Critic(model.model, config.hidden_size).to(where)  # the LM head is dropped
        if not path:
            outer.zero_value_head()
    parallelize(outer, mesh, compute, cfg.trainer.activation_checkpointing)
    if path:
        outer.to_empty(device=device)
        _rebuild_rotary(model, device)
        # A critic's trunk is the checkpoint's "model."; its value head starts at zero.
        load_policy_shards(outer, path, rename=("trunk.", "model.") if critic else None,
                           skip=("value_head.",) if critic else ())
        if critic:
            outer.zero_value_head()
    return outer


def build_policy_model(cfg: RunConfig, path: str | None, ep: EPContext, mesh: TrainerMesh,
                       device: torch.device) -> nn.Module:
    """The sharded policy of ``cfg`` (``path``: a local HF directory, else the preset)."""
    return _built(cfg, policy_config(cfg, path), path, ep, mesh, device)


def build_reference(cfg: RunConfig, path: str | None, ep: EPContext, mesh: TrainerMesh,
                    device: torch.device) -> nn.Module:
    """The frozen reference policy of the k3 KL penalty (``trainer.kl_coef`` > 0)."""
    return build_policy_model(cfg, path, ep, mesh, device).eval().requires_grad_(False)


def build_critic_parts(cfg: RunConfig, path: str | None, ep: EPContext, mesh: TrainerMesh, device: torch.device):
    """PPO's critic (app/trainer/critic.py: a value head on a copy of the policy's trunk, or on
    ``trainer.critic_path``'s trunk), sharded like the policy, with its own AdamW.

    A ``trainer.critic_path`` of another (dense) architecture is loaded whole with ``AutoModel`` on
    every rank and then sharded; its decoder stack must be ``.layers`` (transformers' decoders).

    Raises:
        FileNotFoundError: ``trainer.critic_path`` has no config.json (named).
        ValueError: the critic's MoE layout does not fit ``trainer.parallel``.
    """
    t = cfg.trainer
    critic_path = t.critic_path or path
    try:
        config = policy_config(cfg, critic_path)
    except FileNotFoundError as e:
        raise FileNotFoundError(f"trainer.critic_path: {e}") from None

    if config.model_type in MODEL_CLASSES:
        critic = _built(cfg, config, critic_path, ep, mesh, device, critic=True)
    else:  # a dense model (e.g. a small reward-model-sized trunk): every rank loads it, FSDP shards it

        # no Hub kernels: app/engine/load.py says why
        trunk = AutoModel.from_pretrained(critic_path, dtype=torch.float32, use_kernels=False).to(device)
        critic = parallelize(Critic(trunk, config.hidden_size).to(device), mesh, getattr(torch, cfg.model.dtype),
                             t.activation_checkpointing)

    optimizer = build_optimizer(critic.parameters(), t.critic_lr or t.lr, t.adam_betas, t.weight_decay, device)
    return CriticParts(module=critic, optimizer=optimizer)
