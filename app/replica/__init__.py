"""`moerl replica dist/`: every pod of the synthesized manifests, run as local processes.

    moerl replica dist/ [--out runs/replica-<time>] [--steps 250] [--chaos/--no-chaos] [--router]

1. synthesizes (charts8s) the manifests of a small workload into ``dist/``: one trainer node
   running 2 processes (EP 2), 2 rollout pods, the env pool, the Redis buffer and the feed pod
   with its held-out evaluation engine; the run config is the tiny recipe of `make run` starting
   from its warm-up checkpoint (``--no-synth`` runs the manifests already in ``dist/``);
2. runs what dist/ holds (app/replica/cluster.py, kubelet.py, network.py, aws.py): every
   container of every pod with the manifest's command, args and environment, ConfigMaps and
   Secrets written where the pod mounts them, per-pod directories, Services and pod DNS names on
   loopback addresses, S3 on moto with Pod Identity credentials, probes, restarts, preStop hooks
   and grace periods as the kubelet plays them, and the controllers' restarts (Deployment,
   StatefulSet, Volcano ``RestartJob``, LeaderWorkerSet);
3. with ``--chaos`` (default), deletes a rollout pod (graceful: preStop, SIGTERM, SIGKILL after
   its grace period) and SIGKILLs the trainer pod (the Volcano policy restarts the gang, every
   pod with ``--resume``), keyed to the trainer's progress;
4. when the trainer's Job completes and the feed pod has measured the final version: drains the
   rollout pods, audits the ledger (app/ledger.py: the feed pod's issued.jsonl against the
   trainer pods' trained.jsonl, every incarnation, and what Redis still holds) and writes
   ``replica.json``: held-out reward before (v0) and after (the final version), ledger figures,
   the substitutions made, the events.

Substituted, and nothing else: the image (this venv and repository), the engine (the built-in
`moerl engine` for SGLang), GPU counts (torchrun processes per node), torchrun's rendezvous port
(one free on the host), the S3 endpoint (moto).
The model is the warm-up checkpoint as a local directory, standing for one baked into the image.
"""

from __future__ import annotations

import json
import os
import secrets as pysecrets
import signal
import subprocess
import sys
import time
from pathlib import Path

import typer
import yaml

from app.buffer import ExperienceBuffer
from app.buffer.experience import stale_share
from app.config import RunConfig
from app.ledger import audit, pending_prompts, read_issued, read_lineage
from app.local.procs import sigterm_as_interrupt
from app.local.report import read_metrics
from app.local.run import embedded_default, warmup_dir
from app.replica.cluster import Cluster
from app.replica.kubelet import PodError
from app.replica.manifests import ManifestError, read_manifests, secret_keys
from infra.config import load_config

cli = typer.Typer(add_completion=False, help="Run every pod of synthesized manifests (dist/) as local processes.")
REPO = Path(__file__).resolve().parents[2]


def pod_path(pod, path: str) -> Path:
    """Where ``path`` of the pod (a path its manifest names) is on this host."""
    return Path(pod.rewrite(path))


def trainer_run_dir(pod) -> Path:
    # charts8s needs the infra extra (cdk8s, torchx): only where the replica reads or renders charts
    from charts8s.trainer import RUN_DIR

    return pod_path(pod, RUN_DIR)


def feed_run_dir(pod) -> Path:
    # charts8s needs the infra extra (cdk8s, torchx): only where the replica reads or renders charts
    from charts8s.feed import RUN_DIR

    return pod_path(pod, RUN_DIR)


def small_run_config(steps: int, base: Path, router: bool = False):
    """The run config of the replica: `make run`'s tiny recipe (app/local/run.py `embedded_default`),
    starting from the warm-up checkpoint ``base``, with short drain and lease times so that a
    deleted pod's work returns within the run, and held-out evaluation at the start and end;
    with ``router``, SGLang's router in front of the engines (its Deployment runs the real
    sglang-router binary)."""
    cfg = embedded_default()
    cfg.run_id = "replica"
    cfg.model.path = str(base)
    cfg.trainer.steps = steps
    cfg.trainer.save_every = 2  # the trainer kill lands after an unsaved step: the resume rolls it back
    cfg.buffer.capacity_groups = (cfg.trainer.save_every + 1) * cfg.trainer.groups_per_step
    # The dev cluster recipe's version per step and engine batch (recipes/dev-tiny-grpo.yaml),
    # not the embedded default's tuning for 2 CPU cores.
    cfg.trainer.publish_every = 1
    cfg.rollout.engine.max_running_requests = 32
    cfg.buffer.lease_ms = 4000
    cfg.buffer.stale_policy = "requeue"  # a stale group is generated again: no prompt is dropped
    cfg.rollout.drain_grace_s = 5.0
    cfg.rollout.request_timeout_s = 30.0
    cfg.rollout.weight_update_timeout_s = 60.0
    # A trainer that gets no groups says so (its TimeoutError names what it waited for) long
    # before the replica's --timeout-s stops the run (the test's is 600 s).
    cfg.trainer.batch_timeout_s = 120.0
    cfg.feed.eval_every = steps  # v0 and the final version
    cfg.feed.eval_samples = 8  # 1600 completions per measurement: ~1 point of standard error
    cfg.feed.poll_s = 0.5
    if router:
        cfg.rollout.router, cfg.rollout.pause_mode = True, "abort"
    return cfg.validated()


def write_workload(out: Path, steps: int, base: Path, router: bool = False) -> tuple[Path, Path]:
    """Write the small workload: run config, workloads file and deployment overrides (one more
    rollout-gpu node than dev's 2, for the feed pod's evaluation engine; the run among
    trainer_runs, as charts8s requires). Returns (workloads, overrides)."""
    out.mkdir(parents=True, exist_ok=True)
    run = small_run_config(steps, base, router)
    run.save(out / "run.yaml")
    wl = {"run_config": str(out / "run.yaml"), "trainer": {"nodes": 1},
          "rollout": {"replicas": 2, "model_path": str(base), "drain_margin_s": 2},
          "env": {"replicas": 2}}
    (out / "workloads.yaml").write_text(yaml.safe_dump(wl, sort_keys=False))
    (out / "deploy.yaml").write_text(yaml.safe_dump({"pools": {"rollout-gpu": {"max_size": 3}}, "trainer_runs": [run.run_id]}))
    return out / "workloads.yaml", out / "deploy.yaml"


def warm_base(cache: Path, steps: int) -> Path:
    """The warm-up checkpoint of the replica's recipe (`moerl warmup`, cached by recipe as
    `moerl run` caches it)."""
    cfg = small_run_config(steps, Path("/unused"))
    cfg.model.path = None
    out = warmup_dir(cfg, cache.resolve())
    if not (out / "config.json").exists():
        cache.mkdir(parents=True, exist_ok=True)
        conf = cache / "replica-warmup.yaml"
        cfg.save(conf)
        subprocess.run([sys.executable, "-m", "app.cli", "warmup", "--config", str(conf), "--out", str(out)],
                       check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    return out


def progress(cluster) -> int:
    """The trainer's newest step over every trainer pod incarnation (metrics.jsonl)."""
    step = 0
    for pod in cluster.history:
        if cluster.owner[pod.name].kind == "Job":
            path = trainer_run_dir(pod) / "metrics.jsonl"
            if path.exists():
                recs = read_metrics(path)
                if recs:
                    step = max(step, int(recs[-1]["step"]))
    return step


class StepCounter:
    """The replica's live progress: a line each time the trainer passes another 5 % of its
    steps (``  <s>s trainer step N/M, pods running R/P``), and while it has made none, one
    every 15 s saying how many pods run (starting the pods and loading models takes a minute
    on 2 cores, and the replica must not look hung)."""

    def __init__(self, steps: int, started: float, say, every_s: float = 15.0):
        self.steps, self.started, self.say, self.every_s = steps, started, say, every_s
        self.stride = max(1, steps // 20)
        self.shown = 0  # the last step printed
        self.quiet_since = time.monotonic()

    def update(self, step: int, running: int, pods: int) -> None:
        now = time.monotonic()
        due = step >= self.shown + self.stride or (step == self.steps and step > self.shown)
        if due or (step == self.shown and now - self.quiet_since >= self.every_s):
            what = f"trainer step {step}/{self.steps}" if step else "waiting for the trainer's first step"
            self.say(f"  {time.time() - self.started:5.0f}s {what}, pods running {running}/{pods}")
            self.shown = max(self.shown, step)
            self.quiet_since = now


def _cat(paths: list[Path], out: Path) -> Path:
    """Concatenate files in order into ``out`` (the pods' ledgers, oldest incarnation first)."""
    with open(out, "w") as f:
        for p in paths:
            if p.exists():
                f.write(p.read_text())
    return out


def run_replica(dist: Path, out: Path, *, env: str = "dev", overrides: Path | None = None, chaos: bool = True,
                procs_per_node: int = 2, timeout_s: float = 1800.0, image_repo: Path = REPO, say=print) -> dict:
    """Run the manifests in ``dist`` (module docstring, steps 2-4); returns the summary.

    Raises:
        FileNotFoundError, ManifestError, PodError: manifests the replica cannot run (named).
        TimeoutError: the trainer's Job did not complete within ``timeout_s``.
        RuntimeError: the trainer's Job failed.
    """
    cfg = load_config(env, overrides)
    m = read_manifests(dist)
    # charts8s needs the infra extra (cdk8s, torchx): only where the replica reads or renders charts
    from charts8s.cluster import RUN_CONFIG_KEY, RUN_CONFIG_MAP

    run = RunConfig.model_validate(yaml.safe_load(m.config_maps[RUN_CONFIG_MAP][RUN_CONFIG_KEY]))
    if not run.store_url.startswith("s3://"):
        raise ManifestError(f"the mounted run config's store_url is {run.store_url!r}; the cluster's is s3://")

    # What `kubectl create secret` makes (docs/cluster.md): a random value for every key the pods read.
    secret_values = {name: {key: pysecrets.token_hex(16) for key in keys or {"password"}}
                     for name, keys in secret_keys(m).items()}
    out.mkdir(parents=True, exist_ok=True)
    cluster = Cluster(m, out, secret_values,
                      dict(bin_dir=str(Path(sys.executable).parent), repo=str(image_repo), procs_per_gpu_node=procs_per_node),
                      # the bucket the mounted run config names (store_url: s3://bucket/prefix)
                      bucket=run.store_url.removeprefix("s3://").split("/")[0], region=cfg.region,
                      associations={cfg.trainer_service_account_of(run.run_id), cfg.rollout_service_account})
    # charts8s (cdk8s, torchx): see trainer_run_dir
    from charts8s.feed import NAME as FEED
    from charts8s.rollout import NAME as ROLLOUT

    job = next(w.name for w in m.workloads if w.kind == "Job")
    feed = next((w.name for w in m.workloads if w.name == FEED), None)
    rollout = next(w.name for w in m.workloads if w.name == ROLLOUT)
    steps = run.trainer.steps
    events = [(max(1, round(0.3 * steps)), "delete-rollout-pod"), (max(2, round(0.6 * steps)), "kill-trainer-pod")]
    save_every = run.trainer.save_every
    fired: list[dict] = []
    started = time.time()
    say(f"replica: {len(m.workloads)} workloads from {dist}; pods under {out / 'pods'}")
    counter = StepCounter(steps, started, say)
    final_eval = None
    try:
        cluster.start()
        deadline = time.monotonic() + timeout_s
        done_at = None
        while True:
            cluster.reconcile()
            phase = cluster.job_phase(job)
            if phase == "Failed":
                raise RuntimeError(f"the trainer's Volcano Job failed; see {out / 'events.log'} and the pods' logs")
            step = progress(cluster)
            live = [p for p in cluster.pods.values() if p.phase == "Running"]
            counter.update(step, len(live), len(cluster.pods))
            for at, kind in events if chaos else []:
                # The trainer is killed just after a step that was not saved (step % save_every
                # != 0): the resumed gang rolls that step back and trains its groups again.
                unsaved = kind != "kill-trainer-pod" or step % save_every != 0
                if step >= at and unsaved and kind not in {e["kind"] for e in fired}:
                    if kind == "delete-rollout-pod":
                        target = cluster.pods_of(rollout)[0].name
                        say(f"  {time.time() - started:5.0f}s step {step}: kubectl delete pod {target}")
                        cluster.delete_pod(target)
                    else:
                        target = cluster.pods_of(job)[0].name
                        say(f"  {time.time() - started:5.0f}s step {step}: SIGKILL trainer pod {target}")
                        cluster.pods[target].kill()
                    fired.append({"kind": kind, "at_step": step, "pod": target, "time": time.time() - started})
            if phase == "Completed":
                done_at = done_at or time.monotonic()
                heldout = _heldout(cluster, feed)
                final_eval = next((r for r in heldout if r.get("final")), None)  # the trainer's last version
                if feed is None or final_eval is not None or time.monotonic() - done_at > 300:
                    break
            if time.monotonic() > deadline:
                raise TimeoutError(f"trainer at step {step} after {timeout_s:.0f}s; see {out / 'events.log'}")
            time.sleep(0.5)
        say(f"  {time.time() - started:5.0f}s trainer Job completed at step {progress(cluster)}; draining")
        # Rollout pods drain (their unfinished tasks go back to the queue) before Redis is read.
        # (With the router the rollout pods are a StatefulSet too: the buffer is told by name.)
        # charts8s (cdk8s): see trainer_run_dir
        from charts8s.cluster import BUFFER_SERVICE

        cluster.delete_workloads([w.name for w in m.workloads if w.kind != "Job" and w.name != BUFFER_SERVICE])
        buffer_pod = next(p for p in cluster.pods.values() if cluster.owner[p.name].name == BUFFER_SERVICE)
        # charts8s (cdk8s): see trainer_run_dir
        from charts8s.buffer import ADMIN_KEY

        password = next(v[ADMIN_KEY] for v in secret_values.values() if ADMIN_KEY in v)  # the default user's
        with ExperienceBuffer(f"redis://:{password}@{buffer_pod.ip}:6379/0", run.run_id, prefix=run.buffer.run_prefix) as buf:
            pending = pending_prompts(buf)
            counters = buf.stats()
    finally:
        cluster.stop()
    trainers = [p for p in cluster.history if cluster.owner[p.name].kind == "Job"]
    feeds = [p for p in cluster.history if cluster.owner[p.name].name == feed]
    issued = read_issued(_cat([feed_run_dir(p) / "issued.jsonl" for p in feeds], out / "issued.jsonl"))
    lineage = read_lineage(_cat([trainer_run_dir(p) / "trained.jsonl" for p in trainers], out / "trained.jsonl"))
    a = audit(issued, lineage, pending, run.buffer.max_staleness)
    heldout = _heldout(cluster, feed)
    summary = {
        "dist": str(dist), "wall_s": time.time() - started, "chaos": fired,
        "heldout": heldout,
        # The last step always publishes: its version is the one the trainer trained on, plus one.
        "final_version": lineage.steps[-1]["trainer_version"] + 1 if lineage.steps else None,
        "heldout_before": heldout[0]["mean_reward"] if heldout else None,
        "heldout_after": final_eval["mean_reward"] if final_eval else None,
        "gain_points": 100 * (final_eval["mean_reward"] - heldout[0]["mean_reward"]) if final_eval and heldout else None,
        "heldout_greedy_before": heldout[0]["greedy"] if heldout else None,
        "heldout_greedy_after": final_eval["greedy"] if final_eval else None,
        "ledger": a.to_dict(), "ok": a.ok(),
        # the buffer's counters once the workers drained; stale_share: finished groups thrown away as too stale
        "buffer": counters, "stale_share": stale_share(counters),
        "job_restarts": cluster.job_state.get(job, {}).get("retries", 0),
        "pods": [{"name": p.name, "ip": p.ip, "phase": p.phase, "dir": str(p.root),
                  "restarts": {c.name: c.restarts for c in p.containers}} for p in cluster.history],
        "services": dict(cluster.cluster_ips),  # Service name -> its address here
        "substitutions": sorted({f"{c}: {note}" for _, c, note in cluster.subs.log}),
        "pod_identity_calls": cluster.agent.calls,
    }
    tmp = out / ".replica.json.tmp"
    tmp.write_text(json.dumps(summary, indent=1))
    os.replace(tmp, out / "replica.json")
    return summary


def _heldout(cluster, feed: str | None) -> list[dict]:
    recs = []
    for p in cluster.history:
        if cluster.owner[p.name].name == feed:
            path = feed_run_dir(p) / "heldout.jsonl"
            if path.exists():
                recs += read_metrics(path)
    return sorted(recs, key=lambda r: r["version"])


def format_summary(s: dict) -> str:
    a = s["ledger"]
    def fmt(x):
        return "none" if x is None else f"{x:.3f}"

    gb, ga = s.get("heldout_greedy_before"), s.get("heldout_greedy_after")
    lines = [f"held-out mean reward (feed pod, through its engine), before -> after: sampled {fmt(s['heldout_before'])} "
             f"-> {fmt(s['heldout_after'])}"
             + (f" ({s['gain_points']:+.1f} points)" if s["gain_points"] is not None else "")
             + f"   greedy {fmt(gb)} -> {fmt(ga)}"
             + (f" ({100 * (ga - gb):+.1f} points)" if ga is not None and gb is not None else ""),
             f"faults: {', '.join(e['kind'] + ' ' + e['pod'] + ' at step ' + str(e['at_step']) for e in s['chaos']) or 'none'};"
             f" trainer gang restarts {s['job_restarts']}",
             f"ledger: issued {a['issued']}, completed {a['completed']}, pending {a['pending']}, lost {a['lost']}, "
             f"trained twice {a['duplicated']}, over-stale {a['overstale']}; {a['samples_trained']} samples over "
             f"{a['steps']} steps ({a['rolled_back_steps']} rolled back by {a['resumes']} resumes)",
             f"buffer: {s['buffer']['finished']} groups finished, {100 * (s['stale_share'] or 0):.1f} % of them "
             "thrown away as too stale",
             "substituted: " + "; ".join(s["substitutions"]),
             "OK: nothing lost, trained twice or over-stale" if s["ok"] else "FAIL"]
    return "\n".join(lines)


@cli.command()
def replica(
    dist: Path = typer.Argument(Path("dist"), help="Manifests directory (written unless --no-synth)."),
    out: Path = typer.Option(None, "--out", help="Run directory (default runs/replica-<time>); must be empty."),
    steps: int = typer.Option(250, "--steps", min=4, help="Trainer steps of the small workload."),
    synth: bool = typer.Option(True, "--synth/--no-synth", help="Synthesize the small workload into DIST first."),
    chaos: bool = typer.Option(True, "--chaos/--no-chaos", help="Delete a rollout pod and kill the trainer pod."),
    cache: Path = typer.Option(Path("runs/cache"), "--cache", help="Warm-up checkpoint cache."),
    timeout_s: float = typer.Option(1800.0, "--timeout-s", min=10, help="Limit for the trainer's Job."),
    image_repo: Path = typer.Option(REPO, "--image-repo", help="The repository the pods' image holds (PYTHONPATH); "
                                    "another checkout runs its code in the same manifests."),
    router: bool = typer.Option(False, "--router/--no-router", help="SGLang's router in front of the engines "
                                "(rollout.router; the real sglang-router binary, with its keys)."),
) -> None:
    """Synthesize a small workload and run every pod of it locally; exit 1 if the ledger is not clean."""
    out = (out or Path("runs") / f"replica-{time.strftime('%Y%m%d-%H%M%S')}").resolve()
    if out.exists() and any(out.iterdir()):
        raise typer.BadParameter(f"{out} is not empty", param_hint="--out")
    overrides = None
    if synth:
        # charts8s (cdk8s, torchx): see trainer_run_dir
        from charts8s.main import build
        from charts8s.workloads import load_workloads

        if cache.resolve().is_relative_to("/tmp"):
            raise typer.BadParameter(f"{cache}: the model stands for a directory of the image, and every pod "
                                     "mounts its own /tmp over the image's", param_hint="--cache")
        typer.echo(f"replica: the tiny recipe's warm-up checkpoint (cached in {cache})")
        base = warm_base(cache, steps)
        typer.echo(f"replica: synthesizing the small workload into {dist}")
        workloads, overrides = write_workload(out / "workload", steps, base, router)

        build(load_workloads(load_config("dev", overrides), workloads), dist)
    signal.signal(signal.SIGTERM, sigterm_as_interrupt)  # run_replica's finally stops every pod
    try:
        s = run_replica(dist.resolve(), out, overrides=overrides, chaos=chaos, timeout_s=timeout_s,
                        image_repo=image_repo.resolve(),
                        say=lambda x: typer.echo(x))
    except (ManifestError, PodError, TimeoutError, RuntimeError) as e:
        typer.echo(f"moerl replica: {e}", err=True)
        raise SystemExit(1) from None
    typer.echo(format_summary(s))
    raise SystemExit(0 if s["ok"] else 1)
