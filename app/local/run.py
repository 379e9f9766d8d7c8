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
import importlib.util
import json
import os
import re
import shutil
import signal
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import typer
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from app.buffer.experience import stale_share
from app.config import RolloutConfig, RunConfig
from app.envs.contract import check_reset
from app.envs.env_client import EnvError
from app.envs.episodes_remote import load_demos
from app.envs.fingerprint import warmup_fingerprint
from app.envs.openenv_server import user_environment
from app.envs.tasks import make_splits
from app.envs.wire import fetch_wire_format
from app.feed import TaskFeeder, make_feeder
from app.local.embedded import EmbeddedLoop, RoleFailed
from app.local.machine import plan_run
from app.local.procs import moerl_argv
from app.local.report import read_steps, resume_times, samples_per_s, trained_span, write_plot, write_tensorboard
from app.local.status import PLAIN_EVERY_S, Stage, every_rollout_fails, training_info
from app.model.source import resolve_model_path
from app.rollout.router import ROUTER_PACKAGE
from app.rollout.scoring import load_score_fn
from app.storage import open_store
from app.storage.policy import download_policy, latest_policy_version

console = Console()
# Piped or logged (no terminal): whole lines, as the training bar's plain lines, not rich's cut at 80 columns.
console.soft_wrap = not console.is_terminal
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
    # torch and transformers (the model's config, here and below): `moerl run --help` and a bad
    # run config's error come before they load
    from app.model.config import tiny_config, validate_config

    make_splits(cfg.task)
    if cfg.rollout.router:
        if importlib.util.find_spec("sglang_router") is None:
            raise ValueError(f"rollout.router is on but {ROUTER_PACKAGE} is not installed here "
                             f"(pip install -e '.[router]')")
    if cfg.env.name and cfg.env.served_by_moerl() and not cfg.env.builtin():
        user_environment(cfg.env.name)  # importable, an OpenEnv Environment, reset takes spec
    if not cfg.task.reward_model:  # the workers import it at start (app/rollout/scoring.py score_fn_for)
        load_score_fn(cfg.rollout.reward_fn)
    if cfg.env.demos_path:
        load_demos(cfg.env.demos_path)
    if cfg.model.path:
        from app.model.checkpoint import check_checkpoint  # torch and transformers (above)

        config = check_checkpoint(resolve_model_path(cfg.model.path, cfg.model.cache_dir))
    else:
        config = tiny_config(cfg.model.preset)
    validate_config(config, cfg.trainer.parallel.ep)
    check_context(cfg, config)


def check_dispatch(cfg: RunConfig) -> None:
    """``trainer.parallel.ep_backend: deepep`` where DeepEP cannot run (the trainer's own probe,
    app/model/dispatch/deepep.py, without the EP group it has only once started): one line now,
    not after the warm-up and start-up. With ``ep`` 1 the trainer dispatches locally anyway.

    Raises:
        ValueError: naming the field and the reason.
    """
    par = cfg.trainer.parallel
    if par.ep_backend != "deepep" or par.ep == 1:
        return
    # torch: as in check_inputs, after `moerl run --help` and the config's own errors
    from app.model.dispatch.deepep import deepep_unavailable_reason

    if reason := deepep_unavailable_reason():
        raise ValueError(f"trainer.parallel.ep_backend='deepep' cannot run here: {reason}")


def replaced_fields(cfg: RunConfig) -> list[str]:
    """``field=value`` of each field a config set that `moerl run` replaces with the run's own:
    its store (``store_url``, the run directory's store/), its buffer (``buffer.redis_url``, a
    redis-server of its own) and the engines' policy cache (``rollout.policy_cache_dir``)."""
    default = RunConfig()
    fields = (("store_url", cfg.store_url, default.store_url),
              ("buffer.redis_url", cfg.buffer.redis_url, default.buffer.redis_url),
              ("rollout.policy_cache_dir", cfg.rollout.policy_cache_dir, default.rollout.policy_cache_dir))
    # A Redis URL's user and password stay off the console.
    return [f"{name}={re.sub(r'//[^/@]*@', '//', value)}" for name, value, default_value in fields
            if value != default_value]


def check_context(cfg: RunConfig, config) -> None:
    """The policy's turns fit its context: ``rollout.max_new_tokens`` (times ``env.max_turns``:
    an episode's turns and observations share one sequence) plus ``<bos>`` must stay below
    ``max_position_embeddings`` (the tiny presets': 512), or every generation would run into the
    context's end (100000 new tokens kept the held-out evaluation generating for minutes).

    Raises:
        ValueError: naming the fields and the context.
    """
    context = int(getattr(config, "max_position_embeddings", 0) or 0)
    need = cfg.max_policy_tokens() + 1
    if context and need >= context:
        turns = f" x env.max_turns={cfg.env.max_turns}" if cfg.env.name else ""
        source = cfg.model.path or f"model.preset {cfg.model.preset}"
        raise ValueError(f"rollout.max_new_tokens={cfg.rollout.max_new_tokens}{turns} does not fit the policy's "
                         f"context of {context} tokens ({source}: max_position_embeddings), which the prompt"
                         f"{', observations' if cfg.env.name else ''} and turns share")


# The signal that interrupted the run (`_interrupt`), for its exit code: 128 + the signal's number.
_stopped_by: list[int] = []


def _interrupt(signum, frame) -> None:
    """Ctrl-C, or SIGTERM (e.g. from a supervisor): end the run through its clean-up.

    Both signals are ignored from here on, before anything unwinds: a second Ctrl-C (or
    `timeout` forwarding the same signal) that came while the stack unwinds to the clean-up
    would raise again there, abort it and orphan the workers and engines.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    _stopped_by.append(signum)
    raise KeyboardInterrupt


def interrupted_exit_code() -> int:
    """128 + the interrupting signal's number (SIGINT 130, SIGTERM 143: the shell's convention)."""
    return 128 + (_stopped_by[0] if _stopped_by else signal.SIGINT)


class RunFailed(Exception):
    """The run cannot go on; ``code`` is the exit code (2: the user's input, a config or an
    environment that fails every episode; 1: anything else)."""

    def __init__(self, message: str, code: int = 1):
        super().__init__(message)
        self.code = code


def unwritable(path: Path) -> str | None:
    """Why ``path`` cannot be made (or written) as a directory, or None: the nearest existing one
    of it and its parents must be a directory a file can be created in (tried: permissions say
    nothing of a read-only mount, and root passes them all)."""
    probe = path
    while not probe.exists():
        probe = probe.parent
    if not probe.is_dir():
        return f"{probe} is not a directory"
    try:
        fd, tmp = tempfile.mkstemp(dir=probe, prefix=".moerl-write-check-")
        os.close(fd)
        os.unlink(tmp)
    except OSError as e:
        return f"{probe} is not writable ({e.strerror or e})"
    return None


def check_cache(cache: Path) -> None:
    """``--cache`` can hold the warm-up: checked before anything starts when it cannot even be
    made (a read-only cache that exists may still hold this recipe's warm-up: `make_base_policy`
    checks it before a warm-up would write there).

    Raises:
        ValueError: naming --cache.
    """
    if cache.exists() and not cache.is_dir():
        raise ValueError(f"--cache {cache}: exists and is not a directory")
    if not cache.exists() and (why := unwritable(cache)):
        raise ValueError(f"--cache {cache}: cannot be made: {why}")


def warmup_dir(cfg: RunConfig, cache_root: Path, env_url: str | None = None) -> Path:
    """Where the warm-up checkpoint for this recipe is cached. The key: the model, task and
    environment config, and what the warm-up sees (app/envs/fingerprint.py): the task's
    problems and, for an environment of the user's, its server's reset observations (at
    ``env_url``, default ``env.url``), so that a changed environment gets a warm-up of its own.

    Raises:
        ValueError, EnvError: an environment of the user's and no server, or a failed reset.
    """
    recipe = {"model": cfg.model.model_dump(), "task": cfg.task.model_dump(exclude={"warmup_done"}),
              "ep": cfg.trainer.parallel.ep, "seen": warmup_fingerprint(cfg, env_url)}
    if cfg.env.name:  # the warm-up plays the environment's demonstrations
        # openenv (the env extra, pyproject.toml; episodes_local needs it): only for an environment
        from app.envs.episodes_local import CALC_TOOL_DEMOS, RETRY_DEMOS

        recipe["env"] = cfg.env.model_dump(exclude={"url"})
        if cfg.env.builtin():  # the scripted demonstrations' mix is part of the recipe
            recipe["scripted"] = [RETRY_DEMOS, CALC_TOOL_DEMOS]
        if cfg.env.demos_path and Path(cfg.env.demos_path).is_file():
            recipe["demos"] = hashlib.sha256(Path(cfg.env.demos_path).read_bytes()).hexdigest()
    key = hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:12]
    return cache_root / f"warmup-{key}"


WARMUP_LINE = re.compile(r"warmup step (\d+)/(\d+)|held-out evaluation (\d+)/(\d+)")


def make_base_policy(loop: EmbeddedLoop, cache_root: Path) -> Path:
    """Run `moerl warmup` once per recipe; later runs reuse the checkpoint. A config that says
    the warm-up is done (``task.warmup_done``: a run's own run.yaml re-used as ``--config``)
    starts from its ``model.path`` as it is: a second warm-up on a warmed checkpoint would
    leave RL nothing to gain. The warm-up's steps and its held-out evaluation show as a bar.

    Raises:
        RoleFailed: the warm-up process failed (its log tail is in the message).
        ValueError: ``task.warmup_done`` without ``model.path``; the cache cannot be written;
            the warm-up refused its input (exit 2: its one line).
    """
    cfg = loop.cfg
    if cfg.task.warmup_done:
        if not cfg.model.path:
            raise ValueError("task.warmup_done: true needs model.path (the warm-up checkpoint it names)")
        console.print(f"warm-up: already done (task.warmup_done): starting from {cfg.model.path}")
        return Path(cfg.model.path)
    out = warmup_dir(cfg, cache_root, loop.env_url)
    if (out / "config.json").exists():
        console.print(f"warm-up: reusing {out} (same recipe, problems{' and environment answers' if cfg.env.name else ''})",
                      soft_wrap=True)
        return out
    if why := unwritable(out):
        raise ValueError(f"--cache {cache_root}: cannot hold this recipe's warm-up ({out.name}): {why}")
    console.print("warm-up: supervised fit of the tiny base policy on the task's training examples")
    argv = moerl_argv("warmup", "--config", str(loop.config_path), "--out", str(out))
    if cfg.env.name and not cfg.env.builtin():
        argv += ["--env-url", loop.env_url]
    proc = loop.sup.start("warmup", argv)
    with Stage(console, "warm-up", total=cfg.task.warmup_steps, unit="steps") as stage:
        deadline = time.monotonic() + 1800
        while (code := proc.wait(timeout_s=0.5)) is None and time.monotonic() < deadline:
            for m in WARMUP_LINE.finditer(proc.tail(5)):
                if m.group(1):
                    stage.update(int(m.group(1)), info=f"fitting ({m.group(2)} steps)")
                else:
                    stage.update(cfg.task.warmup_steps, info=f"held-out evaluation {m.group(3)}/{m.group(4)}")
        if code == 2:  # bad input, said in one line by `moerl warmup` (app/cli.py)
            line = next((x for x in reversed(proc.tail(20).splitlines()) if x.strip()), "")
            raise ValueError(f"warm-up: {line.removeprefix('moerl warmup: ').removeprefix('ValueError: ')}")
        if code != 0:
            raise RoleFailed(f"warm-up failed with {code}:\n{proc.tail(30)}")
    return out


def held_out_reward(cfg: RunConfig, model_dir: Path, env_url: str | None = None, label: str = "") -> dict:
    """Held-out mean reward of the policy in `model_dir` (app/envs/evaluate.py
    `evaluate_run_policy`): episodes or completions sampled at the rollout temperature (the
    figure RL is judged by), and the greedy one; a bar shows it going when ``label`` is given.
    A warm-up checkpoint's own figure (its warmup.json, measured the same way) is taken as it is.

    Raises:
        ValueError: a user's environment failed the episodes or broke the reward rule (one line).
    """
    # torch and transformers: `moerl run --help` and a bad run config's error come before they
    # load (see check_inputs)
    from app.envs.evaluate import evaluate_run_policy, evaluation_key, evaluation_size

    recorded = Path(model_dir) / "warmup.json"
    if recorded.is_file():
        w = json.loads(recorded.read_text())
        if w.get("evaluation") == evaluation_key(cfg) and w.get("heldout"):
            return {"n": w["heldout"]["n"], "mean_reward": w["heldout"]["sampled"], "greedy": w["heldout"]["greedy"]}
    _, heldout = make_splits(cfg.task)
    try:
        if not label:
            r = evaluate_run_policy(cfg, model_dir, env_url)
        else:
            with Stage(console, label, total=evaluation_size(heldout),
                       unit="episodes" if cfg.env.name else "completions") as stage:
                r = evaluate_run_policy(cfg, model_dir, env_url, progress=stage.advance)
    except EnvError as e:
        raise ValueError(f"held-out evaluation: {e}") from None
    return {"n": r.n, "mean_reward": r.sampled, "greedy": r.greedy}


BEFORE_FILE = "heldout-before.json"  # the base policy's held-out figure, read again by --resume


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
    before = held_out_reward(loop.cfg, base, loop.env_url, label=f"held-out evaluation {label}")
    (loop.run_dir / BEFORE_FILE).write_text(json.dumps(before))
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
    ``spec`` and ``episode_id`` at reset and hold concurrent sessions (app/envs/contract.py).
    Says the reward rule when an environment or reward function of the user's gives them.

    Raises:
        RoleFailed: the server exited or never answered.
        WireError (a ValueError): its schema has no usable text field, or its reset drops spec
            or episode_id, or it holds one session.
    """
    cfg = loop.cfg
    env = cfg.env
    if (env.name and not env.builtin()) or cfg.rollout.reward_fn != RolloutConfig().reward_fn \
            or cfg.rollout.reward_range != RolloutConfig().reward_range:
        out.print(f"rewards: a reward outside {cfg.rollout.reward_range_text()} fails its group (never trained); "
                  "declare the range your rewards take there", soft_wrap=True)
    if not env.name:
        return
    if env.served_by_moerl():
        with Stage(out, f"environment: starting moerl env for {env.name}"):
            loop.ensure_env()
        out.print(f"environment: {env.name} served by moerl env at {loop.env_url}", soft_wrap=True)
    else:
        loop.ensure_env()
        out.print(f"environment: {env.name} at {env.url} (env.url): the user's server; moerl starts none",
                  soft_wrap=True)
    if not env.builtin():
        wire = fetch_wire_format(loop.env_url)
        out.print(f"environment: actions go in {wire.action_field!r}, observations are read from "
                  f"{wire.observation_field!r} (its /schema)", soft_wrap=True)
    if not env.served_by_moerl():  # `moerl env` checked its class in process; a user's server is asked
        train, _ = make_splits(loop.cfg.task)
        check_reset(loop.env_url, fetch_wire_format(loop.env_url), spec=train[0].spec,
                    max_sessions=loop.cfg.env.max_sessions)
        out.print("environment: its reset takes spec and episode_id, and it holds concurrent sessions (checked on "
                  "two probe sessions)", soft_wrap=True)


def start_training(loop: EmbeddedLoop, base: Path, resume: bool) -> None:
    """Start the trainer gang, the engines and the rollout workers, with a live line until every
    engine answers."""
    n, s = loop.workers, "s" if loop.workers > 1 else ""
    with Stage(console, f"start-up: trainer, {n} engine{s} and {n} rollout worker{s}"):
        loop.start_trainer(resume=resume)
        loop.start_rollout(base)


def progress_loop(loop: EmbeddedLoop, feeder: TaskFeeder, steps: int) -> None:
    """Show step, reward, samples/s, staleness and policy version until the trainer is done, and
    what the rollout workers wait on or fail with (app/local/status.py).

    Raises:
        RoleFailed: the trainer failed.
        RunFailed: every rollout fails (code 2: the environment's or reward's doing).
    """
    columns = [
        TextColumn("[bold]step {task.completed:.0f}/{task.total:.0f}"), BarColumn(),
        TextColumn("{task.fields[info]}"), TimeElapsedColumn(),
    ]
    buf = loop.buffer()
    plain_at = time.monotonic()
    try:
        # Not a terminal: plain lines below instead (rich would print one frame cut at 80 columns).
        with Progress(*columns, console=console, transient=False, disable=not console.is_terminal) as bar:
            task = bar.add_task("train", total=steps, info="waiting for the first batch")
            while not loop.trainer_done():
                loop.check_roles()
                feeder.top_up()
                records = loop.metrics()
                health, stats = buf.health(), buf.stats()
                verdict = every_rollout_fails(stats, health, loop.cfg.trainer.groups_per_step)
                if verdict:
                    raise RunFailed(verdict, code=2)
                info = training_info(records, health)
                bar.update(task, completed=records[-1]["step"] if records else 0, info=info)
                if not console.is_terminal and time.monotonic() - plain_at >= PLAIN_EVERY_S:
                    plain_at = time.monotonic()
                    console.print(f"step {records[-1]['step'] if records else 0}/{steps}  {info}", soft_wrap=True)
                time.sleep(1.0)
            records = loop.metrics()
            if records:
                bar.update(task, completed=records[-1]["step"])
                if not console.is_terminal:
                    console.print(f"step {records[-1]['step']}/{steps}  {training_info(records, None)}", soft_wrap=True)
    finally:
        buf.close()


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
    sets: list[str] = typer.Option(None, "--set", help="key=value: set any run config field (dotted path, YAML "
                                   "value), e.g. --set trainer.lr=1e-4; repeatable; checked like the file."),
    resume: Path = typer.Option(None, "--resume", help="Continue the run in this directory from its last saved "
                                "training state (its run.yaml, store/ and redis/); --steps, and --set of its saves, "
                                "timeouts and logging, may change it."),
) -> None:
    """Run the embedded loop end to end and print a summary; exit code 0 on success.

    Bad input (config, task, model) raises before anything starts; app/cli.py prints it as one
    line with exit code 2. A failure before the trainer's first step leaves no run directory.
    Interrupted (Ctrl-C 130, SIGTERM 143) after a step, the run writes its summary and plot and
    prints the command that continues it.
    """
    if resume is not None:
        if config or task or out or algorithm:
            raise typer.BadParameter("--resume continues a run with its own run.yaml and directory: give no "
                                     "--config, --task, --out or --algorithm", param_hint="--resume")
        run_dir = resume.resolve()
        cfg = load_resumed_config(run_dir, steps, sets)
        check_inputs(cfg)
        cfg, layout = plan_run(cfg, preset=False, workers=workers)
        replaced = []  # the run's own, from its first start
    else:
        cfg = load_run_config(config, task, steps, algorithm, sets)
        check_inputs(cfg)
        check_cache(cache)
        # Which roles run where on this machine's cores and GPUs; a layout that cannot work is one line now.
        cfg, layout = plan_run(cfg, preset=config is None, workers=workers)
        run_dir = new_run_dir(cfg, out)
        replaced = replaced_fields(cfg)
    check_dispatch(cfg)
    cfg.store_url = f"file://{run_dir / 'store'}"
    cfg.rollout.policy_cache_dir = str(run_dir / "policy-cache")
    # A resumed run's time in all includes its earlier runs' (their summary's), not the gap between them.
    started = time.time() - (earlier_wall_s(run_dir) if resume is not None else 0.0)

    signal.signal(signal.SIGINT, _interrupt)
    signal.signal(signal.SIGTERM, _interrupt)
    loop = EmbeddedLoop(cfg, run_dir, layout=layout)
    before = after = None
    try:
        console.print(f"run directory: {run_dir}")
        if replaced:
            console.print(f"not used by moerl run (a run keeps its store and buffer in its directory): "
                          f"{', '.join(replaced)}", soft_wrap=True)
        console.print(f"layout: {layout.describe(loop.cfg)}", soft_wrap=True)
        if resume is not None:
            base, before, feeder = restart_saved(loop)
        else:
            base, before, feeder = start_from_base(loop, cache.resolve(), "before RL")
        start_training(loop, base, resume is not None)
        progress_loop(loop, feeder, loop.cfg.trainer.steps)
        feeder.close()
        # A user's environment is evaluated against its server: `moerl env` stays up for it.
        loop.stop_rollout(keep_env=bool(loop.cfg.env.name) and not loop.cfg.env.builtin())
        after = final_evaluation(loop)
    except KeyboardInterrupt:
        # `_interrupt` has set both signals to be ignored: the clean-up runs to its end.
        console.print("[yellow]interrupted: stopping every process[/]")
        end_unfinished(loop, before, started, resume is not None, interrupted_exit_code(), "interrupted")
    except (RoleFailed, RunFailed) as e:
        log = next((p.log_path for p in loop.sup.procs.values() if p.returncode() not in (None, 0)), None)
        line = failure_line(e, log)
        kept = resume is not None or bool(loop.metrics())
        if line is None:  # no line of its own: the log's tail, which goes with the run directory unless kept
            line = str(e) if not kept else str(e).splitlines()[0]
        if kept and log is not None:
            line += f" (log: {log})"
        console.print(f"[red]run failed:[/] {line}", soft_wrap=True)
        end_unfinished(loop, before, started, resume is not None, e.code, "failed")
    except Exception:
        close_failed(loop, keep=resume is not None)  # bad input found late (app/cli.py: one line)
        raise
    summary = summarize(loop, before, after, started)
    loop.close()
    print_summary(summary)
    if isinstance(after, Exception):
        console.print(f"[red]held-out evaluation after RL failed:[/] {after}", soft_wrap=True)
        raise typer.Exit(2 if isinstance(after, ValueError) else 1)


def final_evaluation(loop: EmbeddedLoop) -> dict | Exception:
    """The held-out figure of the last published policy, or the error that kept it from being
    measured: what was trained is summarized and plotted either way (`summarize` takes both)."""
    try:
        final = latest_local_policy(loop)
        return held_out_reward(loop.cfg, final, loop.env_url, label="held-out evaluation after RL")
    except (ValueError, RoleFailed, OSError, RuntimeError) as e:
        return e


OWN_ERROR = re.compile(r"^moerl \w+(?: \(rank (\d+)\))?: (.+)$")


def failure_line(e: Exception, log: Path | None = None) -> str | None:
    """One line for a failed run, or None when there is none to give: a `RunFailed`'s message; a
    failed role's own one-line error (``moerl train (rank 0): ...``, which names the cause the
    rollout workers reported, app/buffer/health.py), not torchrun's dump, from the error's log
    tail or, further up, the role's ``log`` (torchrun's dump alone is some 40 lines)."""
    if isinstance(e, RunFailed):
        return str(e)
    lines = str(e).splitlines()
    if log is not None and log.is_file():
        lines += log.read_text(errors="replace").splitlines()[-200:]
    own = [(m.group(1), m.group(2)) for m in map(OWN_ERROR.match, (x.strip() for x in lines[1:])) if m]
    if not own:
        return None
    rank0 = [text for rank, text in own if rank in (None, "0")]
    return f"{lines[0].rstrip(':')}: {(rank0 or [own[-1][1]])[-1]}"


def end_unfinished(loop: EmbeddedLoop, before: dict | None, started: float, resumed: bool, code: int,
                   how: str) -> None:
    """End a run that stopped before its last step: stop every process; after a step, write the
    summary and plot of what was trained and say how to continue it; before one, leave no run
    directory (unless it is a resumed run's).

    Raises:
        typer.Exit: always, with ``code``.
    """
    if loop.metrics() and before is not None:
        # The roles first (the trainer ends its step), Redis last: the summary counts every step
        # and reads the workers' failure reasons.
        loop.stop_rollout()
        trainer = loop.sup.procs.get("trainer")
        if trainer is not None:
            trainer.stop(loop.cfg.rollout.drain_grace_s + 5)
        summary = summarize(loop, before, None, started)
        close_failed(loop, keep=True)
        print_summary(summary)
        console.print(f"{how} at step {summary['steps']}/{loop.cfg.trainer.steps}; continue it with:  "
                      f"moerl run --resume {loop.run_dir}", soft_wrap=True)
    else:
        close_failed(loop, keep=resumed)
    raise typer.Exit(code)


# What `moerl run --resume` may change (``--steps``, ``--set``): the step count, how often states
# are saved and how many are kept, timeouts, retries and logging, as a resume in verl or TRL may.
# Everything else (the objective, the model, the task, the run's name, the batch, where its
# buffer and store are) is what the saved state and the buffer's groups were made with.
RESUME_MAY_CHANGE = (
    "trainer.steps", "trainer.save_every", "trainer.keep_states", "trainer.keep_versions",
    "trainer.batch_timeout_s", "trainer.max_bad_steps", "trainer.log_entropy",
    "rollout.request_timeout_s", "rollout.reward_timeout_s", "rollout.reward_warmup_timeout_s",
    "rollout.drain_grace_s", "rollout.weight_update_timeout_s", "rollout.flush_timeout_s",
    "rollout.engine_retries", "rollout.retry_backoff_s", "rollout.policy_poll_s",
    "env.step_timeout_s", "env.episode_timeout_s", "task.verify_timeout_s",
    "weight_sync.timeout_s", "weight_sync.ready_timeout_s", "buffer.lease_ms", "feed.poll_s",
)


def load_resumed_config(run_dir: Path, steps: int | None, sets: list[str] | None) -> RunConfig:
    """The config of ``moerl run --resume RUN_DIR``: its run.yaml with ``--steps`` and ``--set``
    changing only `RESUME_MAY_CHANGE` (run.yaml itself is rewritten only once the run starts).

    Raises:
        ValueError: not a run directory, a ``--set`` of a field a resume keeps (each named), or a
            run that made its steps already (names --resume).
    """
    if not (run_dir / "run.yaml").is_file():
        raise ValueError(f"--resume {run_dir}: no run.yaml there (not a moerl run directory)")
    if not (run_dir / "store").is_dir() or not (run_dir / "redis").is_dir():
        raise ValueError(f"--resume {run_dir}: no store/ or redis/ there: nothing saved to continue from")
    saved = RunConfig.load(run_dir / "run.yaml")
    cfg = saved.with_sets(sets) if sets else saved.model_copy(deep=True)
    if steps:
        cfg.trainer.steps = steps
    cfg = cfg.validated()
    kept = [f for f in saved.changed_fields(cfg) if f not in RESUME_MAY_CHANGE]
    if kept:
        raise ValueError(f"--resume {run_dir}: --set {', '.join(kept)}: a resumed run keeps the config its saved "
                         "state was trained with; only the step count, saves, timeouts and logging may change "
                         "(docs/local-run.md); start a new run for another config")
    done = read_steps(run_dir / "metrics.jsonl") if (run_dir / "metrics.jsonl").is_file() else []
    if done and done[-1]["step"] >= cfg.trainer.steps:
        raise ValueError(f"--resume {run_dir}: the run made {done[-1]['step']} steps already (trainer.steps "
                         f"{cfg.trainer.steps}); give --steps N with N > {done[-1]['step']} to train further")
    return cfg


def earlier_wall_s(run_dir: Path) -> float:
    """The seconds the earlier runs of a resumed run directory took in all (its summary.json's
    ``wall_s``, written when a run ends, is interrupted or fails after a step); 0 without one."""
    try:
        return float(json.loads((run_dir / "summary.json").read_text()).get("wall_s") or 0.0)
    except (OSError, ValueError, TypeError, AttributeError):
        return 0.0


def restart_saved(loop: EmbeddedLoop) -> tuple[Path, dict, TaskFeeder]:
    """``--resume``: Redis again in the run's directory (its append-only file brings back the
    queue, the leases and the groups not yet trained), the environment, the base policy
    (``model.path``) and its held-out figure from the first start; the trainer is started with
    ``--resume`` (its newest saved state: weights, optimizer, step, version, RNG, the groups it
    trained on; app/trainer/trainer.py).

    Raises:
        ValueError: the base policy is gone (the warm-up cache was removed).
    """
    cfg = loop.cfg
    base = Path(cfg.model.path or "")
    if not (base / "config.json").is_file():
        raise ValueError(f"--resume {loop.run_dir}: its base policy model.path={cfg.model.path} is gone")
    loop.start_redis()
    start_environment(loop, console)
    saved = loop.run_dir / BEFORE_FILE
    if saved.is_file():
        before = json.loads(saved.read_text())
    else:
        before = held_out_reward(cfg, base, loop.env_url, label="held-out evaluation before RL")
        saved.write_text(json.dumps(before))
    console.print(f"resuming: held-out reward before RL (first start): sampled {before['mean_reward']:.3f}, "
                  f"greedy {before['greedy']:.3f} (n={before['n']})", soft_wrap=True)
    feeder = make_feeder(cfg, base, loop.buffer, cache_dir=loop.run_dir)
    feeder.top_up()
    return base, before, feeder


def load_run_config(config: Path | None, task: str | None, steps: int | None, algorithm: str | None,
                    sets: list[str] | None = None) -> RunConfig:
    """The run config of `moerl run`'s options, validated: ``--config`` or ``--task``, then
    ``--set`` (`RunConfig.with_sets`), ``--steps`` and ``--algorithm``.

    Raises:
        typer.BadParameter: --config with --task, or an unknown --algorithm.
        ValueError: an invalid config or --set (the field named).
    """
    if config and task:
        raise typer.BadParameter("give --config or --task, not both", param_hint="--task")
    cfg = RunConfig.load(config, sets) if config else task_preset(task or "spell_backward")
    if sets and not config:
        cfg = cfg.with_sets(sets)
    if steps:
        cfg.trainer.steps = steps
    if algorithm:
        if algorithm not in ("grpo", "ppo"):
            raise typer.BadParameter(f"{algorithm!r}: must be 'grpo' or 'ppo'", param_hint="--algorithm")
        cfg.trainer.algorithm = algorithm
    return cfg.validated()


def task_label(cfg: RunConfig) -> str:
    """What a run directory is named after: the config's ``run_id`` when it sets one (a user's runs
    of one environment told apart), else the environment (a user's: its class name) or the task
    (``calculator``, ``spell-retry``, ``spell-backward``, ``guessnumberenv``)."""
    if cfg.run_id != RunConfig.model_fields["run_id"].default:
        return cfg.run_id
    name = cfg.env.name.rpartition(":")[2] if cfg.env.name else cfg.task.name
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "run"


def new_run_dir(cfg: RunConfig, out: Path | None) -> Path:
    """``--out``, or ``runs/<run_id or task>-<UTC time>``; never one holding an earlier run's files.

    Raises:
        typer.BadParameter: the directory exists and is not empty.
        ValueError: it cannot be made or written (names --out).
    """
    stamp = datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S")
    run_dir = (out or Path("runs") / f"{task_label(cfg)}-{stamp}").resolve()
    if run_dir.exists() and not run_dir.is_dir():
        raise ValueError(f"--out {run_dir}: exists and is not a directory")
    if run_dir.exists() and any(run_dir.iterdir()):
        raise typer.BadParameter(f"run directory {run_dir} is not empty", param_hint="--out")
    if why := unwritable(run_dir):
        raise ValueError(f"--out {run_dir}: cannot be made: {why}")
    return run_dir


def close_failed(loop: EmbeddedLoop, keep: bool = False) -> None:
    """Stop every process of a failed run; if the trainer never made a step, remove the run
    directory too (it holds nothing worth keeping: the warm-up is cached elsewhere), so a failed
    start leaves nothing half-written. ``keep``: a resumed run's directory stays, always. The
    console named the directory at the start: it says it is gone."""
    loop.close()
    if not keep and not loop.metrics():
        shutil.rmtree(loop.run_dir, ignore_errors=True)
        console.print(f"run directory {loop.run_dir} removed: the run stopped before its first trainer step",
                      soft_wrap=True)


def latest_local_policy(loop: EmbeddedLoop) -> Path:
    """Download the newest published policy version to run_dir/final (for the held-out eval)."""
    store = open_store(loop.cfg.store_url)
    version = latest_policy_version(store, loop.cfg.run_id)
    if version is None:
        raise RoleFailed("the trainer published no policy version")
    return download_policy(store, loop.cfg.run_id, version, loop.run_dir / "final" / f"v{version}")


def summarize(loop: EmbeddedLoop, before: dict, after: dict | Exception | None, started: float) -> dict:
    """Write plot.png, TensorBoard events and summary.json; return the summary. ``after`` is the
    held-out figure after RL, None when the run stopped before its end, or the error that kept
    the final evaluation from measuring it: the "after" figures are then null (and the error is
    in ``final_evaluation_error``), the rest is written as always."""
    records = loop.metrics()
    measured = after if isinstance(after, dict) else None
    restarts = resume_times(loop.run_dir / "trained.jsonl")
    rate = samples_per_s(records, restarts)
    evals = {"held-out sampled before RL": before["mean_reward"], "held-out greedy before RL": before["greedy"],
             "held-out sampled after RL": measured and measured["mean_reward"],
             "held-out greedy after RL": measured and measured["greedy"]}
    plot = write_plot(records, loop.run_dir / "plot.png", evals, samples_per_s_run=rate, restarts=restarts)
    write_tensorboard(records, loop.run_dir / "tensorboard")
    last = records[-1] if records else {}
    # Fewer than two steps measure no rate: null in summary.json (NaN is not JSON).
    elapsed = max(trained_span(records, restarts)[1], 1e-9) if len(records) > 1 else None
    summary = {
        "run_dir": str(loop.run_dir),
        "task": (loop.cfg.task.name if loop.cfg.task.source != "env" else "its own episodes")
        + (f" in env {loop.cfg.env.name}" if loop.cfg.env.name else ""),
        "held_out_prompts": before["n"],
        "held_out_reward_before": before["mean_reward"],
        "held_out_reward_after": measured and measured["mean_reward"],
        "held_out_greedy_before": before["greedy"],
        "held_out_greedy_after": measured and measured["greedy"],
        "gain_points": 100 * (measured["mean_reward"] - before["mean_reward"]) if measured else None,
        "gain_points_greedy": 100 * (measured["greedy"] - before["greedy"]) if measured else None,
        "final_evaluation_error": str(after) if isinstance(after, Exception) else None,
        "finished": measured is not None,
        "steps": last.get("step", 0),
        "steps_planned": loop.cfg.trainer.steps,
        "policy_version": last.get("policy_version", 0),
        "samples_trained": last.get("samples_total", 0),
        # samples trained between the first and the last step over the seconds between them
        # (app/local/report.py samples_per_s: the plot's throughput panel, over a window)
        "samples_per_s": rate,
        "train_s": elapsed,
        "buffer": last.get("buffer", {}),
        "stale_share": stale_share(last.get("buffer", {})),  # finished groups thrown away as too stale
        "failures": rollout_failures(loop),
        "note": greedy_note(loop.cfg, before, measured),
        "wall_s": time.time() - started,
        "plot": str(plot),
    }
    tmp = loop.run_dir / ".summary.json.tmp"
    tmp.write_text(json.dumps(summary, indent=2, allow_nan=False))
    os.replace(tmp, loop.run_dir / "summary.json")
    return summary


# Points a held-out figure moves by chance between two measurements (app/envs/evaluate.py).
EVAL_NOISE_POINTS = 3.0


LOWER_TEMPERATURE = 0.7  # the rollout temperature that kept greedy on the sorting environment


def greedy_note(cfg: RunConfig, before: dict, after: dict | None) -> str | None:
    """What to change when greedy decoding fell (by more than `EVAL_NOISE_POINTS`) while the
    sampled figure rose, or None. Why, as measured on a letter-sorting environment
    (bench/results/run-task.md): rollouts sampled far from the greedy answers (at temperature 1.0
    most were wrong while greedy decoding was right) taught RL answers that moved the greedy one;
    at 0.7 greedy held while sampled still rose, and giving each turn its own share of the reward
    did not keep it. On a roman-numeral environment greedy fell at 0.7 and 0.49 alike."""
    if after is None:
        return None
    sampled, greedy = 100 * (after["mean_reward"] - before["mean_reward"]), 100 * (after["greedy"] - before["greedy"])
    if sampled <= 0 or greedy >= -EVAL_NOISE_POINTS:
        return None
    t = cfg.rollout.temperature
    cause = (f"greedy fell ({greedy:+.1f} points) while sampled rose ({sampled:+.1f}): RL learned from rollouts sampled at "
             f"rollout.temperature {t:g}, {'far ' if before['greedy'] - before['mean_reward'] > 0.2 else ''}from the "
             f"greedy answers (held-out before RL: sampled {before['mean_reward']:.3f}, greedy {before['greedy']:.3f}), "
             "and moved them; ")
    if t > LOWER_TEMPERATURE:
        return cause + (f"a lower temperature trains nearer them (--set rollout.temperature={LOWER_TEMPERATURE:g}; on a "
                        "sorting environment 1.0 -> 0.7 turned greedy -11.5 into -1.2 points, docs/your-own-environment.md)")
    # At 0.7 a lower temperature did not help a roman-numeral environment (bench/results/run-task.md):
    # no setting to name, only where to look.
    return cause + (f"at {t:g} a lower temperature did not keep greedy on another environment; look at the warm-up "
                    "(more demonstrations or steps) and how the reward pays near-misses (docs/your-own-environment.md)")


def rollout_failures(loop: EmbeddedLoop) -> dict:
    """Failed rollout groups of the run (a reward or environment call failed: never trained):
    requeued and dropped after ``buffer.max_failures`` (the buffer's counters), with the reasons
    the workers counted (app/buffer/health.py), most frequent first."""
    try:
        buf = loop.buffer()
        try:
            stats, health = buf.stats(), buf.health()
        finally:
            buf.close()
    except Exception:  # noqa: BLE001 - Redis already gone: the last step's buffer figures
        stats = loop.metrics()[-1].get("buffer", {}) if loop.metrics() else {}
        health = None
    requeued, dropped = int(stats.get("failed_requeued", 0)), int(stats.get("failed_dropped", 0))
    return {"failed": requeued + dropped, "requeued": requeued, "dropped": dropped,
            "top_reasons": health.top(3) if health is not None else []}


def print_summary(s: dict) -> None:
    def fmt(x):
        return "n/a" if x is None else f"{x:.3f}"

    def gain(x):
        return "" if x is None else f" ({x:+.1f} points)"

    rate = "n/a samples/s" if s["samples_per_s"] is None else f"{s['samples_per_s']:.1f} samples/s"
    console.rule("moerl run: summary")
    console.print(f"task {s['task']}: held-out mean reward over {s['held_out_prompts']} prompts, before RL -> after RL")
    console.print(
        f"  sampled {fmt(s['held_out_reward_before'])} -> {fmt(s['held_out_reward_after'])}{gain(s['gain_points'])}"
        f"   greedy {fmt(s['held_out_greedy_before'])} -> {fmt(s['held_out_greedy_after'])}"
        f"{gain(s['gain_points_greedy'])}", soft_wrap=True
    )
    if not s["finished"]:
        console.print(f"  (after RL not measured: {s['final_evaluation_error'] or 'the run stopped before its end'})",
                      soft_wrap=True)
    console.print(
        f"  {s['steps']} trainer steps, policy v{s['policy_version']}, {s['samples_trained']} samples "
        f"trained, {rate} over {(s['train_s'] or 0) / 60:.1f} min of training; "
        f"{s['wall_s'] / 60:.1f} min in all (warm-up and evaluations included)", soft_wrap=True
    )
    f = s["failures"]
    reasons = "; ".join(f"{reason} ({n})" for reason, n in f["top_reasons"])
    console.print(f"  failed rollout groups: {f['failed']} ({f['requeued']} requeued, {f['dropped']} dropped after "
                  f"buffer.max_failures){f'; top reasons: {reasons}' if reasons else ''}", soft_wrap=True)
    if s.get("note"):
        console.print(f"  [yellow]note:[/] {s['note']}", soft_wrap=True)
    console.print(f"  run directory {s['run_dir']}  (run.yaml, metrics.jsonl, tensorboard/, plot.png, "
                  "summary.json, logs/)", soft_wrap=True)
