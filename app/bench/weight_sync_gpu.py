"""`moerl bench weight-sync --device cuda`: one version of a real-width model from GPU memory in
this process to a second process on the same GPU (paths: app/bench/weight_sync.py's module doc).

Both processes hold the stock transformers model of the config (bf16, random weights; the
values do not change the time); the receiver loads what arrives by Hugging Face name with the
built-in engine's own loader (`app.engine.receive.load_named`). The sender plans and
buckets exactly as the trainer does (`app.trainer.publish.plan_version`,
`app.weight_group.plan_buckets`). Baselines measured in the same run: a device-to-device copy
and pinned host<->device copies of the same number of bytes.
"""

from __future__ import annotations

import shutil
import socket
import statistics
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from app.bench.common import DTYPES
from app.bench.train_step import model_config
from app.engine.receive import hf_slots, load_named
from app.storage import open_store
from app.storage.policy import download_policy
from app.trainer.publish import plan_version, publish_version
from app.trainer.weight_sync import _piece
from app.weight_group import bucket_bytes, dtype_name, open_group, pack_bucket, parse_dtype, plan_buckets, unpack_bucket


def real_width_config(layers: int):
    """Qwen3-30B-A3B at its published widths with ``layers`` decoder layers
    (`app.bench.train_step.model_config`)."""
    return model_config("qwen3-30b-a3b", layers=layers)


def _model(config, dtype: torch.dtype, device: str):
    with torch.device(device):
        return AutoModelForCausalLM.from_config(config, dtype=dtype).eval()


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _host_buffer(nbytes: int) -> torch.Tensor:
    """A host staging buffer: pinned where CUDA is (fast and asynchronous copies)."""
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=torch.cuda.is_available())


def _check_sums(model, names: list[str]) -> list[float]:
    slots = hf_slots(model)
    return [float(slots[n][0][slots[n][1]].float().sum()) for n in names]


def _receiver(config, dtype_name: str, inbox, outbox, work: str, device: str) -> None:
    """The second process: a model on the GPU that takes versions by each path."""
    if device.startswith("cuda"):
        torch.cuda.set_device(0)
    model = _model(config, DTYPES[dtype_name], device)
    slots = hf_slots(model)
    buffers = group = host = None
    outbox.put("ready")
    while True:
        msg = inbox.get()
        kind = msg[0]
        if kind == "stop":
            break
        if kind == "ipc-buffers":  # the sender's two GPU staging buffers, shared once
            buffers = msg[1]
        elif kind == "ipc":  # bucket in buffers[slot][:nbytes]
            _, slot, nbytes, meta = msg
            views = unpack_bucket(buffers[slot][:nbytes], meta["shapes"], [parse_dtype(d) for d in meta["dtypes"]])
            load_named(slots, list(zip(meta["names"], views)))
            _sync(device)
            outbox.put(("free", slot))
        elif kind == "gloo-join":
            _, port = msg
            group = open_group("gloo", "127.0.0.1", port, 2, 1, "bench", timeout_s=600)
            outbox.put("joined")
        elif kind == "gloo":  # one version: every bucket over the group, into one pinned buffer
            for meta in msg[1]:
                types = [parse_dtype(d) for d in meta["dtypes"]]
                n = bucket_bytes(meta["shapes"], types)
                if host is None or host.numel() < n:
                    host = _host_buffer(n)
                flat = host[:n]
                group.broadcast(flat)
                load_named(slots, list(zip(meta["names"], unpack_bucket(flat, meta["shapes"], types))))
            _sync(device)
            outbox.put("done")
        elif kind == "disk":
            _, store_url, version = msg
            path = download_policy(open_store(store_url), "bench", version, Path(work) / "recv" / f"v{version}")
            for f in sorted(path.glob("*.safetensors")):
                load_named(slots, list(load_file(str(f), device=device).items()))
            _sync(device)
            shutil.rmtree(Path(work) / "recv" / f"v{version - 1}", ignore_errors=True)  # the disk is finite
            outbox.put("done")
        elif kind == "sums":
            outbox.put(_check_sums(model, msg[1]))
    if group is not None:
        group.close()


def _bandwidths(nbytes: int, device: str) -> dict[str, float]:
    """GB/s of a device-to-device copy, and of (pinned) host->device / device->host copies, of
    ``nbytes`` bytes (best of 3)."""
    a = torch.empty(nbytes, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    h = _host_buffer(nbytes)
    out = {}
    for name, fn in (("d2d", lambda: b.copy_(a)), ("h2d", lambda: a.copy_(h, non_blocking=True)),
                     ("d2h", lambda: h.copy_(a, non_blocking=True))):
        best = float("inf")
        for _ in range(3):
            _sync(device)
            t0 = time.perf_counter()
            fn()
            _sync(device)
            best = min(best, time.perf_counter() - t0)
        out[name] = nbytes / best / 1e9
    return out


def run_gpu(b, work: Path, device: str = "cuda", config=None):
    """The GPU measurement. Returns (shape, figures, ratios, notes).

    ``device`` and ``config`` exist for the tests, which run the same two processes on the CPU
    with a tiny model (default: the GPU and `real_width_config(b.layers)`)."""
    dtype = DTYPES[b.dtype if b.dtype != "float32" else "bfloat16"]
    config = config or real_width_config(b.layers)
    ctx = mp.get_context("spawn")
    inbox, outbox = ctx.Queue(), ctx.Queue()
    receiver = ctx.Process(target=_receiver, args=(config, dtype_name(dtype), inbox, outbox, str(work), device),
                           daemon=True)
    receiver.start()
    if device.startswith("cuda"):
        torch.cuda.set_device(0)
    model = _model(config, dtype, device)
    tensors = plan_version(model, None, dtype).tensors
    limit = int(b.bucket_mb * 2**20)
    buckets = plan_buckets([t.nbytes for t in tensors], limit)
    meta = [{"names": [tensors[i].name for i in k], "dtypes": [dtype_name(dtype)] * len(k),
             "shapes": [list(tensors[i].shape) for i in k]} for k in buckets]
    state = model.state_dict()
    nbytes = sum(t.nbytes for t in tensors)
    biggest = max(sum(tensors[i].nbytes for i in k) for k in buckets)
    probe = [tensors[0].name, tensors[len(tensors) // 2].name, tensors[-1].name]
    assert outbox.get(timeout=600) == "ready"

    def piece(i: int) -> torch.Tensor:
        return _piece(state[tensors[i].source].detach(), tensors[i], 0)

    def perturb() -> None:
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1e-3)
        _sync(device)

    def verify(path: str) -> None:
        inbox.put(("sums", probe))
        got, want = outbox.get(timeout=600), _check_sums(model, probe)
        if got != want:
            raise RuntimeError(f"{path}: the receiver's weights differ from the sender's ({got} vs {want})")

    times: dict[str, list[float]] = {"cuda-ipc": [], "gloo-staged": [], "disk": []}
    # cuda-ipc: two shared GPU staging buffers, used in turn
    staging = [torch.empty(biggest, dtype=torch.uint8, device=device) for _ in range(2)]
    inbox.put(("ipc-buffers", staging))
    free = [True, True]
    for v in range(b.versions + 1):
        perturb()
        t0 = time.perf_counter()
        for k, idx in enumerate(buckets):
            slot = k % 2
            while not free[slot]:
                free[outbox.get(timeout=600)[1]] = True
            flat = pack_bucket([piece(i) for i in idx], staging[slot])
            _sync(device)
            free[slot] = False
            inbox.put(("ipc", slot, flat.numel(), meta[k]))
        while not all(free):
            free[outbox.get(timeout=600)[1]] = True
        if v:
            times["cuda-ipc"].append(time.perf_counter() - t0)
    verify("cuda-ipc")
    del staging
    # gloo-staged: the network path's buckets through pinned host memory
    with socket.socket() as sock:  # app.buffer's free_port would import redis (not in the GPU image)
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    inbox.put(("gloo-join", port))
    group = open_group("gloo", "127.0.0.1", port, 2, 0, "bench", timeout_s=600)
    assert outbox.get(timeout=600) == "joined"
    host = _host_buffer(biggest)
    for v in range(b.versions + 1):
        perturb()
        t0 = time.perf_counter()
        inbox.put(("gloo", meta))
        for k, idx in enumerate(buckets):
            group.broadcast(pack_bucket([piece(i) for i in idx], host))
        assert outbox.get(timeout=600) == "done"
        if v:
            times["gloo-staged"].append(time.perf_counter() - t0)
    group.close()
    verify("gloo-staged")
    # disk: the store path with a file:// store on the local disk
    store_url = f"file://{work / 'store'}"
    store = open_store(store_url)
    for v in range(b.versions + 1):
        perturb()
        t0 = time.perf_counter()
        publish_version(model, None, v, store=store, run_id="bench", work_dir=work / "publish", keep=1, dtype=dtype)
        inbox.put(("disk", store_url, v))
        assert outbox.get(timeout=1200) == "done"
        if v:
            times["disk"].append(time.perf_counter() - t0)
    verify("disk")
    inbox.put(("stop",))
    receiver.join(60)
    bw = _bandwidths(min(nbytes, 4 * 2**30), device)
    med = {k: statistics.median(v) for k, v in times.items()}
    figures = [{"name": k, "s_per_version": s, "GB_per_s": nbytes / s / 1e9} for k, s in med.items()]
    figures.append({"name": "baseline copies", "s_per_version": nbytes / (bw["d2d"] * 1e9),
                    "d2d_GB_per_s": bw["d2d"], "h2d_GB_per_s": bw["h2d"], "d2h_GB_per_s": bw["d2h"]})
    ratios = {
        "disk s / cuda-ipc s": med["disk"] / med["cuda-ipc"],
        "disk s / gloo-staged s": med["disk"] / med["gloo-staged"],
        "cuda-ipc GB/s / device copy GB/s": nbytes / med["cuda-ipc"] / 1e9 / bw["d2d"],
        "gloo-staged GB/s / pinned d2h GB/s": nbytes / med["gloo-staged"] / 1e9 / bw["d2h"],
    }
    shape = {"params": sum(p.numel() for p in model.parameters()), "bytes_per_version": nbytes,
             "buckets": len(buckets), "largest_bucket_bytes": biggest,
             "gpu": torch.cuda.get_device_name(0) if device.startswith("cuda") else None}
    notes = [
        "two processes on one GPU: NCCL refuses two ranks on one device, so the cluster's NCCL-over-EFA push is "
        "not measured here; cuda-ipc is the same-GPU path SGLang uses (update_weights_from_tensor), gloo-staged "
        "is this repository's network path with buckets staged through pinned host memory",
        "per version: sender's first bucket packed -> receiver's last tensor loaded (synchronized); medians over "
        "--versions after one untimed version; disk = publish_version to file:// + download + safetensors to GPU",
        f"model: {config.model_type} widths, {b.layers} layers, {dtype_name(dtype)}; random weights, moved by "
        "1e-3 per version; the receiver's sums of three tensors equal the sender's after each path",
    ]
    return shape, figures, ratios, notes
