"""What `moerl run` shows while it works: a live line per stage (warm-up, held-out evaluation,
start-up, training), the rollout workers' troubles read from the run's health hash
(app/buffer/health.py), and the rule that ends a run whose every rollout fails.

On a terminal a stage is a rich progress bar (spinner, bar, elapsed time); when the output is a
file or a pipe, a plain line when the stage starts, one at most every `PLAIN_EVERY_S` seconds
while it runs, and one when it ends, so a log shows progress without terminal control codes.
"""

from __future__ import annotations

import time

from rich.console import Console
from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

from app.buffer.health import RolloutHealth
from app.local.report import samples_per_s

PLAIN_EVERY_S = 15.0
# Seconds without a new trainer step before the live line says what the workers wait on.
QUIET_STEP_S = 10.0


class Stage:
    """One stage's live line (context manager): ``update(done, info)`` as it goes.

    Args:
        console: where to show it.
        label: what the stage is ("warm-up", "held-out evaluation before RL", ...).
        total: units of work (steps, episodes); None: a spinner with no bar.
        unit: what ``total`` counts, shown in plain lines.
    """

    def __init__(self, console: Console, label: str, total: float | None = None, unit: str = ""):
        self.console, self.label, self.total, self.unit = console, label, total, unit
        self.done: float = 0
        self.info = ""
        self._bar: Progress | None = None
        self._task = None
        self._t0 = self._last_plain = 0.0

    def __enter__(self) -> "Stage":
        self._t0 = self._last_plain = time.monotonic()
        if self.console.is_terminal:
            self._bar = Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(),
                                 TextColumn("{task.fields[info]}"), TimeElapsedColumn(),
                                 console=self.console, transient=False)
            self._bar.start()
            self._task = self._bar.add_task(self.label, total=self.total, info="")
        else:
            self.console.print(f"{self.label}: started", soft_wrap=True)
        return self

    def update(self, done: float | None = None, info: str | None = None) -> None:
        """Set the work done so far and/or the text beside the bar."""
        if done is not None:
            self.done = done
        if info is not None:
            self.info = info
        if self._bar is not None:
            self._bar.update(self._task, completed=self.done, info=self.info)
        elif time.monotonic() - self._last_plain >= PLAIN_EVERY_S:
            self._last_plain = time.monotonic()
            self.console.print(f"{self.label}: {self._plain_progress()}", soft_wrap=True)

    def advance(self, n: float = 1) -> None:
        self.update(self.done + n)

    def _plain_progress(self) -> str:
        parts = []
        if self.total:
            parts.append(f"{self.done:.0f}/{self.total:.0f}{f' {self.unit}' if self.unit else ''}")
        if self.info:
            parts.append(self.info)
        parts.append(f"{time.monotonic() - self._t0:.0f} s")
        return ", ".join(parts)

    def __exit__(self, *exc) -> None:
        if self._bar is not None:
            if exc[0] is None and self.total:
                self._bar.update(self._task, completed=self.total)
            self._bar.stop()
        else:
            self.console.print(f"{self.label}: {'done' if exc[0] is None else 'stopped'}, "
                               f"{self._plain_progress()}", soft_wrap=True)


def training_info(records: list[dict], health: RolloutHealth | None, now: float | None = None) -> str:
    """The text beside the training bar: the last step's figures, the workers' failures so far
    and, when no step came for `QUIET_STEP_S` seconds, what they wait on."""
    now = time.time() if now is None else now
    parts = []
    if records:
        r = records[-1]
        sps = samples_per_s(records[-10:])
        parts.append(f"reward {r.get('reward_mean', float('nan')):.3f}  "
                     f"{'n/a' if sps is None else f'{sps:.1f}'} samples/s  "
                     f"staleness {r.get('staleness_mean', 0):.2f}  policy v{r['policy_version']}")
    quiet = not records or now - records[-1]["time"] > QUIET_STEP_S
    waiting = health.waiting_line(now) if health is not None and quiet else None
    if waiting:
        parts.append(f"waiting: {waiting}")
    elif not records:
        parts.append("waiting for the first batch")
    if health is not None and health.failed:
        top = health.top(1)[0]
        parts.append(f"{health.failed} groups failed ({top[0]}: {top[1]})")
    return "  ".join(parts)


def every_rollout_fails(stats: dict, health: RolloutHealth | None, groups_per_step: int) -> str | None:
    """The message that ends a run whose rollouts all fail, or None: no group has ever finished
    while at least ``2 x groups_per_step`` failed and some were dropped after
    ``buffer.max_failures`` (a reward or environment that fails every episode: NaN rewards,
    rewards outside the declared range, a server that refuses every session). Waiting for the
    trainer's ``batch_timeout_s`` would only say it later and less clearly."""
    failed = stats.get("failed_requeued", 0) + stats.get("failed_dropped", 0)
    if stats.get("finished", 0) or failed < 2 * groups_per_step or not stats.get("failed_dropped", 0):
        return None
    why = health.top_text() if health is not None and health.failed else "no reason recorded"
    dropped = stats["failed_dropped"]
    return (f"every rollout group failed ({failed} groups, none finished; {dropped} task{'' if dropped == 1 else 's'} "
            f"dropped after buffer.max_failures): {why}")
