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
    "reward_mean", "loss", "grad_norm", "clip_frac", "tis", "approx_kl", "mismatch_kl", "kl_ref", "entropy",
    "staleness_mean", "staleness_max", "policy_version", "completion_len_mean", "step_s", "wait_s", "publish_s",
)
# The plot's training panels, what TRL and verl users look at first: (title, metrics.jsonl keys).
PANELS = (
    ("loss", ("loss",)),
    ("KL (k3)", ("approx_kl", "mismatch_kl", "kl_ref")),
    ("token entropy", ("entropy",)),
    ("clipped token fraction", ("clip_frac",)),
    ("gradient norm (before clipping)", ("grad_norm",)),
)
# Steps in the moving windows of the plot (rolling means, throughput).
WINDOW = 20


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


def read_steps(path: str | os.PathLike) -> list[dict]:
    """The trainer's steps in metrics.jsonl, the newest line of each in step order: a trainer
    resumed from the state of step S writes steps S+1.. again after the lines of those it lost.

    Raises:
        FileNotFoundError: the file does not exist.
    """
    by_step = {}
    for r in read_metrics(path):
        if isinstance(r, dict) and "step" in r and "time" in r:
            by_step[r["step"]] = r
    return [by_step[k] for k in sorted(by_step)]


def resume_times(path: str | os.PathLike) -> list[float]:
    """When the trainer resumed (Unix seconds): the ``resume_from_step`` lines of trained.jsonl
    (app/trainer/trainer.py); none when the file does not exist."""
    path = Path(path)
    if not path.is_file():
        return []
    return [r["time"] for r in read_metrics(path) if isinstance(r, dict) and "resume_from_step" in r and "time" in r]


def trained_span(records: list[dict], restarts: list[float] = ()) -> tuple[float, float]:
    """``(samples, seconds)`` trained between the first and the last record (in step order),
    without the intervals between two steps that hold a restart (a time in ``restarts``,
    `resume_times`): the time between an interrupted run and its resume is not training."""
    samples = seconds = 0.0
    for a, b in zip(records, records[1:]):
        if any(a["time"] < t < b["time"] for t in restarts):
            continue
        seconds += b["time"] - a["time"]
        samples += b.get("samples_total", 0) - a.get("samples_total", 0)
    return samples, seconds


def samples_per_s(records: list[dict], restarts: list[float] = ()) -> float | None:
    """Trained samples per second over ``records`` (in step order): the samples trained between
    the first and the last record over the wall-clock seconds between them, a resume's gap left
    out (`trained_span`). The one definition of the run's throughput: the summary takes it over
    the whole run, the live line and the plot over a window of recent steps. None with fewer
    than two records."""
    if len(records) < 2:
        return None
    samples, seconds = trained_span(records, restarts)
    return samples / seconds if seconds > 0 else None


def throughput(records: list[dict], window: int = 1, restarts: list[float] = ()) -> list[float]:
    """`samples_per_s` over the ``window`` steps up to each record from the second on (NaN where
    it measures nothing)."""
    out = []
    for i in range(1, len(records)):
        v = samples_per_s(records[max(0, i - window):i + 1], restarts)
        out.append(float("nan") if v is None else v)
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
    # torch: only to write the events; `moerl run`'s driver and the chaos driver import this
    # module (read_steps) before torch or without it
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


def _values(records: list[dict], key: str) -> list[float]:
    out = []
    for r in records:
        v = r.get(key)
        out.append(float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else float("nan"))
    return out


def write_plot(records: list[dict], path: str | os.PathLike, evals: dict[str, float | None] | None = None,
               samples_per_s_run: float | None = None, restarts: list[float] = ()) -> Path:
    """Plot a run to a PNG (atomic write): the batch reward with the held-out figures, the
    training panels of `PANELS`, and the throughput, over wall-clock minutes. Legends sit beside
    the axes, never over the curves.

    Args:
        records: metrics.jsonl records, in step order.
        path: the PNG to write.
        evals: held-out figures drawn as horizontal lines, e.g. {"held-out sampled before RL": 0.3,
            "held-out greedy before RL": 0.6}: greedy ones in blue, others in green, dotted when
            the name says "before", dashed otherwise; None values (not measured) are left out.
        samples_per_s_run: the summary's throughput (`samples_per_s` of the whole run), drawn as a
            line in the throughput panel, whose curve is the same figure over `WINDOW` steps.
        restarts: when the trainer resumed (`resume_times`): no throughput across them.
    """
    # matplotlib (half a second): only when a plot is drawn; Agg is chosen before pyplot loads
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # after use("Agg") (above)

    path = Path(path)
    t0 = records[0]["time"] if records else 0.0
    minutes = [(r["time"] - t0) / 60 for r in records]
    fig = plt.figure(figsize=(12, 11), layout="constrained")
    grid = fig.add_gridspec(4, 2)
    ax = fig.add_subplot(grid[0, :])
    rewards = _values(records, "reward_mean")
    ax.plot(minutes, rewards, alpha=0.35, label="batch mean reward")
    ax.plot(minutes, rolling_mean(rewards, WINDOW), label=f"batch mean reward, {WINDOW}-step mean")
    for name, value in (evals or {}).items():
        if value is None:
            continue
        # Sampled and greedy side by side: one colour each, dotted before RL, dashed after.
        color = "tab:blue" if "greedy" in name else "tab:green"
        ax.axhline(value, linestyle=":" if "before" in name else "--", color=color, label=name)
    ax.set_ylabel("reward")
    ax.set_title("reward")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small", borderaxespad=0)
    ax.grid(alpha=0.3)
    axes = [fig.add_subplot(grid[1 + i // 2, i % 2], sharex=ax) for i in range(len(PANELS) + 1)]
    for a, (title, keys) in zip(axes, PANELS):
        drawn = False
        for key in keys:
            values = _values(records, key)
            if any(math.isfinite(v) for v in values):
                a.plot(minutes, values, alpha=0.35 if len(keys) == 1 else 0.8, label=key)
                drawn = True
        if len(keys) == 1 and drawn:
            a.plot(minutes, rolling_mean(_values(records, keys[0]), WINDOW), color="tab:red", label=f"{WINDOW}-step mean")
        if drawn:
            a.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="x-small", borderaxespad=0)
        else:
            a.text(0.5, 0.5, "not in metrics.jsonl", ha="center", va="center", transform=a.transAxes, color="gray")
        a.set_title(title)
        a.grid(alpha=0.3)
    tp = axes[len(PANELS)]
    tp.plot(minutes[1:], throughput(records, WINDOW, restarts), color="tab:orange", label=f"over the last {WINDOW} steps")
    if samples_per_s_run is not None:
        tp.axhline(samples_per_s_run, color="tab:orange", linestyle="--", label="whole run (the summary's)")
    tp.set_title("trained samples / s")
    tp.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="x-small", borderaxespad=0)
    tp.grid(alpha=0.3)
    for a in axes[-2:]:
        a.set_xlabel("minutes since first step")
    tmp = path.with_name(f".{path.name}.tmp.png")
    fig.savefig(tmp, dpi=90)
    plt.close(fig)
    os.replace(tmp, path)
    return path
