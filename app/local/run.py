"""`moerl run`: the whole asynchronous GRPO loop on this machine (what `make run` calls).

1. start redis-server (append-only persistence) in the run directory;
2. make the tiny base policy with a short supervised warm-up (`moerl warmup`), cached by recipe;
3. measure the held-out mean reward of that base policy (where RL starts);
4. queue the training prompts as tasks (app/feed.py's `TaskFeeder`, the cluster's prompt
   source), start W engines + W rollout workers and the trainer (torchrun), laid out over this
   machine's cores and GPUs (app/local/machine.py), show live progress;
5. when the trainer has made its steps: drain the workers, measure the held-out mean reward of
   the last published policy, write metrics.jsonl, TensorBoard events, plot.png, summary.json.

Ctrl-C stops every process cleanly (SIGTERM, then SIGKILL after the drain grace period).
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import time
from datetime import datetime, timezone
from pathlib import Path

import typer
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from app.buffer.experience import stale_share
from app.config import RunConfig
from app.local.embedded import EmbeddedLoop, RoleFailed
from app.local.machine import plan_run
from app.feed import TaskFeeder, make_feeder
from app.local.procs import moerl_argv

console = Console()
cli = typer.Typer(add_completion=False, help="Run the whole loop on this machine (the embedded default).")


def embedded_default() -> RunConfig:
    """The run config of `make run`: the tiny recipe of app/envs/__init__.py on 2 CPU cores.

    EP=2 over gloo (two trainer ranks, each holding half of the experts), two rollout workers,
    GRPO groups of 8, short answers. The rest is tuned for 2 cores (bench/results/loop.md, `moerl bench
    loop --profile`: where each step's CPU went):

    * a new policy version every 2 steps: publishing (per-tensor gathers over gloo, files,
      announce) and both engines' reloads came to a quarter of the loop's CPU per step when
      every step published. Samples are then typically 1-2 versions old; max_staleness 2
      (corrected by truncated importance sampling) keeps almost all of them;
    * the training state is saved every 2 steps: a DCP save of both ranks is ~90 ms of CPU, a
      fifth of the loop's CPU at one save per step; a trainer killed between saves redoes at most
      one step from groups still in Redis;
    * back-pressure at (save_every + 2) steps' worth of groups, chosen when taken groups still
      counted against it until the save that covers them: with (save_every + 1) the workers could
      never have the next batch ready when the trainer asked (it waited 30-40 % of each step);
      now only untaken groups and leases count (app/buffer/experience.py, `_backlog`);
    * engines decode up to 64 sequences together (8 groups in flight per worker): a decode step
      of 64 rows costs 1.4x one of 32 on this CPU (`moerl bench engine`).
    """
    cfg = RunConfig()
    cfg.trainer.parallel.ep = 2  # two trainer ranks (dp_shard -1 -> one FSDP shard per EP rank)
    cfg.trainer.steps = 400
    cfg.trainer.groups_per_step = 8
    cfg.trainer.lr = 4e-4
    cfg.trainer.publish_every = 2
    cfg.trainer.save_every = 2
    cfg.rollout.group_size = 8
    cfg.rollout.max_new_tokens = 8
    cfg.rollout.policy_poll_s = 0.5
    cfg.rollout.engine.max_running_requests = 64
    cfg.buffer.max_staleness = 2
    cfg.buffer.capacity_groups = (cfg.trainer.save_every + 2) * cfg.trainer.groups_per_step
    return cfg


# `moerl run --task NAME`: the embedded default, or one of the environments moerl ships
# (app/envs/environments.py), each set up so the tiny policy learns it on this machine.
TASKS = ("spell_backward", "spell-retry", "calculator", "gpu")


def task_preset(name: str) -> RunConfig:
    """The run config of ``moerl run --task NAME``.

    * ``spell_backward``: `embedded_default` (single turn, the task's verifier);
    * ``spell-retry``: the same words as multi-turn episodes: an answer, per-letter feedback
      when it is wrong, one retry (``env.attempts`` 2, ``env.max_turns`` 2);
    * ``calculator``: reasoning-gym ``basic_arithmetic`` products of two 3-digit numbers
      (``378*937=``) with the calculator tool: a call ``[378*937]``, the answer ``=354186``,
      then the final answer (``env.max_turns`` 2, at most one call);
    * ``gpu``: the GPU-sized preset, `gpu_preset`.

    Both environments run at ``trainer.lr`` 2e-4, half the single-turn lr: spell-retry 150
    steps, calculator 300 after a 250-step warm-up whose demonstrations call the tool 40 % of the
    time (greedy decoding starts near 0.43; bench/results/run-task.md).

    Raises:
        ValueError: unknown ``name``.
    """
    if name not in TASKS:
        raise ValueError(f"--task: {name!r} is not one of {', '.join(TASKS)}")
    if name == "gpu":
        return gpu_preset()
    cfg = embedded_default()
    if name == "spell-retry":
        cfg.env.name = "spell-retry"
        cfg.env.attempts = 2
        cfg.env.max_turns = 2
    elif name == "calculator":
        cfg.env.name = "calculator"
        cfg.env.max_turns = 2
        cfg.task.name = "basic_arithmetic"
        # 3-digit operands: the tool's value is 5-6 digits to copy and the call 9 characters, so
        # greedy decoding after the warm-up is not already perfect (2-digit products left it at
        # 0.98, and RL's gain was sampling sharpening only).
        cfg.task.params = {"min_terms": 2, "max_terms": 2, "min_digits": 3, "max_digits": 3, "operators": ["*"],
                           "allow_parentheses": False, "allow_negation": False}
        cfg.rollout.max_new_tokens = 12  # "[123*456]" + <eos> is 10 tokens
        # A warm-up whose greedy decoding calls the tool on only some prompts: its demonstrations
        # call it 40 % of the time (app/envs/episodes_local.py CALC_TOOL_DEMOS), so RL has a
        # skill to add that greedy decoding shows. Greedy 0.430 -> 0.665 (seed 0) and 0.495 ->
        # 0.690 (seed 1), sampled +51.5 points in both. With every demonstration calling the tool
        # (125 steps), greedy started at 0.685, its failures the tiny policy's copying, and RL
        # moved it -5.0, -2.0 (lr 1e-4) and -1.0 (T 0.7) points on seed 0 (bench/results/run-task.md).
        cfg.task.warmup_steps = 250
    if cfg.env.name:
        cfg.trainer.steps = 300 if name == "calculator" else 150  # minutes of this machine per run
        # Half the single-turn lr: at 4e-4 the calculator's greedy reward fell from 0.98 to
        # 0.47-0.58 in 150 steps (the policy mis-copies the tool's value) and its sampled gain
        # halved; at 2e-4 greedy held (0.98 -> 0.97) with a +40-point sampled gain (bench/results/run-task.md).
        cfg.trainer.lr = 2e-4
    return cfg


def gpu_preset() -> RunConfig:
    """``moerl run --task gpu``: the ``gpu-qwen3-moe`` policy (424 M parameters, Qwen3-MoE's
    shape, the character tokenizer; app/model/config.py) on spell_backward words of 5-10 letters,
    sized so that a trainer step on one H200 is matrix work rather than launch overhead.

    On a GPU machine app/local/machine.py adds bf16 compute (fp32 master weights), one trainer
    rank per trainer GPU, engines batching 256 sequences and the weight push. The lr are the
    tiny recipe's scaled by its width over this one's (64 / 1024, as muP scales Adam's lr of hidden
    matrices): the warm-up's 3e-3 -> 2e-4 and RL's 4e-4 -> 3e-5; the warm-up is short (100 steps)
    and the words are longer than the tiny recipe's, so the held-out reward starts well below 1.
    The training state is saved every 50 steps (a DCP save of 424 M fp32 parameters and their
    AdamW state is ~7 GB).
    """
    cfg = embedded_default()
    cfg.model.preset = "gpu-qwen3-moe"
    cfg.task.params = {"min_word_len": 5, "max_word_len": 10}
    cfg.task.train_size = 4000
    cfg.task.warmup_steps = 100
    cfg.task.warmup_lr = 2e-4
    cfg.rollout.max_new_tokens = 12  # a 10-letter word reversed + <eos>
    cfg.rollout.group_size = 16
    cfg.trainer.parallel.ep = 1
    cfg.trainer.groups_per_step = 32
    cfg.trainer.lr = 3e-5
    cfg.trainer.steps = 200
    cfg.trainer.save_every = 50
    cfg.buffer.capacity_groups = 4 * cfg.trainer.groups_per_step
    return cfg


def check_inputs(cfg: RunConfig) -> None:
    """Fail before any process starts: the task's prompt sets can be built, a user's environment
    class can be served and its demonstrations read, and the model config is valid for the EP
    size.

    Raises:
        ValueError, FileNotFoundError: naming the field or file (see `make_splits`,
            `validate_config`, `check_checkpoint`).
    """
    from app.envs.tasks import make_splits
    from app.model.config import tiny_config, validate_config

    make_splits(cfg.task)
    if cfg.rollout.router:
        import importlib.util

        from app.rollout.router import ROUTER_PACKAGE

        if importlib.util.find_spec("sglang_router") is None:
            raise ValueError(f"rollout.router is on but {ROUTER_PACKAGE} is not installed here "
                             f"(pip install -e '.[router]')")
    if cfg.env.name and cfg.env.served_by_moerl() and not cfg.env.builtin():
        from app.envs.openenv_server import user_environment

        user_environment(cfg.env.name)  # importable, an OpenEnv Environment, reset takes spec
    if cfg.env.demos_path:
        from app.envs.episodes_remote import load_demos

        load_demos(cfg.env.demos_path)
    if cfg.model.path:
        from app.model.checkpoint import check_checkpoint
        from app.model.source import resolve_model_path

        config = check_checkpoint(resolve_model_path(cfg.model.path, cfg.model.cache_dir))
    else:
        config = tiny_config(cfg.model.preset)
    validate_config(config, cfg.trainer.parallel.ep)


def _interrupt(signum, frame) -> None:
    """Ctrl-C, or SIGTERM (e.g. from a supervisor): end the run through its clean-up.

    Both signals are ignored from here on, before anything unwinds: a second Ctrl-C (or
    `timeout` forwarding the same signal) that came while the stack unwinds to the clean-up
    would raise again there, abort it and orphan the workers and engines.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise KeyboardInterrupt


def warmup_dir(cfg: RunConfig, cache_root: Path) -> Path:
    """Where the warm-up checkpoint for this recipe is cached (key: model, task and seed)."""
    recipe = {"model": cfg.model.model_dump(), "task": cfg.task.model_dump(exclude={"warmup_done"}),
              "ep": cfg.trainer.parallel.ep}
    if cfg.env.name:  # the warm-up plays the environment's demonstrations
        from app.envs.episodes_local import CALC_TOOL_DEMOS, RETRY_DEMOS

        recipe["env"] = cfg.env.model_dump(exclude={"url"})
        if cfg.env.builtin():  # the scripted demonstrations' mix is part of the recipe
            recipe["scripted"] = [RETRY_DEMOS, CALC_TOOL_DEMOS]
        if cfg.env.demos_path and Path(cfg.env.demos_path).is_file():
            recipe["demos"] = hashlib.sha256(Path(cfg.env.demos_path).read_bytes()).hexdigest()
    key = hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:12]
    return cache_root / f"warmup-{key}"


def make_base_policy(loop: EmbeddedLoop, cache_root: Path) -> Path:
    """Run `moerl warmup` once per recipe; later runs reuse the checkpoint. A config that says
    the warm-up is done (``task.warmup_done``: a run's own run.yaml re-used as ``--config``)
    starts from its ``model.path`` as it is: a second warm-up on a warmed checkpoint would
    leave RL nothing to gain.

    Raises:
        RoleFailed: the warm-up process failed (its log tail is in the message).
        ValueError: ``task.warmup_done`` without ``model.path``.
    """
    cfg = loop.cfg
    if cfg.task.warmup_done:
        if not cfg.model.path:
            raise ValueError("task.warmup_done: true needs model.path (the warm-up checkpoint it names)")
        console.print(f"warm-up: already done (task.warmup_done): starting from {cfg.model.path}")
        return Path(cfg.model.path)
    out = warmup_dir(cfg, cache_root)
    if (out / "config.json").exists():
        console.print(f"warm-up: reusing {out}")
        return out
    console.print("warm-up: supervised fit of the tiny base policy on the task's training examples")
    argv = moerl_argv("warmup", "--config", str(loop.config_path), "--out", str(out))
    if cfg.env.name and not cfg.env.builtin():
        argv += ["--env-url", loop.env_url]
    proc = loop.sup.start("warmup", argv)
    code = proc.wait(timeout_s=1800)
    if code != 0:
        raise RoleFailed(f"warm-up failed with {code}:\n{proc.tail(30)}")
    return out


def held_out_reward(cfg: RunConfig, model_dir: Path, env_url: str | None = None) -> dict:
    """Held-out mean reward of the policy in `model_dir`: completions (or episodes) sampled at
    the rollout temperature (the figure RL is judged by), and the greedy one. A user's
    environment is played against its server at `env_url` (default ``env.url``)."""
    from transformers.utils import logging as hf_logging

    from app.envs.evaluate import evaluate_checkpoint
    from app.envs.tasks import make_splits

    hf_logging.disable_progress_bar()  # the live bar and the summary are the run's output
    _, heldout = make_splits(cfg.task)
    r = evaluate_checkpoint(model_dir, heldout, temperature=cfg.rollout.temperature,
                            max_new_tokens=cfg.rollout.max_new_tokens, seed=cfg.task.seed,
                            env=cfg.env if cfg.env.name else None, overlong_reward=cfg.rollout.overlong_reward,
                            env_url=env_url)
    return {"n": r.n, "mean_reward": r.sampled, "greedy": r.greedy}


def start_from_base(loop: EmbeddedLoop, cache_root: Path, label: str,
                    out: Console | None = None) -> tuple[Path, dict, TaskFeeder]:
    """Start Redis, make (or reuse) the warm-up checkpoint under `cache_root` and make it the
    run's policy (``model.path``, config file rewritten), print its held-out reward as
    "held-out reward <label>: ..." on `out` (default: this module's console), then queue the
    first tasks.

    Returns:
        (checkpoint dir, `held_out_reward` dict, the `TaskFeeder`).

    Raises:
        RoleFailed: the warm-up process failed.
    """
    loop.start_redis()
    start_environment(loop, out or console)
    base = make_base_policy(loop, cache_root)
    loop.cfg.model.path = str(base)
    loop.cfg.task.warmup_done = True  # run.yaml records it: re-used as --config, no second warm-up
    loop.write_config()
    before = held_out_reward(loop.cfg, base, loop.env_url)
    (out or console).print(f"held-out reward {label}: sampled {before['mean_reward']:.3f}, greedy "
                           f"{before['greedy']:.3f} (n={before['n']})", soft_wrap=True)
    feeder = make_feeder(loop.cfg, base, loop.buffer, cache_dir=loop.run_dir)
    feeder.top_up()
    return base, before, feeder


def start_environment(loop: EmbeddedLoop, out: Console) -> None:
    """With ``env.name``: start `moerl env` (or, with ``env.url``, use the user's server, and
    say so), wait until it answers, and for a user's environment read its text fields from its
    ``/schema`` now, so that a server that does not fit moerl's contract fails before the
    warm-up (app/envs/wire.py); a server given by ``env.url`` must also take the task's
    ``spec`` and ``episode_id`` at reset (app/envs/contract.py).

    Raises:
        RoleFailed: the server exited or never answered.
        WireError (a ValueError): its schema has no usable text field, or its reset drops spec
            or episode_id.
    """
    env = loop.cfg.env
    if not env.name:
        return
    if env.served_by_moerl():
        loop.ensure_env()
        out.print(f"environment: {env.name} served by moerl env at {loop.env_url}", soft_wrap=True)
    else:
        loop.ensure_env()
        out.print(f"environment: {env.name} at {env.url} (env.url): the user's server; moerl starts none",
                  soft_wrap=True)
    if not env.builtin():
        from app.envs.wire import fetch_wire_format

        wire = fetch_wire_format(loop.env_url)
        out.print(f"environment: actions go in {wire.action_field!r}, observations are read from "
                  f"{wire.observation_field!r} (its /schema)", soft_wrap=True)
    if not env.served_by_moerl():  # `moerl env` checked its class in process; a user's server is asked
        from app.envs.contract import check_reset
        from app.envs.tasks import make_splits
        from app.envs.wire import fetch_wire_format

        train, _ = make_splits(loop.cfg.task)
        check_reset(loop.env_url, fetch_wire_format(loop.env_url), spec=train[0].spec)
        out.print("environment: its reset takes spec and episode_id (checked on one probe session)", soft_wrap=True)


def progress_loop(loop: EmbeddedLoop, feeder: TaskFeeder, steps: int) -> None:
    """Show step, reward, samples/s, staleness and policy version until the trainer is done."""
    columns = [
        TextColumn("[bold]step {task.completed:.0f}/{task.total:.0f}"), BarColumn(),
        TextColumn("{task.fields[info]}"), TimeElapsedColumn(),
    ]
    with Progress(*columns, console=console, transient=False) as bar:
        task = bar.add_task("train", total=steps, info="waiting for the first batch")
        while not loop.trainer_done():
            loop.check_roles()
            feeder.top_up()
            records = loop.metrics()
            if records:
                r = records[-1]
                window = records[-10:]
                dt = window[-1]["time"] - window[0]["time"]
                sps = (window[-1]["samples_total"] - window[0]["samples_total"]) / dt if dt > 0 else 0.0
                info = (
                    f"reward {r.get('reward_mean', float('nan')):.3f}  {sps:.1f} samples/s  "
                    f"staleness {r.get('staleness_mean', 0):.2f}  policy v{r['policy_version']}"
                )
                bar.update(task, completed=r["step"], info=info)
            time.sleep(1.0)
        records = loop.metrics()
        if records:
            bar.update(task, completed=records[-1]["step"])


@cli.command()
def run(
    config: Path = typer.Option(None, "--config", exists=True, dir_okay=False, help="Run config YAML."),
    out: Path = typer.Option(None, "--out", help="Run directory (default runs/<task>-<time>)."),
    workers: int = typer.Option(None, "--workers", min=1, help="Rollout workers (one engine each); default: "
                                "sized from this machine's cores and GPUs (app/local/machine.py)."),
    steps: int = typer.Option(None, "--steps", min=1, help="Trainer steps (overrides the config)."),
    cache: Path = typer.Option(Path("runs/cache"), "--cache", help="Warm-up checkpoint cache."),
    algorithm: str = typer.Option(None, "--algorithm", help="grpo | ppo (overrides trainer.algorithm)."),
    task: str = typer.Option(None, "--task", help=f"One of {', '.join(TASKS)}: the embedded default, a "
                             "multi-turn environment or the GPU-sized preset (instead of --config)."),
) -> None:
    """Run the embedded loop end to end and print a summary; exit code 0 on success.

    Bad input (config, task, model) raises before anything starts; app/cli.py prints it as one
    line with exit code 2. A failure before the trainer's first step leaves no run directory.
    """
    cfg = load_run_config(config, task, steps, algorithm)
    check_inputs(cfg)
    # Which roles run where on this machine's cores and GPUs; a layout that cannot work is one line now.
    cfg, layout = plan_run(cfg, preset=config is None, workers=workers)
    run_dir = new_run_dir(cfg, out)
    cfg.store_url = f"file://{run_dir / 'store'}"
    cfg.rollout.policy_cache_dir = str(run_dir / "policy-cache")
    started = time.time()

    signal.signal(signal.SIGINT, _interrupt)
    signal.signal(signal.SIGTERM, _interrupt)
    loop = EmbeddedLoop(cfg, run_dir, layout=layout)
    try:
        console.print(f"run directory: {run_dir}")
        console.print(f"layout: {layout.describe(loop.cfg)}", soft_wrap=True)
        base, before, feeder = start_from_base(loop, cache.resolve(), "before RL")
        loop.start_trainer()
        loop.start_rollout(base)
        progress_loop(loop, feeder, loop.cfg.trainer.steps)
        feeder.close()
        # A user's environment is evaluated against its server: `moerl env` stays up for it.
        loop.stop_rollout(keep_env=bool(loop.cfg.env.name) and not loop.cfg.env.builtin())
        final = latest_local_policy(loop)
        after = held_out_reward(loop.cfg, final, loop.env_url)
        summary = summarize(loop, before, after, started)
    except KeyboardInterrupt:
        # `_interrupt` has set both signals to be ignored: the clean-up runs to its end.
        console.print("[yellow]interrupted: stopping every process[/]")
        close_failed(loop)  # before the first step: no run directory left behind
        raise typer.Exit(130)
    except RoleFailed as e:
        console.print(f"[red]run failed:[/] {e}")
        close_failed(loop)
        raise typer.Exit(1)
    except Exception:
        close_failed(loop)  # bad input found late (app/cli.py prints it in one line): nothing left running
        raise
    loop.close()
    print_summary(summary)


def load_run_config(config: Path | None, task: str | None, steps: int | None, algorithm: str | None) -> RunConfig:
    """The run config of `moerl run`'s options, validated.

    Raises:
        typer.BadParameter: --config with --task, or an unknown --algorithm.
        ValueError: an invalid config (the field named).
    """
    if config and task:
        raise typer.BadParameter("give --config or --task, not both", param_hint="--task")
    cfg = RunConfig.load(config) if config else task_preset(task or "spell_backward")
    if steps:
        cfg.trainer.steps = steps
    if algorithm:
        if algorithm not in ("grpo", "ppo"):
            raise typer.BadParameter(f"{algorithm!r}: must be 'grpo' or 'ppo'", param_hint="--algorithm")
        cfg.trainer.algorithm = algorithm
    return cfg.validated()


def task_label(cfg: RunConfig) -> str:
    """What a run directory is named after: the environment (a user's: its class name) or the
    task (``calculator``, ``spell-retry``, ``spell-backward``, ``guessnumberenv``)."""
    import re

    name = cfg.env.name.rpartition(":")[2] if cfg.env.name else cfg.task.name
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "run"


def new_run_dir(cfg: RunConfig, out: Path | None) -> Path:
    """``--out``, or ``runs/<task>-<UTC time>``; never one holding an earlier run's files.

    Raises:
        typer.BadParameter: the directory exists and is not empty.
    """
    stamp = datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S")
    run_dir = (out or Path("runs") / f"{task_label(cfg)}-{stamp}").resolve()
    if run_dir.exists() and any(run_dir.iterdir()):
        raise typer.BadParameter(f"run directory {run_dir} is not empty", param_hint="--out")
    return run_dir


def close_failed(loop: EmbeddedLoop) -> None:
    """Stop every process of a failed run; if the trainer never made a step, remove the run
    directory too (it holds nothing worth keeping: the warm-up is cached elsewhere), so a failed
    start leaves nothing half-written."""
    import shutil

    loop.close()
    if not loop.metrics():
        shutil.rmtree(loop.run_dir, ignore_errors=True)


def latest_local_policy(loop: EmbeddedLoop) -> Path:
    """Download the newest published policy version to run_dir/final (for the held-out eval)."""
    from app.storage import open_store
    from app.storage.policy import download_policy, latest_policy_version

    store = open_store(loop.cfg.store_url)
    version = latest_policy_version(store, loop.cfg.run_id)
    if version is None:
        raise RoleFailed("the trainer published no policy version")
    return download_policy(store, loop.cfg.run_id, version, loop.run_dir / "final" / f"v{version}")


def summarize(loop: EmbeddedLoop, before: dict, after: dict, started: float) -> dict:
    """Write plot.png, TensorBoard events and summary.json; return the summary."""
    from app.local.report import write_plot, write_tensorboard

    records = loop.metrics()
    evals = {"held-out sampled before RL": before["mean_reward"], "held-out sampled after RL": after["mean_reward"],
             "held-out greedy before RL": before["greedy"], "held-out greedy after RL": after["greedy"]}
    plot = write_plot(records, loop.run_dir / "plot.png", evals)
    write_tensorboard(records, loop.run_dir / "tensorboard")
    last = records[-1] if records else {}
    # Fewer than two steps measure no rate: null in summary.json (NaN is not JSON).
    elapsed = max(records[-1]["time"] - records[0]["time"], 1e-9) if len(records) > 1 else None
    summary = {
        "run_dir": str(loop.run_dir),
        "task": (loop.cfg.task.name if loop.cfg.task.source != "env" else "its own episodes")
        + (f" in env {loop.cfg.env.name}" if loop.cfg.env.name else ""),
        "held_out_prompts": before["n"],
        "held_out_reward_before": before["mean_reward"],
        "held_out_reward_after": after["mean_reward"],
        "held_out_greedy_before": before["greedy"],
        "held_out_greedy_after": after["greedy"],
        "gain_points": 100 * (after["mean_reward"] - before["mean_reward"]),
        "gain_points_greedy": 100 * (after["greedy"] - before["greedy"]),
        "steps": last.get("step", 0),
        "policy_version": last.get("policy_version", 0),
        "samples_trained": last.get("samples_total", 0),
        "samples_per_s": (last.get("samples_total", 0) - records[0].get("samples_total", 0)) / elapsed
        if elapsed else None,
        "train_s": elapsed,
        "buffer": last.get("buffer", {}),
        "stale_share": stale_share(last.get("buffer", {})),  # finished groups thrown away as too stale
        "wall_s": time.time() - started,
        "plot": str(plot),
    }
    tmp = loop.run_dir / ".summary.json.tmp"
    tmp.write_text(json.dumps(summary, indent=2, allow_nan=False))
    os.replace(tmp, loop.run_dir / "summary.json")
    return summary


def print_summary(s: dict) -> None:
    rate = "n/a samples/s" if s["samples_per_s"] is None else f"{s['samples_per_s']:.1f} samples/s"
    console.rule("moerl run: summary")
    console.print(f"task {s['task']}: held-out mean reward over {s['held_out_prompts']} prompts, before RL -> after RL")
    console.print(
        f"  sampled {s['held_out_reward_before']:.3f} -> {s['held_out_reward_after']:.3f} ({s['gain_points']:+.1f} points)"
        f"   greedy {s['held_out_greedy_before']:.3f} -> {s['held_out_greedy_after']:.3f} "
        f"({s['gain_points_greedy']:+.1f} points)", soft_wrap=True
    )
    console.print(
        f"  {s['steps']} trainer steps, policy v{s['policy_version']}, {s['samples_trained']} samples "
        f"trained, {rate} over {(s['train_s'] or 0) / 60:.1f} min of training; "
        f"{s['wall_s'] / 60:.1f} min in all (warm-up and evaluations included)", soft_wrap=True
    )
    console.print(f"  run directory {s['run_dir']}  (run.yaml, metrics.jsonl, tensorboard/, plot.png, "
                  "summary.json, logs/)", soft_wrap=True)
