"""DAPO's dynamic sampling: which taken groups a step trains on (rank 0, before the scatter).

A GRPO group whose rewards are all equal has advantage 0 on every sample (app/trainer/grpo.py):
it adds no policy gradient, only tokens to the denominator, so a batch of mostly such groups
trains on little. Dynamic sampling (Yu et al. 2025, "DAPO", arXiv:2503.14476, §3.2; verl's
``algorithm.filter_groups``) skips them and keeps taking groups until the batch holds
``trainer.groups_per_step`` groups with signal. A skipped group is still taken from the buffer
and committed with the step's groups at the next save (the buffer counts it in ``taken`` and
``consumed``), and trained.jsonl lists it under ``skipped`` with the reason ``no_signal``.

The cap: after ``trainer.dynamic_sampling_max_skipped`` skips in one step, groups without signal
fill the batch as they come, so a policy that solves (or fails) every prompt cannot stall the
trainer, and the buffer's capacity rule (app/config.py) bounds what a step may take.
"""

from __future__ import annotations

from app.trainer.batch import sample_rewards


def has_signal(group, soft_overlong: tuple[int, int, float] | None = None) -> bool:
    """True when the rewards the trainer would train on (`sample_rewards`) differ within the group."""
    rewards = sample_rewards(list(group.samples), soft_overlong)
    return bool(rewards.numel() > 1 and rewards.max() != rewards.min())


class SignalFilter:
    """One step's dynamic sampling: ``admit(group)`` says whether the step trains on it.

    Attributes:
        skipped: groups without signal skipped this step.
        admitted_flat: groups without signal admitted after the cap.
    """

    def __init__(self, max_skipped: int, soft_overlong: tuple[int, int, float] | None = None):
        self.max_skipped = max_skipped
        self.soft_overlong = soft_overlong
        self.skipped = 0
        self.admitted_flat = 0

    @classmethod
    def of(cls, cfg) -> "SignalFilter | None":
        """The filter of a run config (``trainer.dynamic_sampling``), or None when it is off."""
        t = cfg.trainer
        return cls(t.dynamic_sampling_max_skipped, cfg.soft_overlong()) if t.dynamic_sampling else None

    def admit(self, group, skipped: list | None = None) -> bool:
        """Admit ``group`` unless it has no signal and fewer than ``max_skipped`` were skipped;
        a skipped group is appended to ``skipped`` as ``[task_id, attempt, "no_signal"]``."""
        if has_signal(group, self.soft_overlong):
            return True
        if self.skipped >= self.max_skipped:
            self.admitted_flat += 1
            return True
        self.skipped += 1
        if skipped is not None:
            skipped.append([group.task_id, group.attempt, "no_signal"])
        return False

    def meta(self) -> dict:
        """The step's figures for metrics.jsonl."""
        return {"no_signal_skipped": self.skipped, "no_signal_admitted": self.admitted_flat}
