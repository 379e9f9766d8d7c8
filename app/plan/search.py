"""`moerl plan --search`: every layout, micro-batch size and checkpointing mode of a world, planned,
and the ones that fit ordered best first.

Candidates: every ``(ep, dp_shard, dp_replicate)`` that app/layout.py's rule accepts for the world
and the model (dp_replicate divides the world, dp_shard = world / dp_replicate, ep divides
dp_shard and the routed experts), times micro-batches of 1, 2, 4, ... whole sequences up to the
rollouts per GPU, times the three checkpointing modes. A candidate whose expert tensors FSDP2
cannot shard is left out (the plan's own error).

Best first (`rank_key`), the order in which a step gets cheaper at the same memory verdict:
  1. least recomputation: checkpointing none, then selective, then full (full recomputes every
     layer's forward in its backward, about a third more FLOPs; selective saves the exchanges only
     on the alltoall dispatcher, elsewhere it counts as full);
  2. fewest micro-batches per step (larger GEMMs; FSDP2 gathers every unit once per micro-batch);
  3. the smallest EP degree (fewer all-to-all peers; up to the GPUs of a node it stays on NVLink);
  4. the fewest FSDP shards (dp_shard: all-gathers and reduce-scatters over fewer ranks, HSDP
     replicating the rest);
  5. the most headroom.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

from transformers import PretrainedConfig

from app.layout import Layout, resolve_layout
from app.model.config import num_routed_experts
from app.plan.memory import plan_memory

RANKING = ("least recomputation (checkpointing none < selective on alltoall < full), then fewest micro-batches, then "
           "smallest ep, then fewest FSDP shards (dp_shard), then most headroom")
_AC_ORDER = {"none": 0, "selective": 1, "full": 2}


@dataclass(frozen=True)
class Candidate:
    layout: Layout
    micro_batch_tokens: int
    activation_checkpointing: str


def layouts(world: int, num_experts: int) -> list[Layout]:
    """Every layout app/layout.py accepts for ``world`` ranks and ``num_experts`` routed experts."""
    out = []
    for rep in range(1, world + 1):
        if world % rep:
            continue
        shard = world // rep
        for ep in range(1, shard + 1):
            if shard % ep or num_experts % ep:
                continue
            out.append(resolve_layout(SimpleNamespace(ep=ep, dp_shard=shard, dp_replicate=rep), world, num_experts))
    return out


def candidates(config: PretrainedConfig, world: int, rollouts_per_gpu: int, seq_len: int) -> list[Candidate]:
    """Every (layout, micro-batch tokens, checkpointing mode) to plan (module docstring)."""
    seqs, n = [], 1
    while n < rollouts_per_gpu:
        seqs.append(n)
        n *= 2
    seqs.append(rollouts_per_gpu)
    return [Candidate(lay, s * seq_len, ac) for lay in layouts(world, num_routed_experts(config))
            for s in seqs for ac in _AC_ORDER]


def evaluate(inp, reason: str) -> dict:
    """One candidate's plan as a row (``fits`` False, with ``error``, where the plan refuses it)."""
    lay = inp.layout
    row = dict(ep=lay.ep, dp_shard=lay.dp_shard, dp_replicate=lay.dp_replicate, efsdp=lay.efsdp,
               ep_backend=inp.ep_backend, ep_backend_reason=reason, micro_batch_tokens=inp.micro_batch_tokens,
               activation_checkpointing=inp.activation_checkpointing)
    try:
        p = plan_memory(inp)
    except ValueError as e:
        return row | dict(fits=False, error=str(e))
    return row | dict(micro_batches=p.micro_batches, peak_phase=p.peak_phase, tensors_peak=p.tensors_peak,
                      reserved=p.reserved, overhead=p.overhead, predicted=p.predicted, headroom=p.headroom,
                      fits=p.fits)


def recomputation(row: dict) -> int:
    """0 none, 1 selective, 2 full; selective off the alltoall dispatcher keeps nothing more than
    full (app/plan/activations.py ``checkpoint_kept``) and recomputes as much, so it counts as full."""
    ac = row["activation_checkpointing"]
    if ac == "selective" and row["ep_backend"] != "alltoall":
        ac = "full"
    return _AC_ORDER[ac]


def rank_key(row: dict) -> tuple:
    """Sort key of a fitting row, best first (module docstring)."""
    return (recomputation(row), row["micro_batches"], row["ep"], row["dp_shard"], -row["headroom"])
