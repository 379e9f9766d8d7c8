"""Rewards: ``score(task, completion) -> float`` in [0, 1] for one completion of a Task.

``Task.answer`` is a JSON string saying where the reward comes from:

* ``{"source": "reasoning-gym", "dataset": NAME, "params": {...}, "entry": {...}}`` (app/envs/tasks.py):
  the reasoning-gym dataset's own ``score_answer(answer, entry)`` decides, as its authors wrote it;
* ``{"source": "jsonl", "answer": "..."}`` (app/envs/jsonl.py): math-verify equivalence.

For reasoning-gym tasks the answer is the completion's first line, stripped (the tiny policy
writes only the answer and then ``<eos>``); math-verify finds the answer in the whole
completion. Anything malformed (an answer field that is not our JSON, an empty completion,
a verifier that raises) scores 0.0: a reward function never fails a rollout. Timeouts are the caller's job (the rollout worker runs ``score`` under
``rollout.reward_timeout_s``).
"""

from __future__ import annotations

import json
import logging
import math
import threading
from functools import lru_cache
from typing import Any, Callable

log = logging.getLogger(__name__)


def extract_answer(completion: str) -> str:
    """The answer part of a completion: its first non-empty line, stripped ("" if none).

    Special tokens should already be removed (decode with ``skip_special_tokens=True``).
    """
    for line in completion.splitlines():
        if line.strip():
            return line.strip()
    return ""


_IMPORT_LOCK = threading.Lock()


@lru_cache(maxsize=None)
def _gym_scorer(dataset: str) -> Callable[[str | None, dict[str, Any]], float]:
    # The rollout worker scores in several threads at once; the first import of reasoning_gym
    # registers its datasets, and a thread that looked the name up mid-import saw an empty
    # registry ("Dataset ... not registered"). One import at a time, of the whole package.
    with _IMPORT_LOCK:
        import reasoning_gym  # noqa: F401  (registers every dataset)
        from reasoning_gym.factory import get_score_answer_fn

        return get_score_answer_fn(dataset)


def _score_reasoning_gym(spec: dict[str, Any], completion: str) -> float:
    answer = extract_answer(completion)
    if not answer:
        return 0.0
    return float(_gym_scorer(spec["dataset"])(answer, spec["entry"]))


def _score_jsonl(spec: dict[str, Any], completion: str) -> float:
    from app.envs.jsonl import math_verify_reward

    return math_verify_reward(completion, spec["answer"])


SCORERS: dict[str, Callable[[dict[str, Any], str], float]] = {
    "reasoning-gym": _score_reasoning_gym,
    "jsonl": _score_jsonl,
}


def score_answer_spec(answer_json: str, completion: str) -> float:
    """Score ``completion`` against a ``Task.answer`` JSON string; 0.0 on any malformed input.

    Returns:
        A float in [0, 1]. Values outside it, NaN, or a raising verifier give 0.0 (logged).
    """
    try:
        spec = json.loads(answer_json)
        value = float(SCORERS[spec["source"]](spec, completion))
    except Exception as e:  # a broken verifier or row must not break the rollout
        log.warning("reward: scored 0 after %s: %s", type(e).__name__, e)
        return 0.0
    if not math.isfinite(value) or value < 0.0 or value > 1.0:
        log.warning("reward: scorer returned %r, out of [0, 1]; scored 0", value)
        return 0.0
    return value


def score(task, completion: str) -> float:
    """Reward of one completion of ``task`` (an `app.buffer.records.Task`), in [0, 1].

    Args:
        task: a Task whose ``answer`` is the JSON written by app/envs/tasks.py or app/envs/jsonl.py.
        completion: the decoded completion text without special tokens.

    Returns:
        The task's verifier score; 0.0 if the completion or the task's answer is malformed or the
        verifier raises.
    """
    return score_answer_spec(getattr(task, "answer", ""), completion)
