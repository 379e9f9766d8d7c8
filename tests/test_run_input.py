"""`moerl run`'s input as a newcomer gives it (issue 44, items 7 and 8): ``--set key=value`` on
any field, YAML that repeats a key or holds nothing, a ``max_new_tokens`` beyond the policy's
context, a ``--cache`` or ``--out`` that cannot be written, a malformed ``env.url`` and a
``--resume`` of something that is not a run: each one line naming the field, flag or file,
exit 2, before anything starts and with nothing left behind.

The command runs in this process (`app.cli.main`, as the ``moerl`` script calls it): each case
fails before any role process starts.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from app.cli import main
from app.config import RunConfig
from app.local.embedded import EmbeddedLoop, RoleRefused
from app.local.procs import moerl_argv
from app.local.run import (RESUME_MAY_CHANGE, earlier_wall_s, embedded_default, load_run_config, make_base_policy,
                           replaced_fields, summarize)

# A directory that exists and that no one, root included, can create files in.
READ_ONLY = Path("/sys")


def moerl_run(capsys, *args: str) -> tuple[int, str]:
    """Exit code and stderr of ``moerl run ARGS``."""
    with pytest.raises(SystemExit) as e:
        main(["run", *args])
    return e.value.code, capsys.readouterr().err


def one_line(err: str) -> str:
    lines = [x for x in err.splitlines() if x.strip()]
    assert len(lines) == 1, err
    return lines[0]


@pytest.mark.parametrize("sets, expected", [
    (["trainer.lrr=1e-4"], "--set: invalid run config: trainer.lrr: Extra inputs are not permitted"),
    (["trainer.lr=fast"], "--set: invalid run config: trainer.lr: Input should be a valid number"),
    (["trainer.steps=true"], "trainer.steps: true is a bool, not a number"),
    (["trainer.lr"], "--set 'trainer.lr': expected key=value"),
    (["trainer.lr.peak=1"], "--set trainer.lr.peak: trainer.lr is not a section of the run config"),
    (["rollout.reward_range=[1, 0]"], "rollout.reward_range: Value error, [1, 0]: low must be below high"),
    (["store_url=ftp://host/runs"], "store_url: Value error, 'ftp://host/runs' is not a file://PATH or "
                                    "s3://BUCKET[/PREFIX] URL"),
    (["buffer.redis_url=notaurl"], "buffer.redis_url: Value error, 'notaurl' is not a redis://, rediss:// or "
                                   "unix:// URL"),
    (["rollout.reward_fn=nocolon"], "rollout.reward_fn: Value error, 'nocolon' is not an import path "
                                    "package.module:attr"),
])
def test_set_names_the_field_it_could_not_set(tmp_path, capsys, sets, expected):
    args = [a for s in sets for a in ("--set", s)]
    code, err = moerl_run(capsys, *args, "--out", str(tmp_path / "run"))
    assert code == 2
    assert expected.replace("Value error, ", "") in one_line(err)
    assert not (tmp_path / "run").exists()


def test_set_reaches_any_field_and_is_validated_like_the_file(tmp_path):
    cfg = load_run_config(None, "calculator", None, None, ["trainer.lr=1e-4", "env.max_turns=3",
                                                           "task.params={min_digits: 2, max_digits: 2}",
                                                           "rollout.reward_range=[-1, 10]", "env.url="])
    assert (cfg.trainer.lr, cfg.env.max_turns, cfg.task.params, cfg.rollout.reward_range, cfg.env.url) == (
        1e-4, 3, {"min_digits": 2, "max_digits": 2}, (-1.0, 10.0), None)
    f = tmp_path / "run.yaml"
    f.write_text("trainer:\n  steps: 3\n")
    cfg = load_run_config(f, None, None, None, ["trainer.steps=7", "run_id=mine"])
    assert (cfg.trainer.steps, cfg.run_id) == (7, "mine")


@pytest.mark.parametrize("text, expected", [
    ("trainer:\n  steps: 3\n  lr: 1.0e-4\n  steps: 400\n",
     "not valid YAML: line 4, column 3: duplicate key 'steps' (first given on line 2)"),
    ("", "the run config is empty (no field set); for the default task leave out --config"),
    ("# nothing here yet\n", "the run config is empty"),
    ("- trainer\n", "a run config is a YAML mapping of sections, not a list"),
])
def test_a_config_file_that_repeats_a_key_or_says_nothing_is_refused_with_its_line(tmp_path, capsys, text, expected):
    f = tmp_path / "run.yaml"
    f.write_text(text)
    code, err = moerl_run(capsys, "--config", str(f), "--out", str(tmp_path / "run"))
    assert code == 2 and f"{f}: {expected}" in one_line(err)
    assert not (tmp_path / "run").exists()


def test_max_new_tokens_beyond_the_policys_context_is_refused(tmp_path, capsys):
    code, err = moerl_run(capsys, "--set", "rollout.max_new_tokens=100000", "--out", str(tmp_path / "run"))
    assert code == 2
    assert ("rollout.max_new_tokens=100000 does not fit the policy's context of 512 tokens "
            "(model.preset tiny-qwen3-moe: max_position_embeddings)") in one_line(err)
    # An episode's turns share the context: 2 turns of 300 do not fit either.
    code, err = moerl_run(capsys, "--task", "calculator", "--set", "rollout.max_new_tokens=300",
                          "--out", str(tmp_path / "run"))
    assert code == 2 and "rollout.max_new_tokens=300 x env.max_turns=2 does not fit" in one_line(err)


def test_a_malformed_env_url_is_reported_at_once(tmp_path, capsys):
    t0 = time.monotonic()
    code, err = moerl_run(capsys, "--set", "env.name=mine", "--set", "env.url=localhost:8091",
                          "--out", str(tmp_path / "run"))
    assert code == 2 and time.monotonic() - t0 < 10  # 15 s of waiting for /health before
    assert "env.url: 'localhost:8091' is not an http(s):// or ws(s):// URL with a host" in one_line(err)
    code, err = moerl_run(capsys, "--set", "env.name=mine", "--set", "env.url=http://127.0.0.1:99999",
                          "--out", str(tmp_path / "run"))
    assert code == 2 and "the port is not a number in 1-65535" in one_line(err)


def test_out_and_cache_errors_name_their_flag(tmp_path, capsys):
    a_file = tmp_path / "file"
    a_file.write_text("")
    for out, expected in ((a_file, f"--out {a_file}: exists and is not a directory"),
                          (READ_ONLY / "moerl-run", f"--out {READ_ONLY / 'moerl-run'}: cannot be made: "
                                                     f"{READ_ONLY} is not writable")):
        code, err = moerl_run(capsys, "--out", str(out))
        assert code == 2 and expected in one_line(err)
    code, err = moerl_run(capsys, "--cache", str(READ_ONLY / "moerl-cache"), "--out", str(tmp_path / "run"))
    assert code == 2 and f"--cache {READ_ONLY / 'moerl-cache'}: cannot be made: {READ_ONLY} is not writable" \
        in one_line(err)
    assert not (tmp_path / "run").exists()


def test_a_read_only_cache_without_this_warm_up_is_found_before_the_warm_up(tmp_path):
    """A cache that exists but cannot be written may hold the recipe's warm-up; when it does not,
    `moerl run` says so before starting one (the warm-up ran, then failed to save: exit 1)."""
    started = []
    sup = SimpleNamespace(start=lambda *a, **k: started.append(a))
    loop = SimpleNamespace(cfg=embedded_default(), env_url=None, sup=sup, config_path=tmp_path / "run.yaml")
    loop.cfg.task.train_size, loop.cfg.task.eval_size = 50, 10
    with pytest.raises(ValueError, match=rf"--cache {READ_ONLY}: cannot hold this recipe's warm-up \(warmup-\w+\): "
                                         rf"{READ_ONLY} is not writable"):
        make_base_policy(loop, READ_ONLY)
    assert started == []


def test_resume_of_what_is_not_a_run_is_one_line(tmp_path, capsys):
    code, err = moerl_run(capsys, "--resume", str(tmp_path / "nothing"))
    assert code == 2 and f"--resume {tmp_path / 'nothing'}: no run.yaml there" in one_line(err)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    RunConfig().save(run_dir / "run.yaml")
    code, err = moerl_run(capsys, "--resume", str(run_dir))
    assert code == 2 and "no store/ or redis/ there: nothing saved to continue from" in one_line(err)
    code, _ = moerl_run(capsys, "--resume", str(run_dir), "--task", "calculator")
    assert code == 2  # --resume takes the run's own config


def saved_run(tmp_path: Path) -> Path:
    """A run directory as an interrupted run leaves it (run.yaml, store/, redis/), its base
    policy gone: a resume that passes its config checks stops at that, before any process."""
    run_dir = tmp_path / "run"
    cfg = embedded_default()
    cfg.task.train_size, cfg.task.eval_size = 50, 10
    cfg.model.path, cfg.task.warmup_done = str(tmp_path / "gone"), True
    cfg.save(run_dir / "run.yaml")
    (run_dir / "store").mkdir()
    (run_dir / "redis").mkdir()
    return run_dir


@pytest.mark.parametrize("sets, named", [
    (["trainer.algorithm=ppo"], "trainer.algorithm"),
    (["run_id=other"], "run_id"),
    (["model.preset=tiny-deepseek-v3", "trainer.lr=1e-3", "trainer.steps=500"], "model.preset, trainer.lr"),
])
def test_resume_refuses_a_change_its_saved_state_was_not_made_with(tmp_path, capsys, sets, named):
    """A resume may change the step count, saves, timeouts and logging; any other field is one
    line naming it, and run.yaml stays as it was (it was rewritten, then the trainer failed on it
    after start-up, and every later --resume failed the same way)."""
    run_dir = saved_run(tmp_path)
    before = (run_dir / "run.yaml").read_bytes()
    code, err = moerl_run(capsys, "--resume", str(run_dir), *[a for s in sets for a in ("--set", s)])
    assert code == 2
    assert f"--resume {run_dir}: --set {named}: a resumed run keeps the config its saved state was trained " \
           "with" in one_line(err)
    assert (run_dir / "run.yaml").read_bytes() == before
    assert sorted(p.name for p in run_dir.iterdir()) == ["redis", "run.yaml", "store"]


def test_resume_takes_steps_timeouts_and_saves(tmp_path, capsys):
    run_dir = saved_run(tmp_path)
    before = (run_dir / "run.yaml").read_bytes()
    code, err = moerl_run(capsys, "--resume", str(run_dir), "--steps", "500", "--set", "trainer.batch_timeout_s=30",
                          "--set", "trainer.save_every=4", "--set", "env.step_timeout_s=20")
    # Past the resume's own checks: the next is the base policy's, gone here.
    assert code == 2 and f"model.path '{tmp_path / 'gone'}': not a local directory" in one_line(err)
    assert (run_dir / "run.yaml").read_bytes() == before


def test_a_resumed_runs_summary_counts_training_time_not_the_gap_between_its_runs(tmp_path):
    """Steps 1-2 of the first run, a resume from step 2 some 16 minutes later (trained.jsonl's
    resume line), steps 3-4: 20 s of training and 128 samples, not 1020 s."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    t0 = 1_700_000_000.0
    steps = [(1, t0, 64), (2, t0 + 10, 128), (3, t0 + 1010, 192), (4, t0 + 1020, 256)]
    (run_dir / "metrics.jsonl").write_text("".join(
        json.dumps({"step": s, "time": t, "samples_total": n, "reward_mean": 0.5, "policy_version": s}) + "\n"
        for s, t, n in steps))
    (run_dir / "trained.jsonl").write_text(json.dumps({"resume_from_step": 2, "version": 1, "time": t0 + 1000}) + "\n")
    (run_dir / "summary.json").write_text(json.dumps({"wall_s": 300.0}))
    assert earlier_wall_s(run_dir) == 300.0  # the first run's time in all, counted on by the resumed one
    loop = SimpleNamespace(run_dir=run_dir, cfg=embedded_default(), buffer=None,
                           metrics=lambda: [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()])
    before = {"n": 10, "mean_reward": 0.4, "greedy": 0.6}
    summary = summarize(loop, before, None, started=time.time())
    assert summary["train_s"] == pytest.approx(20.0)
    assert summary["samples_per_s"] == pytest.approx(128 / 20)


@pytest.mark.parametrize("reward_fn, expected", [
    ("app.envs.rewards:nope", "rollout.reward_fn 'app.envs.rewards:nope' cannot be imported: module "
                              "'app.envs.rewards' has no attribute 'nope'"),
    ("no_such_mod_xyz:score", "rollout.reward_fn 'no_such_mod_xyz:score' cannot be imported: No module named "
                              "'no_such_mod_xyz'"),
])
def test_a_reward_fn_that_cannot_be_imported_is_refused_before_anything_starts(tmp_path, capsys, reward_fn, expected):
    """Not after start-up, with workers crash-looping and the console waiting for the first batch
    until trainer.batch_timeout_s."""
    code, err = moerl_run(capsys, "--set", f"rollout.reward_fn={reward_fn}", "--out", str(tmp_path / "run"))
    assert code == 2 and expected in one_line(err)
    assert not (tmp_path / "run").exists()


def test_a_rollout_role_that_refuses_its_input_twice_ends_the_run_with_its_line(tmp_path):
    """A worker that exits 2 (its input refused, one line) is restarted once; the same line again
    ends the run with that line instead of a restart loop that the console never shows."""
    loop = EmbeddedLoop(RunConfig(), tmp_path / "run", workers=1)
    line = "moerl rollout: ValueError: rollout.reward_fn 'mine:score' cannot be imported: No module named 'mine'"
    refuses = [sys.executable, "-c", f"print({line!r}); raise SystemExit(2)"]
    crashes = [sys.executable, "-c", "raise SystemExit(1)"]
    try:
        proc = loop.sup.start("worker-0", refuses)  # checked first (dict order)
        crashing = loop.sup.start("worker-1", crashes)
        assert proc.wait(30) == 2 and crashing.wait(30) == 1
        loop.check_roles()  # the first refusal: restarted (it may pass, e.g. a server not up yet)
        assert proc.starts == 2 and crashing.starts == 2
        assert proc.wait(30) == 2 and crashing.wait(30) == 1
        with pytest.raises(RoleRefused, match="worker-0 exited with 2 twice") as e:
            loop.check_roles()
        assert e.value.code == 2 and str(e.value).splitlines()[-1] == line
        # Another failure (exit 1, or exit 2 with a new line) is restarted as before, every time.
        loop.sup.procs.pop("worker-0")
        loop.check_roles()
        assert crashing.starts == 3
    finally:
        loop.close()


def test_more_workers_than_the_machine_holds_are_refused(tmp_path, capsys):
    code, err = moerl_run(capsys, "--workers", "500", "--out", str(tmp_path / "run"))
    assert code == 2 and "--workers 500: at most" in one_line(err)
    assert not (tmp_path / "run").exists()


def test_deepep_where_deep_ep_cannot_run_is_refused_before_the_warm_up(tmp_path, capsys):
    code, err = moerl_run(capsys, "--set", "trainer.parallel.ep_backend=deepep", "--out", str(tmp_path / "run"))
    assert code == 2
    assert "trainer.parallel.ep_backend='deepep' cannot run here: the deep_ep module is not installed" in one_line(err)
    assert "warm-up" not in capsys.readouterr().out
    assert not (tmp_path / "run").exists()


def test_moerl_run_says_which_fields_of_the_config_it_replaces():
    """`moerl run` keeps a run's store and buffer in its directory (docs/local-run.md): a
    store_url or buffer.redis_url the config set is named on the console, not silently dropped."""
    cfg = embedded_default()
    assert replaced_fields(cfg) == []
    cfg.store_url, cfg.buffer.redis_url = "s3://bucket/runs", "redis://:secret@buffer:6379/0"
    assert replaced_fields(cfg) == ["store_url=s3://bucket/runs", "buffer.redis_url=redis://buffer:6379/0"]


def test_what_a_resume_may_change_names_fields_of_the_run_config():
    """A renamed field left in the list would silently stop being changeable on resume."""
    def field_of(path: str) -> bool:
        model = RunConfig
        for part in path.split("."):
            if part not in model.model_fields:
                return False
            model = model.model_fields[part].annotation
        return True

    assert [f for f in RESUME_MAY_CHANGE if not field_of(f)] == []
    assert not field_of("trainer.no_such_field")
