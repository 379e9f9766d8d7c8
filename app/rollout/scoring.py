"""Reward execution on the rollout worker: which reward a run scores with (`score_fn_for`: the
reward-model server or the verifier ``rollout.reward_fn``), and the pool of daemon threads that
runs it with a per-sample timeout (`RewardPool`, `score_with_timeout`)."""

from __future__ import annotations

import asyncio
import importlib
import logging
import math
import os
import queue
import sys
import threading
from typing import Callable

from app.buffer.records import Task
from app.config import RunConfig
from app.envs.reward_model import RemoteReward

log = logging.getLogger("moerl.rollout")

ScoreFn = Callable[[Task, str], float]


def score_fn_for(cfg: RunConfig) -> ScoreFn:
    """The worker's reward: the reward-model server (`moerl reward`) when ``task.reward_model``
    is set, else the verifier ``rollout.reward_fn``.

    Raises:
        ValueError: ``rollout.reward_fn`` cannot be imported.
    """
    if cfg.task.reward_model:
        return RemoteReward(cfg.rollout.reward_url, timeout_s=cfg.rollout.reward_timeout_s)
    return load_score_fn(cfg.rollout.reward_fn)


def load_score_fn(spec: str) -> ScoreFn:
    """Import ``"module:attr"``, a callable ``score(task: Task, completion: str) -> float``.

    Raises:
        ValueError: ``spec`` is not "module:attr", the module or attribute does not exist, or
            it is not callable; the message names ``rollout.reward_fn``.
    """
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise ValueError(f"rollout.reward_fn must be 'module:attr', got {spec!r}")
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.append(os.getcwd())  # as `python -m` (the workers) has it: the `moerl` script's path lacks it
    try:
        fn = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"rollout.reward_fn {spec!r} cannot be imported: {e}") from None
    if not callable(fn):
        raise ValueError(f"rollout.reward_fn {spec!r} is not callable")
    return fn


class RewardPool:
    """Daemon threads that run reward functions, shared by every sample of a worker.

    Daemon threads (not a ThreadPoolExecutor, whose threads are joined at exit) so that a reward
    function that hangs forever cannot keep the process from exiting. A timeout counts from when
    the function starts running; a thread still stuck in a timed-out call is replaced (at most
    ``4 x size`` threads in all), so hung verifiers do not starve the others.

    Args:
        size: threads running reward functions at once.
    """

    def __init__(self, size: int = 8):
        if size < 1:
            raise ValueError(f"reward pool size must be >= 1, got {size}")
        self.size = size
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._threads = 0
        self._lock = threading.Lock()
        for _ in range(size):
            self._spawn()

    def _spawn(self) -> None:
        with self._lock:
            if self._threads >= 4 * self.size:
                return
            self._threads += 1
            n = self._threads
        threading.Thread(target=self._serve, daemon=True, name=f"reward-{n}").start()

    def _serve(self) -> None:
        while True:
            self._jobs.get()()

    async def score(self, fn: ScoreFn, task: Task, completion: str, timeout_s: float) -> tuple[float, str | None]:
        """``fn(task, completion)`` on a pool thread, at most ``timeout_s`` seconds once started.

        Returns:
            (reward, problem): problem is None, "error" (raised or returned a non-finite /
            non-number value) or "timeout"; reward is 0.0 whenever problem is not None.
        """
        loop = asyncio.get_running_loop()
        started: asyncio.Future = loop.create_future()
        done: asyncio.Future = loop.create_future()

        def settle(fut: asyncio.Future, value) -> None:
            try:
                loop.call_soon_threadsafe(lambda: fut.done() or fut.set_result(value))
            except RuntimeError:
                pass  # the loop closed while a hung reward ran on: its result is not wanted

        def job() -> None:
            settle(started, True)
            try:
                value = float(fn(task, completion))
                result: tuple[float, str | None] = (value, None) if math.isfinite(value) else (0.0, "error")
            except TimeoutError as e:  # the verifier's own deadline (app/envs/process_pool.py): a timeout
                log.debug("reward timed out on %s: %s", task.task_id, e)
                result = (0.0, "timeout")
            except Exception as e:  # noqa: BLE001 - a reward that raises scores 0, counted
                log.debug("reward raised on %s: %s", task.task_id, e)
                result = (0.0, "error")
            settle(done, result)

        self._jobs.put(job)
        await started
        try:
            return await asyncio.wait_for(asyncio.shield(done), timeout_s)
        except asyncio.TimeoutError:
            self._spawn()  # that thread may never come back
            return 0.0, "timeout"


_default_pool: RewardPool | None = None


async def score_with_timeout(fn: ScoreFn, task: Task, completion: str, timeout_s: float,
                             pool: RewardPool | None = None) -> tuple[float, str | None]:
    """Score one completion on ``pool`` (default: one shared `RewardPool`); see `RewardPool.score`."""
    global _default_pool
    if pool is None:
        if _default_pool is None:
            _default_pool = RewardPool()
        pool = _default_pool
    return await pool.score(fn, task, completion, timeout_s)
