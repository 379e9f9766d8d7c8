"""Rewards: ``score(task, completion) -> float`` in [0, 1] for one completion of a Task.

``Task.answer`` is a JSON string saying where the reward comes from:

* ``{"source": "reasoning-gym", "dataset": NAME, "params": {...}, "entry": {...}}`` (app/envs/tasks.py):
  the reasoning-gym dataset's own ``score_answer(answer, entry)`` decides, as its authors wrote it;
* ``{"source": "jsonl", "answer": "..."}`` (app/envs/jsonl.py): math-verify equivalence.

For reasoning-gym tasks the answer is the completion's first line, stripped (the tiny policy
writes only the answer and then ``<eos>``); math-verify finds the answer in the whole
completion. A bad completion is the policy's doing and scores 0.0 (an empty one, one the
verifier finds wrong). A failed reward is not: a ``Task.answer`` that is not our JSON, a
verifier that raises, or a value that is not a finite number in [0, 1] raises `RewardError`
(or the verifier's own exception), and the rollout worker then fails the whole group, which is
never trained (app/rollout/worker.py). Timeouts are the caller's job too (the worker runs
``score`` under ``rollout.reward_timeout_s``); math-verify also runs in a process killed after
``task.verify_timeout_s``, whose timeout raises a TimeoutError (a failure). `warm` imports and sets up the verifier of a
task before the first call, so the first call is not slower than the timeout.
"""

from __future__ import annotations

import json
import math
import threading
from functools import lru_cache
from typing import Any, Callable

from app.envs.jsonl import math_verify_reward, verifier_pool


def extract_answer(completion: str) -> str:
    """The answer part of a completion: its first non-empty line, stripped ("" if none).

    Special tokens should already be removed (decode with ``skip_special_tokens=True``).
    """
    for line in completion.splitlines():
        if line.strip():
            return line.strip()
    return ""


class RewardError(ValueError):
    """A reward could not be computed: the task's answer spec is malformed or the verifier
    returned something that is not a finite number in [0, 1]. Never a reward of 0."""


_IMPORT_LOCK = threading.Lock()


@lru_cache(maxsize=None)
def _gym_scorer(dataset: str) -> Callable[[str | None, dict[str, Any]], float]:
    # The rollout worker scores in several threads at once; the first import of reasoning_gym
    # registers its datasets, and a thread that looked the name up mid-import saw an empty
    # registry ("Dataset ... not registered"). One import at a time, of the whole package.
    with _IMPORT_LOCK:
        # reasoning_gym (a second to import): on first use, under the lock (above)
        import reasoning_gym  # noqa: F401  (registers every dataset)
        from reasoning_gym.factory import get_score_answer_fn

        return get_score_answer_fn(dataset)


def _score_reasoning_gym(spec: dict[str, Any], completion: str) -> float:
    answer = extract_answer(completion)
    if not answer:
        return 0.0
    return float(_gym_scorer(spec["dataset"])(answer, spec["entry"]))


def _score_jsonl(spec: dict[str, Any], completion: str) -> float:
    return math_verify_reward(completion, spec["answer"])


SCORERS: dict[str, Callable[[dict[str, Any], str], float]] = {
    "reasoning-gym": _score_reasoning_gym,
    "jsonl": _score_jsonl,
}


def score_answer_spec(answer_json: str, completion: str) -> float:
    """Score ``completion`` against a ``Task.answer`` JSON string.

    Returns:
        A float in [0, 1] (0.0 for an empty or wrong completion).

    Raises:
        RewardError: ``answer_json`` is not a JSON object with a known ``source`` (and the
            fields that source needs), or the verifier returned a value that is not a finite
            number in [0, 1]. An exception the verifier raises propagates as it is.
    """
    try:
        spec = json.loads(answer_json)
        scorer = SCORERS[spec["source"]]
    except (TypeError, ValueError, KeyError) as e:
        raise RewardError(f"Task.answer is not a reward spec ({type(e).__name__}: {e}): {str(answer_json)[:120]}") from None
    try:
        value = float(scorer(spec, completion))
    except KeyError as e:
        raise RewardError(f"Task.answer lacks {e} for source {spec['source']!r}") from None
    except (TypeError, ValueError) as e:
        raise RewardError(f"verifier of {spec['source']!r} returned a non-number: {e}") from None
    if not math.isfinite(value) or value < 0.0 or value > 1.0:
        raise RewardError(f"verifier of {spec['source']!r} returned {value!r}, not in [0, 1]")
    return value


def warm(task_cfg) -> None:
    """Import and set up the verifier of ``task_cfg`` (an `app.config.TaskConfig`): the
    reasoning-gym registry and the dataset's scorer, or math-verify. Called by the rollout
    worker before it leases its first task (the first import takes seconds on a busy machine,
    longer than ``rollout.reward_timeout_s``)."""
    if task_cfg.source == "jsonl":
        verifier_pool(task_cfg.verify_timeout_s)  # the deadline of this run's config
        math_verify_reward("1", "1")  # starts the forkserver, which imports math-verify once
    else:
        _gym_scorer(task_cfg.name)


def score(task, completion: str) -> float:
    """Reward of one completion of ``task`` (an `app.buffer.records.Task`), in [0, 1].

    Args:
        task: a Task whose ``answer`` is the JSON written by app/envs/tasks.py or app/envs/jsonl.py.
        completion: the decoded completion text without special tokens.

    Returns:
        The task's verifier score; 0.0 for an empty or wrong completion.

    Raises:
        RewardError (or the verifier's exception): see `score_answer_spec`.
    """
    return score_answer_spec(getattr(task, "answer", ""), completion)


score.warm = warm  # the worker's hook: `warm(cfg.task)` before the first lease
