"""`moerl bench weight-sync`: seconds per policy version, network path vs store path.

CPU (``--device cpu``, the default): the real components on this machine. N built-in engines
(`moerl engine`, one thread each) and N rollout workers (`moerl rollout`, ``weight_sync.mode:
network``, no tasks) on a local redis-server; this process plays the trainer with the policy
unsharded (one rank). Per version:

- network: `app.trainer.weight_sync.WeightPusher.push`, prepare to the last engine's ``done``
  (pause, group, buckets over gloo on loopback, load, version, continue);
- store (the baseline): `app.trainer.publish.publish_version` into a ``file://`` store (the
  embedded stand-in for S3), then for every engine at once what its worker does: download the
  version into its own cache and pause -> ``/update_weights_from_disk`` -> continue.

The first network push, which also builds the group, is reported on its own. Models: ``tiny``
(the embedded default's preset), ``medium`` (~85 M parameters, built in code), ``small``
(`app.bench.train_step.MODELS`, ~0.5 B).

GPU (``--device cuda``, one H200): a real-width model (Qwen3-30B-A3B widths, ``--layers``
decoder layers, bf16) from GPU memory in this process to a second process on the same GPU. NCCL
cannot put two ranks on one GPU, so the network path is measured in the two ways a GPU box
offers without it, plus the store path:

- ``cuda-ipc``: each bucket packed into a GPU staging buffer shared by CUDA IPC (what SGLang's
  ``/update_weights_from_tensor`` does for an engine on the trainer's GPUs), loaded by the
  receiver device to device;
- ``gloo-staged``: the network path's code (app/weight_group.py buckets, the engine's
  `load_named`) with every bucket staged through pinned host memory and sent over gloo on
  loopback: what this protocol costs where NCCL is not available;
- ``disk``: `publish_version` to a ``file://`` store on the local disk, download, read the
  safetensors straight to the GPU and load: the store path without S3's network.
"""

from __future__ import annotations

import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx
import torch

from app.bench.common import DTYPES, check_device
from app.bench.results import check_out_dir, print_notes_and_write
from app.bench.train_step import MODELS
from app.bench.weight_sync_gpu import run_gpu
from app.config import RouterConfig, RunConfig
from app.model.config import tiny_config
from app.model.parallel import EPContext
from app.model.policy import build_policy
from app.rollout.engine_client import wait_until_healthy
from app.storage import open_store
from app.storage.policy import download_policy
from app.trainer.publish import publish_version
from app.trainer.weight_sync import WeightPusher

MEDIUM = dict(hidden_size=512, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4, head_dim=64,
              num_experts=32, num_experts_per_tok=4, moe_intermediate_size=256, vocab_size=32768,
              max_position_embeddings=1024)
CPU_MODELS = ("tiny", "medium", "small")
GPU_MODELS = ("qwen3-30b-a3b",)


@dataclass
class WeightSyncBench:
    """Flags of `moerl bench weight-sync` (see the module doc)."""

    model: str = "tiny"
    layers: int = 2
    engines: int = 2
    versions: int = 3
    bucket_mb: float = 64.0
    dtype: str = "float32"
    device: str = "cpu"
    work_dir: str = ""


def cpu_model_config(name: str):
    """The transformers config of a CPU ``--model``."""
    if name == "tiny":
        return tiny_config("tiny-qwen3-moe")
    if name == "medium":
        return tiny_config("tiny-qwen3-moe", **MEDIUM)
    if name == "small":
        return tiny_config("tiny-qwen3-moe", **MODELS["small"])
    raise ValueError(f"--model must be one of {CPU_MODELS} on cpu, got {name!r}")


def check(b: WeightSyncBench) -> None:
    """Raise ValueError naming the first bad flag."""
    check_device(b.device)
    if b.dtype not in DTYPES:
        raise ValueError(f"--dtype must be one of {sorted(DTYPES)}, got {b.dtype!r}")
    names = GPU_MODELS if b.device.startswith("cuda") else CPU_MODELS
    if b.model not in names:
        raise ValueError(f"--model must be one of {names} with --device {b.device}, got {b.model!r}")
    for flag in ("engines", "versions", "layers"):
        if getattr(b, flag) < 1:
            raise ValueError(f"--{flag} must be at least 1, got {getattr(b, flag)}")
    # NaN and infinity pass "> 0" and then fail int() mid-run; below one byte, int() gives 0.
    if not (math.isfinite(b.bucket_mb) and b.bucket_mb * 2**20 >= 1):
        raise ValueError(f"--bucket-mb must be a finite size of at least one byte (2**-20 MiB), got {b.bucket_mb}")


def run(b: WeightSyncBench, out_dir: str = "runs/bench") -> dict:
    """Run the benchmark; print and write its result (app/bench/results.py)."""
    check(b)
    check_out_dir(out_dir)
    scratch = Path(b.work_dir) if b.work_dir else Path(tempfile.mkdtemp(prefix="weight-sync-", dir="runs"
                                                                            if Path("runs").is_dir() else None))
    scratch = scratch.resolve()  # redis-server and the engines resolve paths from their own cwd
    scratch.mkdir(parents=True, exist_ok=True)
    try:
        if b.device.startswith("cuda"):
            shape, figures, ratios, notes = run_gpu(b, scratch)
        else:
            shape, figures, ratios, notes = run_cpu(b, scratch)
    finally:
        if not b.work_dir:
            shutil.rmtree(scratch, ignore_errors=True)
    for f in figures:
        print(f"{f['name']:>24}: {f['s_per_version']:8.3f} s/version  "
              + "  ".join(f"{k} {v:.3f}" for k, v in f.items() if k not in ("name", "s_per_version")
                          and isinstance(v, float)))
    for k, v in ratios.items():
        print(f"{k}: {v:.2f}")
    return print_notes_and_write("weight_sync", {**asdict(b), **shape}, figures, ratios, notes, out_dir)


# ---------------------------------------------------------------------------------------- CPU


def _perturb(model: torch.nn.Module) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1e-3)


def run_cpu(b: WeightSyncBench, work: Path):
    """The CPU measurement (module doc). Returns (shape, figures, ratios, notes)."""
    # redis: the CPU mode's buffer only; the GPU image, where the GPU mode runs, has none
    from app.buffer import ExperienceBuffer
    from app.buffer.redis_server import LocalRedis, free_port
    from app.buffer.weight_sync import SyncBoard

    dtype = DTYPES[b.dtype]
    config = cpu_model_config(b.model)
    model = build_policy(config, RouterConfig(), EPContext.local(), dtype=torch.float32, seed=0)
    n_params = sum(p.numel() for p in model.parameters())
    redis = LocalRedis(work / "redis")
    redis.start()
    procs: list[subprocess.Popen] = []
    try:
        cfg = RunConfig(run_id="wsbench", store_url=f"file://{work / 'store'}")
        cfg.buffer.redis_url = redis.url
        cfg.rollout.policy_cache_dir = str(work / "worker-cache")
        ws = cfg.weight_sync
        ws.mode, ws.master_address, ws.bucket_bytes = "network", "127.0.0.1", int(b.bucket_mb * 2**20)
        ws.timeout_s, ws.ready_timeout_s = 300.0, 60.0
        cfg.save(work / "run.yaml")
        store = open_store(cfg.store_url)
        publish_version(model, None, 0, store=store, run_id=cfg.run_id, work_dir=work / "publish", keep=2, dtype=dtype)
        v0 = download_policy(store, cfg.run_id, 0, work / "v0")
        ports = [free_port() for _ in range(b.engines)]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        for i, port in enumerate(ports):
            procs.append(_popen(work, f"engine-{i}", env, "engine", "--model-path", str(v0), "--port", str(port),
                                "--threads", "1", "--dtype", b.dtype, "--weight-sync-timeout", str(ws.timeout_s)))
        urls = [f"http://127.0.0.1:{p}" for p in ports]
        for url in urls:
            wait_until_healthy(url, timeout_s=600)
        for i, url in enumerate(urls):
            procs.append(_popen(work, f"worker-{i}", env, "rollout", "--config", str(work / "run.yaml"),
                                "--engine-url", url, "--worker-id", f"w{i}"))
        board = SyncBoard.of(ExperienceBuffer.from_config(cfg))
        deadline = time.monotonic() + 300
        while len(board.engines()) < b.engines:
            if time.monotonic() > deadline:
                raise RuntimeError(f"only {len(board.engines())}/{b.engines} workers registered; see {work}/*.log")
            time.sleep(0.2)
        pusher = WeightPusher(ws, 0, torch.device("cpu"), board=board)
        version = 0
        first = None
        network = []
        for i in range(b.versions + 1):
            version += 1
            _perturb(model)
            r = pusher.push(model, None, version, dtype)
            if len(r.pushed) != b.engines:
                raise RuntimeError(f"push of v{version} reached {r.pushed} of {b.engines} engines: {r.error}")
            if i == 0:
                first = r
            else:
                network.append(r)
        pusher.close()
        store_runs = []
        client = httpx.Client(timeout=600)
        for _ in range(b.versions):
            version += 1
            _perturb(model)
            store_runs.append(_store_version(model, version, store, cfg, work, urls, client, dtype))
        served = {int(client.get(u + "/model_info").json()["weight_version"]) for u in urls}
        if served != {version}:
            raise RuntimeError(f"engines serve {served} after the store path, expected v{version}")
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        for p in procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
        redis.stop()
    nbytes = first.bytes
    net_s = statistics.median(r.seconds for r in network)
    store_s = statistics.median(s["total_s"] for s in store_runs)
    figures = [
        {"name": "network (first: builds the group)", "s_per_version": first.seconds, "buckets": first.buckets},
        {"name": "network", "s_per_version": net_s, "buckets": network[0].buckets,
         "GB_per_s_per_engine": nbytes / net_s / 1e9},
        {"name": "store (baseline)", "s_per_version": store_s,
         "publish_s": statistics.median(s["publish_s"] for s in store_runs),
         "download_s": statistics.median(s["download_s"] for s in store_runs),
         "load_s": statistics.median(s["load_s"] for s in store_runs)},
    ]
    ratios = {"store s / network s per version": store_s / net_s}
    shape = {"params": n_params, "bytes_per_version": nbytes, "bucket_bytes": int(b.bucket_mb * 2**20)}
    notes = [
        f"{b.engines} built-in engines and workers as processes on {os.cpu_count()} cores, gloo over loopback; "
        "medians over --versions versions; the store is file:// on this machine's disk (S3's network is not in it)",
        "network: prepare -> every engine acked done (includes pausing, the HTTP calls per bucket and the load into "
        "the model); store: publish (write + upload) + the slowest engine's download and pause/load/continue",
    ]
    return shape, figures, ratios, notes


def _popen(work: Path, name: str, env: dict, *args: str) -> subprocess.Popen:
    with open(work / f"{name}.log", "ab") as log:
        return subprocess.Popen([sys.executable, "-m", "app.cli", *args], stdout=log, stderr=subprocess.STDOUT,
                                env=env, start_new_session=True)


def _store_version(model, version: int, store, cfg, work: Path, urls: list[str], client, dtype) -> dict:
    """One version by the store path: publish, then every engine downloads and loads it at once."""
    t0 = time.perf_counter()
    publish_version(model, None, version, store=store, run_id=cfg.run_id, work_dir=work / "publish", keep=2,
                    dtype=dtype)
    t1 = time.perf_counter()

    def one(i: int) -> tuple[float, float]:
        a = time.perf_counter()
        path = download_policy(store, cfg.run_id, version, work / f"engine-cache-{i}" / f"v{version}")
        b_ = time.perf_counter()
        client.post(urls[i] + "/pause_generation", json={"mode": cfg.rollout.pause_mode})
        r = client.post(urls[i] + "/update_weights_from_disk", json={"model_path": str(path),
                                                                    "weight_version": str(version)})
        client.post(urls[i] + "/continue_generation", json={})
        if r.status_code != 200:
            raise RuntimeError(f"{urls[i]} refused v{version}: {r.text[:300]}")
        shutil.rmtree(work / f"engine-cache-{i}" / f"v{version - 1}", ignore_errors=True)
        return b_ - a, time.perf_counter() - b_

    with ThreadPoolExecutor(len(urls)) as pool:
        parts = list(pool.map(one, range(len(urls))))
    t2 = time.perf_counter()
    return {"total_s": t2 - t0, "publish_s": t1 - t0, "download_s": max(p[0] for p in parts),
            "load_s": max(p[1] for p in parts)}
