"""`moerl bench engine`: the built-in engine's generation throughput and policy-load time.

A Qwen3-MoE policy (a `train_step.MODELS` preset) is built in code, saved as a Hugging Face
directory (`app.model.checkpoint.save_policy`), published to a file:// store as version 1 and
downloaded again (`app.storage.policy.publish_policy` / `download_policy`), exactly the path a
rollout worker takes. Then, in the same run and on the same disk:

  - disk: sequential read of a file of the checkpoint's size (16 MiB reads) after dropping it
    from the page cache, the read bandwidth in GB/s; also the same read warm, for reference;
  - load: the engine's weight load (`app.engine.load.load_checkpoint`: stock
    `AutoModelForCausalLM.from_pretrained(...).to(device)`, what `/update_weights_from_disk`
    runs) of the downloaded version, after one untimed load, with its files dropped from the page
    cache ("cold") and again right after ("warm"): seconds per GB and GB/s against the disk's;
  - generate: `app.engine.sampler.generate` (no HTTP) on the loaded model at each batch size,
    fixed prompt and output lengths (``ignore_eos``, temperature 1, top_p 1): output tokens/s;
    a run with ``max_new_tokens=1`` gives the prefill time, and decode tokens/s =
    B x (output_len - 1) / (full time - prefill time); with ``repeats`` > 1, medians of each.

Page cache: ``os.posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED)`` after an fsync, per file
(Linux drops the clean cached pages of that file; a hypervisor's cache below the guest, if any,
is not reached). Whether it worked is judged from the figures: a "cold" read not clearly slower
than the warm one is flagged in the notes.

Timing: `time.perf_counter` around each call with `torch.cuda.synchronize` before and after on
CUDA (generate syncs every token anyway, to read the sampled ids); one untimed warm-up call
per batch size.
"""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from transformers.utils import logging as hf_logging

from app.bench.results import print_notes_and_write
from app.bench.common import DTYPES, check_at_least_one, check_device
from app.bench.train_step import check_model_and_dtype, check_seq_len, model_config
from app.config import RouterConfig
from app.engine.load import load_checkpoint
from app.engine.sampler import SamplingParams, generate
from app.model.checkpoint import save_policy
from app.model.parallel import EPContext
from app.model.policy import build_policy
from app.storage.file import FileStore
from app.storage.policy import download_policy, publish_policy

CHUNK = 16 << 20


def drop_from_page_cache(path: str | os.PathLike) -> bool:
    """Ask the kernel to drop ``path``'s pages from the page cache (fsync, then fadvise DONTNEED).

    Returns:
        False where ``os.posix_fadvise`` does not exist (e.g. macOS), else True (the kernel
        treats the advice as a hint; see the module docstring).
    """
    if not hasattr(os, "posix_fadvise"):
        return False
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    return True


def read_seconds(path: str | os.PathLike) -> float:
    """Seconds to read the whole file sequentially in 16 MiB reads."""
    buf = bytearray(CHUNK)
    view = memoryview(buf)
    t0 = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        while f.readinto(view):
            pass
    return time.perf_counter() - t0


def write_file(path: str | os.PathLike, nbytes: int, seed: int = 0) -> None:
    """Write ``nbytes`` of random bytes (a 16 MiB random block repeated) and fsync."""
    block = torch.randint(0, 256, (min(CHUNK, max(nbytes, 1)),), dtype=torch.uint8,
                          generator=torch.Generator().manual_seed(seed)).numpy().tobytes()
    with open(path, "wb") as f:
        left = nbytes
        while left > 0:
            f.write(block[: min(left, len(block))])
            left -= len(block)
        f.flush()
        os.fsync(f.fileno())


def engine_loader():
    """The engine's checkpoint loader and its name: `app.engine.load.load_checkpoint`, what
    ``/update_weights_from_disk`` runs. It needs torch and transformers only, not the server's
    FastAPI, so the GPU image runs the engine's own load."""
    return load_checkpoint, "app.engine.load.load_checkpoint"


@dataclass
class EngineBench:
    """Inputs of the engine benchmark (the CLI's flags)."""

    model: str = "tiny"
    batch_sizes: tuple[int, ...] = (1, 8, 64)
    prompt_len: int = 128
    output_len: int = 128
    dtype: str = "float32"
    device: str = "cpu"
    repeats: int = 1  # timed generate calls per batch size (and per prefill); the median is reported
    work_dir: str = ""  # where the checkpoint, store and disk-test file go; "" = a temp dir
    seed: int = 0

    def check(self) -> None:
        """Raise ValueError naming the first bad flag (before anything is built)."""
        check_model_and_dtype(self.model, self.dtype)
        if not self.batch_sizes or min(self.batch_sizes) < 1:
            raise ValueError(f"--batch-sizes must be positive integers, got {list(self.batch_sizes)}")
        check_at_least_one(self, ("repeats",))
        if self.prompt_len < 1 or self.output_len < 2:
            raise ValueError("--prompt-len must be >= 1 and --output-len >= 2 (decode needs a second token)")
        check_device(self.device)
        check_seq_len(self.model, self.prompt_len + self.output_len, "--prompt-len + --output-len")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn, device: torch.device):
    _sync(device)
    t0 = time.perf_counter()
    out = fn()
    _sync(device)
    return out, time.perf_counter() - t0


def run(bench: EngineBench, out_dir: str = "runs/bench") -> dict:
    """Build, publish and download a policy version, time disk, load and generation; write the result.

    Returns:
        dict with ``figures``, ``ratios``, ``notes`` and ``path`` (the JSON result file).

    Raises:
        ValueError: a bad flag (see `EngineBench.check`).
    """
    bench.check()

    hf_logging.disable_progress_bar()  # one "Loading weights" bar per load clutters the log
    device = torch.device(bench.device)
    dtype = DTYPES[bench.dtype]
    notes: list[str] = []
    figures: list[dict] = []
    own_dir = not bench.work_dir
    work = Path(tempfile.mkdtemp(prefix="moerl-bench-engine-") if own_dir else bench.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    try:
        # A published policy version, as the trainer leaves it and a worker fetches it.
        config = model_config(bench.model)
        policy = build_policy(config, RouterConfig(), EPContext.local(), device="cpu", dtype=dtype, seed=bench.seed)
        ckpt = save_policy(policy, work / "ckpt", EPContext.local(), overwrite=True)
        del policy
        store = FileStore(work / "store")
        publish_policy(store, "bench", 1, ckpt)
        cache = work / "cache" / "v1"
        shutil.rmtree(cache, ignore_errors=True)
        _, download_s = _timed(lambda: download_policy(store, "bench", 1, cache), device)
        files = [p for p in cache.rglob("*") if p.is_file()]
        nbytes = sum(p.stat().st_size for p in files)
        gb = nbytes / 1e9

        # The disk: a file of the same size, read cold then warm.
        probe = work / "disk-probe.bin"
        write_file(probe, nbytes, bench.seed)
        dropped = drop_from_page_cache(probe)
        disk_cold_s = read_seconds(probe)
        disk_warm_s = read_seconds(probe)
        probe.unlink()
        disk_gbps = gb / disk_cold_s
        if not dropped:
            notes.append("os.posix_fadvise is missing here: 'cold' reads may come from the page cache")
        elif disk_cold_s < 1.25 * disk_warm_s:
            notes.append(f"cold read ({gb / disk_cold_s:.2f} GB/s) is not clearly slower than warm "
                         f"({gb / disk_warm_s:.2f} GB/s): the page-cache drop probably did not take effect "
                         "(or the file was too small to tell)")
        figures.append({"name": "disk_read_cold", "gb": gb, "seconds": disk_cold_s, "gb_per_s": disk_gbps})
        figures.append({"name": "disk_read_warm", "gb": gb, "seconds": disk_warm_s, "gb_per_s": gb / disk_warm_s})
        figures.append({"name": "download_policy", "gb": gb, "seconds": download_s, "gb_per_s": gb / download_s})

        # The engine's weight load of that version, cold and warm.
        load, loader_name = engine_loader()
        notes.append(f"loader: {loader_name}")
        # An untimed first load: imports, first-call and allocator costs stay out of both figures.
        load(str(cache), str(device), bench.dtype)  # the model is dropped at once
        for p in files:
            drop_from_page_cache(p)
        cold, load_cold_s = _timed(lambda: load(str(cache), str(device), bench.dtype), device)
        del cold
        loaded, load_warm_s = _timed(lambda: load(str(cache), str(device), bench.dtype), device)
        for name, s in (("load_cold", load_cold_s), ("load_warm", load_warm_s)):
            figures.append({"name": name, "gb": gb, "seconds": s, "s_per_gb": s / gb, "gb_per_s": gb / s,
                            "vs_disk_read": (gb / s) / disk_gbps})
        model = loaded.model
        notes.append(f"served model: {type(model).__name__}, attention "
                     f"{getattr(model.config, '_attn_implementation', None)}, experts "
                     f"{getattr(model.config, '_experts_implementation', None)}")

        # Generation at each batch size.
        gen = torch.Generator(device=device).manual_seed(bench.seed)
        ids = torch.Generator().manual_seed(bench.seed + 1)
        vocab = config.vocab_size

        def call(batch: int, new_tokens: int):
            prompts = torch.randint(4, vocab, (batch, bench.prompt_len), generator=ids).tolist()
            params = [SamplingParams(max_new_tokens=new_tokens, temperature=1.0, top_p=1.0, ignore_eos=True)
                      for _ in range(batch)]
            return generate(model, prompts, params, pad_id=loaded.pad_id, eos_ids=loaded.eos_ids, generator=gen)

        for batch in bench.batch_sizes:
            call(batch, 2)  # warm-up: kernels, allocator, cache code paths
            prefill_s = statistics.median(_timed(lambda: call(batch, 1), device)[1] for _ in range(bench.repeats))
            runs = [_timed(lambda: call(batch, bench.output_len), device) for _ in range(bench.repeats)]
            outs, full_s = sorted(runs, key=lambda r: r[1])[(len(runs) - 1) // 2]  # the median run
            produced = sum(len(o.token_ids) for o in outs)
            if produced != batch * bench.output_len:
                notes.append(f"batch {batch}: {produced} tokens generated, expected {batch * bench.output_len}")
            decode_s = max(full_s - prefill_s, 1e-9)
            figures.append({"name": f"generate_b{batch}", "batch": batch, "seconds": full_s,
                            "tokens_per_s": produced / full_s, "prefill_ms": prefill_s * 1e3,
                            "decode_tokens_per_s": batch * (bench.output_len - 1) / decode_s,
                            "ms_per_decode_step": decode_s / (bench.output_len - 1) * 1e3})
    finally:
        if own_dir:
            shutil.rmtree(work, ignore_errors=True)

    by = {f["name"]: f for f in figures}
    ratios = {
        "load_cold GB/s / disk_read_cold GB/s": by["load_cold"]["vs_disk_read"],
        "load_warm GB/s / disk_read_cold GB/s": by["load_warm"]["vs_disk_read"],
    }
    first = f"generate_b{bench.batch_sizes[0]}"
    for b in bench.batch_sizes[1:]:
        ratios[f"generate_b{b} / {first} tokens/s"] = by[f"generate_b{b}"]["tokens_per_s"] / by[first]["tokens_per_s"]
    shape = asdict(bench)
    shape["batch_sizes"] = list(bench.batch_sizes)
    shape.update(checkpoint_bytes=nbytes, checkpoint_files=len(files), vocab=vocab,
                 hidden=config.hidden_size, layers=config.num_hidden_layers, experts=config.num_experts,
                 topk=config.num_experts_per_tok)

    print(f"engine  model={bench.model} checkpoint {gb:.3f} GB ({len(files)} files) {bench.dtype} on {device}")
    print(f"{'what':<18}{'seconds':>10}{'GB/s':>9}{'s/GB':>8}{'vs disk':>9}")
    for f in figures:
        if "gb" in f:
            print(f"{f['name']:<18}{f['seconds']:>10.3f}{f['gb_per_s']:>9.2f}{f['seconds'] / gb:>8.2f}"
                  f"{f.get('vs_disk_read', f['gb_per_s'] / disk_gbps):>9.2f}")
    print(f"{'batch':<8}{'tokens/s':>12}{'decode tok/s':>14}{'prefill ms':>12}{'ms/step':>10}   "
          f"(prompt {bench.prompt_len}, output {bench.output_len})")
    for b in bench.batch_sizes:
        f = by[f"generate_b{b}"]
        print(f"{b:<8}{f['tokens_per_s']:>12.1f}{f['decode_tokens_per_s']:>14.1f}{f['prefill_ms']:>12.1f}"
              f"{f['ms_per_decode_step']:>10.2f}")
    for k, v in ratios.items():
        print(f"ratio {k}: {v:.2f}")
    return print_notes_and_write("engine", shape, figures, ratios, notes, out_dir)
