"""The built-in engine's scheduler: the `Engine` holds the served model, the waiting line and the
one generation loop (continuous batching, app/engine/sampler.py), and applies pauses and weight
updates as SGLang 0.5.23 does (the routes are app/engine/server.py's)."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid
from collections import deque
from dataclasses import dataclass

import torch

from app.engine.load import LoadedModel, load_checkpoint
from app.engine.receive import NO_SESSION, NOT_FLUSHED, EngineWeightGroups, WeightLoadError, hf_slots, load_named
from app.engine.sampler import Completion, DecodeBatch, RoutingCapture, SamplingParams
from app.weight_group import GroupError

log = logging.getLogger("moerl.engine")


@dataclass
class _Pending:
    prompt: list[int]
    params: SamplingParams
    future: asyncio.Future
    # A sequence retracted by a pause: its tokens so far (the new prompt ends with them).
    prefix: Completion | None = None
    rid: str = ""  # SGLang's request id (meta_info.id); see `Engine.abort`


# SGLang 0.5.23's finish_reason of an aborted request: a running one ends with FINISH_ABORT()
# (managers/schedule_batch.py, to_json), one still waiting with the tokenizer manager's own
# (managers/tokenizer_manager.py, the AbortReq handler). Both answer HTTP 200 with the tokens
# generated so far and their logprobs (no status_code: not an error).
ABORT_RUNNING = {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}
ABORT_WAITING = {"type": "abort", "message": "Abort in waiting queue"}


class DuplicateRid(ValueError):
    """A request id already in flight (SGLang ``TokenizerManager._init_req_state``: HTTP 400)."""


@dataclass
class EngineStats:
    """Counters shown by /server_info."""

    steps: int = 0  # decode steps (one forward over every live row)
    prefills: int = 0  # forwards that admitted new rows into the batch
    sequences: int = 0
    tokens: int = 0
    max_batch_seen: int = 0  # most rows decoded in one step
    weight_loads: int = 0
    failed_weight_loads: int = 0
    aborted: int = 0  # sequences ended by a pause in mode abort or by /abort_request
    retracted: int = 0  # sequences put back in the queue by a pause in mode retract
    flushes_refused: int = 0  # /flush_cache (or an update's flush) refused: a request ran or queued


PAUSE_MODES = ("abort", "retract", "in_place")


class Engine:
    """The model, the waiting sequences and the one generation loop (continuous batching).

    Each turn of the loop admits waiting sequences (up to ``max_batch`` rows) and decodes one
    token for every live row; a sequence that finishes answers its caller at once.

    Weight updates and pauses follow SGLang 0.5.23 (``managers/tokenizer_manager.py``):
      - not paused: admission stops, the live rows finish on the old weights, then the weights
        swap, so no sequence mixes two versions;
      - paused: the swap happens at once (SGLang skips its model-update lock while paused);
      - every update reloads the checkpoint, also one that names the version already served
        (SGLang has no such no-op);
      - `pause` modes: ``abort`` ends every live and waiting sequence (``abort_all``, see
        `abort`), ``retract`` takes the live rows out and queues them first again (re-prefilled
        with their tokens so far after `resume`), ``in_place`` holds the rows as they are; in
        every mode a request that arrives while paused is held before the queue (SGLang's
        tokenizer manager waits on ``is_pause`` after registering its rid) and joins it on
        `resume`.
    A response reports the weight_version served when its sequence finished.

    Request ids and aborts follow 0.5.23 too (`abort`): every sequence in flight has a rid (its
    ``meta_info.id``), a rid in flight twice is refused (`DuplicateRid`), and an abort names a
    rid exactly.

    Args:
        loaded: the initial checkpoint (see `load_checkpoint`).
        weight_version: version string reported in every response (SGLang reports a string).
        max_batch: most sequences decoded together.
        device, dtype: where and how later checkpoints are loaded.
        seed: seed of the sampling generator.
        batch_wait_s: when the first sequence arrives at an idle engine, wait this long for
            others to join its prefill.
        capture_routing: keep the experts each token was routed to (SGLang's
            ``--enable-return-routed-experts``).
        weight_sync_timeout_s: bound of every weight-update group join and receive
            (app/engine/receive.py).
    """

    def __init__(
        self, loaded: LoadedModel, *, weight_version: str = "0", max_batch: int = 64,
        device: str = "cpu", dtype: str = "float32", seed: int = 0, batch_wait_s: float = 0.005,
        capture_routing: bool = False, weight_sync_timeout_s: float = 60.0,
    ):
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        self.loaded = loaded
        self.weight_version = str(weight_version)
        self.max_batch = max_batch
        self.device = device
        self.dtype = dtype
        self.batch_wait_s = batch_wait_s
        self.capture_routing = capture_routing
        self.capture = RoutingCapture(loaded.model) if capture_routing else None
        self.generator = torch.Generator(device=device).manual_seed(seed)
        self.stats = EngineStats()
        self.waiting: deque[_Pending] = deque()
        self.held: list[_Pending] = []  # arrived while paused: not queued until `resume`
        self.rids: dict[str, _Pending] = {}  # every sequence in flight by rid (the tokenizer's rid_to_state)
        self._abort_sent: set[str] = set()  # rids an abort already named (SGLang ``state.abort_sent``)
        self.paused = False
        self.pause_mode = "abort"
        self.updates = 0  # weight updates waiting for the batch to drain
        self.live_rows = 0
        self.last_progress = 0.0  # time.monotonic() of the last forward that finished
        self.batch: DecodeBatch | None = None
        self._owners: dict[int, _Pending] = {}
        self._aborts: list[tuple[str, bool]] = []  # aborts (rid prefix, abort_all) the loop has yet to apply
        self._changed: asyncio.Event | None = None  # set whenever the loop should look again
        self._paused_ack: asyncio.Event | None = None  # set once the loop has applied a pause
        self._drained: asyncio.Event | None = None  # set while no row is live
        self.model_lock: asyncio.Lock | None = None  # held during a forward and a weight swap
        self._loop_task: asyncio.Task | None = None
        self.weight_groups = EngineWeightGroups(weight_sync_timeout_s, device)
        self._slots: tuple[torch.nn.Module, dict] | None = None  # (model, hf_slots(model))
        self.started = time.time()  # /server_info startup_time: a restart changes it (as SGLang)

    # -- lifecycle -------------------------------------------------------------------------
    async def start(self) -> None:
        """Create the events and start the generation loop (inside the server's event loop)."""
        self._changed = asyncio.Event()
        self._paused_ack = asyncio.Event()
        self._drained = asyncio.Event()
        self._drained.set()
        self.model_lock = asyncio.Lock()
        self.batch = self._new_batch()
        self._loop_task = asyncio.create_task(self._generation_loop())

    async def stop(self) -> None:
        """Stop the loop; waiting and live requests fail with an error."""
        if self._loop_task:
            self._loop_task.cancel()
            try:
                await self._loop_task
            except asyncio.CancelledError:
                pass
        for item in list(self.waiting) + self.held + list(self._owners.values()):
            if not item.future.done():
                item.future.set_exception(RuntimeError("engine shutting down"))
        self.waiting.clear()
        self.held.clear()
        self._owners.clear()

    def _new_batch(self) -> DecodeBatch:
        m = self.loaded
        return DecodeBatch(m.model, pad_id=m.pad_id, eos_ids=m.eos_ids, generator=self.generator, capture=self.capture)

    def _poke(self) -> None:
        self._changed.set()

    # -- generation ------------------------------------------------------------------------
    async def submit(
        self, prompts: list[list[int]], params: list[SamplingParams], rids: list[str] | None = None,
    ) -> list[tuple[Completion, str]]:
        """Queue sequences and wait for them; returns (completion, weight_version) per sequence.

        rids: each sequence's request id (what `abort` names); default a fresh uuid each.

        Raises:
            DuplicateRid: one of ``rids`` is in flight already (nothing is queued).
        """
        rids = list(rids) if rids else [uuid.uuid4().hex for _ in prompts]
        seen: set[str] = set()
        for rid in rids:
            if rid in self.rids or rid in seen:
                raise DuplicateRid(f"Duplicate request ID detected: {rid}")
            seen.add(rid)
        loop = asyncio.get_running_loop()
        items = [_Pending(prompt, p, loop.create_future(), rid=rid) for prompt, p, rid in zip(prompts, params, rids)]
        for item in items:
            self.rids[item.rid] = item
        (self.held if self.paused else self.waiting).extend(items)
        self._poke()
        try:
            return list(await asyncio.gather(*(item.future for item in items)))
        finally:
            for item in items:
                if self.rids.get(item.rid) is item:
                    del self.rids[item.rid]
                self._abort_sent.discard(item.rid)

    def _take_waiting(self, n: int) -> list[_Pending]:
        taken = []
        while self.waiting and len(taken) < n:
            item = self.waiting.popleft()
            if not item.future.done():  # skip callers that went away
                taken.append(item)
        return taken

    def _deliver(self, item: _Pending, completion: Completion) -> None:
        if item.prefix is not None:  # a retracted sequence: its earlier tokens come first
            completion = Completion(
                item.prefix.token_ids + completion.token_ids, item.prefix.logprobs + completion.logprobs,
                completion.finish_reason, completion.matched_stop, completion.routed_experts)
        self.stats.sequences += 1
        self.stats.tokens += len(completion.token_ids)
        self.stats.aborted += completion.finish_reason == "abort"
        if not item.future.done():
            item.future.set_result((completion, self.weight_version))

    async def _generation_loop(self) -> None:
        while True:
            self._changed.clear()
            if self._aborts:
                self._apply_aborts()
            if self.held and not self.paused:  # after the aborts sent before /continue_generation
                self.waiting.extend(self.held)
                self.held.clear()
            # A pause in mode abort lets the aborted rows take their last step first.
            if self.paused and not (self.pause_mode == "abort" and len(self.batch)):
                if not self._paused_ack.is_set():  # once per pause call: later arrivals wait
                    self._apply_pause()
                    self._paused_ack.set()
                await self._changed.wait()
                continue
            batch = self.batch
            admit = not self.updates and not self.paused
            if admit and self.waiting and not len(batch) and self.batch_wait_s > 0 and len(self.waiting) < self.max_batch:
                await asyncio.sleep(self.batch_wait_s)  # let simultaneous requests share the prefill
                if self.paused:
                    continue
            new = self._take_waiting(self.max_batch - len(batch)) if admit else []
            if not new and not len(batch):
                self.live_rows = 0
                self._drained.set()
                await self._changed.wait()
                continue
            self._drained.clear()
            finished = []
            try:
                async with self.model_lock:
                    if new:
                        for item in new:
                            self._owners[id(item)] = item
                        finished += await asyncio.to_thread(
                            batch.add, [x.prompt for x in new], [x.params for x in new], [id(x) for x in new])
                        self.stats.prefills += 1
                    if len(batch):
                        self.stats.max_batch_seen = max(self.stats.max_batch_seen, len(batch))
                        self.live_rows = len(batch)
                        finished += await asyncio.to_thread(batch.step)
                        self.stats.steps += 1
            except Exception as e:  # noqa: BLE001 - every caller of this batch gets the error
                log.exception("generation failed")
                for item in self._owners.values():
                    if not item.future.done():
                        item.future.set_exception(RuntimeError(f"generation failed: {e}"))
                self._owners.clear()
                self.batch = self._new_batch()
                continue
            self.last_progress = time.monotonic()
            for key, completion in finished:
                self._deliver(self._owners.pop(key), completion)
            self.live_rows = len(batch)

    def _apply_pause(self) -> None:
        """What a pause does to the live rows, by mode (see the class doc); in mode abort they
        are gone already (`pause` aborted every one, and they took their last step)."""
        if self.pause_mode != "retract":
            return
        rows = self.batch.take_all()
        self.live_rows = 0
        for key, c in reversed(rows):  # first in the queue again, in their order
            self._retract(self._owners.pop(key), c)
        self._drained.set()

    def _retract(self, item: _Pending, c: Completion) -> None:
        """Queue a live row first again, its tokens so far as part of its prompt (re-prefilled)."""
        prefix = c if item.prefix is None else Completion(
            item.prefix.token_ids + c.token_ids, item.prefix.logprobs + c.logprobs, "length")
        left = dataclasses.replace(item.params, max_new_tokens=item.params.max_new_tokens - len(c.token_ids))
        self.waiting.appendleft(_Pending(item.prompt + c.token_ids, left, item.future, prefix, item.rid))
        self.stats.retracted += 1

    def _end_aborted(self, item: _Pending, c: Completion | None, reason: dict) -> None:
        """Answer an aborted waiting sequence with SGLang's finish_reason ``reason`` and nothing
        generated (a retracted one: its tokens so far, as `_deliver` adds them)."""
        if item.future.done():
            return
        c = c or Completion([], [], "abort")
        c.finish_reason, c.abort, c.routed_experts = "abort", dict(reason), None
        self._deliver(item, c)

    def abort(self, rid: str = "", abort_all: bool = False) -> None:
        """SGLang 0.5.23's /abort_request (``TokenizerManager.abort_request``, then the
        scheduler's ``abort_request``), applied at the loop's next turn:

        - ``abort_all``: every sequence, waiting or running;
        - else ``rid`` must name a sequence in flight exactly (``rid_to_state``); a rid nobody
          has, a prefix of one, or a rid already aborted does nothing. One that is found goes
          to the scheduler, which ends every sequence whose rid starts with it;
        - an empty ``rid`` without ``abort_all`` is ignored (it would match every request).

        A waiting sequence answers at once with nothing generated and "Abort in waiting queue"
        (`ABORT_WAITING`); a running one runs one more decode step and answers with its tokens
        and logprobs and ``FINISH_ABORT()`` (`ABORT_RUNNING`). Requests held by a pause are
        not in the scheduler yet: an abort passes them by, and they run after `resume`.
        """
        if not abort_all and not rid:
            log.warning("Ignore abort_request with empty rid and abort_all=False (as SGLang)")
            return
        if not abort_all:
            if rid not in self.rids or rid in self._abort_sent:
                return
            self._abort_sent.add(rid)
        self._aborts.append((rid, abort_all))
        self._poke()

    def _apply_aborts(self) -> None:
        reqs, self._aborts = self._aborts, []

        def hit(item: _Pending) -> bool:
            return any(every or item.rid.startswith(rid) for rid, every in reqs)

        kept: deque[_Pending] = deque()
        for item in self.waiting:
            if hit(item):
                self._end_aborted(item, None, ABORT_WAITING)
            elif not item.future.done():
                kept.append(item)
        self.waiting = kept
        self.batch.finish_after_next([key for key, item in self._owners.items() if hit(item)])

    # -- control ---------------------------------------------------------------------------
    async def pause(self, mode: str = "abort") -> None:
        """Stop generating (SGLang /pause_generation); returns once ``mode`` has been applied
        to the live rows (see the class doc).

        Raises:
            ValueError: ``mode`` is not abort, retract or in_place.
        """
        if mode not in PAUSE_MODES:
            raise ValueError(f"mode must be one of {list(PAUSE_MODES)}, got {mode!r}")
        self.paused, self.pause_mode = True, mode
        if mode == "abort":  # SGLang: abort_request(abort_all=True), new requests held
            self._aborts.append(("", True))
        self._paused_ack.clear()
        self._poke()
        await self._paused_ack.wait()

    def resume(self) -> None:
        """Generate again (SGLang /continue_generation): the held requests join the queue at
        the loop's next turn, after any abort sent before."""
        self.paused = False
        self._poke()

    def idle(self, ignore_waiting: bool) -> bool:
        """SGLang's ``Scheduler.is_fully_idle``: no live row and, unless ``ignore_waiting``,
        nobody waiting."""
        return not len(self.batch) and (ignore_waiting or not any(not x.future.done() for x in self.waiting))

    def flush_cache(self) -> bool:
        """SGLang's ``Scheduler.flush_cache``: refused (False) unless idle, the waiting line
        ignored while paused (``is_fully_idle(ignore_waiting=paused)``). There is no prefix
        cache here; the refusal is what a worker must cope with."""
        if self.idle(ignore_waiting=self.paused):
            return True
        self.stats.flushes_refused += 1
        return False

    async def update_weights(self, model_path: str, weight_version: str | None,
                             flush_cache: bool = True) -> tuple[bool, str]:
        """Load a checkpoint and swap it in; on failure keep the previous weights.

        The new checkpoint is read while generation goes on; then (unless paused) admission
        stops and the live rows finish on the old weights before the swap. Every call loads
        the checkpoint again, as SGLang does. With ``flush_cache`` (SGLang's default) the
        cache is flushed after the swap; a refused flush (rows held by an in_place pause)
        fails the call with the new weights already serving and ``weight_version`` not taken
        (SGLang ``SchedulerWeightUpdaterManager.flush_cache_after_weight_update``).

        Returns:
            (success, message).
        """
        version = None if weight_version is None else str(weight_version)
        try:
            new = await asyncio.to_thread(load_checkpoint, model_path, self.device, self.dtype, self.loaded)
            if self.capture_routing:
                capture = RoutingCapture(new.model)
        except Exception as e:  # noqa: BLE001 - reported to the caller, old weights stay
            self.stats.failed_weight_loads += 1
            log.warning("update_weights_from_disk %s failed: %s", model_path, e)
            return False, f"failed to load {model_path}: {type(e).__name__}: {e}"
        if new.vocab_size != self.loaded.vocab_size:
            self.stats.failed_weight_loads += 1
            return False, (
                f"{model_path}: vocab_size {new.vocab_size} differs from the served model's "
                f"{self.loaded.vocab_size}"
            )
        self.updates += 1
        self._poke()
        try:
            while not self.paused and not self._drained.is_set():
                await asyncio.sleep(0.01)
            async with self.model_lock:
                self.loaded = new
                if self.capture_routing:
                    self.capture = capture
                # Rows held by an in_place pause continue on the new weights (as in SGLang).
                old = self.batch
                self.batch = self._new_batch()
                if len(old):
                    old.model, old.capture = new.model, self.capture
                    self.batch = old
                self.stats.weight_loads += 1
                if flush_cache and len(self.batch):
                    self.stats.flushes_refused += 1
                    return False, NOT_FLUSHED
                if version is not None:
                    self.weight_version = version
        finally:
            self.updates -= 1
            self._poke()
        log.info("now serving %s as weight_version %s", model_path, self.weight_version)
        return True, f"loaded {model_path} as weight_version {self.weight_version}"

    def _hf_slots(self) -> dict:
        model = self.loaded.model
        if self._slots is None or self._slots[0] is not model:
            self._slots = (model, hf_slots(model))
        return self._slots[1]

    async def update_weights_from_distributed(
        self, names: list[str], dtypes: list[str], shapes: list[list[int]], group_name: str,
        load_format: str | None = None, weight_version: str | None = None, flush_cache: bool = True,
    ) -> tuple[bool, str]:
        """Receive tensors from weight-update group ``group_name`` and load them by HF name
        (SGLang's /update_weights_from_distributed; app/engine/receive.py).

        Only inside a begin/end session. Not paused: admission stops and live rows finish
        first (SGLang's model-update lock); paused: at once. ``weight_version`` is taken only
        when the whole call succeeds; with ``flush_cache`` a batch still holding rows (an
        in_place pause) fails the call after the load, as SGLang's flush does.

        Returns:
            (success, message); on a failed load the weights are partly updated.
        """
        groups = self.weight_groups
        if not groups.session:
            return False, NO_SESSION
        self.updates += 1
        self._poke()
        try:
            while not self.paused and not self._drained.is_set():
                await asyncio.sleep(0.01)
            try:
                named = await asyncio.to_thread(groups.receive, names, dtypes, shapes, group_name, load_format)
            except (ValueError, GroupError) as e:
                log.warning("update_weights_from_distributed: %s", e)
                return False, f"Failed to receive weights: {e}"
            async with self.model_lock:
                try:
                    load_named(self._hf_slots(), named)
                except WeightLoadError as e:
                    self.stats.failed_weight_loads += 1
                    return False, (f"Failed to update parameter online: {e}. The full weights of the ModelRunner "
                                   "are partially updated. Please discard the whole weights.")
                if flush_cache and len(self.batch):
                    return False, NOT_FLUSHED
                if weight_version is not None:
                    self.weight_version = str(weight_version)
                    self.stats.weight_loads += 1
                    log.info("now serving weight_version %s (received over %s)", self.weight_version, group_name)
        finally:
            self.updates -= 1
            self._poke()
        message = "Succeeded to update parameter online."
        return True, message + (f" Weight version updated to {weight_version}." if weight_version is not None else "")

    async def health(self, timeout_s: float) -> bool:
        """SGLang's /health_generate: a one-token request; healthy when it, or any other
        sequence, makes progress within ``timeout_s`` (so a paused engine is unhealthy after
        ``timeout_s``, as in SGLang ``entrypoints/http_server.py``)."""
        tic = time.monotonic()
        probe = asyncio.ensure_future(self.submit([[self.loaded.pad_id]], [SamplingParams(max_new_tokens=1, temperature=0.0)]))
        try:
            while time.monotonic() < tic + timeout_s:
                done, _ = await asyncio.wait({probe}, timeout=0.1)
                if done:
                    return probe.exception() is None and probe.result()[0][0].finish_reason != "abort"
                if self.last_progress > tic:
                    return True
            return False
        finally:
            probe.cancel()
