"""`moerl feed`: the prompt source of a run, and the cluster's held-out evaluator.

    moerl feed --config run.yaml [--run-dir runs/<run_id>/feed] [--engine-url http://127.0.0.1:30000]

Prompt source (`TaskFeeder`; `moerl run` uses the same class in-process): the training prompts
of the run config's task (reasoning-gym, or a JSONL file given as a path or as a ``s3://`` /
``file://`` URL read through app.storage) become GRPO tasks, queued epoch after epoch: whenever
fewer than ``feed.low_water`` wait, the next ``2 * low_water - waiting`` are added. Epoch ``k``
names its tasks ``e<k>-train-NNNNNN``, and the buffer queues a (task_id, attempt) at most once
(`ExperienceBuffer.put_tasks`), so a restarted feeder walks its sequence again from the start
and queues only what was never queued: it is safe to restart at any moment. Every id is
appended to ``<run-dir>/issued.jsonl`` before it is queued (the ledger of app/ledger.py).

The tokenizer comes from the newest policy version in the store (the trainer publishes v0 with
the tokenizer files before its first step), so ``model.path`` may be anything the trainer and
the engine load (a directory, an s3:// prefix, a Hub id).

Held-out evaluation (`HeldOutEval`, with ``--engine-url`` and ``feed.eval_every`` > 0): the
first version, then the newest one whenever it is ``eval_every`` or more versions after the last
measured (and the final one), is downloaded, loaded into the engine
(``/update_weights_from_disk``, SGLang's API) and the held-out prompts are generated through it
(``feed.eval_samples`` completions each at ``rollout.temperature``, and one greedy), scored as
rollouts are (``rollout.overlong_reward`` for a cut-off completion, the task's verifier
otherwise). One JSON line per measured version goes to ``<run-dir>/heldout.jsonl`` and stdout (the final
version's line is marked; written again, marked, if it was measured before the done marker was read).
The prompt source never waits for the engine: evaluation starts when the engine answers, and a
failed one is logged and tried again at the next poll.

Stop: when the trainer's done marker appears in the store (app/storage/done.py), the feeder
queues nothing more, measures the final version (when evaluating) and exits 0 (``--when-done
exit``), or stays up idle (``--when-done idle``: a Deployment restarts a container that exits).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import signal
import sys
import time
from pathlib import Path
from typing import Callable

import httpx
import typer

from app.buffer import ExperienceBuffer
from app.config import RunConfig, TaskConfig
from app.envs.rewards import score_answer_spec
from app.envs.tasks import make_splits, make_tasks
from app.ledger import append_issued
from app.logs import setup_logging
from app.rollout.engine_client import EngineClient, EngineError
from app.storage import open_store, read_done
from app.storage.policy import download_policy, latest_policy_version

log = logging.getLogger("moerl.feed")
cli = typer.Typer(add_completion=False, help="Queue the run's prompts; measure held-out reward.")


def resolve_task(task: TaskConfig, cache_dir: Path) -> TaskConfig:
    """``task`` with a ``jsonl_path`` URL (``s3://bucket/key``, ``file://path``) downloaded into
    ``cache_dir`` through app.storage and replaced by the local path; other tasks unchanged.

    Raises:
        FileNotFoundError: the object does not exist (names the URL).
        ValueError: a URL without an object key.
    """
    url = task.jsonl_path
    if task.source != "jsonl" or not url or "://" not in url:
        return task

    root, _, key = url.rpartition("/")
    if not key or root.endswith(":/"):
        raise ValueError(f"task.jsonl_path: {url!r} names no object (expected s3://bucket/key.jsonl)")
    local = open_store(root).get_file(key, Path(cache_dir) / "task" / key)
    return task.model_copy(update={"jsonl_path": str(local)})


class TaskFeeder:
    """Keeps the task queue topped up with training prompt groups, epoch after epoch.

    Args:
        tasks: one epoch of tasks (`app.envs.tasks.make_tasks`); epoch k queues them as
            ``e<k>-<task_id>``.
        open_buffer: returns a connected `ExperienceBuffer` (called again after a Redis error).
        low_water: add tasks when fewer than this wait; then fill up to twice this.
        ledger: ``issued.jsonl`` path (app/ledger.py), appended before each put; None: no ledger.

    Raises:
        ValueError: no tasks, or low_water < 1.
    """

    def __init__(self, tasks: list, open_buffer: Callable, low_water: int, ledger: Path | None = None):
        if not tasks:
            raise ValueError("TaskFeeder: no training tasks (task.train_size must be >= 1)")
        if low_water < 1:
            raise ValueError(f"feed.low_water must be >= 1, got {low_water}")
        self.tasks = tasks
        self.open_buffer = open_buffer
        self.low_water = low_water
        self.ledger = ledger
        self.next = 0  # index into the endless sequence of epochs
        self.buf = None

    def _task(self, k: int):
        epoch, i = divmod(k, len(self.tasks))
        return dataclasses.replace(self.tasks[i], task_id=f"e{epoch}-{self.tasks[i].task_id}")

    def top_up(self) -> int:
        """Queue tasks until at least ``2 * low_water`` wait; returns how many were added.

        Tasks the buffer already holds (queued before a restart) are skipped and the walk goes
        on, so the call adds as many new ones as are missing.

        Raises:
            redis.RedisError, ConnectionError: the buffer is unreachable (the next call reconnects).
        """
        try:
            if self.buf is None:
                self.buf = self.open_buffer()
            missing = 2 * self.low_water - self.buf.stats()["queued"]
            if missing <= self.low_water:
                return 0
            added = 0
            while added < missing:
                batch = [self._task(self.next + j) for j in range(missing - added)]
                if self.ledger is not None:
                    append_issued(self.ledger, [t.task_id for t in batch])
                added += self.buf.put_tasks(batch)
                self.next += len(batch)
            return added
        except Exception:
            self.buf = None
            raise

    def close(self) -> None:
        if self.buf is not None:
            self.buf.close()
            self.buf = None


def make_feeder(cfg: RunConfig, tokenizer_dir: Path, open_buffer: Callable, ledger: Path | None = None,
                cache_dir: Path | None = None) -> TaskFeeder:
    """The `TaskFeeder` of ``cfg``: its task's training split, tokenized with ``tokenizer_dir``."""
    # transformers: only once a feeder tokenizes; `moerl run`'s driver imports this module without it
    from app.model.tokenizer import load_tokenizer

    task = resolve_task(cfg.task, cache_dir or Path(tokenizer_dir).parent)
    train, _ = make_splits(task)
    low = cfg.feed.low_water or 4 * cfg.trainer.groups_per_step
    return TaskFeeder(make_tasks(train, load_tokenizer(tokenizer_dir), cfg.rollout.group_size),
                      open_buffer, low, ledger)


class HeldOutEval:
    """Held-out mean reward of policy versions, measured through an engine (SGLang's HTTP API).

    Args:
        cfg: the run config (``feed``, ``rollout`` sampling settings, ``run_id``).
        prompts: the held-out split (`app.envs.tasks.make_splits`).
        engine_url: the engine this evaluator owns (it loads each measured version into it).
        store: the run's object store; versions are downloaded to ``cache_dir/v<N>``.
        out: ``heldout.jsonl``; a line per version: ``{"version", "n", "samples",
            "mean_reward", "greedy", "engine_version", "eval_s", "time", "final"}``; the
            trainer's last version has a line with ``final`` true (`mark_final`).
    """

    def __init__(self, cfg: RunConfig, prompts: list, engine_url: str, store, cache_dir: Path, out: Path):
        if not prompts:
            raise ValueError("held-out evaluation: no held-out prompts (task.eval_size must be >= 1)")
        self.cfg, self.prompts, self.engine_url = cfg, prompts, engine_url
        self.store, self.cache_dir, self.out = store, Path(cache_dir), Path(out)
        self.records: dict[int, dict] = {}  # version -> its line in ``out``
        self.tokenizer = None

    @property
    def measured(self) -> set[int]:
        """The versions measured so far."""
        return set(self.records)

    def due(self, version: int, final: bool = False) -> bool:
        """Whether ``version`` is to be measured: the first version seen (v0 normally), then
        one at least ``feed.eval_every`` versions after the last measured, and the final one;
        each once."""
        every = self.cfg.feed.eval_every
        if every <= 0 or version in self.measured:
            return False
        return final or not self.measured or version >= max(self.measured) + every

    def engine_ready(self) -> bool:
        """The engine answers ``/health_generate`` now (it may still be loading its base model:
        the prompt source never waits for it)."""
        try:
            return httpx.get(self.engine_url.rstrip("/") + "/health_generate", timeout=5.0).status_code == 200
        except httpx.HTTPError:
            return False

    async def measure(self, version: int, final: bool = False) -> dict:
        """Load ``version`` into the engine and return (and record) its held-out rewards;
        ``final`` marks the trainer's last version in the record.

        Raises:
            EngineError: the engine failed, or did not load the version.
            FileNotFoundError: the version is not (or no longer) in the store.
        """
        # transformers: only once a feeder tokenizes; `moerl run`'s driver imports this module without it
        from app.model.tokenizer import load_tokenizer

        r = self.cfg.rollout
        t0 = time.time()
        path = download_policy(self.store, self.cfg.run_id, version, self.cache_dir / f"v{version}")
        if self.tokenizer is None:
            self.tokenizer = load_tokenizer(path)
        async with EngineClient(self.engine_url, timeout_s=r.request_timeout_s, retries=r.engine_retries,
                                backoff_s=r.retry_backoff_s) as engine:
            ok, message = await engine.update_weights_from_disk(str(path), version,
                                                                timeout_s=r.weight_update_timeout_s)
            if not ok:
                raise EngineError(f"engine did not load policy v{version}: {message}")
            ids = [self.tokenizer(p.text)["input_ids"] for p in self.prompts]
            sampled = await self._mean(engine, ids, self.cfg.feed.eval_samples, r.temperature)
            greedy = await self._mean(engine, ids, 1, 0.0)
            seen = await engine.weight_version()
        record = {"version": version, "n": len(self.prompts), "samples": self.cfg.feed.eval_samples,
                  "mean_reward": sampled, "greedy": greedy, "engine_version": seen,
                  "eval_s": time.time() - t0, "time": time.time(), "final": final}
        if seen != version:
            raise EngineError(f"engine reports weight version {seen} after loading v{version}")
        self.records[version] = record
        self._write(record)
        return record

    def mark_final(self, version: int) -> None:
        """Record that an already measured ``version`` is the trainer's last: the feed can
        measure it on its own schedule before it reads the done marker, and then `due` (each
        version once) would leave the run without a final line. Writes the same figures again
        with ``final`` true; nothing if ``version`` was not measured."""
        if version in self.records and not self.records[version]["final"]:
            self.records[version] = {**self.records[version], "final": True}
            self._write(self.records[version])

    def _write(self, record: dict) -> None:
        self.out.parent.mkdir(parents=True, exist_ok=True)
        with open(self.out, "a") as f:
            f.write(json.dumps(record) + "\n")
            f.flush()
            os.fsync(f.fileno())
        print(json.dumps({"heldout": record}), flush=True)

    async def _mean(self, engine, ids: list[list[int]], n: int, temperature: float) -> float:
        """Mean reward of ``n`` completions per prompt; a truncated completion earns
        ``rollout.overlong_reward`` (as in rollouts), others the task's verifier."""
        r = self.cfg.rollout
        chunk = max(1, r.inflight_tasks())
        total, count = 0.0, 0
        for start in range(0, len(ids), chunk):
            part = list(range(start, min(start + chunk, len(ids))))
            outs = await asyncio.gather(*(engine.generate(ids[i], n=n, max_new_tokens=r.max_new_tokens,
                                                          temperature=temperature, top_p=r.top_p,
                                                          return_logprob=False) for i in part))
            for i, group in zip(part, outs):
                for o in group:
                    if o.finish_reason == "length" and r.overlong_reward is not None:
                        total += r.overlong_reward
                    else:
                        total += score_answer_spec(self.prompts[i].spec, o.text)
                    count += 1
        return total / count


def check_new_or_same_run(run_dir: Path, store, run_id: str) -> None:
    """Refuse a run directory whose ``issued.jsonl`` belongs to an earlier run: the feeder
    writes its first line only after the run's policy v0 is in the store, so a non-empty
    ledger with no policy of ``run_id`` in this store is another run's (a restarted feeder of
    the same run finds its versions and appends, as it must).

    Raises:
        ValueError: naming the directory.
    """
    ledger = Path(run_dir) / "issued.jsonl"
    if ledger.is_file() and ledger.stat().st_size and latest_policy_version(store, run_id) is None:
        raise ValueError(f"--run-dir {run_dir}: its issued.jsonl is an earlier run's (this store has no policy "
                         f"of run {run_id!r} yet); give a new run a new --run-dir")


def wait_for_policy(store, run_id: str, stop: Callable[[], bool], poll_s: float) -> int | None:
    """Block until the store holds a policy version (the trainer's v0); None if stopped first."""
    while not stop():
        version = latest_policy_version(store, run_id)
        if version is not None:
            return version
        time.sleep(poll_s)
    return None


def run_feed(cfg: RunConfig, run_dir: Path, engine_url: str | None = None, when_done: str = "exit",
             stop: Callable[[], bool] = lambda: False) -> dict:
    """The `moerl feed` loop (module docstring); returns ``{"queued", "measured", "done"}``.

    Raises:
        ValueError, FileNotFoundError: bad task settings or dataset (named).
        BufferConnectionError: Redis unreachable at start.
    """
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    store = open_store(cfg.store_url)
    ExperienceBuffer.from_config(cfg).close()  # fail now, with the URL, if Redis is unreachable
    check_new_or_same_run(run_dir, store, cfg.run_id)
    first = wait_for_policy(store, cfg.run_id, stop, cfg.feed.poll_s)
    if first is None:
        return {"queued": 0, "measured": [], "done": False}
    tok_dir = download_policy(store, cfg.run_id, first, run_dir / "policy" / f"v{first}")
    feeder = make_feeder(cfg, tok_dir, lambda: ExperienceBuffer.from_config(cfg), run_dir / "issued.jsonl",
                         cache_dir=run_dir)
    evaluator = None
    if engine_url and cfg.feed.eval_every > 0:
        _, heldout = make_splits(resolve_task(cfg.task, run_dir))
        evaluator = HeldOutEval(cfg, heldout, engine_url, store, run_dir / "policy", run_dir / "heldout.jsonl")
    queued, done = 0, None
    log.info("feeding %d training prompts per epoch (low water %d)", len(feeder.tasks), feeder.low_water)
    try:
        while not stop():
            done = read_done(store, cfg.run_id)
            if done is not None:
                break
            try:
                queued += feeder.top_up()
            except Exception as e:  # Redis restarting: keep the role up, retry next round
                log.warning("could not top up the task queue: %s", e)
            if evaluator is not None:
                newest = _latest(store, cfg.run_id)
                if newest is not None and evaluator.due(newest) and evaluator.engine_ready():
                    _measure(evaluator, newest)
            time.sleep(cfg.feed.poll_s)
    finally:
        feeder.close()
    if done is not None:
        log.info("trainer done at step %d (policy v%d); %d tasks queued by this process",
                 done["step"], done["policy_version"], queued)
        final = done["policy_version"]
        if evaluator is not None:
            evaluator.mark_final(final)  # measured as a periodic version before the marker was read
        deadline = time.monotonic() + cfg.rollout.weight_update_timeout_s
        while evaluator is not None and evaluator.due(final, final=True) and time.monotonic() < deadline and not stop():
            if evaluator.engine_ready():
                _measure(evaluator, final, final=True)
            else:
                time.sleep(cfg.feed.poll_s)
        if when_done == "idle":
            while not stop():
                time.sleep(cfg.feed.poll_s)
    return {"queued": queued, "measured": sorted(evaluator.measured) if evaluator else [], "done": done is not None}


def _latest(store, run_id: str) -> int | None:
    try:
        return latest_policy_version(store, run_id)
    except OSError as e:
        log.warning("could not read the newest policy version: %s", e)
        return None


def _measure(evaluator: HeldOutEval, version: int, final: bool = False) -> None:
    """One evaluation; a failure is logged and retried at the next version due (never fatal:
    the prompt source must keep going)."""
    try:
        asyncio.run(evaluator.measure(version, final))
    except Exception as e:
        log.warning("held-out evaluation of v%d failed: %s", version, e)


@cli.command()
def feed(
    config: Path = typer.Option(..., "--config", exists=True, dir_okay=False, help="Run config YAML."),
    run_dir: Path = typer.Option(None, "--run-dir", help="issued.jsonl, heldout.jsonl, caches "
                                 "(default runs/<run_id>/feed)."),
    engine_url: str = typer.Option(None, "--engine-url", help="Engine for held-out evaluation "
                                   "(feed.eval_every > 0); none: no evaluation."),
    when_done: str = typer.Option("exit", "--when-done", help="exit | idle, once the trainer is done."),
) -> None:
    """Queue the run's prompts until the trainer is done; measure held-out reward on the way."""
    if when_done not in ("exit", "idle"):
        raise typer.BadParameter(f"{when_done!r}: must be 'exit' or 'idle'", param_hint="--when-done")

    setup_logging("%(asctime)s feed %(message)s")
    cfg = RunConfig.load(config)
    run_dir = run_dir or Path("runs") / cfg.run_id / "feed"
    stopping = []

    def on_signal(signum, frame):
        stopping.append(signum)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    result = run_feed(cfg, run_dir, engine_url, when_done, stop=lambda: bool(stopping))
    typer.echo(json.dumps({"feed": result}))
