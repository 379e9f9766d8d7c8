"""The policy-version contract's one rule (docs/ARCHITECTURE.md, "Policy version and staleness").

Staleness of a sample = the trainer's policy version - the version of the weights that generated
it. The buffer (`ExperienceBuffer.take_batch`), the trainer (`app.trainer.intake.usable`) and the
audit of a run (`app.ledger.audit`) all apply `overstale`. It imports nothing: every role may use
it.
"""

from __future__ import annotations


def staleness(trainer_version: int, policy_version: int) -> int:
    """Versions between the trainer's policy and the one that generated a sample (>= 0 in a run
    whose versions only grow)."""
    return int(trainer_version) - int(policy_version)


def overstale(trainer_version: int, policy_version: int, max_staleness: int) -> bool:
    """True when a sample of ``policy_version`` must not be trained at ``trainer_version``:
    its staleness exceeds ``buffer.max_staleness``."""
    return staleness(trainer_version, policy_version) > max_staleness
