"""`moerl bench lm-head`: the LM head and the loss's logit passes, forward + backward, at real
widths, against plain torch and liger-kernel's fused linear cross entropy on the same inputs.

What the trainer's loss needs from the LM head (app/trainer/grpo.py): per-token logprobs of the
sampled tokens at the engine's temperature, with a gradient under per-token upstream weights
(the GRPO/PPO loss weighs each token by its advantage, ratio and TIS weight), and the entropy of
each row for the metrics. The contenders, each computing ``logp[n] = log_softmax(h[n] W^T / T)
[target[n]]``, then backward of ``sum(w * logp)`` with ``w`` the per-token weights:

- ``ours``: `app.model.logprobs.chunked_logprobs` (chunks of ``--chunk`` rows; on CUDA one Triton
  softmax pass per direction, app/model/logit_kernels.py), with the entropy;
- ``torch``: the full ``[N, V]`` logits, ``log_softmax`` in fp32, gather;
- ``liger_none``: liger-kernel's ``LigerFusedLinearCrossEntropyLoss(reduction="none")`` on
  ``h / T`` (the same logits): per-token NLL, the per-token weights folded in at backward (it
  recomputes the chunks' logits there, as ours does); no entropy;
- ``liger_mean``: the same with ``reduction="mean"``, which computes the gradient inside the
  forward (no recompute) but only for a uniform weight: the speed of the loss we cannot use.

Each line reports ms per forward + backward, the device memory beyond the inputs at the peak
(``max_memory_allocated`` minus the inputs), and the largest difference of its logprobs and of
its gradients from torch's in fp32 (``liger_mean``: gradient of the mean NLL). liger-kernel is
optional (``pip install liger-kernel``); without it its lines are left out with a note.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from app.bench.common import DTYPES, Marks, check_device
from app.bench.results import check_out_dir, print_notes_and_write
from app.model.logprobs import chunked_logprobs

WIDTHS = {"qwen3-30b-a3b": (2048, 151936), "deepseek-v3": (7168, 129280), "tiny": (64, 128)}  # (hidden, vocab)


@dataclass
class LMHeadBench:
    """Inputs of the LM-head benchmark (the CLI's flags)."""

    model: str = "qwen3-30b-a3b"  # a WIDTHS key: (hidden, vocabulary)
    tokens: int = 16384
    chunk: int = 4096
    temperature: float = 1.0
    dtype: str = "bfloat16"
    device: str = "cuda"
    iters: int = 5
    warmup: int = 2
    seed: int = 0

    def check(self) -> None:
        """Raise ValueError naming the first bad flag."""
        if self.model not in WIDTHS:
            raise ValueError(f"--model must be one of {sorted(WIDTHS)}, got {self.model!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"--dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        for name in ("tokens", "chunk", "iters"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name} must be >= 1")
        if not 0 < self.temperature < float("inf"):
            raise ValueError(f"--temperature must be finite and > 0, got {self.temperature}")
        check_device(self.device)


def _contenders(bench: LMHeadBench) -> dict:
    """name -> fn(hidden, weight, targets) returning per-token logprobs [N] (fp32) with gradient."""
    t = bench.temperature

    def ours(h, w, y):
        return chunked_logprobs(h, w, y, t, chunk=bench.chunk, with_entropy=True)[0]

    def plain(h, w, y):
        return torch.log_softmax((h @ w.T).float() / t, -1).gather(1, y[:, None]).squeeze(1)

    out = {"ours": ours, "torch": plain}
    try:
        # optional: Liger's kernel, a contender only where it is installed
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss
    except ImportError:
        return out
    none = LigerFusedLinearCrossEntropyLoss(reduction="none")
    mean = LigerFusedLinearCrossEntropyLoss(reduction="mean")
    out["liger_none"] = lambda h, w, y: -none(w, h / t, y).float()
    out["liger_mean"] = lambda h, w, y: -mean(w, h / t, y).float()  # a scalar: the mean logprob
    return out


def run(bench: LMHeadBench, out_dir: str = "runs/bench") -> dict:
    """Time every contender; print a table; write the result. Raises ValueError on a bad flag."""
    bench.check()
    check_out_dir(out_dir)
    device = torch.device(bench.device)
    dtype = DTYPES[bench.dtype]
    hidden_size, vocab = WIDTHS[bench.model]
    gen = torch.Generator(device="cpu").manual_seed(bench.seed)
    h0 = (torch.randn(bench.tokens, hidden_size, generator=gen) * 0.5).to(device, dtype)
    w0 = (torch.randn(vocab, hidden_size, generator=gen) * hidden_size**-0.5).to(device, dtype)
    y = torch.randint(0, vocab, (bench.tokens,), generator=gen).to(device)
    weights = (torch.rand(bench.tokens, generator=gen) * 2 - 0.5).to(device)  # per-token, mixed signs
    contenders = _contenders(bench)
    results, reference = {}, None
    for name, fn in contenders.items():
        h = h0.clone().requires_grad_(True)
        w = w0.clone().requires_grad_(True)
        scalar = name == "liger_mean"

        def step():
            h.grad = w.grad = None
            logp = fn(h, w, y)
            (logp if scalar else (logp * weights).sum()).backward()
            return logp

        try:
            for _ in range(bench.warmup):
                step()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
                torch.cuda.reset_peak_memory_stats(device)
                base = torch.cuda.memory_allocated(device)
            marks = Marks(device)
            marks.mark()
            for _ in range(bench.iters):
                logp = step()
            marks.mark()
        except torch.cuda.OutOfMemoryError as e:
            results[name] = {"name": name, "error": f"out of memory: {str(e).splitlines()[0][:120]}"}
            continue
        ms = marks.intervals()[0] / bench.iters * 1e3
        extra = (torch.cuda.max_memory_allocated(device) - base) / 1e9 if device.type == "cuda" else None
        row = {"name": name, "ms_fwd_bwd": ms, "extra_memory_gb": extra,
               "logp": logp.detach().float(), "grad_h": h.grad.float(), "grad_w": w.grad.float()}
        if name == "torch":
            reference = row
        results[name] = row
        del h, w, logp
        if device.type == "cuda":
            torch.cuda.empty_cache()
    figures, notes = [], []
    for name, row in results.items():
        fig = {k: v for k, v in row.items() if not isinstance(v, torch.Tensor)}
        if "error" not in row and reference is not None:
            if name == "liger_mean":  # its gradient is that of the mean logprob: compare with torch's of the same
                fig["max_abs_diff_logp"] = abs(float(row["logp"]) - float(reference["logp"].mean()))
            else:
                fig["max_abs_diff_logp"] = float((row["logp"] - reference["logp"]).abs().max())
                for g in ("grad_h", "grad_w"):
                    scale = float(reference[g].abs().max())
                    fig[f"max_rel_diff_{g}"] = float((row[g] - reference[g]).abs().max()) / scale
        figures.append(fig)
    if "liger_none" not in results:
        notes.append("liger-kernel is not installed: its lines are left out (pip install liger-kernel)")
    notes.append("ours also returns each row's entropy (the metrics' entropy); liger's kernels do not")
    ratios = {f"{n} ms / ours ms": results[n]["ms_fwd_bwd"] / results["ours"]["ms_fwd_bwd"]
              for n in results if n != "ours" and "ms_fwd_bwd" in results[n] and "ms_fwd_bwd" in results["ours"]}
    print(f"LM head + logprobs fwd+bwd  {bench.model}: hidden {hidden_size}, vocabulary {vocab}, "
          f"{bench.tokens} tokens, {bench.dtype} on {device}, temperature {bench.temperature}")
    print(f"{'':<12}{'ms':>10}{'extra GB':>10}{'|dlogp|':>10}{'grad_h rel':>12}{'grad_w rel':>12}")
    for f in figures:
        if "error" in f:
            print(f"{f['name']:<12}  {f['error']}")
            continue
        extra = f"{f['extra_memory_gb']:.2f}" if f["extra_memory_gb"] is not None else "-"
        print(f"{f['name']:<12}{f['ms_fwd_bwd']:>10.1f}{extra:>10}{f.get('max_abs_diff_logp', 0):>10.2e}"
              f"{f.get('max_rel_diff_grad_h', float('nan')):>12.2e}{f.get('max_rel_diff_grad_w', float('nan')):>12.2e}")
    shape = asdict(bench) | {"hidden": hidden_size, "vocab": vocab}
    return print_notes_and_write("lm_head", shape, figures, ratios, notes, out_dir)
