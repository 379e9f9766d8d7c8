"""The environments moerl ships, as OpenEnv environments (``openenv.core.env_server``).

Each is an ``openenv`` ``Environment`` (Gym-style ``reset`` / ``step`` / ``state``) with text
actions and text observations, served by `moerl env` (app/envs/openenv_server.py) and driven by
the rollout worker turn by turn (app/rollout/episodes.py). Both take their problems from a
reasoning-gym dataset and score answers with that dataset's own ``score_answer``, like the
single-turn path (app/envs/rewards.py): ``reset(spec=...)`` gets the task's ``Task.answer`` JSON
(``{"source": "reasoning-gym", "dataset", "params", "entry"}``, app/envs/tasks.py).

Wire types: the action is `TextAction` ``{"text": "<the policy's turn, special tokens
removed>"}``; an observation is `TextObservation` ``{"role": "user" | "tool", "content": ...,
"done", "reward"}``. The reset observation's content is the prompt (the task's compact
rendering, app/envs/tasks.py ``render``). The episode's reward is the ``reward`` of the
observation that ends it (``done``), in [0, 1]; observations before it carry 0.0.

``spell-retry`` (`SpellRetryEnv`): the model answers; an exact answer (score 1.0) ends the
episode; otherwise the environment says which letters were wrong and the model answers again,
up to ``env.attempts`` answers. Feedback is ``#`` + one mark per letter of the expected answer
(``+`` right letter in its place, ``-`` wrong or missing) + ``=``, e.g. ``#++-++-=``. Reward: the
mean of the scores of the answers given (so a first exact answer scores 1.0, a wrong one fixed
after feedback scores between its own score and 1.0).

``calculator`` (`CalculatorEnv`): a tool-using task. Call format: a turn that is exactly
``[EXPRESSION]`` (square brackets around the whole turn) calls the calculator
(app/envs/calculator.py: integers, ``+ - * // % **`` and parentheses; no code runs); the
environment answers ``=VALUE`` + newline (role ``tool``), or ``=error: REASON`` + newline. Any
other turn is the final answer, scored on its first line: 1 when the dataset's
``score_answer`` gives it full marks, else 0. (reasoning-gym's default ``score_answer`` gives
``len(answer) / len(text)`` to a text that merely contains the answer, e.g. ``4453`` for
``445``: RL on that credit taught greedy decoding to pad wrong answers, not to compute right
ones; bench/results/run-task.md.) That ends the episode. At most ``env.max_turns - 1`` calls: a call in the last turn ends the
episode with reward 0.

Errors (a step before reset or after done, a spec that is not a reasoning-gym task) raise:
OpenEnv answers them as ``EXECUTION_ERROR`` and the worker fails the episode's group.
"""

from __future__ import annotations

import json
from typing import Any, Optional

from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, EnvironmentMetadata, Observation, State
from pydantic import Field

from app.config import BUILTIN_ENVIRONMENTS, EnvConfig
from app.envs.calculator import CalcError, evaluate
from app.envs.rewards import _gym_scorer, extract_answer
from app.envs.tasks import render

MAX_ACTION_CHARS = 4096


class TextAction(Action):
    """One policy turn: the decoded text of the generated tokens (special tokens removed)."""

    text: str = Field(..., max_length=MAX_ACTION_CHARS, description="The policy's turn.")


class TextObservation(Observation):
    """What the environment says: a message of ``role`` with ``content`` (plus done, reward)."""

    role: str = Field("user", description="Chat role of the message: user (prompt, feedback) or tool.")
    content: str = Field("", description="The message text.")


def _entry(spec: Any) -> tuple[str, dict]:
    """(dataset, entry) of a ``Task.answer`` JSON string. Raises ValueError naming the field."""
    try:
        data = json.loads(spec) if isinstance(spec, str) else spec
        if data["source"] != "reasoning-gym":
            raise ValueError(f"source {data['source']!r}")
        return data["dataset"], data["entry"]
    except (TypeError, KeyError, ValueError) as e:
        raise ValueError(f"reset: spec must be a reasoning-gym Task.answer JSON ({e})") from None


class _TaskEnv(Environment):
    """Shared part: one reasoning-gym problem per episode, scored by its dataset."""

    SUPPORTS_CONCURRENT_SESSIONS = True  # every session has its own instance and no shared state

    def __init__(self, cfg: EnvConfig | None = None):
        super().__init__()
        self.cfg = cfg or EnvConfig()
        self._state = State()
        self._dataset: str | None = None
        self._entry: dict | None = None
        self.done = False

    def reset(self, seed: Optional[int] = None, episode_id: Optional[str] = None, spec: Any = None,
              **kwargs: Any) -> TextObservation:
        """Start the episode of problem ``spec`` (a ``Task.answer`` JSON); returns the prompt.

        Raises:
            ValueError: ``spec`` is missing or not a reasoning-gym task.
        """
        self._dataset, self._entry = _entry(spec)
        self._scorer = _gym_scorer(self._dataset)
        self._state = State(episode_id=episode_id, step_count=0)
        self.done = False
        self._begin()
        return TextObservation(role="user", content=render(self._dataset, self._entry), reward=0.0)

    def _begin(self) -> None:
        pass

    def _check_step(self) -> None:
        if self._entry is None:
            raise RuntimeError("step before reset")
        if self.done:
            raise RuntimeError("step after the episode ended")
        self._state.step_count += 1

    def _score(self, text: str) -> float:
        answer = extract_answer(text)
        return float(self._scorer(answer, self._entry)) if answer else 0.0

    def _end(self, reward: float, content: str = "") -> TextObservation:
        self.done = True
        return TextObservation(role="user", content=content, done=True, reward=reward)

    @property
    def state(self) -> State:
        return self._state


class SpellRetryEnv(_TaskEnv):
    """reasoning-gym answer with per-letter feedback and retries (see the module docstring)."""

    def _begin(self) -> None:
        self.scores: list[float] = []

    def step(self, action: TextAction, timeout_s: Optional[float] = None, **kwargs: Any) -> TextObservation:
        """Score the answer in ``action.text``; feedback and another try, or the end.

        Raises:
            RuntimeError: a step before reset or after the episode ended.
        """
        self._check_step()
        score = self._score(action.text)
        self.scores.append(score)
        if score >= 1.0 or len(self.scores) >= self.cfg.attempts:
            return self._end(sum(self.scores) / len(self.scores))
        return TextObservation(role="user", content=feedback(extract_answer(action.text), str(self._entry["answer"])),
                               reward=0.0)

    def get_metadata(self) -> EnvironmentMetadata:
        return EnvironmentMetadata(name="spell-retry", version="1",
                                   description="reasoning-gym answer with per-letter feedback and a retry")


def feedback(answer: str, expected: str) -> str:
    """``#`` + ``+``/``-`` per letter of ``expected`` (right letter in its place or not) + ``=``."""
    marks = "".join("+" if i < len(answer) and answer[i].lower() == c.lower() else "-" for i, c in enumerate(expected))
    return f"#{marks}="


class CalculatorEnv(_TaskEnv):
    """Arithmetic with a calculator tool (call format in the module docstring)."""

    def _begin(self) -> None:
        self.calls = 0

    def step(self, action: TextAction, timeout_s: Optional[float] = None, **kwargs: Any) -> TextObservation:
        """Answer a ``[EXPRESSION]`` call with its value, or score the final answer.

        Raises:
            RuntimeError: a step before reset or after the episode ended.
        """
        self._check_step()
        text = action.text.strip()
        if not (text.startswith("[") and text.endswith("]")):
            return self._end(1.0 if self._score(text) == 1.0 else 0.0)  # exact answers only
        self.calls += 1
        if self.calls >= self.cfg.max_turns:
            return self._end(0.0)  # no turn left for an answer
        try:
            result = f"={evaluate(text[1:-1])}\n"
        except CalcError as e:
            result = f"=error: {e}\n"
        return TextObservation(role="tool", content=result, reward=0.0)

    def get_metadata(self) -> EnvironmentMetadata:
        return EnvironmentMetadata(name="calculator", version="1",
                                   description="arithmetic problems with a calculator tool")


ENVIRONMENTS: dict[str, type[_TaskEnv]] = {"spell-retry": SpellRetryEnv, "calculator": CalculatorEnv}
# app.config names them too (env.name's check, without importing openenv): one list, kept equal.
if tuple(ENVIRONMENTS) != BUILTIN_ENVIRONMENTS:
    raise ImportError(f"app.config.BUILTIN_ENVIRONMENTS {BUILTIN_ENVIRONMENTS} != {tuple(ENVIRONMENTS)}")


def make_env(cfg: EnvConfig) -> _TaskEnv:
    """A new instance of environment ``cfg.name``.

    Raises:
        ValueError: ``env.name`` is unset or unknown.
    """
    if cfg.name not in ENVIRONMENTS:
        raise ValueError(f"env.name: {cfg.name!r} is not one of {sorted(ENVIRONMENTS)}")
    return ENVIRONMENTS[cfg.name](cfg)
