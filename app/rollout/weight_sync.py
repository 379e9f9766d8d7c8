"""Network weight sync, the rollout worker's side: offer the engine for pushes, and drive the
engine through each push (protocol and failure semantics: app/trainer/weight_sync.py).

A `PushMember` runs beside the worker's main loop (``weight_sync.mode: network``) as one asyncio
task, on the worker's `app.rollout.weights.EngineWeights`. Every ``weight_sync.poll_s`` it
renews the engine's registration on the board (app/buffer/weight_sync.py) and reads the push
record; for a new ``prepare`` it takes the weights lock (the disk path takes the same one: one
weight change at a time; it waits for it within the ready budget, and acks ``busy`` only if a
load holds it longer) and runs the weights' state machine (`EngineWeights.change`): admission
stopped, the worker's in-flight requests waited for, the engine paused (``rollout.pause_mode``)
under the pause marker; it acks ``ready`` and follows the trainer:
join the group (``/init_weights_update_group``, after destroying its previous one), then
``/begin_weight_update``, one ``/update_weights_from_distributed`` per bucket (the version on
the last, ``flush_cache`` false: the cache was flushed after the pause, before ``ready``, as
Miles flushes before its pushes), ``/end_weight_update``, ack ``done``, continue.

What the engine serves is never claimed: the weights' ``version`` moves to N only on a
complete push. A push that fails after it began leaves the engine's weights partly new
(SGLang's own words), so the member keeps the engine paused, holds the weights lock (the disk
path cannot continue it either) and reloads the newest stored version from the store
(``/update_weights_from_disk`` with that version), retrying every poll until it succeeds; only
then does the engine generate again. The engine's ``startup_time`` (/server_info) tells a
restarted engine (which holds no group) from the one that joined.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from concurrent.futures import ThreadPoolExecutor

from app.buffer.weight_sync import Registration, SyncBoard
from app.rollout.engine_client import EngineError

log = logging.getLogger("moerl.rollout.weight_sync")


class PushMember:
    """The network-push side of one rollout worker (see the module doc).

    Args:
        weights: the worker's `app.rollout.weights.EngineWeights` (its client, lock, state
            machine, version, reload from the store, stop event and stats are used).
        board: the run's `SyncBoard` (default: ``SyncBoard.of(buffer)``).
        buffer: the worker's experience buffer, when no ``board`` is given.
    """

    def __init__(self, weights, board: SyncBoard | None = None, buffer=None):
        self.w = weights
        self.cfg = weights.cfg.weight_sync
        self.board = board or SyncBoard.of(buffer)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="wsync")
        self.ranks: int | None = None  # the engine's ranks in a group (None: not offered)
        self.started: float | None = None  # the engine's startup_time when it joined its group
        self.epoch: int | None = None
        self.group_name: str | None = None
        self.last_push: str | None = None
        self.dirty = False  # the engine holds partly updated weights: reload before serving
        self._renew_at = 0.0
        self._event: str | None = None  # last entry read from the board's events stream

    async def _board(self, method: str, *args, **kwargs):
        fn = getattr(self.board, method)
        return await asyncio.get_running_loop().run_in_executor(self._pool, lambda: fn(*args, **kwargs))

    # -- the loop ----------------------------------------------------------------------------
    async def run(self) -> None:
        """Until the worker stops: renew the registration, take new pushes; then withdraw."""
        try:
            while not self.w.stop.is_set():
                try:
                    await self.step()
                except EngineError as e:
                    log.warning("%s: engine call failed outside a push: %s", self.w.worker_id, e)
                    self.ranks = None  # ask again: the engine may have restarted
                    await self.w.sleep_or_stop(self.cfg.poll_s)
                except Exception as e:  # noqa: BLE001 - Redis hiccup: try again at the next poll
                    log.warning("%s: weight-sync board error: %s", self.w.worker_id, e)
                    await self.w.sleep_or_stop(self.cfg.poll_s)
        finally:
            try:
                await self._board("unregister", self.w.worker_id)
            except Exception:  # noqa: BLE001 - the registration expires anyway
                pass
            self._pool.shutdown(wait=False)

    async def step(self) -> None:
        """One poll: (re)register the engine, take a new ``prepare`` push."""
        if self.ranks is None:
            self.ranks = await self._engine_ranks()
            if self.ranks is None:
                return
        await self._renew()
        push = await self._board("push")
        if push and push["state"] == "prepare" and push["id"] != self.last_push:
            await self.take(push)
            return
        self._event = await self._board("wait", "events", self._event, self.cfg.poll_s)  # a change, or poll_s

    async def _renew(self, force: bool = False) -> None:
        """Renew the registration (at most every engine_ttl_s / 3 unless ``force``); also during a
        long push, so the engine is still offered when the next one is prepared."""
        if force or time.monotonic() >= self._renew_at:
            await self._board("register", Registration(self.w.worker_id, self.ranks, self.w.version, self.epoch),
                              self.cfg.engine_ttl_s)
            self._renew_at = time.monotonic() + self.cfg.engine_ttl_s / 3

    async def _engine_ranks(self) -> int | None:
        """The engine's ranks in a weight-update group (its tp_size), or None when it cannot
        join one (SGLang refuses pipeline stages and data-parallel replicas there)."""
        info = await self.w.client.server_info()
        if info.get("pp_size", 1) != 1 or info.get("dp_size", 1) != 1:
            log.error("%s: engine has pp_size %s / dp_size %s: SGLang's weight-update group takes neither; "
                      "this engine gets versions from the store only", self.w.worker_id,
                      info.get("pp_size"), info.get("dp_size"))
            return None
        if info.get("startup_time") != self.started:
            self.epoch = self.group_name = None  # a new engine process: it holds no group
        self.started = info.get("startup_time")
        return int(info.get("tp_size", 1))

    # -- one push ----------------------------------------------------------------------------
    async def take(self, push: dict) -> None:
        """Take part in push ``push`` (a prepare record), or ack busy."""
        pid = push["id"]
        self.last_push = pid
        w = self.w
        # The ready budget counts from when this worker saw the prepare: no clock is compared
        # across hosts. The weights lock is also held by each policy poll's version check (a
        # moment, longer on a loaded host): wait for it within the budget; only a load from the
        # store, which holds it for seconds, makes this worker busy.
        budget = max(0.05, self.cfg.ready_timeout_s - 0.5)
        deadline = time.monotonic() + budget
        try:
            await asyncio.wait_for(w.lock.acquire(), budget)
        except asyncio.TimeoutError:
            await self._board("ack", pid, w.worker_id, "busy")
            return
        try:
            async with w.change() as change:
                try:
                    if not await change.wait_idle(max(0.05, deadline - time.monotonic())):
                        await self._board("ack", pid, w.worker_id, "busy")
                        return
                    self.ranks = await self._engine_ranks()
                    if self.ranks is None:
                        await self._board("ack", pid, w.worker_id, "busy")
                        return
                    await change.pause(self.cfg.ready_timeout_s + self.cfg.timeout_s + 30)
                    # The cache goes before the weights change, as Miles does (the buckets then
                    # carry flush_cache false): a flush refused after a bucket would fail the push
                    # with the weights already changed. Refused within the ready budget: busy.
                    if not await w.client.flush_until(max(0.0, deadline - time.monotonic())):
                        w.stats.flushes_refused += 1
                        await self._board("ack", pid, w.worker_id, "busy")
                        return
                    await self._board("ack", pid, w.worker_id, "ready", ranks=self.ranks, epoch=self.epoch)
                    if await self._follow(pid) == "dirty":
                        self.dirty = True
                except Exception as e:  # noqa: BLE001 - before the send phase: the weights are untouched
                    log.warning("%s: push %s: %s: %s", w.worker_id, pid, type(e).__name__, e)
                    self.epoch = self.group_name = None
                finally:
                    while self.dirty and not w.stop.is_set():
                        if await self.restore():
                            break
                        await w.sleep_or_stop(self.cfg.poll_s * 5)
                    change.keep_paused = self.dirty  # partly new weights never serve
        except EngineError as e:  # /continue_generation after the push
            log.warning("%s: continue after push failed: %s", w.worker_id, e)
            w.suspect = True
        finally:
            w.lock.release()

    async def _follow(self, pid: str) -> str:
        """After ``ready``: join, receive, ack. Returns "updated", "untouched" (the weights did
        not change: left out, cancelled, or the group failed before sending) or "dirty"."""
        deadline = time.monotonic() + self.cfg.ready_timeout_s + 2 * self.cfg.timeout_s + 10
        w = self.w
        while time.monotonic() < deadline:
            push = await self._board("push")
            if push is None or push["id"] != pid or push["state"] in ("cancelled", "failed", "done"):
                return "untouched"
            if push["state"] in ("join", "send"):
                group = push.get("groups", {}).get(w.worker_id)
                if group is None:
                    return "untouched"  # not ready in time (or our group failed): this push goes without us
                if self.epoch != group["epoch"]:
                    if push["state"] == "send" or not await self._join(pid, group):
                        return "untouched"
                if push["state"] == "send":
                    return await self._receive(push)
            self._event = await self._board("wait", "events", self._event, 0.5)
        return "untouched"

    async def _join(self, pid: str, group: dict) -> bool:
        """Leave the engine's old group, join ``group``; ack joined or failed. A group whose
        source is not the trainer (`refuse_source`) is refused before the engine hears of it."""
        w = self.w
        refused = await asyncio.to_thread(refuse_source, group, self.cfg)
        if refused is not None:
            log.error("%s: push %s refused, the engine does not join: %s", w.worker_id, pid, refused)
            await self._board("ack", pid, w.worker_id, "failed", message=f"refused: {refused}"[:500])
            return False
        if self.group_name is not None:
            try:
                await w.client.destroy_weights_update_group(self.group_name, timeout_s=self.cfg.timeout_s)
            except EngineError:
                pass  # a broken or forgotten group: the new one has another name anyway
        self.epoch = self.group_name = None
        ok, message = await w.client.init_weights_update_group(
            group["master_address"], group["master_port"], group["rank_offset"], group["world_size"],
            group["name"], group["backend"], timeout_s=self.cfg.timeout_s + 10)
        if not ok:
            log.warning("%s: could not join weight-update group %s: %s", w.worker_id, group["name"], message)
            await self._board("ack", pid, w.worker_id, "failed", message=message)
            return False
        self.epoch, self.group_name = group["epoch"], group["name"]
        await self._board("ack", pid, w.worker_id, "joined", epoch=self.epoch)
        return True

    async def _receive(self, push: dict) -> str:
        """The send phase for this engine (see the module doc). Any failure once the session is
        open (the engine's, or the board's) counts as partly loaded weights: "dirty"."""
        w, pid, version = self.w, push["id"], int(push["version"])
        t = self.cfg.timeout_s + 10
        ok, message = False, "no bucket plan on the board"
        try:
            plan = await self._board("plan", pid)
            if plan:
                ok, message = await w.client.begin_weight_update(timeout_s=t)
                if not ok:  # a session left open by an earlier failed push
                    await w.client.end_weight_update(timeout_s=t)
                    ok, message = await w.client.begin_weight_update(timeout_s=t)
                for k, bucket in enumerate(plan if ok else []):
                    w.mark_paused(self.cfg.timeout_s + 30)
                    last = k == len(plan) - 1
                    await self._renew()
                    ok, message = await w.client.update_weights_from_distributed(
                        bucket["names"], bucket["dtypes"], bucket["shapes"], self.group_name,
                        load_format=push.get("load_format"), flush_cache=False,
                        weight_version=version if last else None, timeout_s=t)
                    if not ok:
                        message = f"bucket {k + 1}/{len(plan)}: {message}"
                        break
                ended, end_message = await w.client.end_weight_update(timeout_s=t)
                if ok and not ended:
                    ok, message = False, f"end_weight_update: {end_message}"
        except Exception as e:  # noqa: BLE001 - engine or Redis: the weights are not known to be whole
            ok, message = False, f"{type(e).__name__}: {e}"
        if ok:
            w.commit(version)
            log.info("%s: engine now at policy v%d (network push)", w.worker_id, version)
            try:
                await self._board("ack", pid, w.worker_id, "done", version=version)
                await self._renew(force=True)  # the new version and epoch, before the next prepare
            except Exception as e:  # noqa: BLE001 - the engine has v<version>; the trainer counts it missing
                log.warning("%s: could not ack the push of v%d: %s", w.worker_id, version, e)
            return "updated"
        w.stats.pushes_failed += 1
        log.warning("%s: push of v%d failed (%s); reloading from the store before serving", w.worker_id, version,
                    message)
        try:
            await self._board("ack", pid, w.worker_id, "failed", message=message[:500])
        except Exception:  # noqa: BLE001 - the trainer times out on it instead
            pass
        if self.group_name is not None:
            try:
                await w.client.destroy_weights_update_group(self.group_name, timeout_s=self.cfg.timeout_s)
            except EngineError:
                pass
        self.epoch = self.group_name = None
        return "dirty"

    async def restore(self) -> bool:
        """Reload the newest stored version into the (paused) engine; True once it serves it."""
        if not await self.w.reload_from_store():
            return False
        self.dirty = False
        return True


def _resolved(host: str) -> set[str]:
    try:
        return {info[4][0] for info in socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)}
    except (socket.gaierror, UnicodeError, ValueError):
        return set()


def refuse_source(group: dict, cfg) -> str | None:
    """Why an engine must not join ``group`` (a push record's group), or None when its source is
    the trainer's: ``master_address`` resolves only to addresses of ``cfg.trainer_host`` (else
    ``cfg.master_address``, else this host's name) and, when ``cfg.master_port`` is set,
    ``master_port`` is it. The engine would otherwise take its weights from whoever can write
    the push record (app/buffer/acl.py keeps that to the trainer's Redis user).

    Args:
        group: the record's ``group`` (``master_address``, ``master_port``, ...).
        cfg: the run's ``weight_sync`` section.
    """
    expected = cfg.trainer_host or cfg.master_address or socket.gethostname()
    address, port = str(group.get("master_address", "")), group.get("master_port")
    if cfg.master_port and port != cfg.master_port:
        return f"master_port {port!r} is not weight_sync.master_port {cfg.master_port}"
    allowed, got = _resolved(expected), _resolved(address)
    if not allowed:
        return f"the trainer's host {expected!r} does not resolve"
    if not got or not got <= allowed:
        return (f"master_address {address!r} ({', '.join(sorted(got)) or 'unresolved'}) is not the trainer's "
                f"{expected!r} ({', '.join(sorted(allowed))})")
    return None
