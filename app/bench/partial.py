"""`moerl bench rollout --partial-ab`: one rollout worker through weight updates, with and without
partial rollout (``rollout.partial_rollout``), in the same run.

    moerl bench rollout --partial-ab --config run.yaml --seconds 20 --update-every-s 2

What it does: the built-in engine (app/engine/) in this process on the run's model (its preset,
two seeds saved as two checkpoints, so each update really swaps weights), one `RolloutWorker` on
it with an in-memory buffer (`MemoryBuffer`: the run's train prompts in order, published groups
counted), and a stand-in trainer that announces a new policy version every ``--update-every-s``
seconds (the worker loads it from disk, as in store mode). Two arms of ``--seconds`` each, the
same prompts and schedule: ``partial_rollout`` off (each update waits for the worker's in-flight
requests to finish on the old weights) and on (it aborts them and resumes them on the new
weights). ``--rounds`` repeats the pair, in turn (off, on), (on, off), ..., so that a loaded
host's drift and the first arm's warm-up fall on both arms alike; the totals are over all rounds.

Figures per arm: published samples and their completion tokens per second of wall time (whole
groups: coarse when few finish in a window), tokens the engine generated per second (finished or
not; a kept prefix counts once), weight updates,
seconds the engine spent drained per update (admission stopped until the worker's requests were
done or aborted: ``WorkerStats.drained_s``), completions resumed, samples with more than one
version. Ratio: tokens/s with partial rollout over without (measured in the same run).
"""

from __future__ import annotations

import asyncio
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx
import torch
from transformers import AutoModelForCausalLM

from app.bench.results import print_notes_and_write
from app.buffer.records import Task
from app.config import RunConfig
from app.engine.load import load_checkpoint
from app.engine.scheduler import Engine
from app.engine.server import create_app
from app.envs.tasks import make_splits, make_tasks
from app.model.config import tiny_config
from app.model.tokenizer import build_tokenizer, save_tokenizer
from app.rollout.engine_client import EngineClient
from app.rollout.worker import RolloutWorker


class MemoryBuffer:
    """The `ExperienceBuffer` methods a `RolloutWorker` calls, in memory: ``tasks``
    in order (forever), published groups kept, the policy version set by the bench."""

    def __init__(self, tasks: list[Task]):
        self.tasks = tasks
        self.next = 0
        self.version = 0
        self.groups: list[tuple[Task, list]] = []

    def current_policy(self):
        return (self.version, f"memory://policy/v{self.version}")

    def lease(self, worker_id: str, count: int = 1, block_ms: int = 0, engine_version: int | None = None) -> list[Task]:
        out = []
        for _ in range(count):
            t = self.tasks[self.next % len(self.tasks)]
            out.append(Task(task_id=f"{t.task_id}-{self.next}", prompt_ids=list(t.prompt_ids), prompt=t.prompt,
                            answer=t.answer, group_size=t.group_size))
            self.next += 1
        return out

    def publish(self, task: Task, samples: list) -> bool:
        self.groups.append((task, samples))
        return True

    def release(self, tasks: list[Task]) -> None:
        pass

    def extend(self, tasks: list[Task]) -> None:
        pass

    def fail(self, tasks: list[Task]) -> list[Task]:
        return []


def make_checkpoints(cfg, out: Path) -> tuple[Path, Path]:
    """Two checkpoints of the run's preset (seeds 0 and 1) with the character tokenizer."""
    dirs = []
    for seed in (0, 1):
        d = out / f"seed{seed}"
        if not (d / "config.json").is_file():
            torch.manual_seed(seed)
            AutoModelForCausalLM.from_config(tiny_config(cfg.model.preset)).save_pretrained(d)
            save_tokenizer(d)
        dirs.append(d)
    return dirs[0], dirs[1]


async def run_arm(cfg, tasks: list[Task], ckpts: tuple[Path, Path], seconds: float, update_every_s: float,
                  partial: bool, max_batch: int) -> dict:
    """One arm: the engine, a worker, a version every ``update_every_s`` for ``seconds``."""
    cfg = cfg.model_copy(deep=True)
    cfg.rollout.partial_rollout = partial
    cfg.rollout.policy_poll_s = min(cfg.rollout.policy_poll_s, update_every_s / 4)
    cfg.rollout.drain_grace_s = 1.0  # what is in flight when the arm ends is not counted anyway
    engine = Engine(load_checkpoint(ckpts[0]), weight_version="0", max_batch=max_batch)
    await engine.start()
    buffer = MemoryBuffer(tasks)
    try:
        transport = httpx.ASGITransport(app=create_app(engine))
        async with EngineClient("http://engine", transport=transport, retries=0,
                                timeout_s=cfg.rollout.request_timeout_s) as client:
            worker = RolloutWorker(cfg, buffer, client, "bench", score_fn=lambda task, text: 0.0)
            worker.weights.download = lambda version: ckpts[version % 2]
            run = asyncio.create_task(worker.run())
            t0, tokens0 = time.perf_counter(), engine.stats.tokens
            while time.perf_counter() - t0 < seconds:
                await asyncio.sleep(min(update_every_s, seconds - (time.perf_counter() - t0)))
                if time.perf_counter() - t0 < seconds:
                    buffer.version += 1
            published_at = len(buffer.groups)
            wall = time.perf_counter() - t0
            # Tokens the engine generated in the window: answered ones plus the live rows' so far
            # (an aborted prefix is answered, and kept, once; its re-prefill generates nothing).
            generated = engine.stats.tokens - tokens0 + sum(len(row[3].token_ids) for row in engine.batch.rows)
            worker.request_stop()
            await run
    finally:
        await engine.stop()
    groups = buffer.groups[:published_at]
    samples = [s for _, ss in groups for s in ss]
    s = worker.stats
    updates = max(s.weight_updates, 1)
    return {"partial_rollout": partial, "wall_s": wall, "samples": len(samples),
            "tokens": sum(len(x.completion_ids) for x in samples), "samples_per_s": len(samples) / wall,
            "tokens_per_s": sum(len(x.completion_ids) for x in samples) / wall,
            "engine_tokens": generated, "engine_tokens_per_s": generated / wall,
            "weight_updates": s.weight_updates, "versions_announced": buffer.version,
            "drained_s_per_update": s.drained_s / updates, "partial_resumes": s.partial_resumes,
            "mixed_version_samples": sum(1 for x in samples if x.version_segments),
            "engine_errors": s.engine_errors, "weight_update_failures": s.weight_update_failures}


@dataclass
class PartialBench:
    """Inputs of the A/B (the CLI's flags)."""

    seconds: float = 20.0
    config: str = ""
    update_every_s: float = 2.0
    rounds: int = 1
    max_new_tokens: int = 0  # 0 = rollout.max_new_tokens
    max_batch: int = 64
    work_dir: str = ""  # where the two checkpoints are written ("" = a temporary directory)

    def check(self) -> None:
        """Raise ValueError naming the first bad flag."""
        for name in ("seconds", "update_every_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"--{name.replace('_', '-')} must be > 0, got {getattr(self, name)}")
        if self.rounds < 1:
            raise ValueError(f"--rounds must be >= 1, got {self.rounds}")
        if self.max_new_tokens < 0:
            raise ValueError(f"--max-new-tokens must be >= 0, got {self.max_new_tokens}")


def run(bench: PartialBench, out_dir: str = "runs/bench") -> dict:
    """Run both arms ``rounds`` times, print the figures, write the result file.

    Raises:
        ValueError: a bad flag or run config (named), or a run config that sets model.path (the
            A/B builds its checkpoints from the preset).
    """
    bench.check()
    cfg = RunConfig.load(bench.config) if bench.config else RunConfig()
    if cfg.model.path:
        raise ValueError("--partial-ab: the run config sets model.path; the A/B uses the model preset")
    if bench.max_new_tokens:
        cfg.rollout.max_new_tokens = bench.max_new_tokens
    tasks = make_tasks(make_splits(cfg.task)[0], build_tokenizer(), cfg.rollout.group_size)
    arms: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="moerl-partial-") as tmp:
        ckpts = make_checkpoints(cfg, Path(bench.work_dir or tmp))
        for k in range(bench.rounds):
            for partial in ((False, True) if k % 2 == 0 else (True, False)):  # each arm first as often
                arms.append(asyncio.run(run_arm(cfg, tasks, ckpts, bench.seconds, bench.update_every_s, partial,
                                                bench.max_batch)))

    def total(partial: bool) -> dict:
        xs = [a for a in arms if a["partial_rollout"] is partial]
        wall = sum(a["wall_s"] for a in xs)
        updates = sum(a["weight_updates"] for a in xs)
        return {"name": f"partial_rollout {'on' if partial else 'off'}", "wall_s": wall,
                "samples": sum(a["samples"] for a in xs), "tokens": sum(a["tokens"] for a in xs),
                "samples_per_s": sum(a["samples"] for a in xs) / wall, "tokens_per_s": sum(a["tokens"] for a in xs) / wall,
                "engine_tokens_per_s": sum(a["engine_tokens"] for a in xs) / wall,
                "weight_updates": updates,
                "drained_s_per_update": sum(a["drained_s_per_update"] * a["weight_updates"] for a in xs) / max(updates, 1),
                "partial_resumes": sum(a["partial_resumes"] for a in xs),
                "mixed_version_samples": sum(a["mixed_version_samples"] for a in xs),
                "engine_errors": sum(a["engine_errors"] for a in xs)}

    off, on = total(False), total(True)
    figures = [off, on, *({"name": f"round {i // 2 + 1} {'on' if a['partial_rollout'] else 'off'}", **a}
                          for i, a in enumerate(arms))]  # rounds in the order they ran
    ratios = {}
    if off["tokens_per_s"] > 0:
        ratios["tokens/s partial on / off"] = on["tokens_per_s"] / off["tokens_per_s"]
    if off["engine_tokens_per_s"] > 0:
        ratios["engine tokens/s partial on / off"] = on["engine_tokens_per_s"] / off["engine_tokens_per_s"]
    if off["drained_s_per_update"] > 0:
        ratios["drained s per update on / off"] = on["drained_s_per_update"] / off["drained_s_per_update"]
    notes = ["one worker, the built-in engine in process (CPU unless torch picks otherwise), in-memory buffer; "
             "rewards are 0 (no verifier time): the figures are generation and weight updates alone",
             "drained: seconds per update with the worker's admission stopped, until its requests were done "
             "(off) or aborted (on); the load itself is not counted"]
    if off["engine_errors"] or on["engine_errors"]:
        notes.append(f"engine errors: off {off['engine_errors']}, on {on['engine_errors']}")
    r = cfg.rollout
    shape = {**asdict(bench), "preset": cfg.model.preset, "group_size": r.group_size,
             "max_new_tokens": r.max_new_tokens, "inflight_tasks": r.inflight_tasks(), "pause_mode": r.pause_mode,
             "prompts": len(tasks), "task": cfg.task.name}
    print(f"rollout partial A/B: {cfg.model.preset}, {r.inflight_tasks()} groups of {r.group_size} in flight, "
          f"max_new_tokens {r.max_new_tokens}, a version every {bench.update_every_s:g} s, "
          f"{bench.rounds} x {bench.seconds:g} s per arm")
    print(f"{'what':<24}{'samples/s':>10}{'tokens/s':>10}{'engine tok/s':>13}{'updates':>9}{'drained s/upd':>15}"
          f"{'resumed':>9}{'mixed':>7}")
    for f in figures:
        print(f"{f['name']:<24}{f['samples_per_s']:>10.2f}{f['tokens_per_s']:>10.1f}{f['engine_tokens_per_s']:>13.1f}"
              f"{f['weight_updates']:>9}{f['drained_s_per_update']:>15.3f}{f['partial_resumes']:>9}"
              f"{f['mixed_version_samples']:>7}")
    for k, v in ratios.items():
        print(f"ratio {k}: {v:.2f}")
    return print_notes_and_write("rollout-partial", shape, figures, ratios, notes, out_dir)
