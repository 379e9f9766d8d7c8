"""The rollout worker: leases prompt groups, generates and scores them, publishes finished groups.

`moerl rollout --config run.yaml --engine-url URL --worker-id ID` runs one worker against one
engine (our built-in engine or SGLang, through `app.rollout.engine_client.EngineClient`) and the
experience buffer (`app.buffer.ExperienceBuffer`). One asyncio loop:

1. back-pressure: lease nothing while finished groups the trainer has not taken plus leased tasks
   reach ``buffer.capacity_groups``, nor groups the engine's version cannot make fresh enough
   to be trained (`ExperienceBuffer.lease`, one script);
2. lease prompt groups up to ``rollout.inflight_tasks()`` (the engine profile's in-flight
   sequences in whole groups); each becomes one batched /generate of G = ``task.group_size``
   completions (``n = G``) on one shared HTTP connection pool, so the engine batches across
   tasks too; with ``rollout.routing_replay`` each asks for the routed experts, which every
   sample then carries (``Sample.routed_experts``);
3. score every completion with the reward function (``rollout.reward_fn``, default
   ``app.envs.rewards:score``) on a shared pool of daemon threads (`RewardPool`) with a
   per-sample timeout (``rollout.reward_timeout_s``). A raise, a non-finite value or a timeout
   fails the whole group: nothing of it is published, and the task goes back to the queue with
   its failures counted, or is dropped after ``buffer.max_failures`` (`ExperienceBuffer.fail`);
   a failed reward never becomes a reward of 0. The reward function is warmed (its ``warm``
   attribute, e.g. `app.envs.rewards.warm`) before the first lease, without that timeout.
   With ``env.name`` set, a task is G multi-turn episodes against the environment server
   instead (app/rollout/episodes.py), failed the same way when an environment call fails;
4. publish finished groups in portions of ``rollout.publish_every_groups`` (sooner when nothing
   else is in flight); every sample carries the engine's reported weight_version and the
   per-token logprobs; a group the buffer refuses (its checks, or a Redis error answer) fails
   its task as in 3, and a group Redis cannot take now (unreachable) is kept and retried;
5. engine failures: the client retries with backoff (``rollout.engine_retries``); after that the
   task goes back to the queue (``ExperienceBuffer.release``) and the worker health-checks the
   engine before it leases again. A task the engine refuses (HTTP 4xx) is published as an
   all-"error" group with reward 0 instead, so that it cannot circle between workers forever;
   leases of in-flight tasks are renewed every lease_ms / 3 (``ExperienceBuffer.extend``);
6. policy versions: every ``rollout.policy_poll_s`` seconds, compare ``buffer.current_policy()``
   with the engine's weight_version; when newer, download it (`app.storage.policy.download_policy`)
   to ``rollout.policy_cache_dir/<worker>/v<N>``, let in-flight requests finish (so no sequence
   mixes two versions), then pause (``rollout.pause_mode``) -> /update_weights_from_disk(path, N)
   -> continue, with the pause marker (``--pause-marker``) kept meanwhile so the engine's
   probes do not fail a long load. A failed load leaves the engine on its previous version and
   is retried at the next poll; an update that got no answer is not resent until the engine
   reports its version (see `RolloutWorker.sync_policy`).
   An engine that restarted (its version went back) is brought to the current version the same
   way before the worker leases again. The engine's weights (lock, admission, marker, version,
   the update's state machine) are one `app.rollout.weights.EngineWeights`, which the network
   push (app/rollout/weight_sync.py) drives as well. With ``rollout.partial_rollout`` an update
   aborts the in-flight requests instead of waiting for them (SGLang /abort_request with
   abort_all, on the worker's own engine); each aborted completion keeps its tokens and logprobs and is resumed on
   the new weights (`RolloutWorker._resume`), its sample then carrying ``version_segments`` and
   the oldest version as ``policy_version``.

With ``rollout.router`` (app/rollout/router.py), /generate goes to the router (``--router-url``,
with the router's API key) and may land on any engine; every control call above still goes to the
worker's own engine (``--engine-url``). The worker registers its engine with the router (its
control-plane key) once the engine is healthy and at the current version, checks every
``REGISTER_EVERY_S`` that the router still lists it, and takes it out when it drains. The sample's version is then always the answer's ``meta_info.weight_version``,
and an answer aborted by another worker's update (pause mode abort) is sent again.

SIGTERM (Spot notice) / SIGINT: stop leasing, let in-flight groups finish within
``rollout.drain_grace_s``, publish what finished, release unfinished tasks to the queue, exit 0.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import redis
import typer

from app.buffer import ExperienceBuffer
from app.buffer.health import MAX_REASONS_PER_WORKER, OTHER, failure_reason
from app.buffer.records import Sample, Task, routed_experts_of_moe_layers
from app.config import RunConfig
from app.engine.auth import read_config_keys
from app.envs.chat import renderer_for
from app.envs.contract import check_reset_async
from app.logs import setup_logging
from app.metrics import RunMetrics, serve
from app.model.source import config_source
from app.names import ENGINE_KEYS_FILE_ENV, ROUTER_API_KEY_ENV, ROUTER_CONTROL_KEY_ENV
from app.rollout.engine_client import ADMIN_API_KEY_ENV, API_KEY_ENV, EngineClient, EngineError, GenOutput
from app.rollout.episodes import EpisodeRunner, GroupFailed
from app.rollout.group import EngineGroup
from app.rollout.router import REGISTER_EVERY_S, RouterRegistration
from app.rollout.scoring import RewardPool, ScoreFn, score_fn_for
from app.rollout.weight_sync import PushMember
from app.rollout.weights import EngineWeights
from app.storage import open_store

log = logging.getLogger("moerl.rollout")

@dataclass
class WorkerStats:
    """Counters of one worker run (printed as JSON at exit)."""

    groups_published: int = 0
    samples_published: int = 0
    duplicate_groups: int = 0
    tasks_leased: int = 0
    tasks_released: int = 0
    engine_errors: int = 0
    rejected_tasks: int = 0
    reward_errors: int = 0
    reward_timeouts: int = 0
    groups_failed: int = 0  # reward / environment failures, groups the buffer refused: requeued or dropped
    tasks_dropped: int = 0  # ... of which dropped after buffer.max_failures
    weight_updates: int = 0
    weight_update_failures: int = 0
    flushes_refused: int = 0  # updates put off: the paused engine refused /flush_cache (weights untouched)
    pushes_received: int = 0  # versions that came over the network (app/rollout/weight_sync.py)
    pushes_failed: int = 0
    buffer_errors: int = 0
    partial_aborts: int = 0  # partial rollout: weight updates that aborted this worker's requests
    partial_resumes: int = 0  # ... completions resumed on the new weights after such an abort
    drained_s: float = 0.0  # seconds weight updates waited for this worker's requests (admission stopped)
    requests_resent: int = 0  # behind the router: answers aborted by another worker's weight update, sent again


class EngineMisconfigured(ValueError):
    """The engine answers, but not as this run needs (e.g. no routed experts with
    ``rollout.routing_replay``): retrying cannot help, so the worker stops (its tasks go back)."""


class RolloutWorker:
    """One rollout worker bound to one engine.

    Args:
        cfg: the run configuration (rollout, buffer and run_id sections are used).
        buffer: an ``app.buffer.ExperienceBuffer`` (or an object with the same methods).
        client: the engine client.
        worker_id: consumer name in the buffer's consumer group; also names the policy cache dir.
        score_fn: reward function; default imported from ``cfg.rollout.reward_fn``.
        store: object store holding published policies (default ``open_store(cfg.store_url)``,
            opened on first use).
        max_groups: stop (as on SIGTERM) after publishing this many groups; None = run until signalled.
        pause_marker: a file this worker keeps, while it holds the engine paused for a weight
            update, holding the time (epoch seconds) by which it will have continued it; the
            engine's probes (`app.rollout.probe`) read it, so a long load never fails them.
        metrics: an ``app.metrics.RunMetrics`` that gets the duration (s) of every disk weight
            update that succeeded; None: none recorded.
        group: the `app.rollout.group.EngineGroup` of a multi-node engine this worker drives
            from a pod of its own: the group's fetchers put each version on every node, the
            worker asks for the update once all hold it, and records its pauses there (the
            leader's fetcher keeps the probes' marker); None: the engine shares this worker's
            disk and marker (one node, or the embedded loop).
        gen_client: where /generate goes: the router (``rollout.router``, app/rollout/router.py),
            which may send it to any engine; None: ``client``, the worker's own engine. Every
            control call (version, pause, flush, updates, health) goes to ``client`` either way.
        registration: the `app.rollout.router.RouterRegistration` of this worker's engine (with
            the router): registered before the first lease, kept listed, removed at the drain.
    """

    def __init__(
        self, cfg: RunConfig, buffer: Any, client: EngineClient, worker_id: str, *,
        score_fn: ScoreFn | None = None, store: Any = None, max_groups: int | None = None,
        pause_marker: str | os.PathLike | None = None, metrics: Any = None, group: Any = None,
        gen_client: EngineClient | None = None, registration: Any = None,
    ):
        self.cfg = cfg
        self.registration = registration
        self.r = cfg.rollout
        self.buffer = buffer
        self.client = client
        self.gen_client = gen_client or client
        self.routed = gen_client is not None and gen_client is not client
        self.worker_id = worker_id
        self.score_fn = score_fn or score_fn_for(cfg)
        self.max_groups = max_groups
        self.stats = WorkerStats()
        self.metrics = metrics
        self.fatal: Exception | None = None  # set when the worker stopped on an EngineMisconfigured
        self.group = group
        self._stop = asyncio.Event()
        self._finished: list[tuple[Task, list[Sample]]] = []
        self._to_fail: list[Task] = []  # tasks whose group failed (reward / environment), to requeue
        self._fail_reasons: list[str] = []  # ... and why, for the run's health hash (app/buffer/health.py)
        self._reasons_seen: set[str] = set()
        self._waiting_on: tuple[str, str, str] | None = None  # (on, what, why) said to the health hash
        self._env_suspect = False
        # The engine's weights: the lock, admission, pause marker, version, loads (app/rollout/weights.py).
        self.weights = EngineWeights(cfg, client, worker_id, stats=self.stats, stop=self._stop,
                                     current_policy=lambda: self._buf("current_policy"), store=store,
                                     pause_marker=pause_marker, metrics=metrics, group=group)
        self.episodes = self._episode_runner() if cfg.env.name else None
        self.rewards = RewardPool(cfg.rollout.reward_threads)
        self._routing_shape: tuple[int, int, list[int]] | None = None  # (layers, top_k, MoE layers) of the model
        self._tokenizer: Any = None  # partial rollout: decodes resumed completions (False: none here)
        # One thread for every buffer call: the buffer object is not assumed thread-safe.
        self._buffer_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="buffer")

    @property
    def engine_version(self) -> int | None:
        """The version the engine serves, as far as known (`EngineWeights.version`)."""
        return self.weights.version

    # -- multi-turn episodes and reward warm-up (issue 16) ---------------------------------
    def _episode_runner(self):
        # transformers: only for a tokenizer; the worker module loads without it
        from app.model.tokenizer import build_tokenizer, load_tokenizer

        path = self.cfg.model.path
        tokenizer = load_tokenizer(path) if path and (Path(path) / "tokenizer.json").is_file() else build_tokenizer()
        return EpisodeRunner(self.cfg, renderer_for(tokenizer), self._generate_turn, lambda: self.engine_version or 0)

    async def _generate_turn(self, ids: list[int]) -> GenOutput:
        """One turn of an episode (n = 1), held back while weights are swapped like `_generate`."""
        async with self.weights.generating():
            return (await self._gen(ids, n=1, max_new_tokens=self.r.max_new_tokens,
                                    temperature=self.r.temperature, top_p=self.r.top_p))[0]

    async def warm_up(self) -> None:
        """Before the first lease: the reward function's ``warm(cfg.task)`` (imports, verifier
        set-up) without ``rollout.reward_timeout_s``, or the environment server's health.

        Raises:
            TimeoutError: not done within ``rollout.reward_warmup_timeout_s``.
        """
        limit = self.r.reward_warmup_timeout_s
        if self.episodes is not None:
            deadline = time.monotonic() + limit
            while (problem := await self.episodes.health_problem()) is not None:
                await self._say_waiting("environment", self.episodes.url, problem)
                if self._stop.is_set():  # SIGTERM while waiting: nothing leased, nothing to drain
                    return
                if time.monotonic() > deadline:
                    raise TimeoutError(f"environment server {self.episodes.url} not healthy after {limit:.0f} s: "
                                       f"{problem}")
                await self._sleep_or_stop(0.5)
            await self._say_waiting(None)
            wire = await self.episodes.read_wire()  # a schema without text fields ends the worker here
            if not self.cfg.env.served_by_moerl():  # a user's server: reset must take spec (app/envs/contract.py)
                await check_reset_async(self.episodes.url, wire, max_sessions=self.cfg.env.max_sessions)
            return
        warm = getattr(self.score_fn, "warm", None)
        if callable(warm):
            t0 = time.monotonic()
            await asyncio.wait_for(asyncio.to_thread(warm, self.cfg.task), limit)
            log.info("%s: reward function warmed in %.1f s", self.worker_id, time.monotonic() - t0)

    async def _fail_tasks(self) -> None:
        """Requeue (or drop) the tasks whose group failed; nothing of them was published. Their
        reasons are counted in the run's health hash."""
        tasks, self._to_fail = self._to_fail, []
        if not tasks:
            return
        reasons, self._fail_reasons = self._fail_reasons, []
        try:
            await self._buf("note_failures", reasons)
        except Exception as e:  # noqa: BLE001 - the figures are for people; the tasks matter
            log.warning("%s: could not count failure reasons (%s)", self.worker_id, e)
        try:
            dropped = await self._buf("fail", tasks)
        except Exception as e:  # noqa: BLE001 - their leases expire and they return anyway
            self.stats.buffer_errors += 1
            log.warning("%s: could not return %d failed task(s) (%s); their leases will expire",
                        self.worker_id, len(tasks), e)
            return
        self.stats.tasks_dropped += len(dropped)
        for t in dropped:
            log.error("%s: task %s/%s dropped after %d failed rollouts", self.worker_id, t.task_id, t.attempt,
                      t.failures + 1)

    def _reason_key(self, reason: str) -> str:
        """``reason``, or "other" once this worker has counted `MAX_REASONS_PER_WORKER` others."""
        if reason not in self._reasons_seen and len(self._reasons_seen) >= MAX_REASONS_PER_WORKER:
            return OTHER
        self._reasons_seen.add(reason)
        return reason

    async def _say_waiting(self, on: str | None, what: str = "", why: str = "") -> None:
        """Tell the run's health hash what this worker waits on (None: nothing), once per change."""
        cause = (on, what, why) if on else None
        if cause == self._waiting_on:
            return
        try:
            await self._buf("note_waiting", self.worker_id, on, what, why)
            self._waiting_on = cause
        except Exception as e:  # noqa: BLE001 - the figures are for people; retried at the next change
            log.warning("%s: could not say what it waits on (%s)", self.worker_id, e)

    # -- helpers ---------------------------------------------------------------------------
    async def _buf(self, method: str, *args, **kwargs):
        loop = asyncio.get_running_loop()
        fn = getattr(self.buffer, method)
        return await loop.run_in_executor(self._buffer_thread, lambda: fn(*args, **kwargs))

    def request_stop(self) -> None:
        """Begin the drain (what SIGTERM does)."""
        if not self._stop.is_set():
            log.info("%s: stop requested: draining", self.worker_id)
        self._stop.set()

    async def _sleep_or_stop(self, seconds: float) -> None:
        await self.weights.sleep_or_stop(seconds)

    # -- policy versions -------------------------------------------------------------------
    async def sync_policy(self) -> None:
        """Bring the engine to the buffer's current policy version if it lags
        (`EngineWeights.sync`; nothing while a network push holds the weights)."""
        await self.weights.sync()

    # -- one task --------------------------------------------------------------------------
    async def _gen(self, prompt, **kwargs) -> list[GenOutput]:
        """One /generate on `gen_client`. Behind the router, an answer with an aborted sequence
        is sent again, up to ``rollout.engine_retries`` times: the engine it landed on was paused
        (mode abort) for its own worker's weight update. An answer without an integer
        ``meta_info.weight_version`` is refused there: the worker's own engine's version says
        nothing about the engine that served it.

        Raises:
            EngineError: as `EngineClient.generate`; EngineMisconfigured: no version in the answer.
        """
        outs = await self.gen_client.generate(prompt, **kwargs)
        if not self.routed:
            return outs
        for _ in range(self.r.engine_retries):
            if not any(o.finish_reason == "abort" for o in outs):
                break
            self.stats.requests_resent += 1
            outs = await self.gen_client.generate(prompt, **kwargs)
        if any(o.weight_version is None for o in outs):
            raise EngineMisconfigured(
                f"the router {self.gen_client.url} answered without an integer meta_info.weight_version: with "
                "rollout.router every engine must report its version (start it with --weight-version N)")
        return outs

    async def _generate(self, task: Task) -> list[GenOutput]:
        prompt_routing = None
        async with self.weights.generating():
            if self.r.routing_replay:
                # The prompt's routing once per group: a one-token request first (its prefill is
                # the one the group's samples reuse from the prefix cache), then the group asks
                # only for its own tokens (routed_experts_start_len = P), instead of G copies.
                (head,) = await self._gen(
                    task.prompt_ids, n=1, max_new_tokens=1, temperature=self.r.temperature, top_p=self.r.top_p,
                    return_routed_experts=True)
                if head.finish_reason == "abort":
                    raise EngineError(f"engine aborted the prompt-routing request of task {task.task_id}")
                prompt_routing = head.routed_experts
            epoch = self.weights.abort_epoch
            outs = await self._gen(
                task.prompt_ids, n=task.group_size, max_new_tokens=self.r.max_new_tokens,
                temperature=self.r.temperature, top_p=self.r.top_p, return_routed_experts=self.r.routing_replay,
                routed_experts_start_len=len(task.prompt_ids) if self.r.routing_replay else 0,
            )
        if self.r.partial_rollout:
            outs = await self._resume(task.prompt_ids, outs, epoch)
        if any(o.finish_reason == "abort" for o in outs):
            raise EngineError(f"engine aborted a request of task {task.task_id}")
        if any(len(o.logprobs) != len(o.token_ids) for o in outs):
            raise EngineError(f"engine returned fewer logprobs than tokens for task {task.task_id}")
        if self.r.routing_replay and (prompt_routing is None or any(o.routed_experts is None for o in outs)):
            raise EngineMisconfigured(
                f"rollout.routing_replay is set but {self.gen_client.url} returned no meta_info.routed_experts: "
                "start SGLang (or `moerl engine`) with --enable-return-routed-experts")
        if prompt_routing is not None and any(o.weight_version != head.weight_version for o in outs):
            # behind the router the two requests may land on engines at different versions
            raise EngineError(f"task {task.task_id}: the prompt's routing came from v{head.weight_version}, the "
                              f"group from v{outs[0].weight_version}; the task is leased again")
        if prompt_routing is not None:
            for o in outs:  # the prompt's rows, then the sample's own: every token fed, P + C - 1 rows
                o.routed_experts = np.concatenate([prompt_routing, o.routed_experts])
        return outs

    async def _resume(self, prompt: list[int], outs: list[GenOutput], epoch: int) -> list[GenOutput]:
        """Partial rollout: resume every completion this worker's weight update aborted, on the
        new weights, until it stops or reaches ``rollout.max_new_tokens`` in all.

        Each aborted completion keeps its tokens and logprobs (the engine's, under the version it
        reported) and is sent again as prompt + those tokens with the rest of the length budget
        (Miles/slime ``--partial-rollout``), once the update let generation in again. The result
        holds every piece's tokens and logprobs in order, ``weight_version`` the oldest piece's,
        and ``version_segments`` ``[(start, version), ...]`` when more than one version made it.
        An abort this worker did not cause (``abort_epoch`` unchanged) stays an abort: the
        caller fails the task as before.

        Args:
            prompt: the task's prompt ids.
            outs: the group's outputs, input-major; epoch: ``abort_epoch`` when they were sent.
        """
        pieces = [[o] for o in outs]
        while True:
            todo = [j for j, ps in enumerate(pieces) if ps[-1].finish_reason == "abort"]
            if not todo or self.weights.abort_epoch == epoch:
                break
            budget = {j: self.r.max_new_tokens - sum(len(p.token_ids) for p in pieces[j]) for j in todo}
            for j in [j for j in todo if budget[j] <= 0]:  # aborted at its last token: cut at length
                pieces[j][-1].finish_reason = "length"
            todo = [j for j in todo if budget[j] > 0]
            if not todo:
                break
            self.stats.partial_resumes += len(todo)
            async with self.weights.generating():  # after the swap: the new weights
                epoch = self.weights.abort_epoch
                more = await asyncio.gather(*(self.client.generate(
                    prompt + [t for p in pieces[j] for t in p.token_ids], n=1, max_new_tokens=budget[j],
                    temperature=self.r.temperature, top_p=self.r.top_p) for j in todo))
            for j, (o,) in zip(todo, more):
                pieces[j].append(o)
        return [ps[0] if len(ps) == 1 else self._joined(ps) for ps in pieces]

    def _joined(self, pieces: list[GenOutput]) -> GenOutput:
        """One completion from the pieces of a resumed one (see `_resume`)."""
        ids = [t for p in pieces for t in p.token_ids]
        segments: list[tuple[int, int]] = []
        start = 0
        for p in pieces:
            version = p.weight_version if p.weight_version is not None else (self.engine_version or 0)
            if p.token_ids and (not segments or segments[-1][1] != version):
                if segments and version < segments[-1][1]:
                    raise EngineError(f"engine went back from weight version {segments[-1][1]} to {version} "
                                      "inside a resumed completion")
                segments.append((start, version))
            start += len(p.token_ids)
        if not segments:
            segments = [(0, pieces[-1].weight_version or 0)]
        return GenOutput(
            token_ids=ids, logprobs=[lp for p in pieces for lp in p.logprobs], text=self._decode(ids, pieces),
            finish_reason=pieces[-1].finish_reason, weight_version=segments[0][1],
            prompt_tokens=pieces[0].prompt_tokens, version_segments=segments if len(segments) > 1 else None)

    def _decode(self, ids: list[int], pieces: list[GenOutput]) -> str:
        """The text of a resumed completion: its ids decoded whole with the run's tokenizer, as the
        engine decodes one completion (``skip_special_tokens``); the pieces' texts joined when
        there is no tokenizer here (a character split across an abort may then differ)."""
        if self._tokenizer is None:
            # transformers: only for a tokenizer; the worker module loads without it
            from app.model.tokenizer import build_tokenizer, load_tokenizer

            path = self.cfg.model.path
            try:
                self._tokenizer = (load_tokenizer(path) if path and (Path(path) / "tokenizer.json").is_file()
                                   else build_tokenizer() if not path else False)
            except Exception as e:  # noqa: BLE001 - fall back to the engine's texts
                log.warning("%s: no tokenizer for resumed completions (%s); joining the engine's texts", self.worker_id, e)
                self._tokenizer = False
        if self._tokenizer is False:
            return "".join(p.text for p in pieces)
        return self._tokenizer.decode(ids, skip_special_tokens=True)

    def routed_experts(self, task: Task, out: GenOutput):
        """The engine's routed experts of one completion as `Sample.routed_experts` holds them:
        ``[P + C - 1, n_moe, top_k]``, the MoE layers' rows of the engine's ``[P + C - 1, layers,
        top_k]`` (see app/buffer/records.py).

        Raises:
            EngineMisconfigured: the id count does not fit the model's layers and top_k.
        """
        layers, top_k, moe_layers = self._routing_shape or self._model_routing_shape()
        tokens = len(task.prompt_ids) + len(out.token_ids) - 1
        ids = out.routed_experts[: max(tokens, 0) * layers * top_k]  # a 0-token completion: P - 1 rows
        if ids.size != tokens * layers * top_k:
            raise EngineMisconfigured(
                f"meta_info.routed_experts has {ids.size} ids; {tokens} tokens x {layers} layers x {top_k} "
                f"experts expected for task {task.task_id}")
        return routed_experts_of_moe_layers(ids.reshape(tokens, layers, top_k), moe_layers)

    def _model_routing_shape(self) -> tuple[int, int, list[int]]:
        """(num_hidden_layers, num_experts_per_tok, MoE layer indices) of the run's model (its
        config.json, or the preset)."""
        # transformers: only for the model's routing shape (routing replay)
        from transformers import AutoConfig

        from app.model.config import moe_layer_ids, tiny_config

        if self.cfg.model.path:
            config = AutoConfig.from_pretrained(config_source(self.cfg.model.path, self.cfg.model.cache_dir))
        else:
            config = tiny_config(self.cfg.model.preset)
        self._routing_shape = (int(config.num_hidden_layers), int(config.num_experts_per_tok), moe_layer_ids(config))
        return self._routing_shape

    def _error_group(self, task: Task) -> list[Sample]:
        """G empty samples, reward 0, finish_reason "error": consumes a task the engine refuses."""
        return [
            Sample(sample_id=task.sample_id(self.cfg.run_id, j), task_id=task.task_id, index=j,
                   attempt=task.attempt, prompt_ids=list(task.prompt_ids), completion_ids=[], logprobs=[],
                   reward=0.0, policy_version=self.engine_version or 0, finish_reason="error")
            for j in range(task.group_size)
        ]

    async def rollout(self, task: Task) -> list[Sample]:
        """Generate and score the G completions of ``task``.

        A task the engine refuses (HTTP 4xx, e.g. a prompt longer than the context) would fail
        on every worker forever; it is published as a group of "error" samples with reward 0
        (no advantage, nothing to learn) and counted in ``rejected_tasks``.

        Raises:
            EngineError: the engine failed (not refused) after the client's retries.
            GroupFailed: a reward (or, with ``env.name``, environment) call failed.
        """
        try:
            if self.episodes is not None:
                return await self.episodes.group(task)
            outs = await self._generate(task)
        except EngineError as e:
            if not e.rejected:
                raise
            self.stats.rejected_tasks += 1
            log.error("%s: engine refused task %s: %s", self.worker_id, task.task_id, e)
            return self._error_group(task)
        routed = [self.routed_experts(task, o) for o in outs] if self.r.routing_replay else [None] * len(outs)
        rewards = await asyncio.gather(
            *(self.rewards.score(self.score_fn, task, o.text, self.r.reward_timeout_s) for o in outs)
        )
        samples, failed = [], []
        for j, (o, (reward, problem), ids) in enumerate(zip(outs, rewards, routed)):
            if problem is None and not self.r.reward_in_range(reward):
                problem = "range"  # the rule of environment rewards too (app/rollout/episodes.py)
            if problem is not None and not (o.finish_reason == "length" and self.r.overlong_reward is not None):
                failed.append(problem)
            if problem == "timeout":
                self.stats.reward_timeouts += 1
            elif problem == "error":
                self.stats.reward_errors += 1
            if o.finish_reason == "length" and self.r.overlong_reward is not None:
                # Cut off at max_new_tokens: no verifier call, a fixed overlong penalty (the
                # reward rollout.overlong_reward); otherwise a dense verifier pays for run-on text
                # and the policy learns to stop emitting <eos>. DAPO's overlong filtering (masking
                # such samples out of the loss) is the trainer's, trainer.overlong_filter.
                reward = self.r.overlong_reward
            version = o.weight_version if o.weight_version is not None else (self.engine_version or 0)
            samples.append(Sample(
                sample_id=task.sample_id(self.cfg.run_id, j), task_id=task.task_id, index=j,
                attempt=task.attempt, prompt_ids=list(task.prompt_ids), completion_ids=o.token_ids,
                logprobs=o.logprobs, reward=reward, policy_version=version,
                finish_reason=o.finish_reason if o.finish_reason in ("stop", "length") else "error",
                routed_experts=ids, version_segments=o.version_segments,
            ))
        if failed:
            worst = Counter(failed).most_common(1)[0][0]
            reason = (f"reward outside {self.r.reward_range_text()}" if worst == "range"
                      else f"reward function: {'timed out' if worst == 'timeout' else 'raised or gave a non-number'}")
            raise GroupFailed(f"task {task.task_id}: {len(failed)} reward call(s) failed "
                              f"({', '.join(sorted(set(failed)))})", failure_reason(reason, ""))
        return samples

    # -- publishing ------------------------------------------------------------------------
    async def _publish(self, force: bool) -> None:
        while self._finished and (force or len(self._finished) >= self.r.publish_every_groups):
            portion = self._finished[: self.r.publish_every_groups]
            for task, samples in portion:
                try:
                    added = await self._buf("publish", task, samples)
                except (ValueError, redis.exceptions.ResponseError) as e:
                    # Refused: a group the buffer's checks reject, or Redis answering the command with
                    # an error (an ACL or a script's): the same group would be refused again, and a
                    # worker retrying it published nothing more, ever. It fails as a failed group
                    # does (requeued; dropped after buffer.max_failures), its reason counted.
                    log.error("%s: group of %s refused by the buffer: %s", self.worker_id, task.task_id, e)
                    self._finished.remove((task, samples))
                    self.stats.groups_failed += 1
                    self._to_fail.append(task)
                    self._fail_reasons.append(self._reason_key(failure_reason("buffer refused the group", str(e))))
                    continue
                except Exception as e:  # noqa: BLE001 - Redis unreachable: keep the group, retry later
                    self.stats.buffer_errors += 1
                    log.warning("%s: publish failed (%s); will retry", self.worker_id, e)
                    return
                self._finished.remove((task, samples))
                if added:
                    self.stats.groups_published += 1
                    self.stats.samples_published += len(samples)
                else:
                    self.stats.duplicate_groups += 1

    async def _release(self, tasks: list[Task]) -> None:
        if not tasks:
            return
        try:
            await self._buf("release", tasks)
            self.stats.tasks_released += len(tasks)
        except Exception as e:  # noqa: BLE001 - the lease will expire and the task returns anyway
            self.stats.buffer_errors += 1
            log.warning("%s: release of %d task(s) failed (%s); their leases will expire", self.worker_id, len(tasks), e)

    async def _extend(self, tasks: list[Task]) -> None:
        """Renew the leases of in-flight tasks (a slow engine must not lose them to expiry)."""
        try:
            await self._buf("extend", tasks)
        except Exception as e:  # noqa: BLE001 - at worst a lease expires and the task is redone
            self.stats.buffer_errors += 1
            log.warning("%s: lease extension failed: %s", self.worker_id, e)

    def _reap(self, done: set[asyncio.Task], inflight: dict[asyncio.Task, Task]) -> list[Task]:
        """Collect finished rollouts; returns the tasks that failed (to release)."""
        failed = []
        for t in done:
            task = inflight.pop(t)
            if t.cancelled():
                failed.append(task)
                continue
            err = t.exception()
            if err is None:
                self._finished.append((task, t.result()))
            elif isinstance(err, GroupFailed):
                # A failed reward or environment call: never published, never trained.
                self.stats.groups_failed += 1
                log.warning("%s: group of %s failed: %s", self.worker_id, task.task_id, err)
                self._to_fail.append(task)
                self._fail_reasons.append(self._reason_key(err.reason))
                if self.episodes is not None:
                    self._env_suspect = True
            elif isinstance(err, EngineMisconfigured):
                log.error("%s: %s; stopping", self.worker_id, err)
                self.fatal = err
                self.request_stop()
                failed.append(task)
            else:
                self.stats.engine_errors += 1
                self.weights.suspect = True
                log.warning("%s: task %s failed: %s", self.worker_id, task.task_id, err)
                failed.append(task)
        return failed

    # -- main loop -------------------------------------------------------------------------
    async def run(self) -> WorkerStats:
        """Run until `request_stop` (or ``max_groups``), then drain; returns the counters."""
        inflight: dict[asyncio.Task, Task] = {}
        next_poll = 0.0
        next_extend = time.monotonic() + self.cfg.buffer.lease_ms / 3000
        pushes = None
        if self.cfg.weight_sync.mode == "network":
            pushes = asyncio.create_task(PushMember(self.weights, buffer=self.buffer).run())
        next_register = 0.0
        try:
            await self.warm_up()  # before the first lease: the first batch must not be timeouts
            if self.registration is not None:
                await self.sync_policy()  # the router sends other workers' requests here: current weights first
                next_poll = time.monotonic() + self.r.policy_poll_s
            while not self._stop.is_set():
                if self.registration is not None and time.monotonic() >= next_register:
                    # Before the health checks: behind a router that lists no engine they fail until one registers.
                    await self.registration.ensure()
                    next_register = time.monotonic() + REGISTER_EVERY_S
                if self.weights.suspect:
                    sick = None
                    for c in dict.fromkeys((self.client, self.gen_client)):  # the router too, when routed
                        if not await c.health_generate(timeout_s=self.r.request_timeout_s):
                            sick = c
                            break
                    if sick is not None:
                        log.warning("%s: engine %s unhealthy; not leasing", self.worker_id, sick.url)
                        await self._say_waiting("engine", sick.url, "/health_generate failed")
                        await self._sleep_or_stop(self.r.retry_backoff_s * 4)
                        continue
                    await self._say_waiting(None)
                    self.weights.suspect = False
                    next_poll = 0.0  # a restarted engine must load the current version first
                    # It generates again, so no load holds it: its version now says what to do.
                    self.weights.unanswered = None
                if self._env_suspect:
                    problem = await self.episodes.health_problem()
                    if problem is not None:
                        log.warning("%s: environment %s unhealthy (%s); not leasing", self.worker_id,
                                    self.episodes.url, problem)
                        await self._say_waiting("environment", self.episodes.url, problem)
                        await self._sleep_or_stop(self.r.retry_backoff_s * 4)
                        continue
                    await self._say_waiting(None)
                    self._env_suspect = False
                if time.monotonic() >= next_poll:
                    await self.sync_policy()
                    next_poll = time.monotonic() + self.r.policy_poll_s

                if inflight and time.monotonic() >= next_extend:
                    await self._extend(list(inflight.values()))
                    next_extend = time.monotonic() + self.cfg.buffer.lease_ms / 3000
                if inflight:
                    done, _ = await asyncio.wait(inflight, timeout=0.05, return_when=asyncio.FIRST_COMPLETED)
                    await self._release(self._reap(done, inflight))
                    await self._fail_tasks()
                await self._publish(force=not inflight)
                if self.max_groups is not None and self.stats.groups_published + len(self._finished) >= self.max_groups:
                    self.request_stop()
                    break

                free = self.r.inflight_tasks() - len(inflight)
                # No new leases while the weights change (a push waits for in-flight work).
                if (free <= 0 or self.weights.suspect or self._env_suspect or self._stop.is_set()
                        or not self.weights.admitting.is_set()):
                    if not self.weights.admitting.is_set() and not inflight:
                        await asyncio.sleep(0.05)
                    continue
                try:
                    # One script checks back-pressure and leases (nothing while the gate is shut:
                    # it polls within block_ms); the engine's version lets it admit only groups
                    # that can still be trained within buffer.max_staleness.
                    tasks = await self._buf("lease", self.worker_id, count=free, block_ms=200 if inflight else 500,
                                            engine_version=self.engine_version)
                except Exception as e:  # noqa: BLE001 - Redis restart or hiccup: back off
                    self.stats.buffer_errors += 1
                    log.warning("%s: buffer error while leasing: %s", self.worker_id, e)
                    await self._sleep_or_stop(self.r.retry_backoff_s * 4)
                    continue
                self.stats.tasks_leased += len(tasks)
                for task in tasks:
                    inflight[asyncio.create_task(self.rollout(task))] = task
        finally:
            await self._drain(inflight)
            if pushes is not None:
                self._stop.set()
                await asyncio.gather(pushes, return_exceptions=True)
        return self.stats

    async def _drain(self, inflight: dict[asyncio.Task, Task]) -> None:
        """Take the engine out of the router's list, finish in-flight groups within
        drain_grace_s, publish them, release the rest."""
        if self.registration is not None:
            await self.registration.remove()  # no new requests from other workers; the pod is going
        self.weights.admitting.set()  # a weight swap interrupted by the signal must not block the drain
        deadline = time.monotonic() + self.r.drain_grace_s
        to_release: list[Task] = []
        while inflight and time.monotonic() < deadline:
            done, _ = await asyncio.wait(inflight, timeout=deadline - time.monotonic(), return_when=asyncio.FIRST_COMPLETED)
            to_release += self._reap(done, inflight)
        for t in inflight:
            t.cancel()
        if inflight:
            await asyncio.gather(*inflight, return_exceptions=True)
            to_release += list(inflight.values())
            inflight.clear()
        await self._fail_tasks()
        await self._publish(force=True)
        # Groups that could not be published (buffer down) go back to the queue too.
        to_release += [task for task, _ in self._finished]
        self._finished.clear()
        await self._release(to_release)
        self._buffer_thread.shutdown(wait=True)


def router_clients(cfg: RunConfig, router_url: str, engine_url: str) -> tuple[EngineClient, Any]:
    """The worker's client of the router (/generate, with the key in ``$MOERL_ROUTER_API_KEY``:
    the router asks for it and sends none on to the engines) and its engine's registration there
    (the control-plane key in ``$MOERL_ROUTER_CONTROL_KEY``; ``engine_url`` as the router reaches
    the engine).

    Raises:
        ValueError: no control-plane key.
    """
    control_key = os.environ.get(ROUTER_CONTROL_KEY_ENV)
    if not control_key:
        raise ValueError(f"rollout.router is on but ${ROUTER_CONTROL_KEY_ENV} is empty: the worker registers its "
                         "engine with the router's control-plane key")
    gen_client = EngineClient(
        router_url, timeout_s=cfg.rollout.request_timeout_s, retries=cfg.rollout.engine_retries,
        backoff_s=cfg.rollout.retry_backoff_s, max_connections=cfg.rollout.inflight_tasks() + 8,
        api_key=os.environ.get(ROUTER_API_KEY_ENV) or None)
    return gen_client, RouterRegistration(router_url, engine_url, control_key)


async def run_worker(cfg: RunConfig, engine_url: str, worker_id: str, *, max_groups: int | None = None,
                     pause_marker: str | None = None, metrics_port: int = 0, metrics_addr: str = "0.0.0.0",
                     metrics_every_s: float = 5.0, engine_group: str | None = None,
                     group_size: int | None = None, router_url: str | None = None,
                     router_engine_url: str | None = None) -> WorkerStats:
    """Connect to the buffer and the engine, run a `RolloutWorker` until SIGTERM/SIGINT, drain.

    metrics_port: serve the worker's counters (WorkerStats, refreshed every `metrics_every_s`
        seconds and once more at exit) and its weight-update durations on
        ``http://<metrics_addr>:<port>/metrics`` (app.metrics); 0: no endpoint.
    engine_group, group_size: the leader address and pod count of a multi-node engine whose
        pods fetch the versions themselves (app/rollout/group.py); None: one-node engine.
    router_url: send /generate there (SGLang's router, app/rollout/router.py) with the key in
        ``$MOERL_ROUTER_API_KEY``, and register the engine there with the control-plane key in
        ``$MOERL_ROUTER_CONTROL_KEY``; control calls still go to ``engine_url``. None: everything
        to ``engine_url``.
    router_engine_url: the engine's URL as the router reaches it (default ``engine_url``).
    The engine's own keys: the file in ``$MOERL_ENGINE_KEYS_FILE`` (app/rollout/keys.py), else
    ``$MOERL_ENGINE_API_KEY`` and ``$MOERL_ENGINE_ADMIN_API_KEY``; none: the engine asks for none.

    Raises:
        ValueError: ``rollout.reward_fn`` cannot be imported, ``store_url`` is invalid, the keys
            file cannot be read, or the router's control-plane key is missing.
        ConnectionError (or the buffer's own error): Redis unreachable; names the URL.
        TimeoutError: the engine is not healthy within ``rollout.request_timeout_s``.
    """
    score_fn = score_fn_for(cfg)
    # Open the store now: a bad store_url must fail at start, not at the first policy version.
    store = open_store(cfg.store_url)
    keys_file = os.environ.get(ENGINE_KEYS_FILE_ENV)
    if keys_file:  # an engine on the pod network asks for its own admin key (charts8s/rollout.py)
        try:
            api_key, admin_key = read_config_keys(keys_file)
        except OSError as e:
            raise ValueError(f"${ENGINE_KEYS_FILE_ENV}: cannot read {keys_file}: {e}") from None
    else:
        api_key, admin_key = os.environ.get(API_KEY_ENV) or None, os.environ.get(ADMIN_API_KEY_ENV) or None
    gen_client, registration = router_clients(cfg, router_url, router_engine_url or engine_url) if router_url \
        else (None, None)
    buffer = ExperienceBuffer.from_config(cfg)
    client = EngineClient(
        engine_url, timeout_s=cfg.rollout.request_timeout_s, retries=cfg.rollout.engine_retries,
        backoff_s=cfg.rollout.retry_backoff_s,
        # One connection per in-flight group, plus the control calls (versions, health, updates).
        max_connections=cfg.rollout.inflight_tasks() + 8, api_key=api_key, admin_api_key=admin_key,
    )
    metrics = server = reporter = None
    if metrics_port:
        metrics = RunMetrics(cfg.run_id)
        server = serve(metrics, metrics_port, metrics_addr)  # OSError (port taken) before any task is leased
    group = None
    if engine_group:
        group = EngineGroup.of(buffer, engine_group, group_size or 1)
    worker = RolloutWorker(cfg, buffer, client, worker_id, score_fn=score_fn, store=store, max_groups=max_groups,
                           pause_marker=pause_marker, metrics=metrics, group=group, gen_client=gen_client,
                           registration=registration)
    if metrics is not None:
        async def report() -> None:
            while True:
                metrics.observe_worker_stats(asdict(worker.stats))
                await asyncio.sleep(metrics_every_s)

        reporter = asyncio.create_task(report())
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, worker.request_stop)
    try:
        deadline = time.monotonic() + cfg.rollout.request_timeout_s
        while not await client.health_generate(timeout_s=cfg.rollout.request_timeout_s):
            if time.monotonic() > deadline:
                raise TimeoutError(f"engine at {engine_url} not healthy after {cfg.rollout.request_timeout_s:.0f} s")
            if worker._stop.is_set():
                return worker.stats
            await asyncio.sleep(0.5)
        stats = await worker.run()
        if worker.fatal is not None:
            raise worker.fatal
        return stats
    finally:
        if metrics is not None:
            reporter.cancel()
            metrics.observe_worker_stats(asdict(worker.stats))
            server.shutdown()
        await client.aclose()
        if gen_client is not None:
            await gen_client.aclose()
            await registration.aclose()
        close = getattr(buffer, "close", None)
        if callable(close):
            close()


cli = typer.Typer(add_completion=False, help="Run a rollout worker against an engine and the experience buffer.")


@cli.command()
def rollout(
    config: Path = typer.Option(..., "--config", help="Run configuration (YAML)."),
    engine_url: str = typer.Option(None, "--engine-url", help="Engine base URL (default: rollout.engine_url)."),
    worker_id: str = typer.Option(..., "--worker-id", help="Unique name of this worker."),
    max_groups: int = typer.Option(None, "--max-groups", min=1, help="Exit after publishing this many groups."),
    pause_marker: str = typer.Option(None, "--pause-marker", help="File kept while the engine is paused for a "
                                     "weight update (read by its probes: `python -m app.rollout.probe`)."),
    metrics_port: int = typer.Option(0, "--metrics-port", min=0, max=65535,
                                     help="Serve Prometheus /metrics on this port (0: none)."),
    metrics_addr: str = typer.Option("0.0.0.0", "--metrics-addr", help="Address /metrics listens on."),
    engine_group: str = typer.Option(None, "--engine-group", help="A multi-node engine's leader address: its "
                                     "pods fetch each version (python -m app.rollout.group) and this worker "
                                     "waits for all of them before an update."),
    group_size: int = typer.Option(None, "--group-size", min=1, help="Pods in that engine's group."),
    router_url: str = typer.Option(None, "--router-url", help="With rollout.router: the router's URL "
                                   "(default: rollout.router_url); /generate goes there, control calls to "
                                   "--engine-url."),
    router_engine_url: str = typer.Option(None, "--router-engine-url", help="With rollout.router: the engine's "
                                          "URL as the router reaches it, which the worker registers there "
                                          "(default: --engine-url)."),
    env_url: str = typer.Option(None, "--env-url", help="Environment server (default: env.url; moerl run "
                                "passes the `moerl env` it started)."),
) -> None:
    """Lease prompt groups, generate through the engine, score, publish; drain on SIGTERM."""
    setup_logging()
    try:
        cfg = RunConfig.load(config)
    except (FileNotFoundError, ValueError) as e:
        raise typer.BadParameter(str(e), param_hint="--config") from None
    if env_url:
        cfg.env.url = env_url
    url = engine_url or cfg.rollout.engine_url
    if engine_group and not group_size:
        raise typer.BadParameter("--engine-group needs --group-size", param_hint="--group-size")
    router = None
    if cfg.rollout.router:
        router = router_url or cfg.rollout.router_url
        if not router:
            raise typer.BadParameter("rollout.router is on: give the router's URL (rollout.router_url or "
                                     "--router-url)", param_hint="--router-url")
    elif router_url:
        raise typer.BadParameter("--router-url needs rollout.router: true in the run config", param_hint="--router-url")
    elif router_engine_url:
        raise typer.BadParameter("--router-engine-url needs rollout.router: true in the run config",
                                 param_hint="--router-engine-url")
    if router and not os.environ.get(ROUTER_CONTROL_KEY_ENV):
        raise typer.BadParameter(f"rollout.router is on but ${ROUTER_CONTROL_KEY_ENV} is empty: the worker "
                                 "registers its engine with the router's control-plane key", param_hint="--router-url")
    stats = asyncio.run(run_worker(cfg, url, worker_id, max_groups=max_groups, pause_marker=pause_marker,
                                   metrics_port=metrics_port, metrics_addr=metrics_addr, engine_group=engine_group,
                                   group_size=group_size, router_url=router, router_engine_url=router_engine_url))
    print(json.dumps({"worker_id": worker_id, **asdict(stats)}), flush=True)
