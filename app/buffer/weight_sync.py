"""The weight-sync control plane on the run's Redis: who serves what, and each network push.

The trainer does not know the engines and never calls them; the rollout workers do not know the
trainer. They meet here (protocol: app/trainer/weight_sync.py), every key under
``{prefix}:{run_id}:wsync:``:

    engine:<id>    JSON `Registration` of worker ``id``'s engine, offered for pushes (its group
                   ranks, the version it serves, the group epoch it belongs to), with a Redis
                   expiry the worker keeps renewing (``weight_sync.engine_ttl_s``): a worker or
                   engine that is gone drops out by itself, and no clock is compared across hosts.
    engine-ids     set of the worker ids that registered (members whose key expired are removed
                   when read).
    push           JSON of the current push: ``{id, version, state, time, groups?, buckets?,
                   progress?, error?, engines?}`` (``groups``: worker id -> its weight-update
                   group: epoch, name, master address and port, world size, backend, its rank
                   offset), written by the trainer only. ``state`` moves
                   prepare -> (cancelled | join -> send | send) -> done | failed.
    plan:<push id> JSON list of buckets ``[{names, dtypes, shapes}]`` of that push (expires).
    acks:<push id> hash worker_id -> JSON ``{state, ...}`` (ready | busy | joined | done |
                   failed), written by the workers only (expires).
    events         stream: one entry per change of ``push``; workers block on it (XREAD) instead
                   of polling, so a prepare reaches them at once.
    ack-events     stream: one entry per ack; the trainer blocks on it while it waits.

Every value is JSON; a record and its event go in one MULTI/EXEC, so a reader never sees half a
record, and an event is never seen before its record.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from typing import Any

# Plans and acks of old pushes expire: nothing reads them once a newer push exists.
RECORD_TTL_S = 3600
# Event streams are capped (approximately): readers only need the entries since their last read.
EVENTS_MAXLEN = 1000


@dataclass
class Registration:
    """An engine offered for network pushes by its rollout worker.

    Attributes:
        worker_id: the worker (one per engine).
        ranks: the engine's ranks in a weight-update group (SGLang: its tp_size; built-in: 1).
        version: the policy version the engine serves (its /model_info weight_version), or None.
        epoch: the group epoch the engine is a member of, or None.
    """

    worker_id: str
    ranks: int
    version: int | None
    epoch: int | None


class SyncBoard:
    """Reads and writes of the weight-sync keys of one run.

    Args:
        client: a ``redis.Redis`` client with ``decode_responses=True`` (the buffer's own,
            ``ExperienceBuffer.r``; redis-py clients are thread-safe).
        prefix, run_id: the buffer's key prefix and run (``{prefix}:{run_id}:wsync:``).
    """

    def __init__(self, client, prefix: str, run_id: str):
        self.r = client
        self.k = f"{prefix}:{run_id}:wsync:"

    @classmethod
    def of(cls, buffer) -> "SyncBoard":
        """The board next to an `app.buffer.ExperienceBuffer` (same Redis, same run)."""
        return cls(buffer.r, buffer.prefix, buffer.run_id)

    # -- engines (workers write, the trainer reads) -------------------------------------------
    def register(self, reg: Registration, ttl_s: float) -> None:
        """Offer (or renew) an engine for ``ttl_s`` seconds; see `Registration`."""
        pipe = self.r.pipeline(transaction=True)
        pipe.set(self.k + f"engine:{reg.worker_id}", json.dumps(asdict(reg)), px=max(1, int(ttl_s * 1000)))
        pipe.sadd(self.k + "engine-ids", reg.worker_id)
        pipe.execute()

    def unregister(self, worker_id: str) -> None:
        """Withdraw an engine (its worker drains or stops)."""
        pipe = self.r.pipeline(transaction=True)
        pipe.delete(self.k + f"engine:{worker_id}")
        pipe.srem(self.k + "engine-ids", worker_id)
        pipe.execute()

    def engines(self) -> dict[str, Registration]:
        """Registrations that have not expired, by worker id."""
        ids = sorted(self.r.smembers(self.k + "engine-ids"))
        if not ids:
            return {}
        out, gone = {}, []
        for worker_id, raw in zip(ids, self.r.mget([self.k + f"engine:{w}" for w in ids])):
            if raw is None:
                gone.append(worker_id)
                continue
            try:
                out[worker_id] = Registration(**json.loads(raw))
            except (TypeError, ValueError):
                continue  # a record of another version: not ours to trust
        if gone:
            self.r.srem(self.k + "engine-ids", *gone)
        return out

    # -- the push (the trainer writes, workers read) ------------------------------------------
    def set_push(self, record: dict[str, Any]) -> None:
        """Make ``record`` (with ``id``, ``version``, ``state``) the current push."""
        pipe = self.r.pipeline(transaction=True)
        pipe.set(self.k + "push", json.dumps({**record, "time": time.time()}))
        pipe.xadd(self.k + "events", {"push": record["id"], "state": record["state"]},
                  maxlen=EVENTS_MAXLEN, approximate=True)
        pipe.execute()

    def wait(self, stream: str, last: str | None, timeout_s: float) -> str:
        """Block until stream ``"events"`` or ``"ack-events"`` has an entry after ``last`` (None:
        after now), at most ``timeout_s``; returns the id to pass next time."""
        if last is None:
            newest = self.r.xrevrange(self.k + stream, count=1)
            last = newest[0][0] if newest else "0-0"
        got = self.r.xread({self.k + stream: last}, count=1000, block=max(1, int(timeout_s * 1000)))
        return got[0][1][-1][0] if got else last

    def push(self) -> dict[str, Any] | None:
        """The current push record, or None before the first."""
        raw = self.r.get(self.k + "push")
        return json.loads(raw) if raw else None

    def set_plan(self, push_id: str, buckets: list[dict[str, list]]) -> None:
        """The buckets of push ``push_id``: ``[{names, dtypes, shapes}]`` in send order."""
        self.r.set(self.k + f"plan:{push_id}", json.dumps(buckets), ex=RECORD_TTL_S)

    def plan(self, push_id: str) -> list[dict[str, list]] | None:
        """The buckets of push ``push_id`` (None if not written or expired)."""
        raw = self.r.get(self.k + f"plan:{push_id}")
        return json.loads(raw) if raw else None

    # -- acknowledgements (workers write, the trainer reads) ---------------------------------
    def ack(self, push_id: str, worker_id: str, state: str, **fields: Any) -> None:
        """Worker ``worker_id``'s answer to push ``push_id`` (ready, busy, joined, done, failed)."""
        key = self.k + f"acks:{push_id}"
        pipe = self.r.pipeline(transaction=True)
        pipe.hset(key, worker_id, json.dumps({"state": state, "time": time.time(), **fields}))
        pipe.expire(key, RECORD_TTL_S)
        pipe.xadd(self.k + "ack-events", {"push": push_id, "worker": worker_id, "state": state},
                  maxlen=EVENTS_MAXLEN, approximate=True)
        pipe.execute()

    def acks(self, push_id: str) -> dict[str, dict[str, Any]]:
        """Every worker's latest answer to push ``push_id``."""
        return {w: json.loads(v) for w, v in self.r.hgetall(self.k + f"acks:{push_id}").items()}
