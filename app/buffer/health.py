"""Why rollouts fail or wait, as the rollout workers see it, kept in the run's Redis so that the
trainer, `moerl run` and an operator can name the cause instead of guessing at it.

One hash per run, ``{prefix}:{run_id}:health`` (app/buffer/keys.py), written by the workers
(`ExperienceBuffer.note_failures`, `note_waiting`):

    fail:<reason>      groups that failed for that reason (a reward or environment call), counted;
                       a reason is short and names no episode or URL (`failure_reason`), so that
                       equal causes add up
    wait:<worker id>   JSON ``{"on": "environment" | "engine", "what": <URL>, "why": <error>,
                       "since": <epoch s>}`` while that worker leases nothing because ``on`` does
                       not answer; ``""`` once it answers again

`RolloutHealth` is the hash read back; `starved_because` turns it into the one line the trainer
and `moerl run` print when no batch comes.
"""

from __future__ import annotations

import json
import re
import time
from collections import Counter
from dataclasses import dataclass, field

FAIL_PREFIX = "fail:"
WAIT_PREFIX = "wait:"
MAX_REASON_CHARS = 160
# Distinct reasons one worker writes; later new ones count as "other" (the hash stays small when
# an environment's error text holds the episode's own data).
MAX_REASONS_PER_WORKER = 32
OTHER = "other"

_URL = re.compile(r"\b(?:wss?|https?)://[^\s/]+(?:/[^\s:]*)?")


def failure_reason(kind: str, text: str) -> str:
    """``"<kind>: <text>"`` with a leading URL dropped and others said as "the server", at most
    `MAX_REASON_CHARS` characters (the key of a failure count: equal causes give equal reasons)."""
    text = re.sub(r"\s+", " ", str(text)).strip()
    m = _URL.match(text)
    if m:
        text = text[m.end():].lstrip(" :")
    text = _URL.sub("the server", text).strip(" :")
    return f"{kind}: {text}"[:MAX_REASON_CHARS] if text else kind


@dataclass
class RolloutHealth:
    """The health hash, read back: failed groups per reason and who waits on what."""

    failures: dict[str, int] = field(default_factory=dict)
    waiting: dict[str, dict] = field(default_factory=dict)  # worker id -> {on, what, why, since}

    @classmethod
    def from_hash(cls, fields: dict) -> "RolloutHealth":
        failures, waiting = {}, {}
        for key, value in fields.items():
            key = key.decode() if isinstance(key, bytes) else key
            value = value.decode() if isinstance(value, bytes) else value
            if key.startswith(FAIL_PREFIX):
                failures[key[len(FAIL_PREFIX):]] = int(value)
            elif key.startswith(WAIT_PREFIX) and value:
                try:
                    waiting[key[len(WAIT_PREFIX):]] = json.loads(value)
                except ValueError:
                    continue
        return cls(failures, waiting)

    @property
    def failed(self) -> int:
        return sum(self.failures.values())

    def top(self, n: int = 3) -> list[tuple[str, int]]:
        """The ``n`` most frequent failure reasons with their counts."""
        return Counter(self.failures).most_common(n)

    def top_text(self, n: int = 3) -> str:
        """``"<reason> (<count>); ..."`` of the `top` reasons ("" when none)."""
        return "; ".join(f"{reason} ({count})" for reason, count in self.top(n))

    def waiting_line(self, now: float | None = None) -> str | None:
        """One line on the workers that wait (the longest wait's cause first), or None."""
        if not self.waiting:
            return None
        now = time.time() if now is None else now
        by_cause = Counter((w.get("on", "?"), w.get("what", ""), w.get("why", "")) for w in self.waiting.values())
        (on, what, why), n = by_cause.most_common(1)[0]
        since = min(float(w.get("since", now)) for w in self.waiting.values()
                    if (w.get("on", "?"), w.get("what", ""), w.get("why", "")) == (on, what, why))
        who = f"{n} rollout worker{'s' if n > 1 else ''}"
        return f"{who} waiting {now - since:.0f} s on the {on}{f' at {what}' if what else ''}: {why or 'no answer'}"


def starved_because(health: RolloutHealth | None) -> str:
    """Why no batch came, as far as the workers know: who waits on what, else the failures and
    their top reasons, else the question it used to end with."""
    if health is not None:
        line = health.waiting_line()
        if line:
            return line
        if health.failed:
            return f"{health.failed} rollout groups failed so far: {health.top_text()}"
    return "are rollout workers running?"
