"""The trainer's parallel layout rule, declared once and used by the trainer, charts8s and `moerl plan`.

The trainer world of W ranks is a data-parallel mesh ``[dp_replicate, dp_shard]`` (W =
dp_replicate x dp_shard), as in torchtitan's ``ParallelDims``:

* non-expert parameters, their gradients and AdamW state are sharded by FSDP2 over ``dp_shard``
  and replicated over ``dp_replicate`` (HSDP when dp_replicate > 1);
* routed experts are split over ``ep`` ranks (expert parallelism: EP rank r holds experts
  ``[r * E/ep, (r + 1) * E/ep)``) and sharded by FSDP2 over the remaining ``efsdp = dp_shard / ep``
  ranks (expert data parallelism), so the expert mesh is ``[dp_replicate, efsdp, ep]``;
* every rank is a data-parallel rank: it trains its own share of each step's GRPO groups.

Per GPU, every parameter (expert or not) costs ``1 / dp_shard`` of its fp32 master weight,
gradient and optimizer state. Nothing here imports torch, so charts8s can apply the rule.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Layout:
    """A checked trainer layout.

    Attributes:
        world: trainer ranks (GPUs, or CPU processes under gloo).
        dp_replicate: HSDP replicas (1: plain FSDP).
        dp_shard: FSDP shard degree of non-expert parameters.
        ep: expert-parallel degree (EP ranks share one MoE layer's experts).
        efsdp: FSDP shard degree of expert parameters (dp_shard / ep).
    """

    world: int
    dp_replicate: int
    dp_shard: int
    ep: int
    efsdp: int


def resolve_layout(parallel, world: int, num_experts: int | None = None) -> Layout:
    """Check ``trainer.parallel`` against the trainer world and the model; return the layout.

    Args:
        parallel: ``app.config.ParallelConfig`` (fields ``ep``, ``dp_shard`` (-1: world /
            dp_replicate), ``dp_replicate``).
        world: number of trainer ranks (torchrun's WORLD_SIZE; nodes x GPUs per node in the
            cluster).
        num_experts: routed experts per MoE layer, or None when the model is not known yet.

    Returns:
        The `Layout`.

    Raises:
        ValueError: one message naming the ``trainer.parallel`` field that does not fit.
    """
    if world < 1:
        raise ValueError(f"trainer world size must be >= 1, got {world}")
    rep = parallel.dp_replicate
    if world % rep:
        raise ValueError(f"trainer.parallel.dp_replicate={rep} does not divide the {world} trainer ranks")
    shard = world // rep if parallel.dp_shard == -1 else parallel.dp_shard
    if rep * shard != world:
        raise ValueError(
            f"trainer.parallel.dp_replicate x dp_shard = {rep} x {shard} = {rep * shard} must equal the "
            f"{world} trainer ranks (dp_shard -1 takes the rest)"
        )
    ep = parallel.ep
    if shard % ep:
        raise ValueError(
            f"trainer.parallel.ep={ep} must divide trainer.parallel.dp_shard={shard}: EP ranks are "
            f"carved out of the FSDP shard group"
        )
    if num_experts is not None and num_experts % ep:
        raise ValueError(f"trainer.parallel.ep={ep} does not divide the model's {num_experts} routed experts")
    return Layout(world=world, dp_replicate=rep, dp_shard=shard, ep=ep, efsdp=shard // ep)


def default_world(parallel) -> int:
    """Ranks the embedded default starts when nothing else fixes the world: dp_replicate x
    dp_shard, or ep x dp_replicate when dp_shard is -1 (one FSDP shard per EP rank)."""
    shard = parallel.ep if parallel.dp_shard == -1 else parallel.dp_shard
    return parallel.dp_replicate * shard
