"""`moerl run`'s input as a newcomer gives it (issue 44, items 7 and 8): ``--set key=value`` on
any field, YAML that repeats a key or holds nothing, a ``max_new_tokens`` beyond the policy's
context, a ``--cache`` or ``--out`` that cannot be written, a malformed ``env.url`` and a
``--resume`` of something that is not a run: each one line naming the field, flag or file,
exit 2, before anything starts and with nothing left behind.

The command runs in this process (`app.cli.main`, as the ``moerl`` script calls it): each case
fails before any role process starts.
"""

from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from app.cli import main
from app.config import RunConfig
from app.local.run import embedded_default, load_run_config, make_base_policy

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
