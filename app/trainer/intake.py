"""How a step's batch reaches every trainer rank: rank 0 takes and assigns group headers, each rank
reads and decodes its own groups, and the next step's headers are taken during the step.

Rank 0 takes the step's group *headers* (`ExperienceBuffer.take_headers`: ids, policy versions,
rewards and lengths, a few hundred bytes a group; app/buffer/encoding.py), checks them with the
`usable` (the lineage's duplicates, staleness, all-"error" groups and the header's cheap
shape checks, `GroupHeader.check`) and assigns whole groups to ranks (`split_mini_batches`: the
step's mini-batches of ``trainer.ppo_mini_batch_size`` groups, each one's groups balanced over the
ranks by tokens). Only that assignment is broadcast. Each rank then reads its own groups' payloads from
Redis, decodes them (`decode_group`: the dtypes and lengths the header promised, finite logprobs,
0/1 masks, expert ids below E) and collates them. A payload that does not decode is reported by
its rank; the ranks agree on the list (one object all-gather a step), drop those groups
everywhere, and rank 0 dead-letters them (`ExperienceBuffer.dead_letter_taken`, counted as
``malformed``): a malformed group is never trained and never stops the gang.

Prefetch: once a step's batch is handed out, rank 0 takes the next step's headers in a thread,
during the step, checked against the policy version that step will train at (one more than now
if this step publishes). They become the trainer's only when handed out: the step's
``commit_point`` covers the batches handed out, and the commit after a save deletes only those,
so a trainer killed mid-step reads the prefetched groups again after a restart. A group the
prefetch meets twice (the current batch's, republished) is a duplicate as if trained already.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from dataclasses import dataclass, field

import torch.distributed as dist

from app.buffer import ExperienceBuffer
from app.buffer.health import starved_because
from app.config import RunConfig
from app.trainer import TrainingError
from app.trainer.batch import TrainBatch, collate_groups, split_mini_batches
from app.trainer.publish import next_version
from app.trainer.sampling import SignalFilter
from app.trainer.state import TrainState, newer_entry
from app.versions import overstale, staleness

log = logging.getLogger("moerl.train")

COUNTERS = ("duplicates", "overstale", "error_groups", "malformed")


class Stop(Exception):
    """Raised on every rank when rank 0 says the run must end (a signal)."""


def take_groups(buffer, cfg: RunConfig, version: int, should_stop, keep) -> tuple[list, float]:
    """Rank 0: block until ``groups_per_step`` whole groups' headers (`GroupHeader`) that pass
    ``keep(group)`` are taken.

    Groups that ``keep`` rejects are consumed from the buffer but not trained on (``keep``
    counts them).

    Returns:
        ``(groups, seconds waited)``.

    Raises:
        TimeoutError: fewer groups than needed arrived within ``trainer.batch_timeout_s``.
        Stop: ``should_stop()`` became true while waiting.
    """
    n = cfg.trainer.groups_per_step
    t0 = time.monotonic()
    groups: list = []
    while len(groups) < n:
        if should_stop():
            raise Stop("stop requested while waiting for a batch")
        waited = time.monotonic() - t0
        if waited > cfg.trainer.batch_timeout_s:
            raise TimeoutError(
                f"only {len(groups)}/{n} GRPO groups arrived within trainer.batch_timeout_s="
                f"{cfg.trainer.batch_timeout_s:g}s from {cfg.buffer.redis_url} "
                f"(run {cfg.run_id!r}): {why_starved(buffer)}"
            )
        got = buffer.take_headers(n - len(groups), trainer_version=version, timeout_s=1.0)
        groups.extend(g for g in got if keep(g))
    return groups, time.monotonic() - t0


def why_starved(buffer) -> str:
    """What the rollout workers reported in the run's health hash (app/buffer/health.py): who
    waits on what, or why groups failed; else the question of old."""
    try:
        health = buffer.health()
    except Exception:  # noqa: BLE001 - the timeout is the error; its explanation is best effort
        health = None
    return starved_because(health)


def scatter_groups(payload: dict | None, rank: int) -> dict:
    """Broadcast rank 0's step payload ``{"parts": [groups per rank], "minis": [their mini-batch
    indices per rank], "error": str|None, "stop": bool}`` and return it on every rank. Raises `Stop` / `TrainingError` everywhere if
    rank 0 reported one."""
    box = [payload if rank == 0 else None]
    if dist.get_world_size() > 1:
        dist.broadcast_object_list(box, src=0)
    msg = box[0]
    if msg["error"]:
        raise TrainingError(msg["error"])
    if msg["stop"]:
        raise Stop("stop requested")
    return msg


def usable(group, state: TrainState, max_staleness: int, pad_id: int, *,
           trained: set[str] | None = None, skipped: list | None = None, moe_layers: list[int] | None = None) -> bool:
    """Rank 0's check of one group before it is scattered: not trained on before by this
    lineage (``trained`` holds "task_id/attempt" keys), within ``max_staleness`` (the buffer
    enforces it already; this guards the contract), not an all-"error" group, and well-formed
    (its ``check``). A rejected group is counted in ``state``, appended to ``skipped`` as
    ``[task_id, attempt, reason]``, never trained on, and does not take a place in the step's
    ``groups_per_step``. ``group`` is a `GroupHeader` (what rank 0 takes; its payload is checked
    by the rank that decodes it) or a whole `Group`."""
    reason = None
    if trained is not None and f"{group.task_id}/{group.attempt}" in trained:
        state.duplicates += 1
        reason = "duplicate"
    elif overstale(state.version, group.policy_version, max_staleness):
        state.overstale += 1
        reason = "overstale"
    elif all(s.finish_reason == "error" for s in group.samples):
        # A task the engine refused (rollout worker): no completion tokens to learn from.
        state.error_groups += 1
        reason = "error"
    else:
        try:
            group.check(moe_layers)
        except ValueError as e:
            state.malformed += 1
            log.warning("skipping malformed group %s/%s: %s", group.task_id, group.attempt, e)
            reason = "malformed"
    if reason is not None and skipped is not None:
        skipped.append([group.task_id, group.attempt, reason])
    return reason is None


def batch_meta(groups: list, version: int) -> dict:
    """Rank 0's summary of a step's groups: rewards and staleness (whole batch)."""
    samples = [s for g in groups for s in g.samples]
    rewards = [float(s.reward) for s in samples]
    stale = [staleness(version, s.policy_version) for s in samples]
    lengths = [s.completion_len for s in samples]
    n = max(len(samples), 1)
    return {
        "groups": len(groups),
        "samples": len(samples),
        "reward_mean": sum(rewards) / n if samples else float("nan"),
        "reward_max": max(rewards, default=float("nan")),
        "completion_len_mean": sum(lengths) / n,
        "staleness_mean": sum(stale) / n,
        "staleness_max": max(stale, default=0),
    }


@dataclass
class Batch:
    """One step's batch as `BatchIntake.next` hands it to the loop.

    Attributes:
        groups: rank 0: the step's `GroupHeader`s, in the order taken; [] on other ranks.
        skipped: rank 0: ``[task_id, attempt, reason]`` of groups taken and not trained.
        meta: `batch_meta` of the step's groups (the same on every rank), and ``read_s``: this
            rank's seconds reading, decoding and collating its share.
        wait_s: rank 0: seconds the loop waited for the groups (for a prefetched batch, only
            what was still missing when the step ended).
        commit_point: rank 0: the newest samples-stream entry taken for this step.
        train: this rank's share, collated.
    """

    groups: list
    skipped: list
    meta: dict
    wait_s: float
    commit_point: str | None
    train: TrainBatch


@dataclass
class _Taken:
    """What rank 0's take produced (in the loop or in the prefetch thread)."""

    headers: list = field(default_factory=list)
    skipped: list = field(default_factory=list)
    counts: dict = field(default_factory=dict)
    wait_s: float = 0.0
    commit_point: str | None = None
    error: BaseException | None = None
    signal: dict = field(default_factory=dict)  # dynamic sampling's figures of the take (metrics.jsonl)


class _Seen:
    """The lineage's trained groups plus the batch in flight, for `usable`'s duplicate check."""

    def __init__(self, trained: set[str], inflight: set[str]):
        self.trained, self.inflight = trained, inflight

    def __contains__(self, key: str) -> bool:
        return key in self.inflight or key in self.trained


class BatchIntake:
    """Every rank's source of batches (see the module doc).

    Args:
        cfg: the run configuration (``trainer.groups_per_step``, ``publish_every``, ``steps``,
            ``batch_timeout_s``, ``scale_by_std``; ``buffer.max_staleness``).
        buffer: rank 0: its `ExperienceBuffer` (autocommit off); other ranks: None (they open a
            reader of their own at their first batch, after rank 0 checked Redis).
        rank, world: this rank and the world size.
        pad_id: the tokenizer's pad id.
        moe_layers: with routing replay, the MoE layer indices; None without.
        num_experts: routed experts E (a decoded expert id must be below it).
    """

    def __init__(self, cfg: RunConfig, buffer, rank: int, world: int, pad_id: int,
                 moe_layers: list[int] | None, num_experts: int):
        self.cfg, self.buffer, self.rank, self.world = cfg, buffer, rank, world
        self.pad_id, self.moe_layers, self.num_experts = pad_id, moe_layers, num_experts
        self._reader = buffer
        self._thread: threading.Thread | None = None
        self._ahead: _Taken | None = None
        self._closing = threading.Event()
        self._abort = threading.Event()

    # -- rank 0: taking headers --------------------------------------------------------------

    def _take(self, version: int, seen, should_stop, cfg: RunConfig | None = None) -> _Taken:
        """Block until ``groups_per_step`` usable headers are taken for `version` (rank 0), or
        ``trainer.batch_timeout_s`` of `cfg` (default: the run's) ran out."""
        out = _Taken()
        scratch = TrainState(version=version)  # usable() counts here; merged into the loop's state at hand-out

        signal_filter = SignalFilter.of(self.cfg)  # DAPO dynamic sampling, or None

        def keep(h) -> bool:
            out.commit_point = newer_entry(out.commit_point, h.entry_id)
            return usable(h, scratch, self.cfg.buffer.max_staleness, self.pad_id, trained=seen, skipped=out.skipped,
                          moe_layers=self.moe_layers) and (signal_filter is None or signal_filter.admit(h, out.skipped))

        try:
            out.headers, out.wait_s = take_groups(
                self.buffer, cfg or self.cfg, version,
                lambda: should_stop() or self._closing.is_set() or self._abort.is_set(), keep)
        except BaseException as e:  # noqa: BLE001 - handed to the loop (Stop included)
            out.error = e
        out.counts = {k: getattr(scratch, k) for k in COUNTERS}
        out.signal = signal_filter.meta() if signal_filter else {}
        return out

    def _prefetch(self, version: int, seen, should_stop) -> None:
        # No deadline of its own: trainer.batch_timeout_s counts from when the loop waits for it
        # (`_collect`), not from the start of the step it overlaps.
        patient = self.cfg.model_copy(deep=True)
        patient.trainer.batch_timeout_s = math.inf

        def run() -> None:
            self._ahead = self._take(version, seen, should_stop, patient)

        self._ahead = None
        self._thread = threading.Thread(target=run, name="moerl-batch-prefetch", daemon=True)
        self._thread.start()

    def _collect(self, state, trained: set[str], should_stop) -> _Taken:
        if self._thread is None:
            return self._take(state.version, _Seen(trained, set()), should_stop)
        t0 = time.monotonic()
        timeout = self.cfg.trainer.batch_timeout_s
        while self._thread.is_alive() and time.monotonic() - t0 < timeout and not should_stop():
            self._thread.join(timeout=min(1.0, max(timeout - (time.monotonic() - t0), 0.0)))
        late = self._thread.is_alive()
        if late:  # stop it (its groups stay in Redis, not committed) and report like take_groups
            self._abort.set()
            self._thread.join()
            self._abort.clear()
        self._thread = None
        taken = self._ahead
        taken.wait_s = time.monotonic() - t0  # what the loop waited, not the prefetch's own wait
        if late and not should_stop():
            n = self.cfg.trainer.groups_per_step
            taken.error = TimeoutError(
                f"fewer than {n} GRPO groups arrived within trainer.batch_timeout_s={timeout:g}s "
                f"from {self.cfg.buffer.redis_url} (run {self.cfg.run_id!r}): {why_starved(self.buffer)}")
        return taken

    def version_of_next(self, state) -> int:
        """The policy version the step after the current one trains at: one more if the step now
        starting (``state.step + 1``) publishes (`app.trainer.publish.next_version`)."""
        return next_version(self.cfg, state.step + 1, state.version).version

    # -- every rank ------------------------------------------------------------------------

    def next(self, state, trained: set[str], should_stop) -> Batch:
        """The next step's batch on every rank (a collective: every rank calls it).

        Args:
            state: the loop's `TrainState` (rank 0 adds the take's rejections to its counters).
            trained: rank 0: "task_id/attempt" of every group the lineage trained on.
            should_stop: rank 0: a stop was requested.

        Raises:
            Stop: on every rank, when rank 0 was asked to stop.
            TrainingError: on every rank, when rank 0 could not take a batch or a rank could not
                read its share (Redis unreachable).
        """
        t = self.cfg.trainer
        payload = None
        taken = _Taken()
        if self.rank == 0:
            payload = {"parts": None, "minis": None, "error": None, "stop": False}
            taken = self._collect(state, trained, should_stop)
            for k, v in taken.counts.items():
                setattr(state, k, getattr(state, k) + v)
            if taken.error is None:
                payload["parts"], payload["minis"] = split_mini_batches(taken.headers, self.world,
                                                                        t.mini_batch_groups())
            elif isinstance(taken.error, Stop):
                payload["stop"] = True
            else:
                payload["error"] = f"rank 0 could not take a batch: {taken.error}"
            if should_stop():
                payload["stop"] = True
            elif payload["parts"] is not None and state.step + 1 < t.steps:
                inflight = {f"{h.task_id}/{h.attempt}" for h in taken.headers}
                self._prefetch(self.version_of_next(state), _Seen(trained, inflight), should_stop)
        msg = scatter_groups(payload, self.rank)
        t0 = time.perf_counter()
        mine = dict(zip((h.entry_id for h in msg["parts"][self.rank]), msg["minis"][self.rank]))
        groups, bad, error = self._read(msg["parts"][self.rank])
        bad, error = self._agree(bad, error)
        if error:
            raise TrainingError(error)
        headers = [h for part in msg["parts"] for h in part if h.entry_id not in bad]
        if self.rank == 0 and bad:
            by_id = {h.entry_id: h for part in msg["parts"] for h in part}
            for entry_id, reason in bad.items():
                h = by_id[entry_id]
                log.warning("dead-lettering group %s/%s: its payload is malformed: %s", h.task_id, h.attempt, reason)
                self.buffer.dead_letter_taken(h, reason)
                state.malformed += 1
                taken.skipped.append([h.task_id, h.attempt, "malformed"])
        good = [g for g in groups if g.entry_id not in bad]
        train = collate_groups(good, pad_id=self.pad_id, scale_by_std=t.scale_by_std, moe_layers=self.moe_layers,
                               mask_truncated=t.overlong_filter, soft_overlong=self.cfg.soft_overlong(),
                               mini_batches=[mine[g.entry_id] for g in good])
        meta = {**batch_meta(headers, state.version), **taken.signal, "read_s": time.perf_counter() - t0}
        return Batch(groups=[h for h in taken.headers if h.entry_id not in bad] if self.rank == 0 else [],
                     skipped=taken.skipped, meta=meta, wait_s=taken.wait_s, commit_point=taken.commit_point,
                     train=train)

    def _read(self, mine: list) -> tuple[list, dict[str, str], str | None]:
        """Read and decode this rank's groups: ``(groups, {entry: reason} of the bad ones, error)``."""
        if not mine:
            return [], {}, None
        try:
            if self._reader is None:
                self._reader = ExperienceBuffer.from_config(self.cfg, autocommit=False)
            groups, bad = self._reader.read_groups(mine, num_experts=self.num_experts)
        except Exception as e:  # noqa: BLE001 - every rank must hear of it, not wait for this one
            return [], {}, f"rank {self.rank} could not read its groups' payloads: {type(e).__name__}: {e}"
        bad = {h.entry_id: reason for h, reason in bad}
        good = []
        for g in groups:
            try:
                g.check(self.moe_layers)
            except ValueError as e:
                bad[g.entry_id] = str(e)
                continue
            good.append(g)
        return good, bad, None

    def _agree(self, bad: dict[str, str], error: str | None) -> tuple[dict[str, str], str | None]:
        """Every rank's bad payloads and errors, on every rank."""
        if self.world == 1:
            return bad, error
        parts: list = [None] * self.world
        dist.all_gather_object(parts, (bad, error))
        merged = {k: v for b, _ in parts for k, v in b.items()}
        errors = [e for _, e in parts if e]
        return merged, "; ".join(errors) if errors else None

    def close(self) -> None:
        """Stop a prefetch in flight (its groups stay in Redis, not committed) and close the reader
        a rank other than 0 opened."""
        self._closing.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
            self._thread = None
        if self._reader is not None and self._reader is not self.buffer:
            self._reader.close()
