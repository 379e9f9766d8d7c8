"""`moerl bench loop` (the embedded loop vs TRL's GRPOTrainer) on a tiny recipe, both legs.

No timings are asserted (speed belongs to the benchmark output). The test runs the real CLI
for a few seconds per leg and checks that the result file holds both legs' figures, that the
ratios are the quotients of those figures, that each leg trained whole batches of the recipe
and left a loadable final policy, and that bad flags fail with one message before any work.
"""

from __future__ import annotations

import math
from pathlib import Path

import yaml
from typer.testing import CliRunner

from app.bench.cli import cli
from app.bench.results import read_result
from app.config import RunConfig

GROUP, GROUPS_PER_STEP = 4, 2


def tiny_config(path: Path) -> Path:
    """A recipe small enough for CI: EP 1, batch of 2 groups x 4, 20 held-out prompts, 5 warm-up steps."""
    cfg = RunConfig()
    cfg.trainer.parallel.ep = 1
    cfg.trainer.groups_per_step = GROUPS_PER_STEP
    cfg.trainer.lr = 4e-4
    cfg.trainer.lr_warmup_steps = 2
    cfg.rollout.group_size = GROUP
    cfg.rollout.max_new_tokens = 8
    cfg.rollout.policy_poll_s = 0.5
    cfg.buffer.capacity_groups = 3 * GROUPS_PER_STEP
    cfg.task.train_size = 100
    cfg.task.eval_size = 20
    cfg.task.warmup_steps = 5
    cfg.task.warmup_batch_size = 16
    cfg.save(path)
    return path


def invoke(*args: str):
    return CliRunner().invoke(cli, ["loop", *args], catch_exceptions=False)


def test_loop_bench_runs_both_legs(tmp_path):
    out = tmp_path / "out"
    r = invoke("--seconds", "4", "--workers", "1", "--config", str(tiny_config(tmp_path / "run.yaml")),
               "--cache", str(tmp_path / "cache"), "--work-dir", str(tmp_path / "work"),
               "--out-dir", str(out), "--rounds", "1")
    assert r.exit_code == 0, r.output
    files = sorted(out.glob("loop-*.json"))
    assert len(files) == 1, files
    doc = read_result(files[0])
    assert doc["benchmark"] == "loop"
    assert doc["shape"]["seconds"] == 4 and doc["shape"]["heldout_prompts"] == 20
    legs = {f["name"]: f for f in doc["figures"]}
    assert set(legs) == {"moerl", "trl"}
    for name, f in legs.items():
        assert f["steps"] >= 1, name
        # Whole GRPO batches: groups_per_step groups of G completions per optimizer step.
        assert f["samples_trained"] == f["steps"] * GROUP * GROUPS_PER_STEP, name
        assert f["train_window_s"] > 0 and f["samples_per_s"] > 0 and f["samples_per_cpu_s"] > 0, name
        assert 0.0 <= f["heldout_reward_after"] <= 1.0, name
        before = doc["shape"]["heldout_reward_before"]
        assert math.isclose(f["gain_points"], 100 * (f["heldout_reward_after"] - before)), name
        assert not f["step_cap_hit"], name
        # The machine's state during the leg, and the quiet mark that follows from it.
        load = f["load"]
        assert load["window_s"] > 0 and load["cores"] == doc["shape"]["cores"], name
        assert load["others_cores"] >= 0 and load["load_max"] >= load["load_mean"] >= 0, name
        assert f["quiet"] == (load["others_cores"] <= doc["shape"]["quiet_share"] * load["cores"]), name
        assert f["round"] == 1 and not f["profiled"], name
        # Completion tokens per second, where the time went, and the GPU (none on this machine).
        assert f["tokens_per_s"] > 0 and f["gpu"]["source"] in ("none", "nvidia-smi", "pynvml"), name
        trainer = f["time_split"]["trainer"]
        assert all(0.0 <= v <= 1.0 for v in trainer.values()) and trainer["train_step"] > 0, name
    assert [f["position"] for f in doc["figures"]] == [1, 2] and doc["figures"][0]["name"] == "moerl"
    assert doc["quiet"] == all(f["quiet"] for f in doc["figures"])
    assert ("NOT QUIET" in r.output) == (not doc["quiet"])
    ratios = doc["ratios"]
    assert math.isclose(ratios["samples_per_s moerl/trl"], legs["moerl"]["samples_per_s"] / legs["trl"]["samples_per_s"])
    after_m, after_t = legs["moerl"]["heldout_reward_after"], legs["trl"]["heldout_reward_after"]
    if after_t > 0:
        assert math.isclose(ratios["heldout_reward_after moerl/trl"], after_m / after_t)
    else:  # a 5-step warm-up may leave the policy at reward 0: no ratio, not a division error
        assert math.isnan(ratios["heldout_reward_after moerl/trl"])
    assert math.isclose(ratios["gain_points moerl-trl"], legs["moerl"]["gain_points"] - legs["trl"]["gain_points"])
    # Both final policies are HF checkpoints: the moerl one downloaded from the store, TRL's saved.
    work = tmp_path / "work"
    assert list((work / "moerl" / "final").glob("v*/config.json"))
    assert (work / "trl" / "final" / "config.json").is_file()
    assert legs["moerl"]["policy_version"] == legs["moerl"]["steps"]
    assert legs["moerl"]["time_split"]["engines"]["samples"] > 0  # each engine's /server_info, sampled
    assert legs["trl"]["time_split"]["trainer"]["generation"] > 0  # TRL's own generate, timed
    assert doc["shape"]["device"] == "cpu" and "0 GPUs" in doc["shape"]["layout"]
    assert "moerl/trl" in r.output  # the printed ratios


def test_loop_bench_refuses_bad_flags_before_work(tmp_path):
    for args, flag in ((["--seconds", "0"], "--seconds"), (["--workers", "0"], "--workers"),
                       (["--config", str(tmp_path / "missing.yaml")], "--config"), (["--rounds", "0"], "--rounds"),
                       (["--wait-quiet", "-1"], "--wait-quiet")):
        r = CliRunner().invoke(cli, ["loop", *args, "--out-dir", str(tmp_path / "out")])
        assert r.exit_code == 2, (args, r.output)
        assert flag in r.output
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({"trainer": {"kl_coef": 0.1}}))
    r = CliRunner().invoke(cli, ["loop", "--config", str(bad), "--out-dir", str(tmp_path / "out")])
    assert r.exit_code == 2 and "kl_coef" in r.output, r.output
    assert not (tmp_path / "out").exists()  # nothing started, nothing written
    # A file where a directory must go: refused before the legs, not when the result is written.
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    for args, flag in ((["--work-dir", str(a_file)], "--work-dir"), (["--out-dir", str(a_file / "sub")], "--out-dir")):
        r = CliRunner().invoke(cli, ["loop", "--seconds", "1", "--work-dir", str(tmp_path / "work"),
                                     "--out-dir", str(tmp_path / "out"), *args])
        assert r.exit_code == 2 and flag in r.output, (args, r.output)
    assert not (tmp_path / "work").exists()
