"""Trainer resume (issue 4): training state save/load, kills during saves, a killed trainer resumed.

- a SIGKILL between the rank files and the manifest of a training-state save leaves the
  previous state the newest complete one, and it loads bit-exactly;
- a SIGKILL in the middle of a policy publish leaves ``latest`` on the previous version,
  which still downloads;
- a real `moerl train` process killed after an unsaved step, then `--resume`d: the rolled-back
  step is re-read from Redis and trained once in the final lineage, the resumed weights are
  those of the saved state, versions keep increasing; without --resume the run is refused;
- a pickled payload put into a saved state (the RNG file, DCP's metadata, an optimizer item)
  is refused by the resume, and never runs.
"""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch

from app.buffer import ExperienceBuffer, Sample, Task
from app.buffer.redis_server import free_port
from app.config import RunConfig
from app.ledger import read_lineage
from app.local.procs import descendants
from app.storage import open_store
from app.storage.policy import download_policy, latest_policy_version, policy_versions
from app.trainer.state import latest_state, load_state, state_steps

ROOT = Path(__file__).resolve().parents[1]

# Child process: saves state 1 (or publishes v0), changes the weights, then dies by SIGKILL
# inside the second save at the point named by argv[2].
_KILL_CHILD = textwrap.dedent('''
    import os, signal, sys, torch
    from pathlib import Path
    from app.config import RouterConfig
    from app.model.checkpoint import save_policy
    from app.model.config import tiny_config
    from app.model.parallel import EPContext
    from app.model.policy import build_policy
    from app.storage import open_store
    from app.storage.policy import publish_policy
    from app.trainer.state import save_state

    root, what = Path(sys.argv[1]), sys.argv[2]
    store = open_store(f"file://{root}/store")
    ep = EPContext.local()
    model = build_policy(tiny_config("tiny-qwen3-moe"), RouterConfig(), ep, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(input_ids=torch.tensor([[1, 5, 6]])).logits.sum().backward()
    opt.step()

    class DiesOnWrite:
        """Delegates to the store; SIGKILLs this process at the n-th write."""
        def __init__(self, inner, n):
            self.inner, self.n = inner, n
        def __getattr__(self, name):
            return getattr(self.inner, name)
        def _tick(self):
            self.n -= 1
            if self.n == 0:
                os.kill(os.getpid(), signal.SIGKILL)
        def put_file(self, *a):
            self._tick(); return self.inner.put_file(*a)
        def put_bytes(self, *a):
            self._tick(); return self.inner.put_bytes(*a)

    if what == "state":
        save_state(store, "r", 1, {"policy": (model, opt)},
                   {"train_state": {"step": 1}, "policy_version": 1, "commit_point": "1-0"},
                   lineage=["a/0"], work_dir=root / "work")
        torch.save(model.state_dict(), root / "expected.pt")
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
        # writes 1-4: the DCP file, DCP's metadata, the RNG state, the lineage of step 2 (stored);
        # write 5: its manifest -> killed before it.
        save_state(DiesOnWrite(store, 5), "r", 2, {"policy": (model, opt)}, {"train_state": {"step": 2}},
                   lineage=["a/0", "b/0"], work_dir=root / "work")
    else:
        for v in (0, 1):
            out = root / f"hf{v}"
            save_policy(model, out, ep)
            from app.model.tokenizer import save_tokenizer
            save_tokenizer(out)
            if v == 0:
                publish_policy(store, "r", 0, out)
                torch.save(model.state_dict(), root / "expected.pt")
                with torch.no_grad():
                    for p in model.parameters():
                        p.add_(1.0)
        # v1: killed after its first file, before the manifest and `latest`.
        publish_policy(DiesOnWrite(store, 2), "r", 1, root / "hf1")
    print("NOT KILLED")
''')


def _run_killed_child(tmp_path: Path, what: str) -> None:
    proc = subprocess.run([sys.executable, "-c", _KILL_CHILD, str(tmp_path), what], cwd=ROOT,
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == -signal.SIGKILL, proc.stdout + proc.stderr[-3000:]


def test_kill_during_state_save_keeps_previous_state(tmp_path):
    from app.config import RouterConfig
    from app.model.config import tiny_config
    from app.model.parallel import EPContext
    from app.model.policy import build_policy

    _run_killed_child(tmp_path, "state")
    store = open_store(f"file://{tmp_path}/store")
    assert state_steps(store, "r", complete_only=False) == [1, 2]  # step 2 half-written
    assert state_steps(store, "r") == [1]
    manifest = latest_state(store, "r")
    assert manifest["step"] == 1 and manifest["commit_point"] == "1-0"

    model = build_policy(tiny_config("tiny-qwen3-moe"), RouterConfig(), EPContext.local(), seed=5)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    assert load_state(store, "r", manifest, {"policy": (model, opt)}) == ["a/0"]
    expected = torch.load(tmp_path / "expected.pt")
    got = model.state_dict()
    assert expected.keys() == got.keys()
    for k in expected:
        assert torch.equal(expected[k], got[k]), k
    assert opt.state_dict()["state"], "optimizer moments were not restored"


class _Payload:
    """What a holder of the bucket's write access could leave in a state: unpickling it runs a command."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _tiny_state(tmp_path: Path, tamper=None):
    """A saved training state of a small module (step 1); ``tamper(state)`` edits what DCP saves."""
    import app.trainer.state as state_mod

    store = open_store(f"file://{tmp_path}/store")
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    real = state_mod.module_states
    if tamper is not None:
        state_mod.module_states = lambda modules: tamper(real(modules))
    try:
        state_mod.save_state(store, "r", 1, {"policy": (model, opt)}, {"policy_version": 1},
                             lineage=["a/0"], work_dir=tmp_path / "work")
    finally:
        state_mod.module_states = real
    fresh = torch.nn.Linear(4, 3)
    return store, {"policy": (fresh, torch.optim.AdamW(fresh.parameters(), lr=1e-3))}


@pytest.mark.parametrize("where", ["rng", "metadata-pickle", "metadata-torch-save", "optimizer-item"])
def test_a_pickled_payload_in_the_store_is_refused_on_resume(tmp_path, where):
    """Resume reads every file of a state weights-only: a payload planted in the RNG file, in
    DCP's metadata (as the plain pickle DCP itself writes, or inside torch.save) or in a non-tensor
    optimizer item raises, and its command never runs."""
    import pickle

    marker = tmp_path / "payload-ran"

    def plant_item(state):
        state["policy"]["optim"]["param_groups"][0]["lr"] = _Payload(marker)
        return state

    store, modules = _tiny_state(tmp_path, plant_item if where == "optimizer-item" else None)
    assert not marker.exists()
    prefix = "r/train/s00000001/"
    if where == "rng":
        buf = io.BytesIO()
        torch.save({"cpu": _Payload(marker), "cuda": None}, buf)
        store.put_bytes(prefix + "rng0.pt", buf.getvalue())
    elif where == "metadata-pickle":
        store.put_bytes(prefix + "dcp/.metadata", pickle.dumps(_Payload(marker)))
    elif where == "metadata-torch-save":
        buf = io.BytesIO()
        torch.save(_Payload(marker), buf)
        store.put_bytes(prefix + "dcp/.metadata", buf.getvalue())
    manifest = latest_state(store, "r")
    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException

    with pytest.raises((Exception, CheckpointException)) as e:
        load_state(store, "r", manifest, modules)
    assert not marker.exists(), f"the payload in {where} ran during resume"
    # DCP wraps a rank's error in CheckpointException (its .failures, rank -> exception).
    said = " ".join([str(e.value)] + [str(f) for f in getattr(e.value, "failures", {}).values()])
    assert "Weights only load failed" in said, said[:800]


def test_an_untampered_state_loads_weights_only(tmp_path):
    """The same small state, untouched, loads: every file of it is plain data."""
    store, modules = _tiny_state(tmp_path)
    manifest = latest_state(store, "r")
    assert manifest["format"] == "dcp-weights-only"
    assert load_state(store, "r", manifest, modules) == ["a/0"]
    opt = modules["policy"][1]
    assert opt.param_groups[0]["lr"] == 1e-3 and opt.state_dict()["state"]


def test_kill_during_policy_publish_keeps_previous_version(tmp_path):
    from safetensors.torch import load_file

    _run_killed_child(tmp_path, "policy")
    store = open_store(f"file://{tmp_path}/store")
    assert latest_policy_version(store, "r") == 0
    assert policy_versions(store, "r") == [0]
    assert 1 in policy_versions(store, "r", complete_only=False)  # the killed upload
    with pytest.raises(FileNotFoundError):
        download_policy(store, "r", 1, tmp_path / "dl1")
    d = download_policy(store, "r", 0, tmp_path / "dl0")
    expected = torch.load(tmp_path / "expected.pt")
    tensors = {}
    for f in d.glob("*.safetensors"):
        tensors.update(load_file(f))
    assert torch.equal(tensors["model.embed_tokens.weight"], expected["model.embed_tokens.weight"])


# ------------------------------------------------------------------------------------------
# A real trainer process killed after an unsaved step, then resumed


def _produce(url: str, run_id: str, stop: threading.Event, per_version: int, group_size: int) -> None:
    """A fake rollout worker paced by the trainer: for each newly announced policy version it
    publishes up to ``per_version`` leased groups stamped with that version."""
    buf = ExperienceBuffer(url, run_id, capacity_groups=64, max_staleness=1)
    served = -1
    while not stop.is_set():
        current = buf.current_policy()
        if current is None or current[0] == served:
            time.sleep(0.05)
            continue
        tasks = buf.lease("fake-worker", count=per_version, block_ms=200)
        for task in tasks:
            samples = [
                Sample(sample_id=task.sample_id(run_id, k), task_id=task.task_id, index=k, attempt=task.attempt,
                       prompt_ids=task.prompt_ids, completion_ids=[10 + k] * (1 + k), logprobs=[-4.6] * (1 + k),
                       reward=float(k % 2), policy_version=current[0], finish_reason="stop")
                for k in range(group_size)
            ]
            buf.publish(task, samples)
        if tasks:
            served = current[0]
    buf.close()


def _put(url: str, run_id: str, ids: range, group_size: int) -> None:
    with ExperienceBuffer(url, run_id) as buf:
        buf.put_tasks([Task(task_id=f"p{i}", prompt_ids=[1, 4 + i % 50, 9], prompt="", answer="{}",
                            group_size=group_size) for i in ids])


def _lineage_steps(run_dir: Path) -> list[int]:
    return [r["step"] for r in read_lineage(run_dir / "trained.jsonl").steps]


def _kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL a trainer and every descendant: torchrun starts each rank in a session of its own."""
    for pid in [proc.pid, *descendants(proc.pid)]:  # parent first: a dead torchrun starts no new rank
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait(10)


@pytest.mark.slow
@pytest.mark.parametrize("ranks", [1, 4])
def test_killed_trainer_resumes_from_saved_state(tmp_path, redis_server, ranks):
    """One rank started directly, or a 4-rank gang under torchrun (dp_shard 4 x EP 2: FSDP shards
    of everything, each EP rank half the experts): each rank saves and restores its own shards of
    the weights and the optimizer state (DCP)."""
    run_id, gps, G = "resume-test", 2, 2
    cfg = RunConfig.model_validate({
        "run_id": run_id, "store_url": f"file://{tmp_path}/store", 
        "buffer": {"redis_url": redis_server, "max_staleness": 1, "capacity_groups": 16,
                   "stale_policy": "requeue"},
        "rollout": {"group_size": G},
        "trainer": {"parallel": {"ep": min(ranks, 2)}, "steps": 5, "groups_per_step": gps, "lr": 1e-3, "save_every": 2,
                    "keep_versions": 20, "batch_timeout_s": 120, "log_entropy": False},
    })
    cfg_path = tmp_path / "run.yaml"
    cfg.save(cfg_path)
    run_dir = tmp_path / "run"
    argv = [sys.executable, "-m", "app.cli", "train", "--config", str(cfg_path), "--run-dir", str(run_dir)]
    if ranks > 1:
        argv[1:2] = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}",
                     "--max-restarts=0", "-m"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MASTER_PORT": str(free_port())}

    # Only 3 steps' worth of prompts: the trainer saves at step 2, trains step 3, then waits.
    _put(redis_server, run_id, range(3 * gps), G)
    stop = threading.Event()
    producer = threading.Thread(target=_produce, args=(redis_server, run_id, stop, gps, G), daemon=True)
    producer.start()
    # The log goes to a file: a pipe nobody reads while the trainer runs could fill and block it.
    log = open(tmp_path / "trainer.log", "wb")
    proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    store = open_store(cfg.store_url)
    try:
        deadline = time.monotonic() + 240
        # Step 3's line is written before its version is published: wait for v3 itself (no save
        # at step 3: save_every=2), not for a fixed time after the line.
        while _lineage_steps(run_dir)[-1:] != [3] or latest_policy_version(store, run_id) != 3:
            assert proc.poll() is None, (tmp_path / "trainer.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "trainer did not reach step 3 and publish v3"
            time.sleep(0.1)
    finally:
        _kill_tree(proc)
        log.close()
    assert latest_state(store, run_id)["step"] == 2
    assert latest_state(store, run_id)["world_size"] == ranks
    assert latest_policy_version(store, run_id) == 3  # v0 + steps 1..3

    # Without --resume the run is refused (its versions exist already).
    refused = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert refused.returncode == 1 and "--resume" in refused.stderr, refused.stderr[-2000:]
    if ranks > 1:  # every rank refuses, not only rank 0
        assert all(f"moerl train (rank {r})" in refused.stderr for r in range(ranks)), refused.stderr[-2000:]

    _put(redis_server, run_id, range(100, 100 + 2 * gps), G)
    try:
        done = subprocess.run(argv + ["--resume"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    finally:
        stop.set()
        producer.join(30)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    final = json.loads(next(x for x in reversed(done.stdout.strip().splitlines()) if x.startswith('{"done"')))
    assert (final["step"], final["resumed_from"]) == (5, 2)

    lineage = read_lineage(run_dir / "trained.jsonl")
    assert [r["step"] for r in lineage.steps] == [1, 2, 3, 4, 5]
    assert (lineage.rolled_back_steps, lineage.resumes) == (1, 1)
    trained = [(g["task_id"], g["attempt"]) for r in lineage.steps for g in r["groups"]]
    # Every prompt once. Step 3's groups (v2) came back after the kill but were stale for the
    # resumed trainer (v4, max_staleness 1): requeued as attempt 1 and trained as such.
    first = [(f"p{i}", 0) for i in range(2 * gps)]
    step3 = [(f"p{i}", 1) for i in range(2 * gps, 3 * gps)]
    later = [(f"p{i}", 0) for i in range(100, 100 + 2 * gps)]
    assert sorted(trained) == sorted(first + step3 + later)
    samples = [sid for r in lineage.steps for g in r["groups"] for sid, _ in g["samples"]]
    assert len(samples) == len(set(samples)) == 5 * gps * G
    # Versions continue: v4 is the resumed (step-2) weights, then steps 3..5 give v5..v7.
    assert latest_policy_version(store, run_id) == 7
    from safetensors.torch import load_file

    def weights(v):
        d = download_policy(store, run_id, v, tmp_path / f"dl{v}")
        out = {}
        for f in sorted(d.glob("*.safetensors")):
            out.update(load_file(f))
        return out

    v2, v3, v4 = weights(2), weights(3), weights(4)
    assert all(torch.equal(v2[k], v4[k]) for k in v2), "resumed weights differ from the saved state"
    assert not all(torch.equal(v3[k], v4[k]) for k in v3)
    metrics = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["policy_version"] for m in metrics][-3:] == [5, 6, 7]
