"""Guess the number: an environment written the OpenEnv way, outside moerl, trained by `moerl run`.

The secret is an integer in [LOW, HIGH]; each turn the policy guesses, and the environment
answers ``<`` (the secret is lower), ``>`` (higher) or ends the episode. Reward 1.0 when the
secret is guessed within the episode's turns, else 0.0 (moerl ends an episode after
``env.max_turns`` turns; bisection needs at most 4 for 15 numbers).

Nothing here imports moerl: the classes are OpenEnv's (``Environment``, ``Action``,
``Observation``, ``State``) with OpenEnv's ordinary field names (the action's ``message``, the
observation's ``message``), and moerl reads them from the server's ``/schema``. The one thing
moerl asks of it: ``reset`` takes ``spec``, the episode's problem, so that every episode of a
GRPO group plays the same secret. With ``task.source: env`` moerl sends
``{"source": "env", "split": "train" | "heldout", "index": i, "seed": s}`` as JSON; the secret
is drawn from it, so held-out episodes are a fixed set. Each reset observation's OpenEnv
``metadata`` also carries ``{"demonstration": [the bisection guesses]}``, which moerl's warm-up
plays with ``env.demos_from_env: true`` instead of reading ``demos.jsonl``.

Serve it on its own, as any OpenEnv environment::

    python -m examples.guess_number.server --port 8091      # then env.url: http://127.0.0.1:8091

or let `moerl env` serve it: ``env.name: examples.guess_number.env:GuessNumberEnv``.
"""

from __future__ import annotations

import json
import random
from typing import Any, Optional

from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State
from pydantic import Field

LOW, HIGH = 1, 15


class GuessAction(Action):
    """One guess, as the policy wrote it (e.g. ``"8"``); anything that is not a number in range
    is a wasted turn."""

    message: str = Field(..., max_length=64, description="The guess.")


class GuessObservation(Observation):
    """The environment's answer: the task at reset, then ``<`` or ``>`` after a wrong guess."""

    message: str = Field("", description="What the player reads.")
    guesses: int = Field(0, description="Guesses made so far.")


def secret_of(spec: Any) -> int:
    """The secret number of an episode's ``spec`` (a JSON string or object; an integer is taken
    as the secret itself).

    Raises:
        ValueError: no spec, or one that names no episode.
    """
    if spec is None:
        raise ValueError("reset needs spec: the episode's problem")
    data = json.loads(spec) if isinstance(spec, str) else spec
    if isinstance(data, int) and not isinstance(data, bool):
        if not LOW <= data <= HIGH:
            raise ValueError(f"spec {data} is outside [{LOW}, {HIGH}]")
        return data
    if isinstance(data, dict) and {"split", "index"} <= set(data):
        rng = random.Random(f"{data['split']}:{data['index']}:{data.get('seed', 0)}")
        return rng.randint(LOW, HIGH)
    raise ValueError(f"spec {str(spec)[:80]!r} names no episode")


class GuessNumberEnv(Environment[GuessAction, GuessObservation, State]):
    """Guess a number in [LOW, HIGH] with higher/lower hints (module docstring)."""

    SUPPORTS_CONCURRENT_SESSIONS = True  # no state shared between instances

    def __init__(self):
        super().__init__()
        self._state = State()
        self.secret: int | None = None
        self.done = False

    def reset(self, seed: Optional[int] = None, episode_id: Optional[str] = None, spec: Any = None,
              **kwargs: Any) -> GuessObservation:
        self.secret = secret_of(spec)
        self.done = False
        self._state = State(episode_id=episode_id, step_count=0)
        # OpenEnv's metadata, which the player never reads: the turns that solve this episode,
        # for moerl's warm-up with env.demos_from_env (instead of a demonstrations JSONL).
        return GuessObservation(message=f"{LOW}-{HIGH}?", reward=0.0, metadata={"demonstration": bisect(self.secret)})

    def step(self, action: GuessAction, timeout_s: Optional[float] = None, **kwargs: Any) -> GuessObservation:
        if self.secret is None or self.done:
            raise RuntimeError("step outside an episode")
        self._state.step_count += 1
        text = action.message.strip()
        guess = int(text) if text.isdigit() else None
        if guess == self.secret:
            self.done = True
            return GuessObservation(message="", guesses=self._state.step_count, done=True, reward=1.0)
        hint = "<" if guess is not None and guess > self.secret else ">"
        return GuessObservation(message=hint, guesses=self._state.step_count, reward=0.0)

    @property
    def state(self) -> State:
        return self._state


def bisect(secret: int) -> list[str]:
    """The guesses of binary search for ``secret``: the demonstrations moerl's warm-up plays."""
    lo, hi, out = LOW, HIGH, []
    while True:
        mid = (lo + hi) // 2
        out.append(str(mid))
        if mid == secret:
            return out
        lo, hi = (lo, mid - 1) if mid > secret else (mid + 1, hi)


def write_demos(path: str, n: int = 500, seed: int = 0) -> None:
    """``n`` warm-up demonstrations (binary search) of training episodes 0..n-1, as moerl's
    ``env.demos_path`` reads them: ``{"spec": <the episode's spec>, "actions": [guesses]}``."""
    with open(path, "w") as f:
        for i in range(n):
            spec = {"source": "env", "split": "train", "index": i, "seed": seed}
            f.write(json.dumps({"spec": spec, "actions": bisect(secret_of(spec))}) + "\n")


if __name__ == "__main__":  # python -m examples.guess_number.env demos.jsonl
    import sys

    write_demos(sys.argv[1] if len(sys.argv) > 1 else "examples/guess_number/demos.jsonl")
