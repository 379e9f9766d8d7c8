"""The engine's weights as one rollout worker drives them: one owner for every change.

An `EngineWeights` holds what both ways of changing the engine's weights share: the lock (one
change at a time), the admission gate of the worker's /generate calls, the pause marker the
engine's probes read, the version the engine serves (``version``), the download of a version
from the store (or, for a multi-node engine, the wait until every pod of its group holds it),
the disk load, and the reload after a failed push. The worker's policy poll calls `sync`;
the network-push member (app/rollout/weight_sync.py) calls `change`, `commit` and
`reload_from_store`.

The weight-update state machine (`change`), the same for a disk load and a network push:

1. stop admission: no new /generate starts (`generating` waits);
2. wait until idle: the worker's in-flight requests finish on the old weights (so no sequence
   mixes two versions), bounded for a push by its ready budget; with ``rollout.partial_rollout``
   they are aborted instead (SGLang /abort_request with ``abort_all``: the engine is this
   worker's alone) and answer at once with their tokens so far, which the worker resumes on
   the new weights (a sample then has version segments);
3. pause: the pause marker is written for the probes (``hold_s``), then /pause_generation
   (``rollout.pause_mode``);
4. swap: the caller's body (flush, then /update_weights_from_disk, or the push's buckets);
5. continue: /continue_generation (when paused), the marker removed, admission open again;
   unless the change says ``keep_paused`` (a push left the weights partly new: they must not
   serve, the reload owns the engine from then on).

Versions are never claimed: ``version`` moves only on a load or push that succeeded, or on the
engine's own report (/model_info).
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import time
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, AsyncIterator, Awaitable, Callable

from app.config import RunConfig
from app.rollout.engine_client import EngineClient, EngineError
from app.rollout.group import group_cache_dir
from app.storage import open_store
from app.storage.policy import download_policy

log = logging.getLogger("moerl.rollout")


class GroupNotReady(RuntimeError):
    """Not every pod of a multi-node engine holds the version yet (app/rollout/group.py): the
    update waits for a later poll, the engine keeps serving what it has."""


class WeightChange:
    """One change of the engine's weights in progress (the handle `EngineWeights.change` yields).

    Attributes:
        paused: /pause_generation succeeded (so the exit continues the engine).
        keep_paused: set by the caller when the weights are not known to be whole: the exit
            leaves the engine paused, the marker kept and admission closed.
    """

    def __init__(self, weights: "EngineWeights"):
        self.w = weights
        self.paused = False
        self.keep_paused = False

    async def wait_idle(self, within_s: float | None = None) -> bool:
        """Step 2: wait for the worker's in-flight requests; False when not idle within ``within_s``
        (None: no bound). With ``rollout.partial_rollout`` they are aborted first
        (`EngineWeights.abort_in_flight`): they answer at once with their tokens so far, which
        the worker resumes after the swap. The wait is added to ``stats.drained_s``."""
        t0 = time.monotonic()
        try:
            if self.w.r.partial_rollout:
                await self.w.abort_in_flight(within_s)
            if within_s is None:
                await self.w.idle.wait()
                return True
            if self.w.idle.is_set():
                return True
            try:
                await asyncio.wait_for(self.w.idle.wait(), max(0.0, t0 + within_s - time.monotonic()))
                return True
            except asyncio.TimeoutError:
                return False
        finally:
            self.w.stats.drained_s += time.monotonic() - t0

    async def pause(self, hold_s: float) -> None:
        """Step 3: keep the probes' marker for ``hold_s`` seconds, pause the engine.

        Raises:
            EngineError: the engine did not pause (then it is not continued either).
        """
        self.w.mark_paused(hold_s)
        await self.w.client.pause_generation(self.w.r.pause_mode)
        self.paused = True


class EngineWeights:
    """The weights of the engine one worker drives (see the module doc).

    Args:
        cfg: the run configuration (rollout, weight_sync, store_url, run_id are used).
        client: the engine client.
        worker_id: names the worker in logs and its policy cache dir.
        stats: the worker's `WorkerStats` (weight-update counters are kept there).
        current_policy: async callable returning the buffer's ``(version, url)`` or None (the
            worker's buffer thread, `ExperienceBuffer.current_policy`).
        stop: the worker's stop event (set on SIGTERM).
        store: object store of the published versions (default ``open_store(cfg.store_url)``,
            opened on first use).
        pause_marker: the file the engine's probes read while it is paused (epoch seconds by which
            it will have continued); None: no marker.
        metrics: an ``app.metrics.RunMetrics`` that gets each successful disk update's duration (s).
        group: the `app.rollout.group.EngineGroup` of a multi-node engine (its pods fetch each
            version; the pause is recorded there for the leader's fetcher); None: one node.
    """

    def __init__(self, cfg: RunConfig, client: EngineClient, worker_id: str, *, stats: Any,
                 current_policy: Callable[[], Awaitable[Any]], stop: asyncio.Event, store: Any = None,
                 pause_marker: str | os.PathLike | None = None, metrics: Any = None, group: Any = None):
        self.cfg = cfg
        self.r = cfg.rollout
        self.client = client
        self.worker_id = worker_id
        self.stats = stats
        self.current_policy = current_policy
        self.stop = stop
        self.store = store
        self.metrics = metrics
        self.group = group
        self.pause_marker = Path(pause_marker) if pause_marker else None
        if group is None:
            self.cache_dir = Path(cfg.rollout.policy_cache_dir).resolve() / worker_id
        else:  # the path on the engine's nodes (app/rollout/group.py), not on this pod

            self.cache_dir = group_cache_dir(cfg.rollout.policy_cache_dir, group.engine)
        self.version: int | None = None  # what the engine serves, as far as known
        # The engine failed a call: the worker health-checks it before leasing again, and a
        # restarted engine then loads the current version.
        self.suspect = False
        self.lock = asyncio.Lock()  # held by whoever changes the weights: a disk load or a push
        self.admitting = asyncio.Event()  # cleared while the weights change
        self.admitting.set()
        self.in_flight = 0  # /generate calls of this worker in flight
        self.idle = asyncio.Event()  # set while in_flight == 0
        self.idle.set()
        # A disk update whose answer never came: (version, when it may be sent again).
        self.unanswered: tuple[int, float] | None = None
        # Partial rollout: abort_epoch counts this worker's aborts, so a request tells an abort of
        # ours (resumed) from anyone else's (an engine error, as before).
        self.abort_epoch = 0

    # -- admission --------------------------------------------------------------------------
    @asynccontextmanager
    async def generating(self) -> AsyncIterator[None]:
        """Around one /generate: waits while the weights change, counts the call in flight."""
        await self.admitting.wait()
        self.in_flight += 1
        self.idle.clear()
        try:
            yield
        finally:
            self.in_flight -= 1
            if self.in_flight == 0:
                self.idle.set()

    async def abort_in_flight(self, within_s: float | None = None, every_s: float = 1.0) -> None:
        """Abort this worker's requests on its engine: /abort_request ``abort_all`` (slime and
        Miles do the same), sent again every ``every_s`` seconds while any is still in flight
        (one that was between SGLang's tokenizer and scheduler, e.g. an ``n > 1`` request's
        samples, which 0.5.23 sends after their shared prefill, escapes an abort). Every aborted
        request answers with the tokens and logprobs it has (finish_reason abort). Not by rid:
        SGLang 0.5.23 matches a rid exactly and gives each sample of an ``n > 1`` request a
        fresh one. The engine serves this worker alone (`app.config` refuses partial rollout
        behind the router). An engine that does not answer is waited for instead; the aborts
        stop after ``within_s`` (None: none) and the caller's wait decides."""
        if not self.in_flight:
            return
        self.abort_epoch += 1
        self.stats.partial_aborts += 1
        deadline = None if within_s is None else time.monotonic() + within_s
        while self.in_flight and (deadline is None or time.monotonic() < deadline):
            try:
                await self.client.abort_request(abort_all=True)
            except EngineError as e:
                log.warning("%s: /abort_request failed (%s); waiting for the in-flight requests instead",
                            self.worker_id, e)
                return
            try:
                await asyncio.wait_for(self.idle.wait(), every_s)
            except asyncio.TimeoutError:
                pass

    async def sleep_or_stop(self, seconds: float) -> None:
        """Sleep ``seconds``, or less if the worker is told to stop."""
        try:
            await asyncio.wait_for(self.stop.wait(), seconds)
        except asyncio.TimeoutError:
            pass

    # -- the state machine ------------------------------------------------------------------
    @asynccontextmanager
    async def change(self) -> AsyncIterator[WeightChange]:
        """Steps 1 and 5 of the module doc around the caller's steps 2-4 (the caller holds
        ``lock``).

        Raises:
            EngineError: /continue_generation failed (the marker is removed and admission opened
                all the same).
        """
        self.admitting.clear()
        change = WeightChange(self)
        try:
            yield change
        finally:
            if not change.keep_paused:
                try:
                    if change.paused:
                        await self.client.continue_generation()
                finally:
                    self.mark_paused(None)
                    self.admitting.set()

    def mark_paused(self, for_s: float | None) -> None:
        """Write (atomically) or remove the pause marker the engine's probes read; for a
        multi-node engine, record the pause for its leader's fetcher to mirror."""
        if self.group is not None:
            try:
                self.group.pause(None if for_s is None else time.time() + for_s)
            except Exception as e:  # noqa: BLE001 - the probes may then fail a long load: said, not fatal
                log.warning("%s: could not record the pause for the engine's probes: %s", self.worker_id, e)
        if self.pause_marker is None:
            return
        if for_s is None:
            self.pause_marker.unlink(missing_ok=True)
            return
        self.pause_marker.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.pause_marker.with_name(f".{self.pause_marker.name}.tmp")
        tmp.write_text(f"{time.time() + for_s:.3f}\n")
        os.replace(tmp, self.pause_marker)

    async def flush_paused(self) -> bool:
        """Flush the paused engine's cache before its weights change, retried a second apart for
        ``rollout.flush_timeout_s`` (Miles and slime: pause -> /flush_cache until it succeeds ->
        update with flush_cache false). SGLang refuses a flush while a request runs or queues
        (an in_place pause, a /health_generate probe caught mid-flight); a flush left to the
        update itself would then fail the update after the weights changed, with the old
        version still reported. True once flushed; False: nothing was changed.

        Raises:
            EngineError: the engine did not answer.
        """
        return await self.client.flush_until(self.r.flush_timeout_s)

    # -- from the store ---------------------------------------------------------------------
    def download(self, version: int) -> Path:
        """The local directory of policy ``version`` the engine can load: downloaded here, or,
        for a multi-node engine, held by every pod of its group (raises `GroupNotReady` until then)."""
        if self.group is not None:
            missing = self.group.missing(version)
            if missing:
                raise GroupNotReady(f"engine {self.group.engine}: pod(s) {missing} of {self.group.size} do not "
                                    f"hold policy v{version} yet")
            return self.cache_dir / f"v{version}"

        if self.store is None:
            self.store = open_store(self.cfg.store_url)
        # Idempotent: an intact copy already in the cache is used as it is.
        dest = Path(download_policy(self.store, self.cfg.run_id, version, self.cache_dir / f"v{version}"))
        # Keep this version and the one before it (the engine may still be reading it).
        for old in self.cache_dir.glob("v*"):
            try:
                n = int(old.name[1:])
            except ValueError:
                continue
            if n < version - 1:
                shutil.rmtree(old, ignore_errors=True)
        return dest.resolve()

    async def sync(self) -> None:
        """Bring the engine to the buffer's current policy version if it lags, through the state
        machine; nothing while a network push holds the lock (then at the next poll).

        An update whose answer did not come in time is not sent again blindly: SGLang goes on
        loading after the client gave up and reloads on every call. The engine's own version
        (/model_info) decides: the target version means it loaded; the old one means wait, and
        only ``weight_update_timeout_s`` after the unanswered call is the update sent again.
        """
        if self.lock.locked():
            return
        async with self.lock:
            await self._sync()

    async def _sync(self) -> None:
        try:
            current = await self.current_policy()
            self.version = await self.client.weight_version()
        except EngineError as e:
            log.warning("%s: engine unreachable for the version check: %s", self.worker_id, e)
            self.suspect = True
            return
        except Exception as e:  # noqa: BLE001 - Redis hiccup: try again at the next poll
            self.stats.buffer_errors += 1
            log.warning("%s: buffer error reading the policy version: %s", self.worker_id, e)
            return
        if self.unanswered is not None:
            version, resend_at = self.unanswered
            if self.version is not None and self.version >= version:
                log.info("%s: the unanswered update took effect: engine at v%d", self.worker_id, self.version)
                self.unanswered = None
                self.stats.weight_updates += 1
            elif time.monotonic() < resend_at:
                return  # the engine may still be loading it
            else:
                self.unanswered = None
        if current is None:
            return
        version = int(current[0])
        if self.version is not None and self.version >= version:
            return
        try:
            path = await asyncio.to_thread(self.download, version)
        except GroupNotReady as e:
            log.info("%s: %s; the engine stays at v%s", self.worker_id, e, self.version)
            return
        except Exception as e:  # noqa: BLE001 - retried at the next poll
            self.stats.weight_update_failures += 1
            log.warning("%s: download of policy v%d failed: %s", self.worker_id, version, e)
            return
        timeout = self.r.weight_update_timeout_s
        unanswered = refused = False
        try:
            async with self.change() as change:
                await change.wait_idle()
                await change.pause(timeout + self.r.flush_timeout_s + 60.0)
                try:
                    refused = not await self.flush_paused()
                    ok, message = False, "the engine refused /flush_cache"
                    if not refused:
                        started = time.monotonic()
                        ok, message = await self.client.update_weights_from_disk(
                            str(path), version, timeout_s=timeout, flush_cache=False)
                except EngineError as e:
                    ok, message, unanswered = False, str(e), e.timed_out
        except EngineError as e:
            ok, message = False, str(e)
        if ok:
            self.version = version
            self.stats.weight_updates += 1
            if self.metrics is not None:
                self.metrics.observe_weight_update(time.monotonic() - started)
            log.info("%s: engine now at policy v%d", self.worker_id, version)
            return
        if refused:
            self.stats.flushes_refused += 1
            log.warning("%s: the paused engine refused /flush_cache for %.0f s (a request still runs or "
                        "queues); v%d is loaded at the next poll", self.worker_id, self.r.flush_timeout_s, version)
            return
        self.stats.weight_update_failures += 1
        if unanswered:
            # No answer: ask the engine which version it serves before any new update.
            self.unanswered = (version, time.monotonic() + timeout)
            log.warning("%s: no answer to the update to v%d (%s); waiting for the engine to report it",
                        self.worker_id, version, message)
        else:
            log.warning("%s: engine failed to load v%d (%s); keeps v%s", self.worker_id, version, message, self.version)

    async def reload_from_store(self) -> bool:
        """Reload the newest stored version into the (paused) engine, after a push that left its
        weights partly new; True once it serves it. The caller holds ``lock`` and keeps the
        engine paused until then."""
        try:
            current = await self.current_policy()
            if current is None:
                return False
            version = int(current[0])
            path = await asyncio.to_thread(self.download, version)
            self.mark_paused(self.r.weight_update_timeout_s + self.r.flush_timeout_s + 60)
            ok, message = False, "the engine refused /flush_cache"
            if await self.flush_paused():
                ok, message = await self.client.update_weights_from_disk(
                    str(path), version, timeout_s=self.r.weight_update_timeout_s, flush_cache=False)
        except Exception as e:  # noqa: BLE001 - store, Redis or engine: retried while paused
            ok, message = False, repr(e)
        if not ok:
            log.warning("%s: reload from the store failed (%s); the engine stays paused", self.worker_id, message)
            return False
        self.version = version
        log.info("%s: engine reloaded policy v%d from the store after a failed push", self.worker_id, version)
        return True

    def commit(self, version: int) -> None:
        """A network push of ``version`` completed: the engine serves it."""
        self.version = version
        self.stats.weight_updates += 1
        self.stats.pushes_received += 1
