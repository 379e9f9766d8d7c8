"""JSONL prompt sets for GPU-scale runs: one ``{"prompt": str, "answer": str}`` object per line.

Rows that are not valid JSON objects, or lack a non-empty string ``prompt`` / a string or number
``answer``, are skipped and counted (with the first few line numbers) instead of failing the run;
a file with no valid row at all is an error. The reward is math-verify equivalence
(huggingface/Math-Verify: ``parse`` the gold answer and the completion, then ``verify``), run in
a worker process killed at a deadline (`math_verify_reward`): model output can make it run forever.
"""

from __future__ import annotations

import json
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path

from app.config import TaskConfig
from app.envs.process_pool import DeadlinePool


@dataclass
class JsonlRows:
    """Rows read from a JSONL file.

    Attributes:
        rows: ``(prompt, answer)`` pairs in file order.
        skipped: malformed rows skipped.
        skipped_lines: 1-based line numbers of the first 20 skipped rows (for the log).
    """

    rows: list[tuple[str, str]] = field(default_factory=list)
    skipped: int = 0
    skipped_lines: list[int] = field(default_factory=list)


def _reject_constant(name: str):
    """NaN / Infinity are not JSON; Python's parser accepts them unless told otherwise."""
    raise ValueError(f"{name} is not a valid JSON value")


def _row(line: str) -> tuple[str, str] | None:
    try:
        obj = json.loads(line, parse_constant=_reject_constant)
    except (json.JSONDecodeError, ValueError):
        return None
    if not isinstance(obj, dict):
        return None
    prompt, answer = obj.get("prompt"), obj.get("answer")
    if not isinstance(prompt, str) or not prompt.strip():
        return None
    if isinstance(answer, bool) or not isinstance(answer, (str, int, float)) or str(answer).strip() == "":
        return None
    return prompt, str(answer)


def load_jsonl(path: str | os.PathLike) -> JsonlRows:
    """Read ``{"prompt","answer"}`` rows; blank lines are ignored, malformed rows skipped and counted.

    Rows that are not UTF-8 or hold NaN/Infinity count as malformed; a leading BOM is ignored.

    Raises:
        FileNotFoundError: ``path`` does not exist (message names it).
        ValueError: ``path`` is a directory, or the file holds no valid row (message names the
            file and the skip count).
    """
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"task.jsonl_path: {path} is a directory, not a JSONL file")
    if not path.is_file():
        raise FileNotFoundError(f"task.jsonl_path: {path} does not exist")
    out = JsonlRows()
    # utf-8-sig: a byte-order mark is not part of the first row. A line that is not UTF-8 is a
    # malformed row (skipped and counted), never silently altered.
    with path.open("rb") as f:
        for lineno, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8-sig" if lineno == 1 else "utf-8")
            except UnicodeDecodeError:
                line = None
            if line is not None and not line.strip():
                continue
            row = _row(line) if line is not None else None
            if row is None:
                out.skipped += 1
                if len(out.skipped_lines) < 20:
                    out.skipped_lines.append(lineno)
            else:
                out.rows.append(row)
    if not out.rows:
        raise ValueError(f"{path}: no valid {{\"prompt\", \"answer\"}} row ({out.skipped} malformed rows skipped)")
    return out


def answer_json(answer: str) -> str:
    """The ``Task.answer`` JSON for a JSONL row, read by app/envs/rewards.py."""
    return json.dumps({"source": "jsonl", "answer": answer})


# Worker processes of math-verify at most: more than the reward threads a rollout worker runs
# (`RewardPool`: 4 x rollout.reward_threads at most); each is started only when a call needs it.
VERIFY_PROCESSES = 32
_pool = None
_pool_lock = threading.Lock()


def verify_in_process(completion: str, gold: str) -> float:
    """The math-verify comparison itself (what `math_verify_reward` runs in a worker process).

    Timeouts inside math-verify are off: they use SIGALRM, which only works in a main thread;
    the pool's deadline bounds the call instead.
    """
    # math-verify and sympy (seconds): only in the verifier's processes, whose forkserver loads
    # them once (verify_warm.py); the rollout worker imports this module without them
    from math_verify import parse, verify

    gold_parsed = parse(gold, parsing_timeout=None)
    if not gold_parsed:
        # A gold answer math-verify cannot parse (plain text): compare as stripped strings.
        return float(completion.strip() == gold.strip())
    pred = parse(completion, parsing_timeout=None)
    return float(bool(pred) and verify(gold_parsed, pred, timeout_seconds=None))


def verifier_pool(deadline_s: float | None = None):
    """The process pool math-verify runs in (app/envs/process_pool.py), created on first use with
    ``deadline_s`` (default: ``task.verify_timeout_s``'s default); a later ``deadline_s`` replaces it."""
    global _pool
    with _pool_lock:
        if _pool is None or (deadline_s is not None and deadline_s != _pool.deadline_s):
            if _pool is not None:
                _pool.close()
            if deadline_s is None:
                deadline_s = TaskConfig().verify_timeout_s
            _pool = DeadlinePool("app.envs.jsonl:verify_in_process", VERIFY_PROCESSES, deadline_s,
                                 preload=("app.envs.verify_warm",))
        return _pool


def math_verify_reward(completion: str, gold: str) -> float:
    """1.0 if math-verify finds the completion's answer equal to ``gold``, else 0.0, computed in a
    worker process that is killed at the pool's deadline (``task.verify_timeout_s``).

    Raises:
        app.envs.process_pool.CallTimeout: math-verify ran past the deadline (a TimeoutError: the
            rollout worker counts it as a failed reward, never as a reward of 0).
        app.envs.process_pool.CallFailed: math-verify raised.
    """
    return verifier_pool().call(completion, gold)
