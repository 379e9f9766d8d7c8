"""The marker a finished trainer leaves in the store: ``<run_id>/trainer/done.json``.

Rank 0 writes it once the last step (``trainer.steps``) is trained, published and saved; the
prompt source (app/feed.py) reads it to stop queueing prompts and to measure the final policy
version. A trainer stopped early (SIGTERM) writes nothing, so a restarted gang resumes and the
feeder keeps feeding. The object holds ``{"step", "policy_version", "time"}`` (unix seconds).
"""

from __future__ import annotations

import json
import time

from app.storage.store import ObjectStore, run_area


def done_key(run_id: str) -> str:
    """'<run_id>/trainer/done.json'."""
    return run_area(run_id, "trainer") + "done.json"


def mark_done(store: ObjectStore, run_id: str, step: int, policy_version: int) -> None:
    """Record that run `run_id` finished at `step` with `policy_version` as its last version
    (one atomic put; writing it again overwrites it)."""
    body = {"step": int(step), "policy_version": int(policy_version), "time": time.time()}
    store.put_bytes(done_key(run_id), json.dumps(body).encode())


def read_done(store: ObjectStore, run_id: str) -> dict | None:
    """The marker of `run_id`, or None while the trainer is not done.

    Raises:
        ValueError: the object exists but is not the JSON `mark_done` writes (names the key).
    """
    key = done_key(run_id)
    try:
        raw = store.get_bytes(key)
    except FileNotFoundError:
        return None
    try:
        body = json.loads(raw)
        return {"step": int(body["step"]), "policy_version": int(body["policy_version"]),
                "time": float(body["time"])}
    except (ValueError, KeyError, TypeError):
        raise ValueError(f"{store.uri(key)}: not a trainer done marker: {raw[:80]!r}") from None
