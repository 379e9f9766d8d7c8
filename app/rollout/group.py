"""Engines over several nodes: every node holds each policy version before the engine loads it.

SGLang loads ``/update_weights_from_disk(model_path)`` on every rank, each node reading
``model_path`` from its own disk, so a multi-node engine (a LeaderWorkerSet group,
charts8s/rollout.py) can load a version only once every pod of the group has it at the same
path. Each pod runs a fetcher (`Fetcher`, ``python3 -m app.rollout.group``) beside its SGLang
rank: it downloads every new policy version from the store (``buffer.current_policy``) into
``rollout.policy_cache_dir/<engine>/v<N>`` on the pod's own model volume (the node's NVMe:
no shared filesystem is assumed; with one mounted there, the same path still works) and
reports the versions it holds. The rollout worker of the engine runs in a pod of its own (a
worker restart must not recreate the group) and asks for the update only once every pod
reports the version (`EngineGroup.missing`); until then the engine serves the version it has.

The worker cannot write the pause marker the probes of the leader read (app/rollout/probe.py)
from another pod: it records the pause here (`EngineGroup.pause`) and the leader's fetcher keeps
the marker file in step with it (at most ``MARKER_POLL_S`` behind; the probes tolerate far more).

Keys, under ``{prefix}:{run_id}:group:<engine>:`` (``engine`` is the leader's address, the
``LWS_LEADER_ADDRESS`` every pod of the group gets and the worker's engine URL names):

    held:<i>  JSON list of the versions on pod ``i``'s disk, expiring ``HELD_TTL_S`` after
              its last report (a pod that is gone stops counting).
    pause     the epoch seconds until which the worker holds the engine paused (expires then).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import signal
import sys
import time
from pathlib import Path

from app.buffer import ExperienceBuffer
from app.config import RunConfig
from app.storage import open_store
from app.storage.policy import download_policy

log = logging.getLogger("moerl.rollout.group")

HELD_TTL_S = 120.0  # a fetcher reports every policy poll; silent this long, it counts as missing
MARKER_POLL_S = 1.0


class EngineGroup:
    """The Redis records of one multi-node engine (see the module doc).

    Args:
        client: a ``redis.Redis`` with ``decode_responses=True`` (the buffer's, ``ExperienceBuffer.r``).
        prefix, run_id: the buffer's key prefix and run.
        engine: the engine's name, its leader's address (``LWS_LEADER_ADDRESS``).
        size: pods in the group (``LWS_GROUP_SIZE``).
    """

    def __init__(self, client, prefix: str, run_id: str, engine: str, size: int):
        if size < 1:
            raise ValueError(f"engine group {engine!r}: size must be >= 1, got {size}")
        self.r, self.engine, self.size = client, engine, size
        self.k = f"{prefix}:{run_id}:group:{engine}:"

    @classmethod
    def of(cls, buffer, engine: str, size: int) -> "EngineGroup":
        """The group's records next to an `app.buffer.ExperienceBuffer` (same Redis, same run)."""
        return cls(buffer.r, buffer.prefix, buffer.run_id, engine, size)

    def report(self, index: int, versions: list[int]) -> None:
        """Pod ``index`` holds ``versions`` on its disk (for the next ``HELD_TTL_S``)."""
        self.r.set(self.k + f"held:{index}", json.dumps(sorted(versions)), px=int(HELD_TTL_S * 1000))

    def held(self) -> dict[int, list[int]]:
        """Pod index -> versions on its disk, for the pods that reported within ``HELD_TTL_S``."""
        raw = self.r.mget([self.k + f"held:{i}" for i in range(self.size)])
        return {i: json.loads(v) for i, v in enumerate(raw) if v is not None}

    def missing(self, version: int) -> list[int]:
        """The pod indexes that do not (yet, or no longer) hold ``version``; [] when all do."""
        held = self.held()
        return [i for i in range(self.size) if version not in held.get(i, [])]

    def pause(self, until: float | None) -> None:
        """Record that the worker holds the engine paused until epoch second ``until`` (None: it continued)."""
        if until is None:
            self.r.delete(self.k + "pause")
        else:
            self.r.set(self.k + "pause", f"{until:.3f}", px=max(1, int((until - time.time()) * 1000)))

    def paused_until(self) -> float | None:
        value = self.r.get(self.k + "pause")
        return None if value is None else float(value)


def write_marker(marker: Path, until: float | None) -> None:
    """The probes' pause marker (app/rollout/probe.py): the epoch second it holds until, written
    atomically, or removed."""
    if until is None:
        marker.unlink(missing_ok=True)
        return
    marker.parent.mkdir(parents=True, exist_ok=True)
    tmp = marker.with_name(f".{marker.name}.tmp")
    tmp.write_text(f"{until:.3f}\n")
    os.replace(tmp, marker)


def group_cache_dir(policy_cache_dir: str | os.PathLike, engine: str) -> Path:
    """Where every pod of engine ``engine`` keeps policy versions (the same path on each node)."""
    return Path(policy_cache_dir) / engine


class Fetcher:
    """One pod's fetcher (see the module doc).

    Args:
        cfg: the run config (store, buffer, rollout.policy_cache_dir and policy_poll_s).
        buffer: an `app.buffer.ExperienceBuffer` (its ``current_policy`` and Redis).
        group: this pod's `EngineGroup`; index: this pod's index in it (``LWS_WORKER_INDEX``).
        marker: the pause marker to keep (the leader's; None on the other pods).
        store: the object store (default ``open_store(cfg.store_url)``).
    """

    def __init__(self, cfg, buffer, group: EngineGroup, index: int, marker: str | os.PathLike | None = None,
                 store=None):
        self.cfg, self.buffer, self.group, self.index = cfg, buffer, group, index
        self.marker = Path(marker) if marker else None
        self.store = store or open_store(cfg.store_url)
        self.dir = group_cache_dir(cfg.rollout.policy_cache_dir, group.engine)
        self.downloads = 0

    def versions(self) -> list[int]:
        """Versions complete on this pod's disk (download_policy renames a copy into place only whole)."""
        out = []
        for p in self.dir.glob("v*"):
            if p.is_dir() and p.name[1:].isdigit():
                out.append(int(p.name[1:]))
        return sorted(out)

    def fetch_current(self) -> None:
        """Download the current version if it is not here, keep it and the one before, report."""
        current = self.buffer.current_policy()
        if current is not None:
            version = int(current[0])
            if version not in self.versions():
                download_policy(self.store, self.cfg.run_id, version, self.dir / f"v{version}")
                self.downloads += 1
                log.info("%s[%d]: policy v%d on disk", self.group.engine, self.index, version)
            for old in self.versions():
                if old < version - 1:  # the engine may still read the one before
                    shutil.rmtree(self.dir / f"v{old}", ignore_errors=True)
        self.group.report(self.index, self.versions())

    def mirror_pause(self) -> None:
        if self.marker is not None:
            until = self.group.paused_until()
            write_marker(self.marker, until if until is not None and until > time.time() else None)

    def run(self, stop=lambda: False) -> None:
        """Until ``stop()``: fetch and report every policy poll, mirror the pause marker every
        ``MARKER_POLL_S``. Errors (store, Redis) are logged and retried: this process must
        not exit, a container restart recreates the whole group."""
        next_fetch = 0.0
        while not stop():
            try:
                if time.monotonic() >= next_fetch:
                    next_fetch = time.monotonic() + self.cfg.rollout.policy_poll_s
                    self.fetch_current()
                self.mirror_pause()
            except Exception as e:  # noqa: BLE001 - retried at the next poll, never fatal
                log.warning("%s[%d]: %s: %s", self.group.engine, self.index, type(e).__name__, e)
            time.sleep(MARKER_POLL_S)


def main(argv: list[str] | None = None) -> int:
    """``python3 -m app.rollout.group --config RUN --engine ADDR --index I --size N [--marker F]``."""
    p = argparse.ArgumentParser(prog="python3 -m app.rollout.group", description=__doc__.splitlines()[0])
    p.add_argument("--config", required=True)
    p.add_argument("--engine", required=True, help="the engine's leader address (LWS_LEADER_ADDRESS)")
    p.add_argument("--index", type=int, required=True, help="this pod's index in the group (LWS_WORKER_INDEX)")
    p.add_argument("--size", type=int, required=True, help="pods in the group (LWS_GROUP_SIZE)")
    p.add_argument("--marker", default=None, help="the probes' pause marker to keep (leader only)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        cfg = RunConfig.load(args.config)
        buffer = ExperienceBuffer.from_config(cfg)
        fetcher = Fetcher(cfg, buffer, EngineGroup.of(buffer, args.engine, args.size), args.index, args.marker)
    except (OSError, ValueError) as e:
        print(f"app.rollout.group: {e}", file=sys.stderr)
        return 2
    stopping = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(1))
    fetcher.run(stop=lambda: bool(stopping))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
