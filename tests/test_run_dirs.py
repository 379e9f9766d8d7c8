"""Run directories and re-used configs as a newcomer meets them (issue 30, items 2 and 3).

* `moerl run`'s run.yaml, given back as ``--config``, starts from the same warmed policy
  instead of warming it a second time (the old code fitted the warm-up again on the warmed
  checkpoint: held-out before RL 0.954 instead of 0.475, nothing left for RL to gain);
* run directories are named after the task, and no role appends to an earlier run's records
  (metrics.jsonl, trained.jsonl, issued.jsonl);
* the TorchX snippet of docs/local-run.md picks the warm-up of its own task, not whichever sorts last.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from app.config import RunConfig
from app.local.embedded import EmbeddedLoop
from app.local.run import close_failed, embedded_default, new_run_dir, start_from_base, task_preset, warmup_dir

ROOT = Path(__file__).resolve().parents[1]


def test_run_yaml_reused_as_config_starts_from_the_same_warmed_policy(tmp_path):
    cfg = embedded_default()
    cfg.task.train_size, cfg.task.eval_size, cfg.task.warmup_steps = 100, 20, 10
    cache = tmp_path / "cache"
    first = EmbeddedLoop(cfg, tmp_path / "first")
    try:
        base, before, feeder = start_from_base(first, cache, "before RL")
        feeder.close()
    finally:
        first.close()
    assert "warmup" in first.sup.procs  # the first run made the warm-up checkpoint
    again = RunConfig.load(tmp_path / "first" / "run.yaml")
    assert again.task.warmup_done and again.model.path == str(base)
    second = EmbeddedLoop(again, tmp_path / "second")
    try:
        base2, before2, feeder2 = start_from_base(second, cache, "before RL")
        feeder2.close()
    finally:
        second.close()
    assert "warmup" not in second.sup.procs, "a second warm-up ran on the warmed checkpoint"
    assert base2 == base and before2 == before


def test_run_directories_are_named_after_the_task():
    assert new_run_dir(task_preset("calculator"), None).name.startswith("calculator-")
    assert new_run_dir(task_preset("spell_backward"), None).name.startswith("spell-backward-")
    user = RunConfig.model_validate({"env": {"name": "examples.guess_number.env:GuessNumberEnv"}})
    assert new_run_dir(user, None).name.startswith("guessnumberenv-")


def test_a_run_id_the_config_sets_names_the_run_directory():
    """runs/roman-399-<time>, not runs/roman-numerals-<time> for every run of one environment."""
    user = RunConfig.model_validate({"run_id": "roman-399", "env": {"name": "examples.guess_number.env:GuessNumberEnv"}})
    assert new_run_dir(user, None).name.startswith("roman-399-")
    assert new_run_dir(task_preset("calculator"), None).name.startswith("calculator-")  # run_id left at its default


def test_a_failed_start_says_the_run_directory_it_named_is_removed(tmp_path, capsys):
    """`moerl run` prints "run directory: PATH" first; a start that fails removes PATH and says so."""
    run_dir = tmp_path / "roman-399-20261206-094700"
    (run_dir / "logs").mkdir(parents=True)
    close_failed(SimpleNamespace(run_dir=run_dir, close=lambda: None, metrics=lambda: []))
    assert not run_dir.exists()
    assert f"run directory {run_dir} removed: the run stopped before its first trainer step" in capsys.readouterr().out
    trained = tmp_path / "trained"
    trained.mkdir()
    close_failed(SimpleNamespace(run_dir=trained, close=lambda: None, metrics=lambda: [{"step": 1}]))
    assert trained.exists() and "removed" not in capsys.readouterr().out  # a run with a step keeps it


def test_a_new_trainer_refuses_to_append_to_an_earlier_runs_records(tmp_path, redis_server):
    """A trainer whose store holds no version of its run is a new run: a metrics.jsonl in its
    run directory is another run's, and it says so in one line (exit 1) instead of appending."""
    cfg = embedded_default()
    cfg.trainer.parallel.ep = 1
    cfg.buffer.redis_url = redis_server
    cfg.store_url = f"file://{tmp_path / 'store'}"
    cfg.save(tmp_path / "run.yaml")
    run_dir = tmp_path / "runs" / "dev"
    run_dir.mkdir(parents=True)
    (run_dir / "metrics.jsonl").write_text('{"step": 1}\n')
    proc = subprocess.run([sys.executable, "-m", "app.cli", "train", "--config", str(tmp_path / "run.yaml"),
                           "--run-dir", str(run_dir), "--resume"], capture_output=True, text=True, timeout=300,
                          cwd=ROOT)
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "holds metrics.jsonl of an earlier run" in proc.stderr
    assert (run_dir / "metrics.jsonl").read_text() == '{"step": 1}\n'


def test_a_new_feeder_refuses_an_earlier_runs_ledger(tmp_path, redis_server):
    from app.feed import run_feed

    cfg = embedded_default()
    cfg.buffer.redis_url = redis_server
    cfg.store_url = f"file://{tmp_path / 'store'}"
    (tmp_path / "feed").mkdir()
    (tmp_path / "feed" / "issued.jsonl").write_text('{"task_id": "e0-train-000000", "attempt": 0, "time": 0}\n')
    with pytest.raises(ValueError, match="issued.jsonl is an earlier run's"):
        run_feed(cfg, tmp_path / "feed", stop=lambda: True)


def readme_snippet() -> str:
    text = (ROOT / "docs" / "local-run.md").read_text()
    m = re.search(r"\.venv/bin/python - <<'PY'[^\n]*\n(.*?)\nPY\n", text, re.S)
    assert m, "docs/local-run.md's TorchX snippet is gone"
    return m.group(1)


def test_the_readme_torchx_snippet_uses_the_warm_up_of_its_own_task(tmp_path):
    """The old snippet took sorted(glob('runs/cache/warmup-*'))[-1]: after `--task calculator`
    it trained spell_backward from the calculator's policy at reward 0 for every step."""
    import yaml

    cache = tmp_path / "runs" / "cache"
    own = warmup_dir(embedded_default(), cache)
    other = cache / "warmup-ffffffffffff"  # sorts after any other key
    for d in (own, other):
        d.mkdir(parents=True, exist_ok=True)
        (d / "config.json").write_text("{}")
    proc = subprocess.run([sys.executable, "-"], input=readme_snippet(), capture_output=True, text=True,
                          cwd=tmp_path, timeout=120, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    (written,) = (tmp_path / "runs").glob("torchx-*/run.yaml")
    cfg = yaml.safe_load(written.read_text())
    assert Path(cfg["model"]["path"]).resolve() == own.resolve()
    assert cfg["store_url"].endswith(f"{written.parent.name}/store")  # a store of its own per run
