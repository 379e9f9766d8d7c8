"""Prompt sets from reasoning-gym: deterministic train / held-out splits, compact prompts, Task records.

reasoning-gym (open-thought/reasoning-gym) generates each entry ``i`` of a dataset from
``Random(seed + i)``, so a (task name, parameters, seed) triple fixes every prompt. Its question
texts are long English sentences, too long for a character-level model of a few hundred
thousand parameters, so prompts are rendered compactly from the entry's metadata (for example
``spell_backward`` "Spell this word backward ...: culla" becomes ``culla=``). The reward still
uses the dataset's own ``score_answer`` on the original entry (see app/envs/rewards.py).

Held-out prompts are the first ``eval_size`` distinct rendered prompts; training prompts are the
following distinct ones, never equal to a held-out prompt, so the two sets are disjoint by text.
"""

from __future__ import annotations

import json
import logging
import random
from dataclasses import dataclass
from typing import Any, Callable

from app.buffer.records import Task
from app.config import TaskConfig
from app.envs.jsonl import answer_json, load_jsonl

# name -> compact prompt from a reasoning-gym entry. Tasks not listed use the question text.
RENDERERS: dict[str, Callable[[dict[str, Any]], str]] = {
    "spell_backward": lambda e: f"{e['metadata']['word']}=",
    "chain_sum": lambda e: e["metadata"]["expression"].replace(" ", "") + "=",
    "basic_arithmetic": lambda e: e["metadata"]["expression"].replace(" ", "") + "=",
    "count_bits": lambda e: f"{e['metadata']['number']}=",
    "letter_counting": lambda e: f"{e['metadata']['target_letter']}:{' '.join(e['metadata']['span'])}=",
}
# Entries drawn per prompt wanted before giving up (small problem spaces repeat quickly).
_MAX_DRAWS_PER_PROMPT = 20


@dataclass(frozen=True)
class Prompt:
    """One prompt of a split: the text the policy sees and what the reward needs.

    Attributes:
        prompt_id: stable id, ``"train-000012"`` or ``"heldout-000003"``.
        text: the rendered prompt (without ``<bos>``).
        answer: the reference answer string.
        spec: the JSON string stored in ``Task.answer`` and read by app/envs/rewards.py (for
            reasoning-gym: source, dataset name, its parameters and the whole entry).
    """

    prompt_id: str
    text: str
    answer: str
    spec: str


def render(name: str, entry: dict[str, Any]) -> str:
    """Compact prompt text for a reasoning-gym entry of dataset ``name`` (question text if none)."""
    fn = RENDERERS.get(name)
    return fn(entry) if fn else entry["question"]


def make_splits(cfg: TaskConfig) -> tuple[list[Prompt], list[Prompt]]:
    """Build the (train, held-out) prompt lists of ``cfg.source``, deterministically.

    For ``jsonl`` see `jsonl_splits`; for ``reasoning-gym`` see `gym_splits`.
    """
    if cfg.source == "jsonl":
        return jsonl_splits(cfg)
    if cfg.source == "env":
        return env_splits(cfg)
    return gym_splits(cfg)


def env_splits(cfg: TaskConfig) -> tuple[list[Prompt], list[Prompt]]:
    """The environment's own episodes, numbered (``task.source: env``): ``eval_size`` held-out
    and ``train_size`` training ones, each a spec ``{"source": "env", "split", "index", "seed":
    task.seed}`` (JSON) that the environment's ``reset(spec=...)`` turns into a problem. The
    prompt text is only a label: an episode's prompt is its reset observation."""
    def prompt(split: str, i: int) -> Prompt:
        spec = json.dumps({"source": "env", "split": split, "index": i, "seed": cfg.seed})
        return Prompt(f"{split}-{i:06d}", f"{split}-{i}", "", spec)

    return [prompt("train", i) for i in range(cfg.train_size)], [prompt("heldout", i) for i in range(cfg.eval_size)]


def jsonl_splits(cfg: TaskConfig) -> tuple[list[Prompt], list[Prompt]]:
    """Split the rows of ``task.jsonl_path``: shuffled with ``task.seed``, the first
    ``eval_size`` distinct prompts are held out, up to ``train_size`` following ones train.

    Raises:
        ValueError: ``task.jsonl_path`` unset or the file has no valid row;
            FileNotFoundError: the file does not exist.
    """
    if not cfg.jsonl_path:
        raise ValueError("task.jsonl_path: required when task.source is 'jsonl'")
    data = load_jsonl(cfg.jsonl_path)
    if data.skipped:
        logging.getLogger(__name__).warning(
            "%s: skipped %d malformed rows (lines %s...)", cfg.jsonl_path, data.skipped, data.skipped_lines
        )
    rows = list(dict(data.rows).items())  # distinct prompts, the last answer of a repeated one wins
    random.Random(cfg.seed).shuffle(rows)
    heldout = [Prompt(f"heldout-{i:06d}", p, a, answer_json(a)) for i, (p, a) in enumerate(rows[: cfg.eval_size])]
    rest = rows[cfg.eval_size : cfg.eval_size + cfg.train_size]
    train = [Prompt(f"train-{i:06d}", p, a, answer_json(a)) for i, (p, a) in enumerate(rest)]
    if not train:
        raise ValueError(f"{cfg.jsonl_path}: {len(rows)} distinct prompts leave none for training after "
                         f"task.eval_size={cfg.eval_size} held out")
    return train, heldout


def gym_splits(cfg: TaskConfig) -> tuple[list[Prompt], list[Prompt]]:
    """Build the (train, held-out) prompt lists for a reasoning-gym task, deterministically.

    Args:
        cfg: ``task.name`` (a reasoning-gym dataset), ``task.params`` (its config fields),
            ``task.seed``, ``task.train_size``, ``task.eval_size``.

    Returns:
        ``(train, heldout)``: ``train_size`` and ``eval_size`` prompts with distinct texts, no text
        in both. The same config always gives the same lists.

    Raises:
        ValueError: unknown dataset name or invalid parameters (naming ``task.name`` /
            ``task.params``), or the task has too few distinct prompts for the sizes asked.
    """
    # reasoning_gym registers its every dataset on import (a second): only a reasoning-gym task's
    # prompts need it
    import reasoning_gym
    from reasoning_gym.factory import DATASETS

    if cfg.name not in DATASETS:
        raise ValueError(f"task.name: unknown reasoning-gym dataset {cfg.name!r}")
    want = cfg.train_size + cfg.eval_size
    try:
        ds = reasoning_gym.create_dataset(
            cfg.name, seed=cfg.seed, size=want * _MAX_DRAWS_PER_PROMPT, **cfg.params
        )
    except (TypeError, ValueError, AssertionError) as e:
        raise ValueError(f"task.params: invalid for {cfg.name!r}: {e}") from None
    def prompt(pid: str, text: str, entry: dict[str, Any]) -> Prompt:
        spec = {"source": "reasoning-gym", "dataset": cfg.name, "params": cfg.params, "entry": entry}
        return Prompt(pid, text, str(entry["answer"]), json.dumps(spec, default=str))

    seen: set[str] = set()
    heldout: list[Prompt] = []
    train: list[Prompt] = []
    for i in range(len(ds)):
        entry = ds[i]
        text = render(cfg.name, entry)
        if text in seen:
            continue
        seen.add(text)
        if len(heldout) < cfg.eval_size:
            heldout.append(prompt(f"heldout-{len(heldout):06d}", text, entry))
        else:
            train.append(prompt(f"train-{len(train):06d}", text, entry))
            if len(train) == cfg.train_size:
                return train, heldout
    raise ValueError(
        f"task: {cfg.name!r} with params {cfg.params} gave only {len(seen)} distinct prompts in "
        f"{len(ds)} draws; lower task.train_size ({cfg.train_size}) / task.eval_size ({cfg.eval_size})"
    )


def make_tasks(prompts: list[Prompt], tokenizer, group_size: int):
    """Turn prompts into `app.buffer.records.Task` records (one GRPO group each).

    ``prompt_ids`` start with ``<bos>`` (the tokenizer's post-processor adds it), the same ids
    the engine would make from the text. ``answer`` is `Prompt.spec`.
    """
    return [
        Task(
            task_id=p.prompt_id,
            prompt_ids=tokenizer(p.text)["input_ids"],
            prompt=p.text,
            answer=p.spec,
            group_size=group_size,
        )
        for p in prompts
    ]
