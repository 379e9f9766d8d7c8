"""The environment protocol: moerl's environments on OpenEnv's own server, the worker's client
checked against OpenEnv's own message types and client, the calculator's sandbox, episode
timeouts and malformed answers.

The server is OpenEnv's (``openenv.core.env_server.create_fastapi_app``) as `moerl env` builds
it (app/envs/openenv_server.py), on a loopback port in a thread.
"""

from __future__ import annotations

import asyncio
import json
import time

import pytest
from openenv.core.env_server.types import WSCloseMessage, WSResetMessage, WSStepMessage

from app.buffer.redis_server import free_port
from app.config import RunConfig
from app.envs import calculator
from app.envs.env_client import EnvError, EnvSession, parse_observation, ws_url
from app.envs.environments import CalculatorEnv, SpellRetryEnv, TextAction, feedback
from app.envs.openenv_server import EPISODE_TIMEOUT_CODE
from app.envs.tasks import make_splits
from helpers import EnvServer as Server

CALC_PARAMS = {"min_terms": 2, "max_terms": 2, "min_digits": 2, "max_digits": 2, "operators": ["*"],
               "allow_parentheses": False, "allow_negation": False}


def env_config(name: str, **env) -> RunConfig:
    cfg = RunConfig()
    cfg.env.name = name
    cfg.task.train_size, cfg.task.eval_size = 20, 5
    if name == "calculator":
        cfg.task.name, cfg.task.params = "basic_arithmetic", dict(CALC_PARAMS)
    for k, v in env.items():
        setattr(cfg.env, k, v)
    return cfg


@pytest.fixture(scope="module")
def calc():
    cfg = env_config("calculator")
    server = Server(cfg)
    yield server, make_splits(cfg.task)[0]
    server.stop()


@pytest.fixture(scope="module")
def retry():
    cfg = env_config("spell-retry", episode_timeout_s=1.5)
    server = Server(cfg)
    yield server, make_splits(cfg.task)[0]
    server.stop()


def test_calculator_episode_over_openenv(calc):
    server, train = calc
    p = train[0]
    expr = p.text.rstrip("=")

    async def go():
        async with EnvSession(server.url) as env:
            first = await env.reset(spec=p.spec, episode_id="e0")
            call = await env.step({"text": f"[{expr}]"})
            final = await env.step({"text": p.answer})
            await env.close()
            return first, call, final

    first, call, final = asyncio.run(go())
    assert first.observation["content"] == p.text and not first.done
    assert call.observation == {"metadata": {}, "role": "tool", "content": f"={p.answer}\n"} and not call.done
    assert final.done and final.reward == 1.0


def test_client_messages_are_openenvs_own(calc, monkeypatch):
    """Every message the client sends parses as OpenEnv's WS*Message (extra fields forbidden)."""
    server, train = calc
    sent = []
    import websockets.asyncio.client as wsc

    original = wsc.ClientConnection.send

    async def record(self, message, *a, **k):
        sent.append(json.loads(message))
        return await original(self, message, *a, **k)

    monkeypatch.setattr(wsc.ClientConnection, "send", record)

    async def go():
        async with EnvSession(server.url) as env:
            await env.reset(spec=train[1].spec, episode_id="e1")
            await env.step({"text": "12"})
            await env.close()

    asyncio.run(go())
    assert [m["type"] for m in sent] == ["reset", "step", "close"]
    WSResetMessage(**sent[0])
    WSStepMessage(**sent[1])
    WSCloseMessage(**sent[2])
    TextAction.model_validate(sent[1]["data"])  # the action is the environment's own type


def test_openenv_client_plays_our_environment(calc):
    """OpenEnv's own EnvClient (what TRL and others use) runs a moerl environment unchanged."""
    from openenv.core import EnvClient
    from openenv.core.client_types import StepResult
    from openenv.core.env_server.types import State

    class CalcClient(EnvClient):
        def _step_payload(self, action):
            return {"text": action}

        def _parse_result(self, payload):
            return StepResult(payload["observation"], payload.get("reward"), payload.get("done", False))

        def _parse_state(self, payload):
            return State(**payload)

    server, train = calc
    p = train[2]

    async def go():
        client = CalcClient(base_url=server.url)
        async with client:
            await client.reset(spec=p.spec)
            r = await client.step(p.answer)
            return r

    r = asyncio.run(go())
    assert r.done and r.reward == 1.0


def test_environment_errors_are_env_errors(calc):
    server, train = calc

    async def step_before_reset():
        async with EnvSession(server.url) as env:
            await env.step({"text": "1"})

    with pytest.raises(EnvError, match="EXECUTION_ERROR.*step before reset"):
        asyncio.run(step_before_reset())

    async def bad_spec():
        async with EnvSession(server.url) as env:
            await env.reset(spec="not json")

    with pytest.raises(EnvError, match="reasoning-gym"):
        asyncio.run(bad_spec())

    async def nobody_there():
        async with EnvSession(f"http://127.0.0.1:{free_port()}", step_timeout_s=2):
            pass

    with pytest.raises(EnvError, match="cannot open an episode"):
        asyncio.run(nobody_there())


def test_malformed_answers_are_refused():
    ok = {"type": "observation", "data": {"observation": {"content": "x"}, "reward": 0.5, "done": True}}
    assert parse_observation(ok, "w").reward == 0.5
    for bad in ({"type": "observation", "data": {"observation": {}, "reward": float("nan"), "done": True}},
                {"type": "observation", "data": {"observation": {}, "reward": "1", "done": True}},
                {"type": "observation", "data": {"observation": [], "reward": 1.0, "done": True}},
                {"type": "observation", "data": {"observation": {}, "reward": 1.0}},
                {"type": "state", "data": {}},
                {"type": "error", "data": {"message": "boom", "code": "EXECUTION_ERROR"}},
                ["not", "an", "object"]):
        with pytest.raises(EnvError):
            parse_observation(bad, "w")
    assert ws_url("http://h:1") == "ws://h:1/ws" and ws_url("https://h/") == "wss://h/ws"
    with pytest.raises(ValueError, match="env.url"):
        ws_url("h:1")


def test_episode_timeout_closes_the_session_on_the_server(retry):
    server, train = retry

    async def go():
        async with EnvSession(server.url, step_timeout_s=5) as env:
            await env.reset(spec=train[0].spec)
            await asyncio.sleep(2.5)  # past env.episode_timeout_s = 1.5
            await env.step({"text": "x"})

    with pytest.raises(EnvError, match=f"code {EPISODE_TIMEOUT_CODE}"):
        asyncio.run(go())
    assert server.app.expired >= 1


def test_spell_retry_feedback_and_reward():
    cfg = env_config("spell-retry")
    train, _ = make_splits(cfg.task)
    p = next(q for q in train if len(q.answer) >= 4)
    env = SpellRetryEnv(cfg.env)
    env.reset(spec=p.spec)
    wrong = "#" + p.answer[1:]
    obs = env.step(TextAction(text=wrong))
    assert not obs.done and obs.content == feedback(wrong, p.answer) == "#-" + "+" * (len(p.answer) - 1) + "="
    obs = env.step(TextAction(text=p.answer))
    first = (len(p.answer) - 1) / len(p.answer)  # spell_backward's partial credit
    assert obs.done and obs.reward == pytest.approx((first + 1.0) / 2)
    with pytest.raises(RuntimeError, match="after the episode ended"):
        env.step(TextAction(text="x"))
    env.reset(spec=p.spec)
    assert env.step(TextAction(text=p.answer)).reward == 1.0  # right at once: no retry


def test_calculator_env_call_limit_and_tool_errors():
    cfg = env_config("calculator", max_turns=2)
    p = make_splits(cfg.task)[0][0]
    env = CalculatorEnv(cfg.env)
    env.reset(spec=p.spec)
    assert env.step(TextAction(text="[__import__('os')]")).content == "=error: not allowed: Call\n"
    end = env.step(TextAction(text="[1+1]"))  # a call in the last turn: no answer possible
    assert end.done and end.reward == 0.0
    env.reset(spec=p.spec)
    assert env.step(TextAction(text="[2**10]")).content == "=1024\n"


def test_calculator_scores_exact_answers_only():
    """reasoning-gym's score_answer gives len(answer)/len(text) to a text that contains the
    answer: the calculator pays only for the exact value (RL learned to pad wrong answers)."""
    cfg = env_config("calculator", max_turns=2)
    p = make_splits(cfg.task)[0][0]
    env = CalculatorEnv(cfg.env)
    for text, reward in ((p.answer, 1.0), (p.answer + "3", 0.0), ("1" + p.answer, 0.0), (p.answer[:-1], 0.0)):
        env.reset(spec=p.spec)
        end = env.step(TextAction(text=text))
        assert end.done and end.reward == reward, (text, end.reward)


@pytest.mark.parametrize("expr, value", [("95*21", 1995), ("(3+4)**2//5", 9), ("-7%3", 2), (" 12 - -3 ", 15)])
def test_calculator_computes(expr, value):
    assert calculator.evaluate(expr) == value


@pytest.mark.parametrize("expr, why", [
    ("__import__('os').system('ls')", "not allowed"), ("open('/etc/passwd')", "not allowed"),
    ("x", "not allowed: Name"), ("(1).real", "not allowed: Attribute"), ("'a'*3", "not allowed"),
    ("1.5*2", "not allowed"), ("7/2", "use //"), ("1//0", "division by zero"), ("2**-1", "exponent"),
    ("9**9**9", "exponent"), ("10**19", "too large"), ("9" * 20, "too large"), ("99999999999**2", "too large"),
    ("1+" * 40 + "1", "more than"), ("1" * 200, "longer than"), ("", "empty"), ("1+", "not an arithmetic"),
    ("[1]", "not allowed: List"), ("lambda: 1", "not allowed"),
])
def test_calculator_refuses_code_and_bounds_resources(expr, why):
    t0 = time.monotonic()
    with pytest.raises(calculator.CalcError, match=why):
        calculator.evaluate(expr)
    assert time.monotonic() - t0 < 1.0  # refused before anything large is computed


def test_config_refuses_what_episodes_do_not_support():
    with pytest.raises(ValueError, match="ppo: not supported with env.name"):
        RunConfig.model_validate({"env": {"name": "calculator"}, "trainer": {"algorithm": "ppo"}})
    with pytest.raises(ValueError, match="routing_replay"):
        RunConfig.model_validate({"env": {"name": "calculator"}, "rollout": {"routing_replay": True}})
    with pytest.raises(ValueError, match="env.name"):
        RunConfig.model_validate({"env": {"name": "chess"}})


def test_calculator_demonstrations_call_the_tool_on_a_share_only():
    """The warm-up's scripted calculator episodes call the tool with probability CALC_TOOL_DEMOS
    and otherwise answer at once, each rewarded by the environment as played: when every
    demonstration called the tool, greedy decoding after the warm-up was already as good as RL
    could make it (bench/results/run-task.md), so a greedy gain meant nothing new. The loss covers the
    policy's turns, never the tool's value in the observation."""
    import random

    from app.envs.episodes_local import CALC_TOOL_DEMOS, demonstration
    from app.model.tokenizer import build_tokenizer

    cfg = env_config("calculator", max_turns=2)
    cfg.task.train_size = 400
    train = make_splits(cfg.task)[0]
    tok = build_tokenizer()
    rng = random.Random(0)
    calls = 0
    for p in train:
        ids, mask = demonstration(cfg.env, p, tok, rng)
        taught = tok.decode([i for i, m in zip(ids, mask) if m], skip_special_tokens=True)
        expr = p.text.rstrip("=")
        if taught.startswith(f"[{expr}]"):
            calls += 1
            assert taught == f"[{expr}]{p.answer}", taught  # the call, then the tool's value copied
        else:
            assert taught == p.answer, taught  # the answer at once
    share = calls / len(train)
    assert 0 < share < 1 and abs(share - CALC_TOOL_DEMOS) < 0.08, share
