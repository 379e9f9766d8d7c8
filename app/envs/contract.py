"""A user's environment server checked against moerl's reset contract before any episode.

OpenEnv's server publishes the action, observation and state schemas (``GET /schema``, read by
app/envs/wire.py) but not the signature of the environment's ``reset``: its WebSocket handler
passes ``reset`` only the keyword arguments the signature names (``_get_valid_kwargs`` in
OpenEnv's ``http_server.py``; everything when it has ``**kwargs``) and drops the rest without a
word. A server whose ``reset`` cannot take ``spec`` therefore plays a problem of its own choice
in every episode, and the G episodes of one GRPO group compare different problems.

`check_reset` asks the server itself, on two WebSocket sessions (OpenEnv's protocol,
app/envs/env_client.py):

1. ``reset`` with a ``spec`` that names no problem (`PROBE_SPEC`) must be refused (an error
   answer). An environment that reads ``spec`` refuses one it cannot read; one that dropped or
   ignored it starts an episode anyway.
2. While that session is open, a second one must open too: moerl plays up to ``env.max_sessions``
   episodes at once, and OpenEnv's server holds one session unless the environment class says
   ``SUPPORTS_CONCURRENT_SESSIONS = True`` and ``create_fastapi_app`` gets ``max_concurrent_envs``
   (its defaults: False and 1; a second session is answered ``CAPACITY_REACHED`` and closed).
3. With a problem of the task (``spec``), ``reset`` must succeed, its observation must carry the
   reset text field of the server's schema, and ``state`` (OpenEnv's ``State.episode_id``, which
   OpenEnv's own environments set from ``reset(episode_id=...)``) must name the ``episode_id``
   moerl sent.

Every failure is one `WireError` (a ValueError: `moerl run` prints it in one line, exit 2)
naming the URL and the field. `moerl env` checks its own classes in process instead
(app/envs/openenv_server.py), so only servers given by ``env.url`` are probed.

The reward an episode ends with follows the rule of every reward (`episode_reward`): a finite
number within ``rollout.reward_range``, else the episode fails and is never trained.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

from app.envs.env_client import CAPACITY_REACHED, EnvError, EnvSession, StepResult
from app.envs.wire import WireError, WireFormat, http_base

# Not JSON and not a number: no environment that reads its spec can take it as a problem.
PROBE_SPEC = "moerl-probe: this spec names no problem"


def one_session_error(base: str, max_sessions: int, answer: str) -> WireError:
    """The error of a server that refused a second concurrent session: what to set, in one line."""
    return WireError(
        f"env.url {base}: the server refused a second concurrent session ({answer}); moerl plays up to "
        f"env.max_sessions={max_sessions} episodes at once: set SUPPORTS_CONCURRENT_SESSIONS = True on the "
        f"environment class and pass create_fastapi_app(..., max_concurrent_envs=N) with N >= {max_sessions} "
        "(OpenEnv's defaults are False and 1), or lower env.max_sessions")


async def _second_session(base: str, probe_id: str, timeout_s: float, max_sessions: int) -> None:
    """Open a second session beside the probe's and reset it with `PROBE_SPEC` (an error answer
    is expected: the session exists); a refusal of the session is `one_session_error`."""
    try:
        async with EnvSession(base, step_timeout_s=timeout_s) as other:
            await other.reset(spec=PROBE_SPEC, episode_id=f"{probe_id}-2")
    except EnvError as e:
        if e.code == CAPACITY_REACHED or "session closed" in str(e):
            raise one_session_error(base, max_sessions, str(e).split(": ", 1)[-1]) from None
        if e.code is None:  # no answer at all
            raise


async def check_reset_async(url: str, wire: WireFormat, spec: Any = None, timeout_s: float = 10.0,
                            max_sessions: int = 256) -> None:
    """`check_reset` in a running event loop (the rollout worker's)."""
    base = http_base(url)
    probe_id = f"moerl-probe-{uuid.uuid4().hex[:12]}"
    try:
        async with EnvSession(base, step_timeout_s=timeout_s) as env:
            try:
                await env.reset(spec=PROBE_SPEC, episode_id=probe_id)
            except EnvError as e:
                if "server error" not in str(e):  # no answer at all: not a refusal of the spec
                    raise
            else:
                raise WireError(
                    f"env.url {base}: reset took spec={PROBE_SPEC!r} without an error: its reset drops 'spec' "
                    "(OpenEnv passes reset only the keyword arguments its signature names) or ignores it, so "
                    "the episodes of a GRPO group would not play the same problem; reset must take spec and "
                    "refuse one it cannot read")
            await _second_session(base, probe_id, timeout_s, max_sessions)
            if spec is None:
                return
            try:
                first = await env.reset(spec=spec, episode_id=probe_id)
            except EnvError as e:
                raise WireError(f"env.url {base}: reset with the task's first problem as spec failed: {e}") from None
            wire.message(first.observation, reset=True)  # WireError: no reset text field
            state = await env.state()
            await env.close(check=False)
    except EnvError as e:
        raise ConnectionError(f"env.url {base}: checking reset: {e}") from None
    except WireError as e:
        if str(e).startswith("env.url"):
            raise
        raise WireError(f"env.url {base}: reset's {e}") from None
    if state.get("episode_id") != probe_id:
        raise WireError(f"env.url {base}: reset does not take 'episode_id': after reset(episode_id={probe_id!r}) "
                        f"its state's episode_id is {state.get('episode_id')!r} (OpenEnv's State.episode_id)")


def check_reset(url: str, wire: WireFormat, spec: Any = None, timeout_s: float = 10.0,
                max_sessions: int = 256) -> None:
    """Check that the server at ``url`` takes moerl's ``reset(spec=..., episode_id=...)`` and
    holds two sessions at once (module docstring). Without ``spec`` (no problem at hand) steps 1
    and 2 run.

    Args:
        url: the server, ``http://host:port`` (``env.url``).
        wire: its text fields (`app.envs.wire.fetch_wire_format`).
        spec: one problem of the task, as rollouts send it (`app.envs.tasks.Prompt.spec`).
        max_sessions: ``env.max_sessions``, named in the one-session error.

    Raises:
        WireError: reset takes a spec that names no problem, a second session is refused, reset
            fails on the task's problem, its observation lacks the reset text field, or its
            state does not name the episode_id.
        ConnectionError: no session could be opened or a call got no answer.
    """
    asyncio.run(check_reset_async(url, wire, spec, timeout_s, max_sessions))


def episode_reward(result: StepResult, rollout) -> float:
    """The reward of the observation that ended an episode: a finite number within
    ``rollout.reward_range`` (a `RolloutConfig`), the rule of single-turn rewards too.

    Raises:
        EnvError: no reward (OpenEnv sends a NaN reward as null), or one outside the range.
    """
    if result.reward is None:
        raise EnvError("the episode ended with reward null: no reward, or NaN (OpenEnv sends NaN as null)")
    if not rollout.reward_in_range(result.reward):
        raise RewardOutOfRange(f"reward {result.reward:g} outside {rollout.reward_range_text()} (declare a wider "
                               "range there to train on it)", reason=f"reward outside {rollout.reward_range_text()}")
    return float(result.reward)


class RewardOutOfRange(EnvError):
    """An environment's reward outside ``rollout.reward_range``; ``reason`` names no value."""

    def __init__(self, message: str, reason: str):
        super().__init__(message)
        self.reason = reason
