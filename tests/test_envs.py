"""Tokenizer, task splits, rewards and the JSONL loader (app/envs)."""

from __future__ import annotations

import json
import math

import pytest

from app.buffer.records import Task
from app.config import TaskConfig
from app.envs import rewards
from app.envs.jsonl import load_jsonl, math_verify_reward
from app.envs.tasks import make_splits, make_tasks
from app.model.tokenizer import BOS_ID, EOS_ID, PAD_ID, UNK_ID, VOCAB_SIZE, build_tokenizer, load_tokenizer, save_tokenizer

SMALL = dict(train_size=40, eval_size=10)


def test_tokenizer_round_trip_and_special_ids():
    tok = build_tokenizer()
    text = "Hello, world! 12+7= [a b]\n~"
    ids = tok(text)["input_ids"]
    assert ids[0] == BOS_ID and len(ids) == len(text) + 1  # one token per character
    assert tok.decode(ids, skip_special_tokens=True) == text
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (PAD_ID, BOS_ID, EOS_ID)
    assert len(tok) == VOCAB_SIZE
    assert tok("é", add_special_tokens=False)["input_ids"] == [UNK_ID]


def test_tokenizer_saved_loads_with_auto_tokenizer(tmp_path):
    from transformers import AutoTokenizer

    save_tokenizer(tmp_path)
    assert (tmp_path / "tokenizer.json").is_file()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary left
    stock = AutoTokenizer.from_pretrained(str(tmp_path))
    ours = build_tokenizer()
    for text in ["abc=", "spell me", "3 + 4 = 7"]:
        assert stock(text)["input_ids"] == ours(text)["input_ids"]
    assert stock.decode(ours("xyz=")["input_ids"] + [EOS_ID], skip_special_tokens=True) == "xyz="
    assert stock.eos_token_id == EOS_ID and stock.pad_token_id == PAD_ID
    batch = stock(["a", "abcd"], padding=True)["input_ids"]
    assert batch[0][:3] == [PAD_ID] * 3  # left padding for generation
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        load_tokenizer(tmp_path / "missing")


def test_splits_are_deterministic_disjoint_and_distinct():
    cfg = TaskConfig(**SMALL)
    train, held = make_splits(cfg)
    again_train, again_held = make_splits(TaskConfig(**SMALL))
    assert [p.text for p in train] == [p.text for p in again_train]
    assert [p.text for p in held] == [p.text for p in again_held]
    assert (len(train), len(held)) == (40, 10)
    texts = [p.text for p in train + held]
    assert len(set(texts)) == len(texts)  # distinct, so disjoint
    other_train, _ = make_splits(TaskConfig(seed=1, **SMALL))
    assert [p.text for p in other_train] != [p.text for p in train]
    # compact prompt "word=" whose reference answer is the word reversed
    p = held[0]
    assert p.text.endswith("=") and p.answer == p.text[:-1][::-1]
    assert len(p.text) <= 24 and len(p.answer) <= 8


def test_bad_task_config_names_the_field():
    with pytest.raises(ValueError, match="task.name"):
        make_splits(TaskConfig(name="no_such_task", **SMALL))
    with pytest.raises(ValueError, match="task.params"):
        make_splits(TaskConfig(params={"not_a_field": 1}, **SMALL))
    # chain_sum of one-digit pairs has 200 distinct prompts: asking for more is a clear error
    tiny = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}
    with pytest.raises(ValueError, match="distinct prompts"):
        make_splits(TaskConfig(name="chain_sum", params=tiny, train_size=500, eval_size=10))


def test_tasks_and_rewards_right_wrong_malformed():
    tok = build_tokenizer()
    _, held = make_splits(TaskConfig(**SMALL))
    task = make_tasks(held[:1], tok, group_size=8)[0]
    assert isinstance(task, Task) and task.group_size == 8
    assert task.prompt_ids == tok(held[0].text)["input_ids"] and task.prompt_ids[0] == BOS_ID
    right = held[0].answer
    assert rewards.score(task, right) == 1.0
    assert rewards.score(task, f"  {right} \nextra line") == 1.0  # first line, stripped
    assert rewards.score(task, "#" * len(right)) == 0.0  # no letter in place
    # spell_backward's own partial credit: 1/len per letter in its place
    assert rewards.score(task, "#" + right[1:]) == pytest.approx((len(right) - 1) / len(right))
    assert rewards.score(task, "") == 0.0
    assert rewards.score(task, "\n \n") == 0.0
    # A malformed task answer is a failed reward, not a reward of 0 (issue 16): it raises, and
    # the worker fails the group.
    broken = Task(task_id="x", prompt_ids=[1], prompt="x", answer="not json", group_size=1)
    with pytest.raises(rewards.RewardError, match="not a reward spec"):
        rewards.score(broken, right)
    unknown = Task(task_id="x", prompt_ids=[1], prompt="x", answer=json.dumps({"source": "?"}), group_size=1)
    with pytest.raises(rewards.RewardError, match="not a reward spec"):
        rewards.score(unknown, right)
    incomplete = Task(task_id="x", prompt_ids=[1], prompt="x", answer=json.dumps({"source": "reasoning-gym"}),
                      group_size=1)
    with pytest.raises(rewards.RewardError, match="lacks"):
        rewards.score(incomplete, right)


def test_raising_or_invalid_scorer_raises(monkeypatch):
    task = Task(task_id="t", prompt_ids=[1], prompt="p", answer=json.dumps({"source": "boom"}), group_size=1)

    def boom(spec, completion):
        raise RuntimeError("verifier crashed")

    monkeypatch.setitem(rewards.SCORERS, "boom", boom)
    with pytest.raises(RuntimeError, match="verifier crashed"):
        rewards.score(task, "anything")
    monkeypatch.setitem(rewards.SCORERS, "boom", lambda spec, completion: math.nan)
    with pytest.raises(rewards.RewardError, match="not in"):
        rewards.score(task, "anything")
    monkeypatch.setitem(rewards.SCORERS, "boom", lambda spec, completion: 3.0)
    with pytest.raises(rewards.RewardError, match="not in"):
        rewards.score(task, "anything")
    monkeypatch.setitem(rewards.SCORERS, "boom", lambda spec, completion: "n/a")
    with pytest.raises(rewards.RewardError, match="non-number"):
        rewards.score(task, "anything")
    monkeypatch.setitem(rewards.SCORERS, "boom", lambda spec, completion: 0.25)
    assert rewards.score(task, "anything") == 0.25


def test_jsonl_skips_and_counts_malformed_rows(tmp_path):
    path = tmp_path / "data.jsonl"
    lines = [
        json.dumps({"prompt": "1+1=", "answer": "2"}),
        "{not json",
        json.dumps(["a", "list"]),
        json.dumps({"prompt": "", "answer": "3"}),
        json.dumps({"prompt": "no answer"}),
        "",
        json.dumps({"prompt": "half of one", "answer": 0.5}),
        json.dumps({"prompt": "flag", "answer": True}),
    ]
    path.write_text("\n".join(lines) + "\n")
    data = load_jsonl(path)
    assert data.rows == [("1+1=", "2"), ("half of one", "0.5")]
    assert data.skipped == 5 and data.skipped_lines == [2, 3, 4, 5, 8]
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{oops\n")
    with pytest.raises(ValueError, match="no valid"):
        load_jsonl(bad)
    with pytest.raises(FileNotFoundError, match="task.jsonl_path"):
        load_jsonl(tmp_path / "missing.jsonl")


def test_jsonl_splits_and_math_verify_reward(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"{i}+{i}=", "answer": str(2 * i)}) + "\n" for i in range(30)) + "junk\n")
    cfg = TaskConfig(source="jsonl", jsonl_path=str(path), train_size=100, eval_size=5)
    train, held = make_splits(cfg)
    assert (len(train), len(held)) == (25, 5)
    assert not {p.text for p in train} & {p.text for p in held}
    assert [p.text for p in make_splits(cfg)[1]] == [p.text for p in held]
    task = make_tasks(held[:1], build_tokenizer(), 4)[0]
    assert rewards.score(task, f"The answer is $\\boxed{{{held[0].answer}}}$") == 1.0
    assert rewards.score(task, "The answer is 12345") == 0.0
    assert math_verify_reward("0.5", "1/2") == 1.0
    with pytest.raises(ValueError, match="task.jsonl_path"):
        make_splits(TaskConfig(source="jsonl"))


# A completion on which math-verify never returns: sympy builds the power tower 9^(9^(9^9)).
POWER_TOWER = "Answer: 9^9^9^9"


def _jsonl_task(tmp_path, answer: str = "1"):
    path = tmp_path / "data.jsonl"
    path.write_text(json.dumps({"prompt": "p", "answer": answer}) + "\n" + json.dumps({"prompt": "q", "answer": answer}) + "\n")
    cfg = TaskConfig(source="jsonl", jsonl_path=str(path), train_size=1, eval_size=1, verify_timeout_s=2.0)
    _, held = make_splits(cfg)
    return cfg, make_tasks(held, build_tokenizer(), 2)[0]


def test_math_verify_on_a_power_tower_is_killed_at_its_deadline(tmp_path):
    """``Answer: 9^9^9^9`` made math-verify run for good inside a reward thread. It now runs in a
    worker process that is SIGKILLed at ``task.verify_timeout_s``; the call raises a TimeoutError
    (never a reward), and the pool answers the next completion."""
    import os
    import threading

    from app.envs.jsonl import verifier_pool
    from app.envs.process_pool import CallTimeout

    cfg, task = _jsonl_task(tmp_path)
    rewards.warm(cfg)  # what the rollout worker does before its first lease: the run's deadline
    pool = verifier_pool()
    assert pool.deadline_s == 2.0
    outcome: dict = {}

    def call():
        try:
            outcome["value"] = rewards.score(task, POWER_TOWER)
        except BaseException as e:  # noqa: BLE001 - the test inspects it
            outcome["error"] = e

    t = threading.Thread(target=call, daemon=True)
    t.start()
    t.join(60)
    assert not t.is_alive(), "math-verify on a power tower still running after 60 s"
    assert isinstance(outcome.get("error"), CallTimeout), outcome
    assert isinstance(outcome["error"], TimeoutError)
    assert pool.killed >= 1
    workers = [p.pid for _, p in pool._idle]
    assert rewards.score(task, "The answer is $\\boxed{1}$") == 1.0
    assert rewards.score(task, "The answer is 2") == 0.0
    for pid in workers:  # the idle workers are alive; the killed one is not among them
        os.kill(pid, 0)


def test_power_towers_do_not_use_up_the_reward_threads(tmp_path):
    """Through the rollout worker's RewardPool of one thread: five power towers in a row are five
    "timeout" failures (never a reward of 0), each freeing its thread at the verifier's deadline,
    and a good completion after them still scores. Before, each hung thread stayed hung; after
    4 x size of them no reward ran at all."""
    import asyncio

    from app.rollout.scoring import RewardPool

    cfg, task = _jsonl_task(tmp_path)
    rewards.warm(cfg)
    pool = RewardPool(1)

    async def go():
        bad = [await pool.score(rewards.score, task, POWER_TOWER, 30.0) for _ in range(5)]
        good = await pool.score(rewards.score, task, "The answer is $\\boxed{1}$", 30.0)
        return bad, good

    bad, good = asyncio.run(asyncio.wait_for(go(), 120))
    assert bad == [(0.0, "timeout")] * 5
    assert good == (1.0, None)


def test_reasoning_gym_reward_waits_for_a_concurrent_first_import():
    # The rollout worker scores in threads. reasoning_gym registers its datasets while its
    # package imports, and its `factory` submodule is complete long before the registry is:
    # a scorer that looked a dataset up in that window got "not registered" and reward 0.
    import subprocess
    import sys

    code = """
import json, sys, threading, time
threading.Thread(target=lambda: __import__("reasoning_gym"), daemon=True).start()
while "reasoning_gym.factory" not in sys.modules:
    time.sleep(0.0005)
from app.envs.rewards import score_answer_spec
spec = json.dumps({"source": "reasoning-gym", "dataset": "spell_backward", "params": {},
                   "entry": {"question": "q", "answer": "olleh", "metadata": {"word": "hello"}}})
print(score_answer_spec(spec, "olleh"))
"""
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "1.0", res.stdout + res.stderr


def test_jsonl_bom_non_utf8_and_nan_rows(tmp_path):
    from app.envs.jsonl import load_jsonl

    path = tmp_path / "rows.jsonl"
    path.write_bytes(
        "\ufeff".encode() + b'{"prompt": "1+1=", "answer": "2"}\n'  # BOM before the first row: fine
        + b'{"prompt": "caf\xe9", "answer": "x"}\n'                   # latin-1 byte: malformed
        + b'{"prompt": "p", "answer": NaN}\n'                          # NaN is not JSON: malformed
        + b'{"prompt": "2+2=", "answer": 4}\n'
    )
    data = load_jsonl(path)
    assert data.rows == [("1+1=", "2"), ("2+2=", "4")]
    assert data.skipped == 2 and data.skipped_lines == [2, 3]
    with pytest.raises(ValueError, match="is a directory"):
        load_jsonl(tmp_path)
