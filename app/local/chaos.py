"""`moerl chaos`: the embedded loop under a seeded fault schedule, audited by an independent ledger.

One invocation runs two loops of ``--steps`` trainer steps on this machine (app/local/embedded.py):

1. disturbed: while the trainer works, a schedule drawn from ``--seed`` sends SIGTERM (a Spot
   notice: the worker drains) or SIGKILL (a lost node: the worker and its engine die at once)
   to random rollout workers, which are restarted at once, as a Deployment would; kills the
   trainer once (SIGKILL to torchrun and its ranks) and restarts it with ``--resume``; and kills
   and restarts redis-server once (SIGKILL; append-only file with ``appendfsync always``); with
   ``--env-kills N`` the loop runs multi-turn episodes (``spell-retry``, app/envs/environments.py)
   against an environment server (`moerl env`, the env pool's pod) that is SIGKILLed N times
   and restarted at once: the episodes open on it fail, and their tasks go back to the queue
   (`ExperienceBuffer.fail`), to be played again.
   Events are keyed to trainer progress (the step of the newest metrics line), so the same
   seed gives the same schedule whatever the machine's speed.
2. undisturbed (``--baseline``, default on): the same configuration without faults, for the
   throughput ratio (disturbed / undisturbed trained samples per second, each from the
   trainer's start to its last step).

Prompts are fed by the harness a few at a time (issued.jsonl records each before it is
queued); the trainer records what it trains on (trained.jsonl). When the trainer is done the
workers drain and the ledger (app/ledger.py, where "lost" is defined) compares the two, plus
what Redis still holds. The base policy is a tiny random model (app.model tiny_config +
build_policy with ``--seed``), so no warm-up is needed. Prints prompts issued, completed,
lost, samples trained more than once, samples trained older than ``buffer.max_staleness`` and
the throughput ratio; exits 1 if lost, duplicated or over-stale is not zero. Prompts dropped
after ``buffer.max_failures`` failed rollouts are counted apart ("dropped"): accounted for,
never trained, not lost.
"""

from __future__ import annotations

import json
import os
import random
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

import redis
import typer

from app.config import RunConfig
from app.envs.tasks import make_splits, make_tasks as to_tasks
from app.local.embedded import EmbeddedLoop, RoleFailed
from app.ledger import Audit, append_issued, audit, pending_prompts, read_issued, read_lineage

cli = typer.Typer(add_completion=False, help="Run the loop under a seeded fault schedule and audit the ledger.")


@dataclass
class Event:
    """One fault: fire once when the trainer's progress reaches ``at_step``."""

    at_step: int
    kind: str  # "worker-term" | "worker-kill" | "trainer-kill" | "redis-restart" | "env-kill"
    target: int = -1  # worker index for worker events
    fired_at: float | None = None


def make_schedule(rng: random.Random, steps: int, workers: int, worker_kills: int, save_every: int = 1,
                  env_kills: int = 0) -> list[Event]:
    """The seeded fault schedule: ``worker_kills`` worker events spread over steps 1..steps-1
    (SIGTERM and SIGKILL alternating from a random start, so both appear once there are two),
    one trainer kill near 40 % of the run (just after a step that is not saved, so the resume
    rolls it back) and one Redis restart near 65 %; ``env_kills`` environment-server kills spread
    over the run the same way (drawn after the others, so they leave the rest of a seed's
    schedule as it was).

    Raises:
        ValueError: ``steps`` < 4 (no room for the events), ``worker_kills`` or ``env_kills`` < 0.
    """
    if steps < 4:
        raise ValueError(f"--steps must be >= 4 for a fault schedule, got {steps}")
    if worker_kills < 0 or env_kills < 0:
        raise ValueError(f"--worker-kills and --env-kills must be >= 0, got {worker_kills}, {env_kills}")
    events = []
    first = rng.randrange(2)
    for k in range(worker_kills):
        # Evenly spaced over the run with jitter, never at the very end (the run must see it).
        centre = 1 + (k + 0.5) * (steps - 2) / max(worker_kills, 1)
        at = min(steps - 1, max(1, round(centre + rng.uniform(-0.4, 0.4) * (steps - 2) / max(worker_kills, 1))))
        kind = "worker-term" if (k + first) % 2 == 0 else "worker-kill"
        events.append(Event(at, kind, rng.randrange(workers)))
    at = max(1, round(0.4 * steps))
    if save_every > 1 and at % save_every == 0:
        at += 1
    events.append(Event(at, "trainer-kill"))
    events.append(Event(max(2, round(0.65 * steps)), "redis-restart"))
    for k in range(env_kills):
        centre = 1 + (k + 0.5) * (steps - 2) / env_kills
        at = min(steps - 1, max(1, round(centre + rng.uniform(-0.4, 0.4) * (steps - 2) / env_kills)))
        events.append(Event(at, "env-kill"))
    return sorted(events, key=lambda e: (e.at_step, e.kind))


def chaos_config(steps: int, seed: int, run_dir: Path, *, group_size: int, groups_per_step: int,
                 save_every: int, max_new_tokens: int, workers: int, env: str | None = None) -> RunConfig:
    """Small settings that let the whole loop run on two shared CPU cores; ``env``: multi-turn
    episodes against that environment (`moerl env`)."""
    cfg = RunConfig(run_id="chaos", store_url=f"file://{run_dir / 'store'}")
    cfg.task.seed = seed
    cfg.task.eval_size = 10
    cfg.task.train_size = max(200, steps * groups_per_step * 3)
    b = cfg.buffer
    b.max_staleness = 1
    b.stale_policy = "requeue"  # a stale group's prompt is generated again, not dropped
    b.lease_ms = 4000  # a killed worker's leases come back after 4 s
    r = cfg.rollout
    r.group_size = group_size
    r.max_new_tokens = max_new_tokens
    r.inflight_sequences = 2 * r.group_size
    r.drain_grace_s = 5.0
    r.request_timeout_s = 30.0
    r.engine_retries = 2
    r.retry_backoff_s = 0.2
    r.policy_poll_s = 0.5
    r.weight_update_timeout_s = 30.0
    r.policy_cache_dir = str(run_dir / "policy-cache")
    # The trainer's minimum plus one group per worker: a longer queue of finished groups only
    # ages them past max_staleness (they are then generated again).
    b.capacity_groups = (save_every + 1) * groups_per_step + workers
    t = cfg.trainer
    t.steps = steps
    t.groups_per_step = groups_per_step
    t.lr = 1e-4
    t.publish_every = 1
    t.save_every = save_every
    t.keep_versions = 3
    t.batch_timeout_s = 300.0
    t.log_entropy = False
    if env:
        cfg.env.name = env
        cfg.env.max_turns = 2
        cfg.env.step_timeout_s = 5.0
        b.max_failures = 5  # a task may meet several env kills; a dropped one is counted apart
    return cfg


def make_base_policy(cfg: RunConfig, out: Path) -> Path:
    """A tiny random policy (``model.preset``, seed ``task.seed``) with the character tokenizer."""
    # torch and transformers for the base policy only: the chaos driver runs without them
    from app.model.tokenizer import save_tokenizer
    from app.model.checkpoint import save_policy
    from app.model.config import tiny_config
    from app.model.parallel import EPContext
    from app.model.policy import build_policy

    if (out / "config.json").exists():
        return out
    ep = EPContext.local()
    model = build_policy(tiny_config(cfg.model.preset), cfg.router, ep, seed=cfg.task.seed)
    save_policy(model, out, ep, overwrite=True)
    save_tokenizer(out)
    return out


def make_tasks(cfg: RunConfig, base: Path) -> list:
    """The training prompts of ``cfg.task`` as Task records (ids "train-NNNNNN")."""
    # transformers for the prompts only: the chaos driver runs without it
    from app.model.tokenizer import load_tokenizer

    train, _ = make_splits(cfg.task)
    return to_tasks(train, load_tokenizer(base), cfg.rollout.group_size)


@dataclass
class RunResult:
    """What one loop did: the audit, throughput and the faults injected."""

    audit: Audit
    samples_per_s: float
    wall_s: float
    faults: dict[str, int] = field(default_factory=dict)


def progress(loop: EmbeddedLoop) -> int:
    """The trainer's newest step (its last metrics line; 0 before the first)."""
    path = loop.run_dir / "metrics.jsonl"
    if not path.exists():
        return 0
    step = 0
    with open(path, "rb") as f:
        try:
            f.seek(-4096, os.SEEK_END)
        except OSError:
            f.seek(0)
        for line in f.read().decode(errors="replace").splitlines():
            try:
                step = int(json.loads(line)["step"])
            except (ValueError, KeyError, TypeError):
                continue
    return step


class Feeder:
    """Queues prompts a few at a time (a short queue keeps the end-of-run 'pending' set small),
    writing each to issued.jsonl before it is queued."""

    def __init__(self, loop: EmbeddedLoop, tasks: list, low_water: int):
        self.loop = loop
        self.tasks = tasks
        self.next = 0
        self.low_water = low_water
        self.path = loop.run_dir / "issued.jsonl"
        self.buf = None

    def feed(self) -> None:
        """Top the queue up to ``2 * low_water``; a Redis error is left for the next call."""
        try:
            if self.buf is None:
                self.buf = self.loop.buffer()
            queued = self.buf.stats()["queued"]
            if queued >= self.low_water:
                return
            batch = self.tasks[self.next: self.next + 2 * self.low_water - queued]
            if not batch:
                return
            append_issued(self.path, [t.task_id for t in batch])
            self.buf.put_tasks(batch)
            self.next += len(batch)
        except (redis.RedisError, ConnectionError):
            self.buf = None  # reconnect next time (redis-server restarting)


def run_loop(cfg: RunConfig, run_dir: Path, base: Path, tasks: list, workers: int,
             events: list[Event], kill_engines: bool, timeout_s: float, say) -> RunResult:
    """Run one embedded loop to ``trainer.steps`` steps, firing ``events``; then drain and audit.

    Raises:
        RoleFailed: the trainer failed on its own (not killed by us), or the run timed out.
    """
    loop = EmbeddedLoop(cfg, run_dir, workers=workers)
    faults = {"worker_sigterm": 0, "worker_sigkill": 0, "engine_sigkill": 0, "trainer_sigkill": 0,
              "redis_restart": 0, "env_sigkill": 0}
    try:
        loop.start_redis(appendfsync="always")
        loop.cfg.model.path = str(base)
        loop.write_config()
        feeder = Feeder(loop, tasks, low_water=2 * workers * cfg.rollout.inflight_tasks())
        feeder.feed()
        started = time.time()
        loop.start_trainer()
        loop.start_rollout(base)
        trainer_killed = False
        deadline = time.monotonic() + timeout_s
        while True:
            trainer = loop.sup.procs["trainer"]
            code = trainer.returncode()
            if code == 0:
                break
            if code is not None:
                if trainer_killed:
                    trainer_killed = False
                    say(f"  restarting the trainer with --resume (it exited {code})")
                    loop.start_trainer(resume=True)
                else:
                    raise RoleFailed(f"trainer exited with {code}:\n{trainer.tail(40)}")
            if time.monotonic() > deadline:
                raise RoleFailed(f"run not done after {timeout_s:.0f}s (step {progress(loop)})")
            feeder.feed()
            step = progress(loop)
            for ev in events:
                if ev.fired_at is None and step >= ev.at_step:
                    ev.fired_at = time.time()
                    if ev.kind == "worker-term":
                        loop.sup.procs[f"worker-{ev.target}"].signal(signal.SIGTERM)
                        faults["worker_sigterm"] += 1
                    elif ev.kind == "worker-kill":
                        loop.sup.procs[f"worker-{ev.target}"].signal(signal.SIGKILL)
                        faults["worker_sigkill"] += 1
                        if kill_engines:
                            loop.sup.procs[f"engine-{ev.target}"].signal(signal.SIGKILL)
                            faults["engine_sigkill"] += 1
                    elif ev.kind == "trainer-kill":
                        if not trainer.alive():
                            say(f"  {time.time() - started:5.1f}s step {step}: trainer already done; no kill")
                            continue
                        trainer.kill_tree()  # torchrun and its ranks (each in its own session)
                        trainer_killed = True
                        faults["trainer_sigkill"] += 1
                    elif ev.kind == "redis-restart":
                        loop.redis.restart(graceful=False)
                        faults["redis_restart"] += 1
                    elif ev.kind == "env-kill":  # the env pool's pod: its open episodes die with it
                        loop.sup.procs["env-0"].signal(signal.SIGKILL)
                        faults["env_sigkill"] += 1
                    say(f"  {time.time() - started:5.1f}s step {step}: {ev.kind}"
                        f"{'' if ev.target < 0 else f' worker-{ev.target}'}")
            # Restart what died (a Deployment's job); a worker whose engine is down waits for it.
            for name, proc in list(loop.sup.procs.items()):
                if name.startswith(("engine-", "worker-", "env-")) and not proc.alive():
                    proc.start()
            time.sleep(0.1)
        lineage_end = time.time()
        say(f"  {time.time() - started:5.1f}s trainer done at step {progress(loop)}; draining the workers")
        loop.stop_rollout()
        with loop.buffer() as buf:
            pending = pending_prompts(buf)
            dropped = {key.rsplit("/", 1)[0] for key in buf.dropped_tasks()}
            faults["failed_rollouts_requeued"] = buf.stats()["failed_requeued"]
    finally:
        loop.close()
    lineage = read_lineage(run_dir / "trained.jsonl")
    result = audit(read_issued(run_dir / "issued.jsonl"), lineage, pending, cfg.buffer.max_staleness, dropped)
    end = lineage.last_time or lineage_end
    return RunResult(result, result.samples_trained / max(end - started, 1e-9), end - started, faults)


def run_chaos(steps: int, workers: int, seed: int, worker_kills: int, out: Path, *, baseline: bool = True,
              group_size: int = 4, groups_per_step: int = 2, save_every: int = 2, max_new_tokens: int = 8,
              kill_engines: bool = True, timeout_s: float = 1200.0, say=print, env_kills: int = 0) -> dict:
    """Run the disturbed loop (and the undisturbed baseline); returns the summary dict.

    Raises:
        ValueError: bad sizes (named); ``out`` exists and is not empty.
        RoleFailed: a role failed on its own or a loop timed out.
    """
    if workers < 1:
        raise ValueError(f"--workers must be >= 1, got {workers}")
    out = Path(out).resolve()
    if out.exists() and any(out.iterdir()):
        raise ValueError(f"--out {out} is not empty")
    rng = random.Random(seed)
    events = make_schedule(rng, steps, workers, worker_kills, save_every, env_kills)
    out.mkdir(parents=True, exist_ok=True)
    kw = dict(group_size=group_size, groups_per_step=groups_per_step, save_every=save_every,
              max_new_tokens=max_new_tokens, workers=workers, env="spell-retry" if env_kills else None)
    cfg = chaos_config(steps, seed, out / "disturbed", **kw)
    base = make_base_policy(cfg, out / "base")
    tasks = make_tasks(cfg, base)
    say(f"chaos: {steps} steps, {workers} workers, {len(events)} faults (seed {seed}); run dir {out}")
    disturbed = run_loop(cfg, out / "disturbed", base, tasks, workers, events, kill_engines, timeout_s, say)
    summary = {"command": "disturbed", "schedule": [e.__dict__ for e in events],
               "disturbed": {**disturbed.audit.to_dict(), "samples_per_s": disturbed.samples_per_s,
                             "wall_s": disturbed.wall_s, "faults": disturbed.faults}}
    if baseline:
        say("chaos: undisturbed run of the same length")
        cfg_b = chaos_config(steps, seed, out / "undisturbed", **kw)
        calm = run_loop(cfg_b, out / "undisturbed", base, tasks, workers, [], kill_engines, timeout_s, say)
        summary["undisturbed"] = {**calm.audit.to_dict(), "samples_per_s": calm.samples_per_s,
                                  "wall_s": calm.wall_s}
        summary["throughput_ratio"] = disturbed.samples_per_s / max(calm.samples_per_s, 1e-9)
    else:
        summary["throughput_ratio"] = None
    summary["ok"] = disturbed.audit.ok()
    tmp = out / ".chaos.json.tmp"
    tmp.write_text(json.dumps(summary, indent=1))
    os.replace(tmp, out / "chaos.json")
    return summary


def format_summary(s: dict) -> str:
    d = s["disturbed"]
    f = d["faults"]
    ratio = s["throughput_ratio"]
    lines = [
        f"faults: {f['worker_sigterm']} worker SIGTERM, {f['worker_sigkill']} worker SIGKILL "
        f"({f['engine_sigkill']} with their engine), {f['trainer_sigkill']} trainer SIGKILL + --resume, "
        f"{f['redis_restart']} redis-server SIGKILL + restart, {f.get('env_sigkill', 0)} env server SIGKILL "
        f"({f.get('failed_rollouts_requeued', 0)} failed rollouts requeued)",
        f"trainer steps (final lineage): {d['steps']}  rolled back by resume: {d['rolled_back_steps']}",
        f"prompts issued:     {d['issued']}",
        f"prompts completed:  {d['completed']}",
        f"prompts pending:    {d['pending']}  (queued, leased or finished-untrained at the end)",
        f"prompts dropped:    {d['dropped']}  (after buffer.max_failures failed rollouts; never trained)",
        f"prompts lost:       {d['lost']}",
        f"samples trained:    {d['samples_trained']}",
        f"samples trained more than once:      {d['duplicated']}",
        f"samples trained older than max_staleness: {d['overstale']}",
        f"disturbed throughput:   {d['samples_per_s']:.2f} samples/s over {d['wall_s']:.0f} s",
    ]
    if ratio is not None:
        u = s["undisturbed"]
        lines.append(f"undisturbed throughput: {u['samples_per_s']:.2f} samples/s over {u['wall_s']:.0f} s")
        lines.append(f"throughput ratio (disturbed/undisturbed): {ratio:.3f}")
    lines.append("OK: nothing lost, duplicated or over-stale" if s["ok"] else "FAIL")
    return "\n".join(lines)


@cli.command()
def chaos(
    steps: int = typer.Option(12, "--steps", min=4, help="Trainer steps of each run."),
    workers: int = typer.Option(2, "--workers", min=1, help="Rollout workers (one engine each)."),
    seed: int = typer.Option(0, "--seed", help="Seed of the fault schedule and the base policy."),
    worker_kills: int = typer.Option(4, "--worker-kills", min=0, help="Worker faults (SIGTERM/SIGKILL alternate)."),
    out: Path = typer.Option(None, "--out", help="Run directory (default runs/chaos-<time>); must be empty."),
    baseline: bool = typer.Option(True, "--baseline/--no-baseline", help="Also run undisturbed for the ratio."),
    group_size: int = typer.Option(4, "--group-size", min=2, help="Completions per prompt (G)."),
    groups_per_step: int = typer.Option(2, "--groups-per-step", min=1, help="GRPO groups per step."),
    save_every: int = typer.Option(2, "--save-every", min=1, help="Steps between saved training states."),
    kill_engines: bool = typer.Option(True, "--kill-engines/--no-kill-engines",
                                      help="A worker SIGKILL also kills its engine (a lost node)."),
    timeout_s: float = typer.Option(1200.0, "--timeout-s", min=10, help="Limit of each run, seconds."),
    env_kills: int = typer.Option(0, "--env-kills", min=0, help="Environment-server SIGKILLs (the run then plays "
                                  "multi-turn spell-retry episodes against `moerl env`)."),
) -> None:
    """Run the loop under faults, print the ledger's figures; exit 1 if anything was lost,
    trained twice or trained over-stale."""
    out = out or Path("runs") / f"chaos-{time.strftime('%Y%m%d-%H%M%S')}"
    try:
        s = run_chaos(steps, workers, seed, worker_kills, out, baseline=baseline, group_size=group_size,
                      groups_per_step=groups_per_step, save_every=save_every, kill_engines=kill_engines,
                      timeout_s=timeout_s, env_kills=env_kills)
    except (ValueError, RoleFailed) as e:
        typer.echo(f"moerl chaos: {e}", err=True)
        raise SystemExit(2) from None
    typer.echo(format_summary(s))
    raise SystemExit(0 if s["ok"] else 1)
