"""`moerl bench loop`: the embedded asynchronous loop against TRL's GRPOTrainer, equal wall-clock.

One invocation on this machine runs, one after the other:

1. **moerl**: `moerl run` (app/local/run.py, app/local/embedded.py) on its embedded default,
   another preset (``--task``) or a config (``--config``), laid out over this machine as `moerl
   run` lays it out (app/local/machine.py): redis-server, the trainer gang (torchrun), W engines
   and W rollout workers as separate processes, for ``seconds`` of training wall-clock;
2. **trl**: ``trl.GRPOTrainer`` (synchronous: generate, score, train, in turn, in one process)
   for the same ``seconds``, stopped by a ``TrainerCallback`` at the deadline;

then prints, for both, samples and completion tokens trained per second and the held-out mean
reward reached (the evaluator of app/envs/evaluate.py on the same held-out prompts, with the same
seed, on the final policy saved as an HF checkpoint and loaded with stock transformers), and
their ratios, and writes a result file (app/bench/results.py, benchmark "loop").

``--device cpu`` (the default) runs both legs on the CPU (moerl's CPU layout, the GPUs hidden
from its trainer). ``--device cuda`` runs both on this machine's GPUs: moerl's GPU layout (one
trainer rank per trainer GPU, engines on the GPUs, bf16 compute over fp32 master weights, the
weight push) and TRL on GPU 0 (fp32 parameters, bf16 autocast). Each leg then also reports the
GPU's utilisation and peak memory used (app/bench/gpu.py: nvidia-smi, else pynvml; every process
on the GPU) and, for TRL, torch's peak allocated memory. Where each leg's time goes
(``time_split``, shares of its window): moerl's trainer in its steps, weight updates (push and
store), saves and idle (metrics.jsonl), and its engines generating, paused for a weight update
or idle (each engine's /server_info sampled twice a second); TRL's generation
(``GRPOTrainer._generate`` timed), the rest of its steps (scoring, loss, backward, optimizer)
and the time between steps.

How the comparison is kept fair:

* same start: both legs start from the same warm-up checkpoint (``moerl warmup``, cached by
  recipe like `moerl run` does); TRL loads it with ``AutoModelForCausalLM.from_pretrained``;
* same data and reward: the training prompts of ``make_splits(cfg.task)`` (plain-text prompts,
  tokenized by the same tokenizer with ``<bos>``), scored as the rollout worker scores them:
  ``app.envs.rewards`` on the decoded completion, and ``rollout.overlong_reward`` for one cut
  at max new tokens (without it TRL's policy learns to stop emitting ``<eos>``: run-on text
  earns partial credit from spell_backward's verifier, and held-out reward, where an unfinished
  answer scores 0, falls);
* same GRPO recipe: group size G (``num_generations``), ``groups_per_step * G`` completions per
  optimizer step and one optimizer step per batch (``num_iterations=1``), temperature, top-p,
  max new tokens, group advantages (r - mean) / (std + 1e-4) (``scale_rewards="group"``),
  clipped ratio with eps 0.2 / 0.28, token-mean loss over the whole batch (TRL's ``"dapo"``),
  no KL term (``beta=0``), no router aux loss, grad clip, and the SAME optimizer: torch AdamW
  with the trainer's betas and weight decay and the trainer's lr schedule (linear warm-up
  ``min(1, (step+1)/lr_warmup_steps)``, then constant), handed to TRL through ``optimizers``;
* same CPU budget: both use all of the machine's cores. moerl's roles get the threads `moerl
  run` gives them on this machine (app/local/machine.py); TRL runs in one process with
  ``torch.set_num_threads(cores)``;
* same clock: the moerl window opens when the rollout workers start (the trainer has already
  published v0 and the engines are healthy: process start-up and model loading are reported
  apart as ``setup_s``) and closes when the trainer's step in flight at the deadline has
  finished (SIGTERM: the trainer finishes its step, publishes, exits). The TRL window opens at
  ``on_train_begin`` (model already loaded) and closes at the end of the step in flight at the
  deadline. Either leg makes at least one step. Samples/s = samples trained in the window /
  the window's length;
* same CPU accounting: the machine may be shared, and other tenants can leave the two legs
  unequal shares of the cores (six single-thread processes get more of a busy machine than one
  process with two threads). So each leg also reports the CPU seconds it used in its window
  (moerl: every role process and its children plus redis-server, psutil, up to the stop
  signal; TRL: ``time.process_time()``), the cores it actually got, and samples per CPU-second.

* same machine state, measured: the legs run ``rounds`` times in the order moerl, trl, trl,
  moerl, ... (ABBA: each system goes first as often as second, so a trend in the machine's load
  favours neither), and each leg records the 1-minute load average before and during it and the
  CPU time everything else on the machine used meanwhile (app/bench/machine.py). A leg where the
  others used more than ``QUIET_SHARE`` (10 %) of the cores is marked ``quiet: false``, and the
  benchmark prints a warning: its figures say how the two systems share a busy machine, not how
  fast they are. ``--wait-quiet S`` waits up to S seconds before each leg for a quiet 10 s.
  Ratios are of each system's means over its legs (and per round).

Differences that remain, by design of each system: moerl generates with its own engine
(continuous batching over HTTP) while the trainer trains (rollouts at most
``buffer.max_staleness`` versions behind, with truncated importance sampling against the
engine's logprobs); TRL generates with ``model.generate`` on the training model between steps,
always on-policy.

``--profile`` also runs py-spy on every role process of the first moerl leg and splits the
loop's CPU per step over activities (app/bench/loop_profile.py); py-spy takes CPU itself, so a
profiled leg's throughput is marked ``profiled`` and is not one to quote.
"""

from __future__ import annotations

import math
import os
import statistics
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx
import torch
from rich.console import Console
from transformers import AutoModelForCausalLM, PrinterCallback, TrainerCallback
from transformers.utils import logging as hf_logging

from app.bench.gpu import GpuMonitor
from app.bench.loop_profile import LoopProfiler, per_step_table
from app.bench.machine import QUIET_SHARE, LoadMonitor, LoadWindow, wait_quiet
from app.bench.results import check_out_dir, write_result
from app.config import RunConfig
from app.envs.rewards import score_answer_spec
from app.envs.tasks import make_splits
from app.feed import make_feeder
from app.local.embedded import EmbeddedLoop, RoleFailed
from app.local.machine import Machine, detect_machine, plan_run
from app.local.run import TASKS, held_out_reward, latest_local_policy, start_from_base, task_preset
from app.model.tokenizer import load_tokenizer, save_tokenizer
from app.storage import open_store
from app.storage.policy import latest_policy_version

console = Console(soft_wrap=True)  # table rows stay one line each when piped


@dataclass
class LoopBench:
    """Inputs of `moerl bench loop` (recorded as the result's ``shape``).

    Attributes:
        seconds: training wall-clock of each leg, seconds (> 0).
        workers: rollout workers of the moerl leg (one engine each); None: sized from the machine
            as `moerl run` sizes them (app/local/machine.py).
        config: run config YAML (default: `moerl run`'s ``embedded_default()``).
        task: one of `moerl run --task`'s presets instead of ``config`` (e.g. ``gpu``).
        device: ``cpu`` (both legs on the CPU, GPUs hidden from moerl's roles) or ``cuda`` (both
            on this machine's GPUs: moerl's layout of `moerl run`, TRL on GPU 0).
        cache: warm-up checkpoint cache directory (shared with `moerl run`).
        work_dir: where both legs' run directories go (default ``<out_dir>/loop-<UTC time>``).
        max_steps: trainer step cap of both legs (0: ``max(100, 200 * seconds)``, far above what
            either leg reaches on a CPU, so the deadline ends a leg); a leg that hits the cap
            says so in the result.
        rounds: how many times each leg runs, in the order of `leg_order`.
        wait_quiet_s: before each leg, wait up to this many seconds for a quiet machine (0: no).
        profile: py-spy breakdown of the first moerl leg (app/bench/loop_profile.py).
    """

    seconds: float = 180.0
    workers: int | None = None
    config: str = ""
    task: str = ""
    device: str = "cpu"
    cache: str = "runs/cache"
    work_dir: str = ""
    max_steps: int = 0
    rounds: int = 2
    wait_quiet_s: float = 0.0
    profile: bool = False

    def validate(self) -> None:
        """Raises ValueError naming the flag if an input is out of range or missing."""
        if not (self.seconds > 0 and math.isfinite(self.seconds)):
            raise ValueError(f"--seconds must be a positive number, got {self.seconds}")
        if self.workers is not None and self.workers < 1:
            raise ValueError(f"--workers must be >= 1, got {self.workers}")
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"--device must be cpu or cuda, got {self.device!r}")
        if self.task and self.config:
            raise ValueError("--task: give --config or --task, not both")

        if self.task and self.task not in TASKS:
            raise ValueError(f"--task: {self.task!r} is not one of {', '.join(TASKS)}")
        if self.max_steps < 0:
            raise ValueError(f"--max-steps must be >= 0, got {self.max_steps}")
        if self.config and not Path(self.config).is_file():
            raise ValueError(f"--config: {self.config} is not a file")
        if self.work_dir and Path(self.work_dir).exists() and not Path(self.work_dir).is_dir():
            raise ValueError(f"--work-dir: {self.work_dir} is not a directory")
        if self.rounds < 1:
            raise ValueError(f"--rounds must be >= 1, got {self.rounds}")
        if not (self.wait_quiet_s >= 0 and math.isfinite(self.wait_quiet_s)):
            raise ValueError(f"--wait-quiet must be a number >= 0, got {self.wait_quiet_s}")

    def step_cap(self) -> int:
        # Small test configs make TRL take over 20 steps/s on an idle machine: keep the cap well
        # clear of any real rate so the comparison is by wall-clock.
        return self.max_steps or max(100, int(200 * self.seconds))


def cores() -> int:
    """CPU cores this process may use (the budget both legs share)."""
    return len(os.sched_getaffinity(0))


def load_config(bench: LoopBench):
    """The run config of both legs, before the machine's layout: ``--config``, or `moerl run`'s
    preset (``--task``, default the embedded default).

    Raises:
        ValueError: the config file is invalid (the message names the file and field).
    """
    cfg = RunConfig.load(bench.config) if bench.config else task_preset(bench.task or "spell_backward")
    cfg.trainer.steps = bench.step_cap()
    return cfg


def plan_legs(bench: LoopBench, cfg):
    """The moerl leg's layout on this machine (app/local/machine.py, as `moerl run` lays it out)
    and the config both legs run (a preset's batch, dtype and weight sync follow the machine).

    Raises:
        ValueError: ``--device cuda`` without a GPU, or a layout that cannot work (one line).
    """
    found = detect_machine()
    if bench.device == "cuda" and found.gpus == 0:
        raise ValueError("--device cuda: torch sees no GPU on this machine")
    machine = found if bench.device == "cuda" else Machine(cores=found.cores, gpus=0)
    return plan_run(cfg, preset=not bench.config, workers=bench.workers, machine=machine)


def load_now() -> float:
    """1-minute load average (how busy the shared machine was)."""
    return os.getloadavg()[0]


def tree_cpu_s(pids: list[int]) -> float:
    """CPU seconds (user + system) used so far by the processes ``pids`` and all their live
    descendants (psutil). A process that is gone counts 0."""
    # psutil: the bench extra (pyproject.toml)
    import psutil

    total = 0.0
    for pid in pids:
        try:
            root = psutil.Process(pid)
            procs = [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            continue
        for proc in procs:
            try:
                t = proc.cpu_times()
            except psutil.NoSuchProcess:
                continue
            total += t.user + t.system
    return total


def leg_figures(name: str, steps: int, samples: int, window_s: float, setup_s: float, after: dict,
                before: dict, cap_hit: bool, cpu: tuple[int, float, float], extra: dict, tokens: float) -> dict:
    """One result row: throughput and the held-out reward reached (units in the key names).

    ``cpu`` is (samples trained, CPU seconds, wall seconds) over the part of the window where
    CPU time was measured: on a shared machine samples per CPU-second compares the two systems'
    efficiency even when the other tenants leave them unequal shares of the cores. ``tokens``:
    completion tokens of the samples trained.
    """
    cpu_samples, cpu_s, cpu_wall_s = cpu
    return {
        "name": name,
        "steps": steps,
        "samples_trained": samples,
        "train_window_s": round(window_s, 2),
        "samples_per_s": samples / window_s if window_s > 0 else float("nan"),
        "tokens_per_s": tokens / window_s if window_s > 0 else float("nan"),
        "cpu_s": round(cpu_s, 2),
        "cores_used": cpu_s / cpu_wall_s if cpu_wall_s > 0 else float("nan"),
        "samples_per_cpu_s": cpu_samples / cpu_s if cpu_s > 0 else float("nan"),
        "setup_s": round(setup_s, 2),
        "heldout_reward_after": after["mean_reward"],
        "heldout_greedy_after": after["greedy"],
        "gain_points": 100 * (after["mean_reward"] - before["mean_reward"]),
        "step_cap_hit": cap_hit,
        **extra,
    }


# -- leg 1: the embedded moerl loop ------------------------------------------------------------


def wait_initial_policy(loop, timeout_s: float = 600.0) -> None:
    """Block until the trainer has published policy v0 (it is then waiting for groups).

    Raises:
        RoleFailed: the trainer exited or published nothing within ``timeout_s``.
    """
    store = open_store(loop.cfg.store_url)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        loop.check_roles(restart_rollout=False)
        trainer = loop.sup.procs["trainer"]
        if not trainer.alive():
            raise RoleFailed(f"trainer exited with {trainer.returncode()} before publishing v0:\n{trainer.tail(30)}")
        if latest_policy_version(store, loop.cfg.run_id) is not None:
            return
        time.sleep(0.5)
    raise RoleFailed(f"trainer published no policy v0 within {timeout_s:.0f}s")


def role_pids(loop) -> dict[str, int]:
    """Role name -> pid of every live role process of ``loop`` that runs Python: the trainer's
    ranks (torchrun's children, ``trainer-rank<i>`` in start order), ``engine-<i>``, ``worker-<i>``."""
    # psutil: the bench extra (pyproject.toml)
    import psutil

    out = {}
    for name, proc in loop.sup.procs.items():
        if not proc.alive():
            continue
        if name == "trainer":
            try:
                ranks = [c for c in psutil.Process(proc.pid).children(recursive=True)
                         if "train" in c.cmdline() and "torch.distributed.run" not in " ".join(c.cmdline())]
            except psutil.Error:
                ranks = []
            for i, c in enumerate(sorted(ranks, key=lambda c: c.create_time())):
                out[f"trainer-rank{i}"] = c.pid
        elif name.startswith(("engine-", "worker-")):
            out[name] = proc.pid
    return out


def phase_medians(records: list[dict]) -> dict:
    """Median seconds per trainer step of each phase in metrics.jsonl (wait for groups, step,
    publish, save) and of the whole step-to-step interval."""
    out = {}
    for k in ("wait_s", "step_s", "publish_s", "save_s"):
        vals = [r[k] for r in records if r.get(k) is not None]
        out[k] = round(statistics.median(vals), 4) if vals else float("nan")
    times = [r["time"] for r in records]
    gaps = [b - a for a, b in zip(times, times[1:])]
    out["interval_s"] = round(statistics.median(gaps), 4) if gaps else float("nan")
    return out


def trainer_split(records: list[dict], window_s: float) -> dict:
    """Shares of the window the trainer spent in its steps (forward, backward, optimizer), on
    weight updates (the push to the engines and the store's copies), on saves, and the rest
    (waiting for groups, reading them: idle for its GPU)."""
    if window_s <= 0:
        return {}
    total = {k: sum(r.get(k) or 0.0 for r in records) for k in ("step_s", "push_s", "publish_s", "save_s")}
    split = {"train_step": total["step_s"] / window_s,
             "weight_update": (total["push_s"] + total["publish_s"]) / window_s,
             "save": total["save_s"] / window_s}
    split["idle"] = max(0.0, 1.0 - sum(split.values()))
    return {k: round(v, 4) for k, v in split.items()}


class EngineSampler:
    """Where the engines' time goes: each engine's ``/server_info`` (app/engine/server.py) every
    ``period_s``, counted as generating (sequences running), weight update (paused) or idle;
    shares over every engine and sample. An engine that does not answer (or answers without
    those fields, as SGLang's) counts as ``unknown``."""

    def __init__(self, urls: list[str], period_s: float = 0.5):
        self.urls = urls
        self.period_s = period_s
        self.counts = {"generating": 0, "weight_update": 0, "idle": 0, "unknown": 0}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="engine-sampler", daemon=True)

    def start(self) -> "EngineSampler":
        self._thread.start()
        return self

    def _run(self) -> None:
        with httpx.Client(timeout=2.0) as client:
            while not self._stop.wait(self.period_s):
                for url in self.urls:
                    try:
                        info = client.get(url + "/server_info").json()
                    except (httpx.HTTPError, ValueError):
                        info = {}
                    self.counts[engine_state(info)] += 1

    def stop(self) -> dict:
        self._stop.set()
        self._thread.join(timeout=10)
        n = sum(self.counts.values())
        if not n:
            return {"samples": 0}
        return {**{k: round(v / n, 4) for k, v in self.counts.items()}, "samples": n}


def engine_state(info: dict) -> str:
    """One engine's state in a ``/server_info`` answer (`EngineSampler`)."""
    if "paused" not in info or "running" not in info:
        return "unknown"
    if info["paused"]:
        return "weight_update"
    return "generating" if info["running"] or info.get("waiting") else "idle"


def run_moerl(loop, feeder, base: Path, seconds: float, before: dict, profile_dir: Path | None = None) -> dict:
    """Run the embedded loop for ``seconds`` of training wall-clock; returns its result row.

    ``loop`` is an `EmbeddedLoop` whose redis-server runs; ``feeder`` (app/feed.py `TaskFeeder`)
    keeps its task queue topped up, as in `moerl run`. The row's CPU time counts every role
    process with its children, redis-server, and this process (the supervisor and the feeder,
    the part `moerl run` itself plays). With ``profile_dir``, py-spy profiles the window and the
    row gets a ``profile`` (see `profile_summary`).

    Raises:
        RoleFailed: a role failed (the message carries its log tail).
    """
    t_setup = time.monotonic()
    loop.start_trainer()
    wait_initial_policy(loop)
    loop.start_rollout(base)
    setup_s = time.monotonic() - t_setup
    pids = [p.pid for p in loop.sup.procs.values() if p.alive()] + [loop.redis.proc.pid]
    profiler = None
    if profile_dir is not None:
        profiler = LoopProfiler(role_pids(loop), profile_dir)
        # py-spy starts once every role has settled (first imports, first reward call, first
        # weight load): a quarter of the window, at most 20 s.
        profile_at = time.time() + min(seconds / 4, 20.0)
        redis_cpu0 = self_cpu0 = 0.0

    def spy_pids() -> set[int]:
        return {p.pid for p in profiler.procs.values()} if profiler else set()  # empty until it starts

    def own_cpu() -> float:  # the leg's processes (py-spy too, so that it does not count as a tenant)
        return tree_cpu_s(pids + sorted(spy_pids())) + time.process_time()

    def own_pids() -> set[int]:
        # psutil: the bench extra (pyproject.toml)
        import psutil

        found = set(pids) | spy_pids()
        for pid in list(found):
            try:
                found |= {c.pid for c in psutil.Process(pid).children(recursive=True)}
            except psutil.Error:
                pass
        return found

    monitor = LoadMonitor(own_cpu, own_pids).start()
    gpu = GpuMonitor().start()
    engines = EngineSampler([loop.engine_url(i) for i in range(loop.workers)]).start()
    cpu0 = tree_cpu_s(pids) + time.process_time()
    t0 = time.time()
    deadline = t0 + seconds
    last_print = t0
    records: list[dict] = []
    # Until the deadline, and at least one step (the TRL leg always makes one too).
    profile_t0 = None
    while not loop.trainer_done():
        loop.check_roles()
        feeder.top_up()
        now = time.time()
        if profiler is not None and profile_t0 is None and now >= profile_at:
            profiler.start()
            profile_t0, redis_cpu0, self_cpu0 = now, tree_cpu_s([loop.redis.proc.pid]), time.process_time()
        if now >= deadline:
            records = loop.metrics()
            if records or now > deadline + loop.cfg.trainer.batch_timeout_s:
                break
        if now - last_print >= 15:
            records = loop.metrics()
            step = records[-1]["step"] if records else 0
            console.print(f"  moerl: {now - t0:5.0f}s  step {step}")
            last_print = now
        time.sleep(0.5)
    # CPU is measured up to the stop signal, over the steps recorded by then.
    cpu_s, cpu_wall_s, records = tree_cpu_s(pids) + time.process_time() - cpu0, time.time() - t0, loop.metrics()
    load = monitor.stop()
    engine_split = engines.stop()
    profile = None
    if profile_t0 is not None:
        extra_cpu = {"redis-server": tree_cpu_s([loop.redis.proc.pid]) - redis_cpu0,
                     "bench process (supervisor, feeder, load monitor)": time.process_time() - self_cpu0}
        profile = profile_summary(profiler.stop(), extra_cpu, [r for r in records if r["time"] >= profile_t0],
                                  time.time() - profile_t0)
    cpu = (records[-1]["samples_total"] if records else 0, cpu_s, cpu_wall_s)
    # SIGTERM: every rank finishes its step in flight, publishes it, and exits.
    code = loop.sup.procs["trainer"].stop(grace_s=loop.cfg.trainer.batch_timeout_s)
    gpu_window = gpu.stop()
    loop.stop_rollout()
    records = loop.metrics()
    if not records:
        raise RoleFailed(f"the trainer made no step (exit code {code}):\n{loop.sup.procs['trainer'].tail(30)}")
    last = records[-1]
    after = held_out_reward(loop.cfg, latest_local_policy(loop))
    tail = [r["reward_mean"] for r in records[-10:] if r.get("reward_mean") is not None]
    extra = {
        "policy_version": last["policy_version"],
        "train_reward_last10": sum(tail) / len(tail) if tail else float("nan"),
        "staleness_mean": sum(r.get("staleness_mean", 0.0) for r in records) / len(records),
        "overstale_dropped": last.get("overstale_dropped", 0),
        "dropped_stale_in_buffer": last.get("buffer", {}).get("dropped_stale", 0),
        "trainer_median_s": phase_medians([r for r in records if r["time"] >= t0]),
        "time_split": {"trainer": trainer_split(records, last["time"] - t0), "engines": engine_split},
        "gpu": gpu_window.as_dict(),
        "load": load.as_dict(),
        "quiet": load.quiet,
        "profiled": profile is not None,
    }
    if profile is not None:
        extra["profile"] = profile
    tokens = sum(r.get("completion_len_mean", 0.0) * r.get("samples", 0) for r in records)
    return leg_figures("moerl", last["step"], last["samples_total"], last["time"] - t0, setup_s, after,
                       before, last["step"] >= loop.cfg.trainer.steps, cpu, extra, tokens)


def profile_summary(profiles, extra_cpu_s: dict[str, float], records: list[dict], window_s: float) -> dict:
    """The ``profile`` of a result row: CPU ms per trainer step per role and activity (both
    engines, both workers and both ranks summed; ``extra_cpu_s``: CPU-only processes), each role
    process's split, and the window."""
    steps = len(records)
    return {
        "steps": steps,
        "window_s": round(window_s, 2),
        "per_step": per_step_table(profiles, extra_cpu_s, steps),
        "roles": [asdict(p) for p in profiles],
    }


# -- leg 2: TRL's GRPOTrainer ------------------------------------------------------------------


def trl_reward_fn(eos_ids: list[int], overlong_reward: float | None):
    """The TRL reward function of the recipe, scored as the rollout worker scores.

    TRL calls it with lists (``reward_funcs`` signature): ``prompts``, ``completions`` (decoded
    without special tokens), ``completion_ids`` (cut after the first EOS, which they keep), and
    the dataset's extra columns (here ``spec``, the JSON a rollout Task carries). A completion
    that never reached EOS was cut at max new tokens: like the worker (``finish_reason ==
    "length"``) it gets ``rollout.overlong_reward`` instead of the verifier's partial credit
    (unless that is None); every other one gets ``app.envs.rewards`` on its text.
    """
    stops = set(eos_ids)

    def reward(prompts, completions, completion_ids, spec, **kwargs) -> list[float]:
        out = []
        for text, ids, answer in zip(completions, completion_ids, spec):
            cut = not stops.intersection(ids)
            out.append(overlong_reward if cut and overlong_reward is not None else score_answer_spec(answer, text))
        return out

    return reward


def grpo_args(cfg, out_dir: Path, max_steps: int, device: str = "cpu"):
    """``trl.GRPOConfig`` of `grpo_kwargs` (TRL checks them: bf16 on ``cuda`` needs the GPU).

    Raises:
        ValueError: see `grpo_kwargs`; TRL refuses the arguments on this machine.
    """
    # trl: the bench extra, for TRL's leg only
    from trl import GRPOConfig

    return GRPOConfig(**grpo_kwargs(cfg, out_dir, max_steps, device))


def grpo_kwargs(cfg, out_dir: Path, max_steps: int, device: str = "cpu") -> dict:
    """``trl.GRPOConfig``'s arguments mirroring ``cfg``'s GRPO recipe (see the module docstring),
    on ``device`` (cpu, or cuda: accelerate's first GPU); ``model.dtype`` bfloat16 is autocast
    (``bf16``) over fp32 parameters, as moerl's fp32 master weights.

    Raises:
        ValueError: the recipe has no TRL equivalent here (sequence-mean loss, KL, a PPO trainer,
            an objective other than plain token-mean GRPO with one optimizer step a batch:
            app/config.py TrainerConfig.objective).
    """
    t, r = cfg.trainer, cfg.rollout
    if t.algorithm != "grpo" or t.kl_coef > 0 or t.objective() != "grpo+agg=token-mean":
        raise ValueError("bench loop compares the token-mean GRPO recipe without KL "
                         f"(trainer.algorithm={t.algorithm}, kl_coef={t.kl_coef}, loss_agg={t.loss_agg}, "
                         f"objective={t.objective()})")
    return dict(
        output_dir=str(out_dir),
        per_device_train_batch_size=t.groups_per_step * r.group_size,
        gradient_accumulation_steps=1,
        num_generations=r.group_size,
        num_iterations=1,
        max_completion_length=r.max_new_tokens,
        temperature=r.temperature,
        top_p=r.top_p,
        top_k=0,
        beta=0.0,
        epsilon=t.clip_eps_low,
        epsilon_high=t.clip_eps_high,
        loss_type="dapo",
        scale_rewards="group" if t.scale_by_std else "none",
        router_aux_loss_coef=0.0,
        learning_rate=t.lr,
        max_grad_norm=t.grad_clip,
        max_steps=max_steps,
        use_vllm=False,
        use_cpu=device == "cpu",
        bf16=cfg.model.dtype == "bfloat16",
        gradient_checkpointing=False,
        report_to="none",
        logging_steps=1,
        save_strategy="no",
        disable_tqdm=True,
        seed=cfg.task.seed,
        dataloader_num_workers=0,
    )


def run_trl(cfg, base: Path, out_dir: Path, seconds: float, before: dict, device: str = "cpu") -> dict:
    """Train ``base`` with TRL's GRPOTrainer for ``seconds`` on ``device``; returns its result row.

    The final model is saved to ``out_dir/final`` (HF checkpoint + tokenizer) and evaluated
    from there with the same code as the moerl leg. Where its time goes: TRL's own generation
    (``GRPOTrainer._generate``, timed around each call), the rest of each step (scoring, the
    loss's forward and backward, the optimizer), no weight update (one model), and the time
    between steps.
    """
    # datasets and trl: the bench extra, for TRL's leg only
    from datasets import Dataset
    from trl import GRPOTrainer

    t = cfg.trainer
    batch = t.groups_per_step * cfg.rollout.group_size

    class Deadline(TrainerCallback):
        """Stops training at the end of the first step that ends past the deadline."""

        t0 = end = cpu0 = cpu = step0 = 0.0
        last_print = steps_s = 0.0
        monitor = load = gpu = gpu_window = None

        def on_train_begin(self, args, state, control, **kwargs):
            self.t0 = self.last_print = time.time()
            self.cpu0 = time.process_time()  # every thread of this process
            self.monitor = LoadMonitor(time.process_time).start()
            self.gpu = GpuMonitor().start()
            if device == "cuda":
                torch.cuda.reset_peak_memory_stats()

        def on_step_begin(self, args, state, control, **kwargs):
            self.step0 = time.time()

        def on_step_end(self, args, state, control, **kwargs):
            self.end = now = time.time()
            self.steps_s += now - self.step0
            self.cpu = time.process_time() - self.cpu0
            if now - self.t0 >= seconds or state.global_step >= args.max_steps:
                control.should_training_stop = True
                self.load = self.load or self.monitor.stop()
                self.gpu_window = self.gpu_window or self.gpu.stop()
            if now - self.last_print >= 15:
                console.print(f"  trl:   {now - self.t0:5.0f}s  step {state.global_step}")
                self.last_print = now

    t_setup = time.monotonic()
    torch.set_num_threads(cores())
    train, _ = make_splits(cfg.task)
    dataset = Dataset.from_list([{"prompt": p.text, "spec": p.spec} for p in train])
    # fp32 master weights; the same layers as moerl's leg, no Hub kernels (app/engine/load.py)
    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32, use_kernels=False)
    if device == "cuda":  # before the optimizer is made over its parameters
        model = model.to("cuda")
    tokenizer = load_tokenizer(base)
    # The trainer's optimizer and lr schedule exactly (app/trainer/train.py: AdamW, step_lr).
    opt = torch.optim.AdamW(model.parameters(), lr=t.lr, betas=t.adam_betas, weight_decay=t.weight_decay)
    warm = max(t.lr_warmup_steps, 1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warm))
    deadline = Deadline()
    eos = model.generation_config.eos_token_id
    eos_ids = [tokenizer.eos_token_id, *(eos if isinstance(eos, list) else [eos] if eos is not None else [])]
    reward = trl_reward_fn(eos_ids, cfg.rollout.overlong_reward)
    reward.__name__ = "reward"  # TRL names its reward metrics after the function
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=grpo_args(cfg, out_dir, t.steps, device),
                          train_dataset=dataset, processing_class=tokenizer, optimizers=(opt, sched),
                          callbacks=[deadline])
    trainer.remove_callback(PrinterCallback)  # one dict per step is too much on a terminal
    generate_s = timed(trainer, "_generate")
    setup_s = time.monotonic() - t_setup
    trainer.train()
    load = deadline.load or deadline.monitor.stop()
    gpu_window = deadline.gpu_window or deadline.gpu.stop()
    steps = trainer.state.global_step
    final = out_dir / "final"
    trainer.model.save_pretrained(str(final))
    save_tokenizer(final, tokenizer)
    after = held_out_reward(cfg, final)
    logs = [h["reward"] for h in trainer.state.log_history if "reward" in h]
    tail = logs[-10:]
    window = deadline.end - deadline.t0
    generation = sum(generate_s)
    split = {"generation": generation / window, "train_step": (deadline.steps_s - generation) / window,
             "weight_update": 0.0, "idle": max(0.0, 1.0 - deadline.steps_s / window)} if window > 0 else {}
    extra = {"train_reward_last10": sum(tail) / len(tail) if tail else float("nan"), "threads": cores(),
             "time_split": {"trainer": {k: round(v, 4) for k, v in split.items()}},
             "gpu": gpu_window.as_dict(), "load": load.as_dict(), "quiet": load.quiet, "profiled": False}
    if device == "cuda":
        extra["torch_peak_allocated_mib"] = torch.cuda.max_memory_allocated() / 2**20
    lengths = [h["completions/mean_length"] for h in trainer.state.log_history if "completions/mean_length" in h]
    return leg_figures("trl", steps, steps * batch, window, setup_s, after, before, steps >= t.steps,
                       (steps * batch, deadline.cpu, window), extra, sum(lengths) * batch)


def timed(obj, name: str) -> list[float]:
    """Wrap method ``name`` of ``obj`` (on the instance) to time each call; returns the list the
    durations (seconds) are appended to."""
    method, took = getattr(obj, name), []

    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return method(*args, **kwargs)
        finally:
            took.append(time.perf_counter() - t0)

    setattr(obj, name, wrapper)
    return took


# -- the benchmark -----------------------------------------------------------------------------


def ratio(a: float, b: float) -> float:
    return a / b if b else float("nan")


def leg_order(rounds: int) -> list[tuple[int, str]]:
    """``(round, leg)`` in the order they run: moerl, trl, then trl, moerl, and so on (ABBA), so
    that each system runs first in half of the rounds (round 0 starts with moerl: its set-up
    makes the warm-up checkpoint both legs start from)."""
    order = []
    for r in range(rounds):
        order += [(r, leg) for leg in (("moerl", "trl") if r % 2 == 0 else ("trl", "moerl"))]
    return order


def mean_of(rows: list[dict], key: str) -> float:
    """Mean of ``key`` over ``rows`` (NaN values left out; NaN if none is left)."""
    vals = [r[key] for r in rows if isinstance(r.get(key), (int, float)) and math.isfinite(r[key])]
    return sum(vals) / len(vals) if vals else float("nan")


def comparison(rows: list[dict]) -> dict:
    """The ratios of the result: of each system's means over its legs, and samples/s per round."""
    m = [r for r in rows if r["name"] == "moerl"]
    t = [r for r in rows if r["name"] == "trl"]
    ratios = {
        "samples_per_s moerl/trl": ratio(mean_of(m, "samples_per_s"), mean_of(t, "samples_per_s")),
        "tokens_per_s moerl/trl": ratio(mean_of(m, "tokens_per_s"), mean_of(t, "tokens_per_s")),
        "samples_per_cpu_s moerl/trl": ratio(mean_of(m, "samples_per_cpu_s"), mean_of(t, "samples_per_cpu_s")),
        "heldout_reward_after moerl/trl": ratio(mean_of(m, "heldout_reward_after"),
                                                mean_of(t, "heldout_reward_after")),
        "gain_points moerl-trl": mean_of(m, "gain_points") - mean_of(t, "gain_points"),
    }
    rounds = sorted({r["round"] for r in rows})
    if len(rounds) > 1:
        for n in rounds:
            mr = [r for r in m if r["round"] == n]
            tr = [r for r in t if r["round"] == n]
            ratios[f"samples_per_s moerl/trl round {n}"] = ratio(mean_of(mr, "samples_per_s"),
                                                                 mean_of(tr, "samples_per_s"))
    return ratios


def moerl_leg(bench: LoopBench, cfg, layout, run_dir: Path, base: Path | None, before: dict | None, profile: bool):
    """One moerl leg in its own run directory (its own redis-server and store), laid out as
    ``layout`` (app/local/machine.py). The first leg makes (or reuses) the warm-up checkpoint and
    measures its held-out reward; later ones reuse both. Returns ``(row, base, before, the leg's
    config)``."""
    cfg = cfg.model_copy(deep=True)
    cfg.store_url = f"file://{run_dir / 'store'}"
    cfg.rollout.policy_cache_dir = str(run_dir / "policy-cache")
    loop = EmbeddedLoop(cfg, run_dir, layout=layout)
    try:
        if base is None:
            base, before, feeder = start_from_base(loop, Path(bench.cache).resolve(), "of the warm-up checkpoint",
                                                   out=console)
        else:
            loop.start_redis()
            loop.cfg.model.path = str(base)
            loop.write_config()
            feeder = make_feeder(loop.cfg, base, loop.buffer, cache_dir=loop.run_dir)
            feeder.top_up()
        console.print(f"moerl leg: {bench.seconds:g}s ({layout.describe(loop.cfg)})"
                      + (", py-spy on every role" if profile else ""))
        row = run_moerl(loop, feeder, base, bench.seconds, before, run_dir / "profile" if profile else None)
    finally:
        loop.close()
    return row, base, before, loop.cfg


def run(bench: LoopBench, out_dir: str | os.PathLike = "runs/bench") -> Path:
    """Run the legs (`leg_order`), print the comparison and write the result file; returns its path.

    Raises:
        ValueError: a bad flag or config (before any work starts).
        RoleFailed: a moerl role failed.
        FileNotFoundError: ``profile`` without py-spy installed.
    """
    bench.validate()
    check_out_dir(out_dir)  # the result is written after the last leg: refuse a bad one now
    cfg, layout = plan_legs(bench, load_config(bench))
    hf_logging.disable_progress_bar()  # weight-loading bars of every evaluation
    grpo_args(cfg, Path(out_dir) / "unused", 1, bench.device)  # refuse what TRL cannot mirror, before any work
    if bench.profile:
        LoopProfiler({}, Path(out_dir))  # py-spy missing: say so before any work
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    work = Path(bench.work_dir or Path(out_dir) / f"loop-{stamp}").resolve()
    if work.exists() and any(work.iterdir()):
        raise ValueError(f"--work-dir: {work} is not empty")
    notes: list[str] = []
    base = before = leg_cfg = None
    rows: list[dict] = []
    for i, (r, leg) in enumerate(leg_order(bench.rounds)):
        suffix = "" if r == 0 else f"-{r + 1}"
        if bench.wait_quiet_s > 0:
            probe = wait_quiet(bench.wait_quiet_s)
            notes.append(f"before {leg} (round {r + 1}), waited up to {bench.wait_quiet_s:g}s for a quiet "
                         f"machine: last probe {probe.describe()}")
        if leg == "moerl":
            row, base, before, leg_cfg = moerl_leg(bench, cfg, layout, work / f"moerl{suffix}", base, before,
                                                   bench.profile and r == 0)
        else:
            where = "GPU 0" if bench.device == "cuda" else f"{cores()} threads"
            console.print(f"trl leg: {bench.seconds:g}s (GRPOTrainer, {where})")
            row = run_trl(leg_cfg, base, work / f"trl{suffix}", bench.seconds, before, bench.device)
        row.update({"round": r + 1, "position": 1 + i % 2})
        rows.append(row)
        load = LoadWindow(**row["load"]).describe()
        console.print(f"  {leg} (round {r + 1}): {load}")
        notes.append(f"{leg} round {r + 1} ({'first' if i % 2 == 0 else 'second'}): {load}")

    ratios = comparison(rows)
    quiet = all(row["quiet"] for row in rows)
    if not quiet:
        notes.insert(0, f"NOT QUIET: other processes used more than {QUIET_SHARE:.0%} of the cores during "
                        "at least one leg; these figures show how both systems share a busy machine, "
                        "not how fast they are on an idle one")
    notes += [
        (f"held-out reward of the warm-up checkpoint (both legs start there): {before['mean_reward']:.4f} "
         f"sampled at T={leg_cfg.rollout.temperature}, {before['greedy']:.4f} greedy, n={before['n']}"),
        ("samples_per_s = samples trained in the window / window length; the window of each leg "
         "ends with the step in flight at the deadline (see app/bench/loop.py); ratios are of each "
         "system's means over its legs"),
        f"run directories under {work}",
    ]
    shape = {
        **asdict(bench), "preset": bench.task or ("" if bench.config else "spell_backward"),
        "task": leg_cfg.task.name, "model": leg_cfg.model.preset, "dtype": leg_cfg.model.dtype,
        "layout": layout.describe(leg_cfg), "weight_sync": leg_cfg.weight_sync.mode,
        "base_checkpoint": str(base), "ep": leg_cfg.trainer.parallel.ep,
        "group_size": leg_cfg.rollout.group_size, "groups_per_step": leg_cfg.trainer.groups_per_step,
        "lr": leg_cfg.trainer.lr, "max_new_tokens": leg_cfg.rollout.max_new_tokens,
        "temperature": leg_cfg.rollout.temperature, "heldout_prompts": before["n"],
        "heldout_reward_before": before["mean_reward"], "heldout_greedy_before": before["greedy"],
        "cores": cores(), "quiet_share": QUIET_SHARE,
        "publish_every": leg_cfg.trainer.publish_every, "save_every": leg_cfg.trainer.save_every,
    }
    path = write_result("loop", shape, rows, ratios, notes, out_dir=out_dir, extra={"quiet": quiet})
    print_table(before, rows, ratios, quiet, path)
    return path


def print_table(before: dict, rows: list[dict], ratios: dict, quiet: bool, path: Path) -> None:
    console.rule("moerl bench loop")
    console.print(f"held-out mean reward at the start (warm-up checkpoint): {before['mean_reward']:.3f} "
                  f"over {before['n']} prompts")
    console.print(f"{'leg':<6} {'round':>5} {'steps':>6} {'samples':>8} {'window s':>9} {'samples/s':>10} "
                  f"{'cores':>6} {'samples/cpu-s':>14} {'held-out after':>15} {'gain pts':>9} "
                  f"{'load':>5} {'others':>7}")
    for f in rows:
        mark = "" if f["quiet"] else " NOT QUIET"
        mark += " (profiled)" if f.get("profiled") else ""
        console.print(f"{f['name']:<6} {f['round']:>5} {f['steps']:>6} {f['samples_trained']:>8} "
                      f"{f['train_window_s']:>9.1f} {f['samples_per_s']:>10.2f} {f['cores_used']:>6.2f} "
                      f"{f['samples_per_cpu_s']:>14.2f} {f['heldout_reward_after']:>15.3f} {f['gain_points']:>+9.1f} "
                      f"{f['load']['load_mean']:>5.2f} {f['load']['others_cores']:>7.2f}{mark}")
    for k, v in ratios.items():
        console.print(f"{k}: {v:.2f}")
    for f in rows:
        console.print(f"{f['name']} round {f['round']}: {where_time_goes(f)}")
    for f in rows:
        if f.get("profile"):
            print_profile(f["profile"])
    if not quiet:
        console.print("[bold red]warning:[/] the machine was NOT QUIET during at least one leg (others above "
                      "the threshold in the 'others' column, cores); do not quote these figures as an idle "
                      "machine's")
    console.print(f"result: {path}")


def where_time_goes(row: dict) -> str:
    """One line of a leg's tokens/s, GPU figures and time split (shares of its window)."""
    gpu = row.get("gpu") or {}
    parts = [f"{row['tokens_per_s']:.0f} tokens/s"]
    if gpu.get("samples"):
        parts.append(f"GPU busy {gpu['util_mean_pct']:.0f}% (mean of {gpu['samples']} {gpu['source']} samples), "
                     f"peak memory {gpu['mem_peak_mib'] / 1024:.1f} GiB")
    for who, split in (row.get("time_split") or {}).items():
        shares = ", ".join(f"{k.replace('_', ' ')} {100 * v:.0f}%" for k, v in split.items() if k != "samples")
        parts.append(f"{who}: {shares}")
    return "; ".join(parts)


def print_profile(profile: dict, top: int = 30) -> None:
    """The profile's per-step table: CPU ms per trainer step per role and activity."""
    console.print(f"profile: {profile['steps']} steps in {profile['window_s']:.0f}s; CPU ms per trainer step")
    for row in profile["per_step"][:top]:
        console.print(f"  {row['role']:<52.52} {row['activity']:<55.55} {row['cpu_ms_per_step']:>8.1f} "
                      f"{100 * row['share']:>5.1f}%")
