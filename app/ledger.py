"""The independent ledger of a chaos run: which prompts were issued, which samples were trained.

Two append-only JSON-lines files, each written and fsync'd by a different process, and one
look at Redis at the end; nothing here trusts the buffer's own counters:

* ``issued.jsonl`` (the harness, before each ``put_tasks``): ``{"task_id", "attempt", "time"}``
  per prompt queued. A line written for a put that then failed is harmless: the same task is
  put again (put_tasks is idempotent) and the ledger counts prompts as a set.
* ``trained.jsonl`` (trainer rank 0, one line per step, format in app/trainer/train.py):
  the sample ids, their policy versions and the trainer's version at that step; a resume
  appends ``{"resume_from_step": S}``, which rolls back (voids) the step lines before it whose
  step is after S: the resumed weights never saw those samples, and the trainer re-reads them.
* pending at the end (`pending_prompts`): task ids still in the task stream (queued, or leased
  by a worker that died: the lease returns them to the queue) and in the samples stream
  (finished groups not yet trained).

Definitions (`audit`), over the trainer's final lineage (the step lines that were not rolled
back):
  issued      distinct prompt ids the harness queued;
  completed   issued prompts with at least one trained group;
  pending     issued prompts not completed that are still in the task or samples stream;
  dropped     issued prompts not completed nor pending that the buffer dropped after
              ``buffer.max_failures`` failed rollouts (its ``dropped`` set): accounted for with a
              count, never trained;
  lost        issued prompts neither completed, pending nor dropped: work that vanished;
  duplicated  sample ids trained more than once;
  overstale   trained samples with trainer_version - policy_version > max_staleness.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from app import versions


def append_issued(path: Path, task_ids: list[str], attempt: int = 0) -> None:
    """Append one line per prompt to ``issued.jsonl`` and fsync (before the tasks are queued)."""
    now = time.time()
    with open(path, "a") as f:
        for tid in task_ids:
            f.write(json.dumps({"task_id": tid, "attempt": attempt, "time": now}) + "\n")
        f.flush()
        os.fsync(f.fileno())


def _lines(path: Path) -> list[dict]:
    """Parsed JSON lines; a line cut short by a kill (not valid JSON) is skipped."""
    out = []
    if not Path(path).exists():
        return out
    for line in Path(path).read_text().splitlines():
        line = line.strip()
        if not line:
            continue
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


def read_issued(path: Path) -> set[str]:
    """Distinct prompt ids in ``issued.jsonl``."""
    return {r["task_id"] for r in _lines(path)}


@dataclass
class Lineage:
    """The step lines of trained.jsonl that the final weights descend from."""

    steps: list[dict] = field(default_factory=list)
    rolled_back_steps: int = 0  # step lines voided by a resume
    resumes: int = 0

    @property
    def last_time(self) -> float | None:
        return self.steps[-1]["time"] if self.steps else None


def read_lineage(path: Path) -> Lineage:
    """Replay trained.jsonl: a ``resume_from_step`` line voids the earlier lines of later steps.

    A line cut short by a kill is skipped: it is always a step after the newest saved state
    (the trainer writes a step's line before it saves that step), so a resume voids it anyway.
    """
    lin = Lineage()
    for rec in _lines(path):
        if "resume_from_step" in rec:
            s = int(rec["resume_from_step"])
            kept = [r for r in lin.steps if r["step"] <= s]
            lin.rolled_back_steps += len(lin.steps) - len(kept)
            lin.steps = kept
            lin.resumes += 1
        elif "step" in rec:
            lin.steps.append(rec)
    return lin


def pending_prompts(buffer: Any) -> set[str]:
    """Prompt ids still in the run's task stream (queued or leased) or samples stream.

    Args:
        buffer: an `app.buffer.ExperienceBuffer` (its ``r`` client and ``keys``).
    """
    out: set[str] = set()
    for name, fld in (("tasks", "task"), ("samples", "task")):  # both carry the task's JSON
        last = "-"
        while True:
            entries = buffer.r.xrange(buffer.keys[name], last, "+", count=1000)
            if last != "-":
                entries = entries[1:]  # the range start is inclusive
            if not entries:
                break
            for _, fields in entries:
                if fields and fld in fields:
                    out.add(json.loads(fields[fld])["task_id"])
            last = entries[-1][0]
    return out


@dataclass
class Audit:
    """The figures of one run (definitions in the module docstring)."""

    issued: int
    completed: int
    pending: int
    lost: int
    dropped: int
    duplicated: int
    overstale: int
    samples_trained: int
    steps: int
    rolled_back_steps: int
    resumes: int
    lost_ids: list[str] = field(default_factory=list)
    duplicated_ids: list[str] = field(default_factory=list)
    overstale_ids: list[str] = field(default_factory=list)

    def ok(self) -> bool:
        return self.lost == 0 and self.duplicated == 0 and self.overstale == 0

    def to_dict(self) -> dict:
        d = asdict(self)
        for k in ("lost_ids", "duplicated_ids", "overstale_ids"):
            d[k] = d[k][:20]  # examples, not the whole list
        return d


def audit(issued: set[str], lineage: Lineage, pending: set[str], max_staleness: int,
          dropped: set[str] = frozenset()) -> Audit:
    """Count issued / completed / pending / lost prompts, duplicated and over-stale samples.

    Args:
        issued: prompt ids the harness queued (`read_issued`).
        lineage: the trainer's final lineage (`read_lineage`).
        pending: prompt ids still queued, leased or waiting to be trained (`pending_prompts`).
        max_staleness: ``buffer.max_staleness`` of the run.
        dropped: prompt ids the buffer dropped after too many failed rollouts.
    """
    seen: dict[str, int] = {}
    overstale: list[str] = []
    trained_prompts: set[str] = set()
    for rec in lineage.steps:
        tv = int(rec["trainer_version"])
        for g in rec["groups"]:
            trained_prompts.add(g["task_id"])
            for sid, pv in g["samples"]:
                seen[sid] = seen.get(sid, 0) + 1
                if versions.overstale(tv, pv, max_staleness):
                    overstale.append(sid)
    completed = issued & trained_prompts
    waiting = (issued - completed) & pending
    gave_up = (issued - completed - waiting) & set(dropped)
    lost = sorted(issued - completed - waiting - gave_up)
    dups = sorted(s for s, n in seen.items() if n > 1)
    return Audit(
        issued=len(issued), completed=len(completed), pending=len(waiting), lost=len(lost), dropped=len(gave_up),
        duplicated=len(dups), overstale=len(overstale), samples_trained=sum(seen.values()),
        steps=len(lineage.steps), rolled_back_steps=lineage.rolled_back_steps, resumes=lineage.resumes,
        lost_ids=lost, duplicated_ids=dups, overstale_ids=overstale,
    )
