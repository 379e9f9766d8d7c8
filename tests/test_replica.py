"""The replica of dist/ (issue 19): `moerl replica` synthesizes the small workload with charts8s
and runs every container of every pod as a local process, with the manifest's own command,
args and environment (app/replica/).

Substituted, and nothing else: the image (this venv and repository), the engine (`moerl engine`
for SGLang), GPU counts (torchrun's processes per node: 2 for the node's 8 GPUs), torchrun's
rendezvous port (one free on the host: its c10d store listens on every address, so another
torchrun on port 29500 can take the gang into its own rendezvous) and the S3 endpoint (moto, with
credentials from the Pod Identity stand-in). The model is the warm-up
checkpoint as a local directory, standing for one baked into the image.

The short version (100 steps, ~2-3 min on 2 cores) with SGLang's router in front of the engines
(``--router``: the real sglang-router binary, with its keys; each worker registers its engine)
and both faults: a rollout pod deleted (preStop, SIGTERM, SIGKILL after its grace period; the
StatefulSet replaces it under its name, and its worker registers the engine again) and the trainer
pod SIGKILLed after an unsaved step (Volcano RestartJob; the gang resumes). Stated bar for
this length: held-out mean reward (measured by the feed pod through its own engine, 200
prompts x 8 samples) at least +1 point over v0 (runs here: +4.9 and +6.3 points); the full
`moerl replica` run is held to make run's +10 points (docs/local-run.md). Ledger: nothing lost, trained
twice or over-stale.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from app.replica import small_run_config
from app.replica.kubelet import NOT_RUN, Substitutions

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]
TIMEOUT_S = 600  # the replica's limit for the trainer's Job


def warmup_cache() -> Path:
    """The warm-up cache of `make run` (ROOT/runs/cache), or, for a checkout under /tmp, the
    user's cache directory: `moerl replica` refuses a model under /tmp, which every pod mounts
    over the image's."""
    cache = ROOT / "runs" / "cache"
    if not cache.resolve().is_relative_to("/tmp"):
        return cache
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "moerl" / "cache"


@pytest.fixture(scope="module")
def replica(tmp_path_factory) -> tuple[dict, Path, Path]:
    tmp = tmp_path_factory.mktemp("replica")
    dist, out = tmp / "dist", tmp / "run"
    proc = subprocess.run([sys.executable, "-m", "app.cli", "replica", str(dist), "--out", str(out), "--steps", "100",
                           "--router", "--cache", str(warmup_cache()), "--timeout-s", str(TIMEOUT_S)],
                          capture_output=True, text=True, timeout=900, cwd=ROOT)
    (tmp / "replica.out").write_text(proc.stdout + proc.stderr)
    assert (out / "replica.json").exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((out / "replica.json").read_text())
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return summary, dist, out


def test_replica_learns_and_loses_nothing_through_both_faults(replica):
    s, _, _ = replica
    a = s["ledger"]
    assert (a["lost"], a["duplicated"], a["overstale"]) == (0, 0, 0), a
    assert a["steps"] == 100 and a["samples_trained"] == 100 * 8 * 8
    assert a["completed"] + a["pending"] == a["issued"]
    assert s["buffer"]["finished"] >= 800 and 0.0 <= s["stale_share"] < 1.0
    assert [e["kind"] for e in s["chaos"]] == ["delete-rollout-pod", "kill-trainer-pod"]
    assert s["job_restarts"] == 1 and a["resumes"] == 2  # the first start and the RestartJob, both --resume
    # The final measurement is of the trainer's last version: 100 steps, plus the version a
    # resumed trainer publishes for its restored weights, plus the rolled-back steps trained again.
    assert s["heldout"][0]["version"] == 0 and s["heldout"][-1]["version"] == s["final_version"] > 100
    assert all(r["engine_version"] == r["version"] for r in s["heldout"])  # measured what it meant to
    assert s["gain_points"] >= 1.0, s["heldout"]


def test_replica_ran_what_dist_holds(replica):
    """Every pod of every workload in dist/ ran, with the manifest's own command line: each
    container (but the Redis exporter, which the replica states it does not run) has as its
    first log line its command as the manifest has it, after the stated
    substitutions and the pod's paths and addresses."""
    s, dist, out = replica
    docs = [d for f in sorted(dist.glob("*.k8s.yaml")) for d in yaml.safe_load_all(f.read_text()) if d]
    kinds = {d["kind"] for d in docs}
    assert {"Deployment", "StatefulSet", "Job"} <= kinds
    pods = {p["name"] for p in s["pods"]}
    assert {"moerl-buffer-0", "moerl-env-0", "moerl-env-1", "moerl-feed-0", "moerl-rollout-0", "moerl-rollout-1",
            "moerl-trainer-trainer-0-0"} <= pods
    deleted = next(e["pod"] for e in s["chaos"] if e["kind"] == "delete-rollout-pod")
    assert sum(p["name"] == deleted for p in s["pods"]) == 2  # replaced under its name (a StatefulSet's)
    assert sum(p["name"] == "moerl-trainer-trainer-0-0" for p in s["pods"]) == 2  # the gang, restarted
    # /metrics listens on its pod's address (the pods share the host's): trainer rank 0, each worker
    metrics_at = "network: --metrics-addr {} (its pod's address)".format
    assert set(s["substitutions"]) == {
        "engine: engine: SGLang -> moerl engine (dropped --tp-size)",
        *(f"trainer-0: {metrics_at(p['ip'])}; GPUs: 8 per pod -> torchrun --nproc-per-node 2; network: rendezvous "
          "port 29500 -> one free on the host (torchrun's c10d store listens on every address)"
          for p in s["pods"] if p["name"] == "moerl-trainer-trainer-0-0"),
        *(f"worker: {metrics_at(p['ip'])}" for p in s["pods"] if p["name"].startswith("moerl-rollout-")),
        f"redis: network: redis-server --bind {next(p['ip'] for p in s['pods'] if p['name'] == 'moerl-buffer-0')} (its pod's address)",
        f"redis-exporter: {NOT_RUN['redis_exporter']}",  # the buffer's Prometheus sidecar, stated and skipped
    }
    templates = {d["metadata"]["name"]: d["spec"]["template"]["spec"] for d in docs if d["kind"] in ("Deployment", "StatefulSet")}
    templates |= {f"moerl-trainer-{t['name']}": t["template"]["spec"] for d in docs if d["kind"] == "Job" for t in d["spec"]["tasks"]}
    for p in s["pods"]:  # every container of every pod ran, with a log of its own
        spec = next(v for k, v in templates.items() if p["name"].rsplit("-", 1)[0] == k)
        for c in spec["containers"]:
            if Substitutions.not_run(c):
                assert not (Path(p["dir"]) / "logs" / f"{c['name']}.log").exists(), (p["name"], c["name"])
                continue
            log = (Path(p["dir"]) / "logs" / f"{c['name']}.log").read_text()
            assert log.startswith("--- replica: start"), (p["name"], c["name"])
    worker = templates["moerl-rollout"]["containers"][1]
    rollout0 = next(p for p in s["pods"] if p["name"] == "moerl-rollout-0")
    first = (Path(rollout0["dir"]) / "logs" / "worker.log").read_text().splitlines()[0]
    # the manifest's own command, its mount paths mapped into the pod's directory
    assert first.endswith(f"moerl rollout --config {rollout0['dir']}/volumes/run-config/run.yaml --worker-id moerl-rollout-0"
                          f" --pause-marker {rollout0['dir']}/volumes/state/engine-paused --metrics-port 9464"
                          f" --metrics-addr {rollout0['ip']} --router-url http://{s['services']['moerl-router']}:30100"
                          f" --router-engine-url http://{rollout0['ip']}:30000")
    assert worker["command"][:2] == ["moerl", "rollout"]
    # S3 only through Pod Identity credentials, for the two associated service accounts
    from infra.config import load_config

    trainer = load_config("dev", out / "workload" / "deploy.yaml").trainer_service_account_of("replica")
    assert set(s["pod_identity_calls"]) == {trainer, "moerl-rollout"}  # the run's own trainer account


def test_replica_routes_through_the_real_router(replica):
    """The router Deployment ran the sglang-router binary as its manifest says, its API key and
    control-plane key expanded from the Secret; every rollout pod's worker asked it to add its
    engine (the replacement of the deleted pod too), the deleted one's took it out as it drained,
    and no worker was refused by the router."""
    s, _, _ = replica
    router = next(p for p in s["pods"] if p["name"] == "moerl-router-0")
    first = (Path(router["dir"]) / "logs" / "router.log").read_text().splitlines()[0]
    assert "-m sglang_router.launch_router" in first and "$(" not in first
    assert "--api-key " in first and "--control-plane-api-keys moerl-workers:rollout-workers:admin:" in first
    rollouts = [p for p in s["pods"] if p["name"].startswith("moerl-rollout-")]
    assert len(rollouts) == 3
    deleted = next(e["pod"] for e in s["chaos"] if e["kind"] == "delete-rollout-pod")
    for p in rollouts:
        log = (Path(p["dir"]) / "logs" / "worker.log").read_text()
        assert "asked the router" in log and "could not register" not in log and "HTTP 401" not in log, p["name"]
    first_of_deleted = next(p for p in rollouts if p["name"] == deleted)
    assert "removed engine" in (Path(first_of_deleted["dir"]) / "logs" / "worker.log").read_text()


def test_replica_shows_its_progress_and_no_byte_reprs(replica):
    """A live step counter (the old replica printed nothing for its first 72 s and had none), and
    the Node.js banner of the synth as text, not b'...' reprs."""
    _, _, out = replica
    text = (out.parent / "replica.out").read_text()
    steps = [int(m) for m in __import__("re").findall(r"trainer step (\d+)/100", text)]
    assert len(steps) >= 10 and steps == sorted(steps) and steps[-1] == 100, text[-3000:]
    assert "b'" not in text


def test_a_starved_trainer_reports_its_own_error_before_the_replica_gives_up():
    """The replica's trainer waits at most trainer.batch_timeout_s for a batch, well within the
    replica's own limit: a trainer that gets no groups fails with its own message (which groups
    it waited for, from where) instead of being stopped by the replica's timeout."""
    assert small_run_config(100, Path("/unused")).trainer.batch_timeout_s <= TIMEOUT_S / 4
