"""A newcomer's faulty environment, seen from the console (issue 44, items 3-6): rewards outside
[0, 1] on both paths under one rule, a dead environment server that the workers, the trainer and
`moerl run` name instead of freezing, the failed groups and their reasons in the summary, runs
whose every rollout fails ended in one line, and the summary and plot of what was trained even
when the final evaluation fails.

Against OpenEnv's own server (``create_fastapi_app``) over environments that misbehave on
purpose, a real redis-server and the real rollout worker, with an engine stand-in that answers
every turn with one guess.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Optional

import pytest
from openenv.core.env_server import create_fastapi_app

from app.buffer import ExperienceBuffer
from app.buffer.health import RolloutHealth, failure_reason
from app.buffer.redis_server import free_port
from app.config import RunConfig
from app.envs.tasks import make_splits, make_tasks
from app.local.run import RoleFailed, embedded_default, failure_line, print_summary, summarize
from app.local.status import every_rollout_fails, training_info
from app.model.tokenizer import EOS_ID, build_tokenizer
from app.rollout.engine_client import GenOutput
from app.rollout.worker import RolloutWorker
from app.trainer.intake import take_groups
from examples.guess_number.env import GuessAction, GuessNumberEnv, GuessObservation
from helpers import EnvServer, guess_number_at, moerl_run_fails_in_one_line

TOK = build_tokenizer()
G = 4


class RewardOf(GuessNumberEnv):
    """Ends every episode at its first guess with the reward ``REWARD`` (OpenEnv serializes a
    NaN as null)."""

    REWARD = 7.5

    def step(self, action: GuessAction, timeout_s: Optional[float] = None, **kwargs: Any) -> GuessObservation:
        return GuessObservation(message="", done=True, reward=self.REWARD)


class NaNReward(RewardOf):
    REWARD = float("nan")


def serve(env_cls) -> EnvServer:
    return EnvServer(app=create_fastapi_app(env_cls, GuessAction, GuessObservation, max_concurrent_envs=64))


class OneGuess:
    """An engine client that answers every request with the guess ``8<eos>`` at version 0."""

    url = "stub://engine"

    async def generate(self, ids, n=1, **kw):
        turn = TOK("8", add_special_tokens=False)["input_ids"] + [EOS_ID]
        return [GenOutput(token_ids=turn, logprobs=[-0.5] * len(turn), text="8", finish_reason="stop",
                          weight_version=0)] * n

    async def weight_version(self):
        return 0

    async def health_generate(self, timeout_s=30.0):
        return True


def episode_config(tmp_path: Path, redis_url: str, env_url: str) -> RunConfig:
    cfg = RunConfig(run_id="health", store_url=f"file://{tmp_path / 'store'}")
    cfg.buffer.redis_url = redis_url
    cfg.buffer.max_failures = 1
    cfg.rollout.group_size = G
    cfg.rollout.max_new_tokens = 4
    cfg.rollout.retry_backoff_s = 0.05
    cfg.rollout.policy_cache_dir = str(tmp_path / "cache")
    cfg.task.source, cfg.task.train_size, cfg.task.eval_size = "env", 8, 4
    cfg.env.name, cfg.env.url, cfg.env.max_turns = "guess-number", env_url, 2
    return cfg


def run_worker(cfg: RunConfig, buf: ExperienceBuffer, until, score_fn=None, seconds: float = 60) -> None:
    async def go():
        worker = RolloutWorker(cfg, buf, OneGuess(), "w0", score_fn=score_fn)

        async def stop_when_done():
            while not until():
                await asyncio.sleep(0.1)
            worker.request_stop()

        stopper = asyncio.ensure_future(stop_when_done())
        await asyncio.wait_for(worker.run(), seconds)
        await stopper

    asyncio.run(go())


def test_an_environments_reward_outside_the_range_fails_its_group_unless_declared(tmp_path, redis_server):
    """7.5 from a user's environment was trained silently (the bar showed a mean reward of 2.81)
    while a single-turn reward outside [0, 1] failed its group: one rule now, and the reason is
    counted without the value (equal causes add up)."""
    server = serve(RewardOf)
    try:
        cfg = episode_config(tmp_path, redis_server, server.url)
        buf = ExperienceBuffer.from_config(cfg)
        train, _ = make_splits(cfg.task)
        buf.put_tasks(make_tasks(train[:2], TOK, G))
        run_worker(cfg, buf, lambda: buf.stats()["failed_dropped"] >= 2)
        assert buf.stats()["finished"] == 0
        assert buf.health().failures == {"environment: reward outside rollout.reward_range [0, 1]": 2}
        # Declared, the same rewards are trained.
        cfg.rollout.reward_range = (-1.0, 10.0)
        buf.put_tasks(make_tasks(train[2:3], TOK, G))
        run_worker(cfg, buf, lambda: buf.stats()["finished"] >= 1)
        (group,) = buf.take_batch(8, trainer_version=0, timeout_s=0)
        assert [s.reward for s in group.samples] == [7.5] * G
    finally:
        server.stop()


def test_a_single_turn_reward_outside_the_range_follows_the_same_rule(tmp_path, redis_server):
    cfg = episode_config(tmp_path, redis_server, "http://unused:1")
    cfg.env.name, cfg.env.url, cfg.task.source = None, None, "reasoning-gym"
    buf = ExperienceBuffer.from_config(cfg)
    buf.put_tasks(make_tasks(make_splits(cfg.task)[0][:1], TOK, G))
    run_worker(cfg, buf, lambda: buf.stats()["failed_dropped"] >= 1, score_fn=lambda task, text: 7.5)
    assert buf.health().failures == {"reward outside rollout.reward_range [0, 1]": 1}
    cfg.rollout.reward_range = (0.0, 10.0)
    buf.put_tasks(make_tasks(make_splits(cfg.task)[0][1:2], TOK, G))
    run_worker(cfg, buf, lambda: buf.stats()["finished"] >= 1, score_fn=lambda task, text: 7.5)


def test_the_held_out_episodes_refuse_a_reward_outside_the_range_and_a_nan(tmp_path):
    """The evaluation before RL plays the same rule, so `moerl run` stops there, before training."""
    from app.envs import episodes_remote
    from app.envs.env_client import EnvError
    from app.envs.wire import fetch_wire_format
    from app.model.config import tiny_config
    from app.model.parallel import EPContext
    from app.model.policy import build_policy

    model = build_policy(tiny_config("tiny-qwen3-moe"), RunConfig().router, EPContext.local(), seed=0)
    cfg = episode_config(tmp_path, "redis://unused", "http://unused:1")
    _, heldout = make_splits(cfg.task)
    for env_cls, match in ((RewardOf, r"reward 7\.5 outside rollout\.reward_range \[0, 1\]"),
                           (NaNReward, r"ended with reward null: no reward, or NaN \(OpenEnv sends NaN as null\)")):
        server = serve(env_cls)
        try:
            with pytest.raises(EnvError, match=rf"env\.url {server.url}: .*{match}"):
                episodes_remote.play(model, TOK, heldout, cfg.env, server.url, fetch_wire_format(server.url), 1.0,
                                     4, overlong_reward=None, rollout=cfg.rollout)
        finally:
            server.stop()


def test_a_dead_environment_is_what_the_workers_wait_on_and_what_the_trainer_names(tmp_path, redis_server):
    """With the server gone the bar froze on stale figures and the trainer's timeout asked "are
    rollout workers running?" while the cause was in the workers' logs. The workers now say in
    the run's Redis what they wait on; the trainer's timeout and `moerl run`'s line name it."""
    dead = f"http://127.0.0.1:{free_port()}"
    cfg = episode_config(tmp_path, redis_server, dead)
    cfg.rollout.reward_warmup_timeout_s = 600
    buf = ExperienceBuffer.from_config(cfg)
    run_worker(cfg, buf, lambda: bool(buf.health().waiting), seconds=30)
    wait = buf.health().waiting["w0"]
    assert (wait["on"], wait["what"]) == ("environment", dead) and "ConnectError" in wait["why"]
    line = buf.health().waiting_line()
    assert line.startswith("1 rollout worker waiting") and f"on the environment at {dead}: ConnectError" in line
    cfg.trainer.batch_timeout_s = 0.5
    with pytest.raises(TimeoutError) as e:
        take_groups(buf, cfg, 0, lambda: False, lambda g: True)
    assert "are rollout workers running?" not in str(e.value) and f"environment at {dead}: ConnectError" in str(e.value)
    # The live line once no step came for a while.
    assert f"waiting: 1 rollout worker waiting" in training_info([], buf.health())
    # A worker that reaches it again says so.
    buf.note_waiting("w0", None)
    assert buf.health().waiting == {} and buf.health().waiting_line() is None


def test_a_failed_trainer_is_one_line_of_its_own_not_torchruns_dump():
    log = ("trainer exited with 1:\n[rank0]: Traceback (most recent call last):\n"
           "moerl train (rank 1): fewer than 8 GRPO groups arrived\n"
           "moerl train (rank 0): only 0/8 GRPO groups arrived within trainer.batch_timeout_s=60s from redis://x "
           "(run 'dev'): 2 rollout workers waiting 61 s on the environment at http://127.0.0.1:8091: ConnectError\n"
           "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: \n====\napp.cli FAILED\n")
    assert failure_line(RoleFailed(log)) == (
        "trainer exited with 1: only 0/8 GRPO groups arrived within trainer.batch_timeout_s=60s from redis://x "
        "(run 'dev'): 2 rollout workers waiting 61 s on the environment at http://127.0.0.1:8091: ConnectError")
    assert failure_line(RoleFailed("engine-0 exited with -9:\nKilled")) is None  # no own line: the tail is shown


def test_every_rollout_failing_ends_the_run_naming_the_reason():
    health = RolloutHealth({"environment: reward outside rollout.reward_range [0, 1]": 15, "other": 1})
    stats = {"finished": 0, "failed_requeued": 8, "failed_dropped": 8}
    line = every_rollout_fails(stats, health, groups_per_step=8)
    assert line == ("every rollout group failed (16 groups, none finished; 8 tasks dropped after buffer.max_failures): "
                    "environment: reward outside rollout.reward_range [0, 1] (15); other (1)")
    assert every_rollout_fails({**stats, "finished": 1}, health, 8) is None  # some groups train: go on
    assert every_rollout_fails({**stats, "failed_dropped": 0}, health, 8) is None  # still retried
    one = every_rollout_fails({**stats, "failed_requeued": 15, "failed_dropped": 1}, health, 8)
    assert "none finished; 1 task dropped after buffer.max_failures" in one  # not "1 tasks"


def test_the_summary_says_failed_requeued_and_dropped_groups_and_the_top_reasons(tmp_path, redis_server, capsys):
    cfg = embedded_default()
    cfg.buffer.redis_url = redis_server
    buf = ExperienceBuffer.from_config(cfg)
    reasons = [failure_reason("environment", "ws://127.0.0.1:5/ws: session closed during reset (code 1000)")] * 5 \
        + ["environment: no answer to step within 10 s"] * 2 + ["reward function: timed out"]
    buf.note_failures(reasons)
    buf.r.hset(buf.keys["stats"], mapping={"failed_requeued": 6, "failed_dropped": 2})
    now = time.time()
    records = [{"time": now + i, "step": i + 1, "reward_mean": 0.5, "samples_total": 64 * (i + 1),
                "policy_version": i // 2} for i in range(3)]
    loop = SimpleNamespace(run_dir=tmp_path, cfg=cfg, metrics=lambda: records,
                           buffer=lambda: ExperienceBuffer.from_config(cfg))
    s = summarize(loop, {"n": 200, "mean_reward": 0.4, "greedy": 0.7}, {"n": 200, "mean_reward": 0.5, "greedy": 0.7},
                  now)
    assert s["failures"] == {"failed": 8, "requeued": 6, "dropped": 2, "top_reasons": [
        ("environment: session closed during reset (code 1000)", 5), ("environment: no answer to step within 10 s", 2),
        ("reward function: timed out", 1)]}
    print_summary(s)
    assert ("failed rollout groups: 8 (6 requeued, 2 dropped after buffer.max_failures); top reasons: environment: "
            "session closed during reset (code 1000) (5); environment: no answer to step within 10 s (2); reward "
            "function: timed out (1)") in capsys.readouterr().out


def test_the_summary_prints_whole_lines_when_stdout_is_not_a_terminal(tmp_path, capsys):
    """Piped or logged, rich would cut the header at 80 columns ("... before RL -> after" / "RL")."""
    now = time.time()
    records = [{"time": now + i, "step": i + 1, "reward_mean": 0.5, "samples_total": 64 * (i + 1),
                "policy_version": i // 2} for i in range(3)]
    loop = SimpleNamespace(run_dir=tmp_path, cfg=embedded_default(), metrics=lambda: records)
    s = summarize(loop, {"n": 400, "mean_reward": 0.4, "greedy": 0.7}, {"n": 400, "mean_reward": 0.5, "greedy": 0.7},
                  now)
    s["task"] = "roman-numerals-of-a-new-user"
    print_summary(s)
    header = "task roman-numerals-of-a-new-user: held-out mean reward over 400 prompts, before RL -> after RL"
    assert len(header) > 80 and header in capsys.readouterr().out.splitlines()


def test_a_failed_final_evaluation_still_writes_the_summary_and_plot_of_what_was_trained(tmp_path, capsys):
    now = time.time()
    records = [{"time": now + i, "step": i + 1, "reward_mean": 0.5, "samples_total": 64 * (i + 1),
                "policy_version": i // 2} for i in range(3)]
    loop = SimpleNamespace(run_dir=tmp_path, cfg=embedded_default(), metrics=lambda: records)
    error = ValueError("held-out evaluation: env.url http://x: server error CAPACITY_REACHED: Server at capacity")
    s = summarize(loop, {"n": 200, "mean_reward": 0.4, "greedy": 0.7}, error, now)
    on_disk = json.loads((tmp_path / "summary.json").read_text())
    assert on_disk["held_out_reward_after"] is None and on_disk["gain_points"] is None and on_disk["steps"] == 3
    assert on_disk["final_evaluation_error"] == str(error) and not on_disk["finished"]
    assert (tmp_path / "plot.png").read_bytes()[:4] == b"\x89PNG"
    print_summary(s)
    out = capsys.readouterr().out
    assert "sampled 0.400 -> n/a" in out and f"(after RL not measured: {error})" in out


def test_moerl_run_against_an_environment_whose_every_reward_is_nan_is_one_line_and_exit_2(tmp_path):
    """The held-out episodes (the warm-up's own) meet the null rewards first: the warm-up says so
    in one line, `moerl run` passes it on, exit 2, no run directory (was a traceback, exit 1)."""
    server = serve(NaNReward)
    try:
        line = moerl_run_fails_in_one_line(tmp_path, guess_number_at(tmp_path, server.url, train_size=50, eval_size=10))
    finally:
        server.stop()
    assert "ended with reward null" in line and "OpenEnv sends NaN as null" in line


def test_nan_is_not_a_reward_anywhere():
    assert not RunConfig().rollout.reward_in_range(math.nan)


def test_the_own_line_is_found_above_torchruns_dump_in_the_roles_log(tmp_path):
    """A real dead-environment run: torchrun's ChildFailedError dump filled the 40 lines of the
    error's tail, and the line said only "trainer exited with 1:"; the role's log has the cause."""
    log = tmp_path / "trainer.log"
    own = ("moerl train (rank 0): rank 0 could not take a batch: fewer than 8 GRPO groups arrived within "
           "trainer.batch_timeout_s=60s from redis://127.0.0.1:1/0 (run 'guess-number'): 2 rollout workers waiting "
           "60 s on the environment at http://127.0.0.1:59833: ConnectError: All connection attempts failed")
    dump = [f"torch.distributed.elastic line {i}" for i in range(45)]
    log.write_text("\n".join(["rank0 step 5 v2", own, *dump]) + "\n")
    error = RoleFailed("trainer exited with 1:\n" + "\n".join(dump[-40:]))
    assert failure_line(error) is None
    assert failure_line(error, log) == "trainer exited with 1: " + own.split(": ", 1)[1]
