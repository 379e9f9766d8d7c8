"""A run's artifacts from the trainer's metrics: TensorBoard events and a PNG plot.

Input is ``<run_dir>/metrics.jsonl``: one JSON object per trainer step with at least ``time``
(Unix seconds), ``step``, ``reward_mean`` and ``samples_total`` (see app/trainer/train.py).
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

# Scalars worth a TensorBoard curve; others stay in metrics.jsonl.
SCALARS = (
    "reward_mean", "loss", "grad_norm", "clip_frac", "tis", "kl", "entropy", "staleness_mean",
    "staleness_max", "policy_version", "completion_len_mean", "step_s", "wait_s", "publish_s",
)


def read_metrics(path: str | os.PathLike) -> list[dict]:
    """Read metrics.jsonl; a torn last line (a crash mid-write) is ignored.

    Raises:
        FileNotFoundError: the file does not exist.
    """
    records = []
    for line in Path(path).read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


def throughput(records: list[dict]) -> list[float]:
    """Samples per second between consecutive steps (trained samples over wall-clock seconds)."""
    out = []
    for prev, cur in zip(records, records[1:]):
        dt = cur["time"] - prev["time"]
        ds = cur.get("samples_total", 0) - prev.get("samples_total", 0)
        out.append(ds / dt if dt > 0 else float("nan"))
    return out


def rolling_mean(values: list[float], window: int) -> list[float]:
    """Mean of the last `window` finite values at each position (NaN until one is seen)."""
    out, recent = [], []
    for v in values:
        if isinstance(v, (int, float)) and math.isfinite(v):
            recent = (recent + [v])[-window:]
        out.append(sum(recent) / len(recent) if recent else float("nan"))
    return out


def write_tensorboard(records: list[dict], out_dir: str | os.PathLike) -> Path:
    """Write TensorBoard event files (one scalar per SCALARS key per step) into `out_dir`."""
    from torch.utils.tensorboard import SummaryWriter

    out_dir = Path(out_dir)
    with SummaryWriter(log_dir=str(out_dir)) as writer:
        for r in records:
            for key in SCALARS:
                value = r.get(key)
                if isinstance(value, (int, float)) and math.isfinite(value):
                    writer.add_scalar(f"train/{key}", value, r["step"], walltime=r.get("time"))
        for r, sps in zip(records[1:], throughput(records)):
            if math.isfinite(sps):
                writer.add_scalar("train/samples_per_s", sps, r["step"], walltime=r.get("time"))
    return out_dir


def write_plot(records: list[dict], path: str | os.PathLike, evals: dict[str, float] | None = None) -> Path:
    """Plot batch reward and throughput over wall-clock time to a PNG (atomic write).

    Args:
        records: metrics.jsonl records, in step order.
        path: the PNG to write.
        evals: optional held-out figures drawn as horizontal lines, e.g. {"held-out sampled before
            RL": 0.3, "held-out greedy before RL": 0.6}: greedy ones in blue, others in green,
            dotted when the name says "before", dashed otherwise.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    t0 = records[0]["time"] if records else 0.0
    minutes = [(r["time"] - t0) / 60 for r in records]
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    rewards = [r.get("reward_mean", float("nan")) for r in records]
    ax1.plot(minutes, rewards, alpha=0.35, label="batch mean reward")
    ax1.plot(minutes, rolling_mean(rewards, 20), label="batch mean reward, 20-step mean")
    for name, value in (evals or {}).items():
        # Sampled and greedy side by side: one colour each, dotted before RL, dashed after.
        color = "tab:blue" if "greedy" in name else "tab:green"
        ax1.axhline(value, linestyle=":" if "before" in name else "--", color=color, label=name)
    ax1.set_ylabel("reward")
    ax1.legend(loc="lower right", fontsize="small")
    ax1.grid(alpha=0.3)
    ax2.plot(minutes[1:], rolling_mean(throughput(records), 20), color="tab:orange")
    ax2.set_ylabel("trained samples / s (20-step mean)")
    ax2.set_xlabel("minutes since first step")
    ax2.grid(alpha=0.3)
    fig.tight_layout()
    tmp = path.with_name(f".{path.name}.tmp.png")
    fig.savefig(tmp, dpi=100)
    plt.close(fig)
    os.replace(tmp, path)
    return path
