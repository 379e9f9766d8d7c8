"""Held-out figures in a run's report: greedy and sampled side by side (issue 30, item 5).

The calculator's +38 points were sampling sharpening (greedy 0.984 -> 0.967), and the summary
and plot.png led with the sampled figure alone: the plot had no greedy line.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from types import SimpleNamespace

import matplotlib.figure

from app.local.run import embedded_default, print_summary, summarize


def test_the_plot_and_the_summary_show_greedy_beside_sampled(tmp_path, monkeypatch, capsys):
    drawn = []
    real_savefig = matplotlib.figure.Figure.savefig

    def savefig(fig, *args, **kwargs):
        drawn.append(fig.axes[0].get_legend_handles_labels()[1])
        return real_savefig(fig, *args, **kwargs)

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", savefig)
    now = time.time()
    records = [{"time": now + i, "step": i + 1, "reward_mean": 0.5, "samples_total": 64 * (i + 1),
                "policy_version": i // 2, "buffer": {}} for i in range(4)]
    loop = SimpleNamespace(run_dir=tmp_path, cfg=embedded_default(), metrics=lambda: records)
    s = summarize(loop, {"n": 200, "mean_reward": 0.40, "greedy": 0.70},
                  {"n": 200, "mean_reward": 0.60, "greedy": 0.75}, now)
    (labels,) = drawn
    assert {"held-out sampled before RL", "held-out sampled after RL", "held-out greedy before RL",
            "held-out greedy after RL"} <= set(labels), labels
    assert round(s["gain_points"], 6) == 20.0 and round(s["gain_points_greedy"], 6) == 5.0
    assert json.loads((tmp_path / "summary.json").read_text())["gain_points_greedy"] == s["gain_points_greedy"]
    print_summary(s)
    text = capsys.readouterr().out
    assert "sampled 0.400 -> 0.600 (+20.0 points)" in text and "greedy 0.700 -> 0.750 (+5.0 points)" in text


def test_a_one_step_run_writes_valid_json_without_a_rate(tmp_path, capsys):
    """One metrics record measures no rate: summary.json said ``NaN`` (not JSON, `json.loads`
    of strict parsers and `jq` refuse it); now null, and the printed summary says n/a."""
    now = time.time()
    records = [{"time": now, "step": 1, "reward_mean": 0.5, "samples_total": 64, "policy_version": 0, "buffer": {}}]
    loop = SimpleNamespace(run_dir=tmp_path, cfg=embedded_default(), metrics=lambda: records)
    s = summarize(loop, {"n": 200, "mean_reward": 0.40, "greedy": 0.70},
                  {"n": 200, "mean_reward": 0.45, "greedy": 0.70}, now)
    text = (tmp_path / "summary.json").read_text()
    assert "NaN" not in text
    on_disk = json.loads(text, parse_constant=lambda c: (_ for _ in ()).throw(ValueError(c)))
    assert on_disk["samples_per_s"] is None and on_disk["steps"] == 1
    print_summary(s)
    assert "n/a samples/s" in capsys.readouterr().out


def test_the_plot_has_the_training_panels_legends_beside_them_and_the_summarys_throughput(tmp_path, monkeypatch):
    """What TRL and verl users look at first (loss, KL, entropy, clipping, gradient norm) had no
    panel; the legend covered the curves; the throughput panel (a mean of per-step rates, 40-190
    samples/s) disagreed with the summary (a total over the time, 37-63). One definition now:
    samples trained over the seconds between two steps, the whole run's in the summary and drawn
    in the panel, whose curve is the same figure over the last 20 steps."""
    from app.local.report import WINDOW, samples_per_s

    figures = []
    real_savefig = matplotlib.figure.Figure.savefig

    def savefig(fig, *args, **kwargs):
        fig.canvas.draw()
        figures.append(fig)
        return real_savefig(fig, *args, **kwargs)

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", savefig)
    now, t, records = time.time(), 0.0, []
    for i in range(60):
        t += (0.2, 3.0, 0.5)[i % 3]  # uneven steps: a mean of per-step rates is far from the total rate
        records.append({"time": now + t, "step": i + 1, "reward_mean": 0.5, "samples_total": 64 * (i + 1),
                        "policy_version": i // 2, "loss": -0.01 * i, "approx_kl": 0.001, "mismatch_kl": 0.0005,
                        "entropy": 1.0 - 0.01 * i, "clip_frac": 0.05, "grad_norm": 0.3})
    loop = SimpleNamespace(run_dir=tmp_path, cfg=embedded_default(), metrics=lambda: records)
    s = summarize(loop, {"n": 200, "mean_reward": 0.40, "greedy": 0.70}, {"n": 200, "mean_reward": 0.60, "greedy": 0.75},
                  now)
    (fig,) = figures
    titles = {ax.get_title(): ax for ax in fig.axes}
    for title in ("reward", "loss", "KL (k3)", "token entropy", "clipped token fraction",
                  "gradient norm (before clipping)", "trained samples / s"):
        assert title in titles, sorted(titles)
    for ax in fig.axes:  # no legend over any curve: each sits beside its axes
        legend = ax.get_legend()
        assert legend is not None, ax.get_title()
        box, frame = legend.get_window_extent(), ax.get_window_extent()
        assert box.x0 >= frame.x1 - 1, (ax.get_title(), box, frame)
    assert s["samples_per_s"] == (records[-1]["samples_total"] - records[0]["samples_total"]) / (
        records[-1]["time"] - records[0]["time"])
    tp = titles["trained samples / s"]
    curve, whole = tp.get_lines()
    assert whole.get_ydata()[0] == s["samples_per_s"]  # the summary's figure, in the panel
    assert curve.get_ydata()[-1] == samples_per_s(records[-WINDOW - 1:])
    rates = [(b["samples_total"] - a["samples_total"]) / (b["time"] - a["time"]) for a, b in zip(records, records[1:])]
    assert max(curve.get_ydata()) < 1.5 * s["samples_per_s"] < max(rates)  # not a mean of per-step rates


def test_the_summary_says_what_to_change_when_greedy_fell_while_sampled_rose(tmp_path, capsys):
    """A user's environment: sampled 0.154 -> 0.353, greedy 0.890 -> 0.775 at rollout.temperature 1.0
    (bench/results/run-task.md); the summary said nothing. It names the cause it measured and the
    setting that kept greedy there (0.7: -1.2 points); a greedy change within the noise is no note."""
    now = time.time()
    records = [{"time": now + i, "step": i + 1, "reward_mean": 0.3, "samples_total": 64 * (i + 1),
                "policy_version": i // 2} for i in range(3)]
    loop = SimpleNamespace(run_dir=tmp_path, cfg=embedded_default(), metrics=lambda: records)
    s = summarize(loop, {"n": 200, "mean_reward": 0.154, "greedy": 0.890}, {"n": 200, "mean_reward": 0.353,
                                                                           "greedy": 0.775}, now)
    assert s["note"].startswith("greedy fell (-11.5 points) while sampled rose (+19.9): RL learned from rollouts "
                                "sampled at rollout.temperature 1, far from the greedy answers")
    assert "--set rollout.temperature=0.7" in s["note"]
    print_summary(s)
    assert "note: greedy fell (-11.5 points)" in capsys.readouterr().out
    for after in ({"n": 200, "mean_reward": 0.353, "greedy": 0.870}, {"n": 200, "mean_reward": 0.150, "greedy": 0.7}):
        assert summarize(loop, {"n": 200, "mean_reward": 0.154, "greedy": 0.890}, after, now)["note"] is None
    # at 0.7 a lower temperature was tried and did not help (a roman-numeral environment, 0.7 -> 0.49):
    # the note names no temperature then
    loop.cfg.rollout.temperature = 0.7
    note = summarize(loop, {"n": 200, "mean_reward": 0.102, "greedy": 0.271}, {"n": 200, "mean_reward": 0.129,
                                                                              "greedy": 0.135}, now)["note"]
    assert note.startswith("greedy fell (-13.6 points) while sampled rose (+2.7)") and "--set rollout.temperature" not in note
