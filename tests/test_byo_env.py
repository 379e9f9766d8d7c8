"""Bring your own environment: an OpenEnv environment moerl does not ship, trained through
`moerl run` (docs/environments.md, "Your own environment").

The environment is examples/guess_number/env.py, written as an OpenEnv author writes one: its
own Action/Observation classes with OpenEnv's ordinary field names (``message``), served by
OpenEnv's own ``create_fastapi_app``. The old code refused it (``env.name`` a closed Literal),
overwrote ``env.url`` with its own server, and spoke only ``{"text"}`` / ``content``.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional

import pytest
import yaml
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State
from pydantic import Field

from app.buffer.redis_server import free_port
from app.config import RunConfig
from app.envs.environments import TextAction, TextObservation
from app.envs.wire import WireError, wire_format
from examples.guess_number.env import GuessAction, GuessNumberEnv, GuessObservation, bisect, secret_of
from helpers import EnvServer, guess_number_at, moerl_run_fails_in_one_line

ROOT = Path(__file__).resolve().parents[1]
GUESS = "examples.guess_number.env:GuessNumberEnv"


def schemas(action, observation) -> dict:
    """What OpenEnv's ``GET /schema`` answers for these classes (http_server.py get_schemas)."""
    return {"action": action.model_json_schema(), "observation": observation.model_json_schema(),
            "reset_observation": observation.model_json_schema(), "state": State.model_json_schema()}


class EchoAction(Action):  # OpenEnv's environment template (openenv init)
    message: str = Field(..., description="Message to echo back")


class EchoObservation(Observation):
    echoed_message: str = Field(..., description="The echoed message")
    message_length: int = Field(default=0)


class ArenaObservation(Observation):  # TextArena's shape: a prompt and the messages so far
    prompt: str = ""
    messages: list[dict] = Field(default_factory=list)


class MoveAction(Action):
    move_id: int


def test_the_wire_format_follows_openenvs_own_field_names():
    assert wire_format(schemas(TextAction, TextObservation)).__dict__ == {
        "action_field": "text", "observation_field": "content", "reset_field": "content"}
    guess = wire_format(schemas(GuessAction, GuessObservation))
    assert (guess.action_field, guess.observation_field) == ("message", "message")
    assert guess.action("8") == {"message": "8"}
    assert guess.message(GuessObservation(message="<", guesses=1).model_dump()) == {"role": "user", "content": "<"}
    echo = wire_format(schemas(EchoAction, EchoObservation))
    assert (echo.action_field, echo.observation_field) == ("message", "echoed_message")
    assert wire_format(schemas(EchoAction, ArenaObservation)).observation_field == "prompt"


def test_an_environment_without_a_text_field_is_one_error_naming_it():
    with pytest.raises(WireError, match=r"action schema 'MoveAction' has no string field.*move_id: integer"):
        wire_format(schemas(MoveAction, GuessObservation))

    class Board(Observation):
        cells: list[int] = Field(default_factory=list)

    with pytest.raises(WireError, match=r"observation schema 'Board' has no text field.*cells: array"):
        wire_format(schemas(GuessAction, Board))


class NoSpecEnv(Environment[GuessAction, GuessObservation, State]):
    """Picks its own problem per episode: OpenEnv would drop moerl's spec without a word."""

    SUPPORTS_CONCURRENT_SESSIONS = True

    def reset(self, seed: Optional[int] = None, episode_id: Optional[str] = None) -> GuessObservation:
        return GuessObservation(message="1-15?")

    def step(self, action: GuessAction, timeout_s: Optional[float] = None, **kwargs: Any) -> GuessObservation:
        return GuessObservation(message="<")

    @property
    def state(self) -> State:
        return State()


def test_moerl_env_refuses_a_reset_that_cannot_take_the_spec():
    from app.envs.openenv_server import build_app

    cfg = RunConfig.model_validate({"env": {"name": f"{__name__}:NoSpecEnv"}})
    with pytest.raises(ValueError, match=r"NoSpecEnv\.reset takes no 'spec'"):
        build_app(cfg)


def test_env_name_is_open_to_import_paths_and_to_servers_of_ones_own():
    assert RunConfig.model_validate({"env": {"name": GUESS}}).env.served_by_moerl()
    ext = RunConfig.model_validate({"env": {"name": "guess-number", "url": "http://127.0.0.1:8091"}}).env
    assert not ext.served_by_moerl() and not ext.builtin()
    with pytest.raises(ValueError, match="env.name: 'guess-number' is not a built-in environment"):
        RunConfig.model_validate({"env": {"name": "guess-number"}})


def test_moerl_env_serves_an_import_path_and_every_episode_gets_its_spec():
    """`moerl env`'s app over the example class: /schema names its fields, and reset(spec=...)
    reaches the environment (bisection on the spec's secret ends each episode with reward 1)."""
    import asyncio

    from app.envs.env_client import EnvSession
    from app.envs.wire import fetch_wire_format

    server = EnvServer(RunConfig.model_validate({"task": {"source": "env"}, "env": {"name": GUESS}}))
    try:
        wire = fetch_wire_format(server.url)
        assert (wire.action_field, wire.observation_field) == ("message", "message")

        async def episode(i: int) -> tuple[int, float]:
            spec = json.dumps({"source": "env", "split": "heldout", "index": i, "seed": 0})
            async with EnvSession(server.url) as env:
                first = await env.reset(spec=spec, episode_id=f"t-{i}")
                assert wire.message(first.observation, reset=True)["content"] == "1-15?"
                for n, guess in enumerate(bisect(secret_of(spec)), 1):
                    r = await env.step(wire.action(guess))
                await env.close()
            return n, r.reward if r.done else -1.0

        async def all_episodes():
            return await asyncio.wait_for(asyncio.gather(*(episode(i) for i in range(12))), 60)

        results = asyncio.run(all_episodes())
        assert all(reward == 1.0 for _, reward in results)
        assert len({n for n, _ in results}) > 1  # the episodes had different secrets
    finally:
        server.stop()


class CountingServer(EnvServer):
    """examples/guess_number/server.py's app (OpenEnv's own server over the author's classes;
    ``env_cls`` another environment of the same action and observation) on a free loopback port
    in this process, counting the environments its sessions made."""

    def __init__(self, env_cls=GuessNumberEnv, openenv_defaults: bool = False):
        from openenv.core.env_server import create_fastapi_app

        self.made = 0

        def factory():
            self.made += 1
            return env_cls()

        if openenv_defaults:  # OpenEnv's quick start: create_fastapi_app(Env, Action, Observation)
            app = create_fastapi_app(factory, GuessAction, GuessObservation)
        else:
            app = create_fastapi_app(factory, GuessAction, GuessObservation, max_concurrent_envs=512,
                                     env_name="guess-number", mode="production")
        super().__init__(app=app)


class NoEpisodeIdEnv(GuessNumberEnv):
    """Takes spec, but keeps an episode id of its own."""

    def reset(self, seed: Optional[int] = None, spec: Any = None, **kwargs: Any) -> GuessObservation:
        return super().reset(seed=seed, episode_id="mine", spec=spec)


class NoDemoEnv(GuessNumberEnv):
    """Gives no demonstration in its reset metadata."""

    def reset(self, *args: Any, **kwargs: Any) -> GuessObservation:
        return GuessObservation(message=super().reset(*args, **kwargs).message)


def heldout_spec(i: int = 0) -> str:
    return json.dumps({"source": "env", "split": "heldout", "index": i, "seed": 0})


def test_an_external_server_whose_reset_takes_spec_and_episode_id_passes_the_check():
    from app.envs.contract import check_reset
    from app.envs.wire import fetch_wire_format

    server = CountingServer()
    try:
        check_reset(server.url, fetch_wire_format(server.url), spec=heldout_spec())  # no error
    finally:
        server.stop()


def test_an_external_server_whose_reset_drops_spec_or_episode_id_is_refused_naming_it():
    """OpenEnv's server drops keyword arguments that reset's signature lacks: the check finds
    it from the server's answers (a spec naming no problem is taken; the state keeps another
    episode id), before any episode."""
    from app.envs.contract import check_reset
    from app.envs.wire import fetch_wire_format

    for env_cls, match in ((NoSpecEnv, r"reset took spec=.*drops 'spec'"),
                           (NoEpisodeIdEnv, r"reset does not take 'episode_id'.*episode_id is 'mine'")):
        server = CountingServer(env_cls)
        try:
            with pytest.raises(WireError, match=r"env\.url http://127\.0\.0\.1:\d+: " + match):
                check_reset(server.url, fetch_wire_format(server.url), spec=heldout_spec())
        finally:
            server.stop()


def test_a_rollout_worker_refuses_an_external_server_whose_reset_drops_spec_at_start():
    """The cluster's workers reach env.url directly: their start (before the first lease) asks
    the server too, and a good server passes."""
    import asyncio

    from app.rollout.worker import RolloutWorker

    for env_cls in (GuessNumberEnv, NoSpecEnv):
        server = CountingServer(env_cls)
        try:
            cfg = RunConfig.model_validate({"task": {"source": "env"}, "env": {"name": "guess-number", "url": server.url}})
            worker = RolloutWorker(cfg, None, None, "w0")
            if env_cls is GuessNumberEnv:
                asyncio.run(worker.warm_up())
            else:
                with pytest.raises(WireError, match=r"drops 'spec'"):
                    asyncio.run(worker.warm_up())
        finally:
            server.stop()


def test_moerl_run_refuses_an_external_server_whose_reset_drops_spec(tmp_path):
    """One line, exit 2, naming 'spec'; no warm-up, no run directory left."""
    server = CountingServer(NoSpecEnv)
    try:
        line = moerl_run_fails_in_one_line(tmp_path, guess_number_at(tmp_path, server.url))
    finally:
        server.stop()
    assert "drops 'spec'" in line


class OneSessionEnv(GuessNumberEnv):
    """An environment as OpenEnv's template writes it: ``SUPPORTS_CONCURRENT_SESSIONS`` left at
    OpenEnv's default, False (its server then holds one session)."""

    SUPPORTS_CONCURRENT_SESSIONS = False


def test_the_probe_finds_a_server_that_holds_one_session_and_says_what_to_set():
    """OpenEnv's own quick-start server (create_fastapi_app with its defaults) answers a second
    session CAPACITY_REACHED and closes it; `moerl run` failed later with a 120-line traceback
    ("session closed during reset (code 1000): no reason"). The probe opens two sessions and
    says in one line what to set."""
    from app.envs.contract import check_reset
    from app.envs.wire import fetch_wire_format

    server = CountingServer(OneSessionEnv, openenv_defaults=True)
    try:
        with pytest.raises(WireError) as e:
            check_reset(server.url, fetch_wire_format(server.url), spec=heldout_spec(), max_sessions=64)
        with pytest.raises(WireError, match="SUPPORTS_CONCURRENT_SESSIONS"):  # the workers' start (no spec)
            check_reset(server.url, fetch_wire_format(server.url))
    finally:
        server.stop()
    msg = str(e.value)
    assert "\n" not in msg
    for part in ("refused a second concurrent session", "CAPACITY_REACHED", "SUPPORTS_CONCURRENT_SESSIONS = True",
                 "max_concurrent_envs=N) with N >= 64", "env.max_sessions=64"):
        assert part in msg, msg


def test_moerl_env_refuses_a_class_that_does_not_support_concurrent_sessions():
    from app.envs.openenv_server import user_environment

    with pytest.raises(ValueError, match=r"OneSessionEnv\.SUPPORTS_CONCURRENT_SESSIONS is False"):
        user_environment(f"{__name__}:OneSessionEnv")


def test_moerl_run_against_openenvs_one_session_server_is_one_line_and_exit_2(tmp_path):
    server = CountingServer(OneSessionEnv, openenv_defaults=True)
    try:
        line = moerl_run_fails_in_one_line(tmp_path, guess_number_at(tmp_path, server.url))
    finally:
        server.stop()
    assert "SUPPORTS_CONCURRENT_SESSIONS = True" in line


def _unreachable_env_config(tmp_path) -> Path:
    return guess_number_at(tmp_path, f"http://127.0.0.1:{free_port()}")


def test_moerl_run_with_an_unreachable_env_url_is_one_line_and_exit_2(tmp_path):
    """A typo in env.url waited 120 s and ended as a failed role (exit 1, a traceback-like
    tail); it is bad input: one line naming env.url, exit 2, within the short wait, and no run
    directory or warm-up left."""
    out = tmp_path / "run"
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "app.cli", "run", "--config", str(_unreachable_env_config(tmp_path)),
                           "--out", str(out), "--cache", str(tmp_path / "cache")],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    took = time.monotonic() - t0
    assert proc.returncode == 2, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = [x for x in proc.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].count("env.url http://127.0.0.1:") == 1, proc.stderr
    assert "did not answer /health" in lines[0]
    assert took < 100, took  # 120 s of waiting before; what remains is start-up and the short wait
    assert not out.exists() and not (tmp_path / "cache").exists()


def test_sigterm_while_moerl_run_waits_for_env_url_leaves_no_run_directory(tmp_path):
    """SIGTERM during the start (here: the wait for the user's server) stopped the processes but
    left ``redis/`` and ``run.yaml``: a start that never reached a step leaves nothing."""
    out = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "app.cli", "run", "--config", str(_unreachable_env_config(tmp_path)),
                             "--out", str(out), "--cache", str(tmp_path / "cache")],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT)
    try:
        deadline = time.monotonic() + 120
        while not (out / "run.yaml").exists():  # the run directory exists: Redis is up, the wait begins
            assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read() if proc.poll() else "slow"
            time.sleep(0.1)
        time.sleep(0.5)
        proc.send_signal(signal.SIGTERM)
        text, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 143, text[-3000:]  # 128 + SIGTERM, the shell's convention (SIGINT: 130)
    assert "interrupted" in text
    assert not out.exists(), sorted(p.name for p in out.iterdir())


def test_warm_up_demonstrations_from_the_environments_own_episodes():
    """env.demos_from_env: each training episode's reset metadata gives the turns that solve it
    (the example's bisection); the warm-up's examples are those episodes as played, loss on the
    turns only. An environment without them is one error naming 'demonstration'."""
    from app.envs.env_client import EnvError
    from app.envs.tasks import make_splits
    from app.model.tokenizer import build_tokenizer
    from app.envs.warmup import user_env_examples

    tok = build_tokenizer()
    server = CountingServer()
    try:
        cfg = RunConfig.model_validate({"task": {"source": "env", "train_size": 12, "eval_size": 4},
                                        "env": {"name": "guess-number", "url": server.url, "max_turns": 4,
                                                "demos_from_env": True}})
        examples = user_env_examples(cfg, tok, None, log=lambda *_: None)
        train, _ = make_splits(cfg.task)
        assert len(examples) == len(train) == 12
        for (ids, mask), p in zip(examples, train):
            taught = [i for i, m in zip(ids, mask) if m]
            want = [t for g in bisect(secret_of(p.spec)) for t in tok(g, add_special_tokens=False)["input_ids"]
                    + [tok.eos_token_id]]
            assert taught == want
        assert len({tuple(ids) for ids, _ in examples}) > 1  # different secrets, different episodes
    finally:
        server.stop()
    bare = CountingServer(NoDemoEnv)
    try:
        cfg.env.url = bare.url
        with pytest.raises(EnvError, match=r"metadata has no 'demonstration'"):
            user_env_examples(cfg, tok, None, log=lambda *_: None)
    finally:
        bare.stop()
    with pytest.raises(ValueError, match="env.demos_from_env: .*no env.demos_path"):
        RunConfig.model_validate({"env": {"name": GUESS, "demos_from_env": True, "demos_path": "d.jsonl"}})


@pytest.mark.slow
def test_moerl_run_trains_a_users_environment_at_its_url(tmp_path):
    """`moerl run` with env.url: no `moerl env` of its own, the user's server plays the
    demonstrations, the held-out episodes and the rollouts, and the trainer trains on groups
    whose rewards differ (real signal: a non-zero gradient)."""
    server = CountingServer()
    cfg = yaml.safe_load((ROOT / "examples/guess_number/run.yaml").read_text())
    cfg["env"] = {**cfg["env"], "name": "guess-number", "url": server.url}
    cfg["env"].pop("demos_path")
    cfg["env"]["demos_path"] = str(ROOT / "examples/guess_number/demos.jsonl")
    cfg["task"].update(train_size=200, eval_size=40, warmup_steps=40)
    cfg["trainer"]["steps"] = 4
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(cfg))
    out = tmp_path / "run"
    try:
        proc = subprocess.run([sys.executable, "-m", "app.cli", "run", "--config", str(tmp_path / "run.yaml"),
                               "--out", str(out), "--cache", str(tmp_path / "cache")],
                              capture_output=True, text=True, timeout=900, cwd=ROOT)
    finally:
        server.stop()
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert f"at {server.url} (env.url): the user's server; moerl starts none" in proc.stdout
    assert not (out / "logs" / "env-0.log").exists()
    # demonstrations (200 rows) + held-out episodes (40 x 4 sampled + 40 greedy, twice) + rollouts
    assert server.made > 200 + 2 * 200 + 4 * 8 * 8, server.made
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 4 and summary["task"].endswith("in env guess-number")
    assert 0.0 <= summary["stale_share"] <= 1.0  # finished groups thrown away as too stale
    for key in ("held_out_reward_before", "held_out_reward_after", "held_out_greedy_before", "held_out_greedy_after"):
        assert 0.0 <= summary[key] <= 1.0
    steps = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert any(0.0 < s["reward_mean"] < 1.0 and s["grad_norm"] > 0 for s in steps), steps
    assert yaml.safe_load((out / "run.yaml").read_text())["env"]["url"] == server.url


def test_moerl_runs_own_env_server_serves_the_import_path_and_outlives_the_rollout(tmp_path):
    """The `moerl env` process `moerl run` starts for an import path: it serves the class
    (its /schema names the class's fields), the workers would get its address, and it stays
    up after the rollout stops, for the held-out episodes after RL."""
    from app.local.embedded import EmbeddedLoop
    from app.envs.wire import fetch_wire_format

    cfg = RunConfig.model_validate({"task": {"source": "env"}, "env": {"name": GUESS}})
    loop = EmbeddedLoop(cfg, tmp_path / "run")
    try:
        loop.ensure_env()
        assert loop.env_url.startswith("http://127.0.0.1:") and loop.cfg.env.url is None  # run.yaml keeps None
        loop.stop_rollout(keep_env=True)
        assert loop.sup.procs["env-0"].alive()
        assert fetch_wire_format(loop.env_url).action_field == "message"
        loop.stop_rollout()
        assert not loop.sup.procs["env-0"].alive()
    finally:
        loop.close()
