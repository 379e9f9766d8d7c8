"""Episodes played in this process, against the environment class itself (no server).

The same environments (app/envs/environments.py) and token layout (app/envs/chat.py) as the
rollout worker's episodes (app/rollout/episodes.py), for two jobs that run where the model is:

* `demonstration`: the supervised warm-up's examples for an environment task, played by a
  scripted policy that knows the reference answer. ``spell-retry``: the reference answer, or
  (with probability `RETRY_DEMOS`) a wrong first answer, the environment's feedback and then
  the reference answer, so the policy has seen the feedback format before RL. ``calculator``:
  with probability `CALC_TOOL_DEMOS` the call ``[EXPRESSION]``, the environment's ``=VALUE``,
  then VALUE as the answer; otherwise the answer at once, without the tool (a tiny policy
  cannot multiply 3-digit numbers itself, so those answers are mostly wrong when it plays them:
  when to call the tool is what RL must learn, and greedy decoding can gain it). The loss
  mask is 1 on the tokens the policy should learn (the reference turns and their ``<eos>``), 0
  on the prompt, the observations and a deliberately wrong answer.
* `play`: held-out evaluation: every prompt's episode with ``model.generate`` per turn
  (left-padded batches), rewarded by the environment as in training.
"""

from __future__ import annotations

import random

import torch

from app.config import EnvConfig
from app.envs.chat import renderer_for
from app.envs.environments import TextAction, make_env
from app.envs.tasks import Prompt

RETRY_DEMOS = 0.3  # share of spell-retry demonstrations with a wrong first answer
# Share of calculator demonstrations that call the tool. At 0.4 (250 warm-up steps, seed 0) the
# warm-up's greedy decoding answers 0.430 of the held-out products and RL raised it to 0.665
# (seed 1: 0.495 -> 0.690); at 1.0 greedy started at 0.685 and RL only sharpened sampling
# towards it (bench/results/run-task.md).
CALC_TOOL_DEMOS = 0.4
_LETTERS = "abcdefghijklmnopqrstuvwxyz"


def _message(obs) -> dict:
    return {"role": obs.role, "content": obs.content}


def _wrong(answer: str, rng: random.Random) -> str:
    """``answer`` with one or two letters replaced (never equal to it)."""
    chars = list(answer)
    for i in rng.sample(range(len(chars)), min(len(chars), rng.choice((1, 2)))):
        chars[i] = rng.choice([c for c in _LETTERS if c != chars[i].lower()])
    return "".join(chars)


def _scripted_turns(cfg: EnvConfig, prompt: Prompt, rng: random.Random) -> list[tuple[str | None, bool]]:
    """The scripted policy's turns: (text, trained) pairs; text None means "the value the
    calculator returned"."""
    if cfg.name == "spell-retry":
        if cfg.attempts > 1 and rng.random() < RETRY_DEMOS:
            return [(_wrong(prompt.answer, rng), False), (prompt.answer, True)]
        return [(prompt.answer, True)]
    if cfg.name == "calculator":
        if rng.random() >= CALC_TOOL_DEMOS:
            return [(prompt.answer, True)]
        return [(f"[{prompt.text.rstrip('=')}]", True), (None, True)]
    raise ValueError(f"env.name: no demonstration for {cfg.name!r}")


def demonstration(cfg: EnvConfig, prompt: Prompt, tokenizer, rng: random.Random) -> tuple[list[int], list[int]]:
    """One warm-up example of environment ``cfg.name`` for ``prompt``.

    Returns:
        ``(ids, mask)``: the episode's token ids (prompt, turns with their ``<eos>``,
        observations) and one 0/1 per id (1: a token the policy is taught).

    Raises:
        ValueError: no scripted policy for ``cfg.name``.
    """
    renderer = renderer_for(tokenizer)
    env = make_env(cfg)
    obs = env.reset(spec=prompt.spec)
    history = [_message(obs)]
    ids = renderer.prompt_ids(history)
    mask = [0] * len(ids)
    for text, trained in _scripted_turns(cfg, prompt, rng):
        if text is None:  # the calculator's answer: copy the value it returned
            text = history[-1]["content"].lstrip("=").strip()
        turn = list(tokenizer(text, add_special_tokens=False)["input_ids"]) + [tokenizer.eos_token_id]
        ids += turn
        mask += [int(trained)] * len(turn)
        obs = env.step(TextAction(text=text))
        if obs.done:
            break
        new = [_message(obs)]
        o = renderer.observation_ids(history, new)
        history += [{"role": "assistant", "content": text}] + new
        ids += o
        mask += [0] * len(o)
    return ids, mask


@torch.no_grad()
def _generate(model, pad_id: int, eos_id: int, seqs: list[list[int]], temperature: float,
              max_new_tokens: int) -> list[tuple[list[int], bool]]:
    """One turn for each sequence (left-padded batch): (the generated ids up to and including
    ``<eos>``, True), or (all ``max_new_tokens`` ids, False) when no ``<eos>`` came."""
    width = max(map(len, seqs))
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    attn = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, width - len(s):] = torch.tensor(s)
        attn[i, width - len(s):] = 1
    kwargs = dict(do_sample=False) if temperature <= 0 else dict(do_sample=True, temperature=temperature,
                                                                   top_p=1.0, top_k=None)
    out = model.generate(input_ids=ids.to(model.device), attention_mask=attn.to(model.device),
                         max_new_tokens=max_new_tokens, pad_token_id=pad_id, eos_token_id=eos_id, **kwargs)
    turns = []
    for row in out[:, width:].tolist():
        turns.append((row[: row.index(eos_id) + 1], True) if eos_id in row else (row, False))
    return turns


def play(model, tokenizer, prompts: list[Prompt], cfg: EnvConfig, temperature: float, max_new_tokens: int,
         overlong_reward: float | None = 0.0, batch_size: int = 128, progress=None) -> list[float]:
    """The reward of one episode per prompt, ``model`` generating each turn.

    A turn with no ``<eos>`` within ``max_new_tokens`` ends the episode with
    ``overlong_reward`` (as in rollouts; None: the environment scores it); an episode that runs
    out of ``cfg.max_turns`` turns gets 0. ``progress(n)`` is called as ``n`` episodes end.

    Returns:
        One reward per prompt, in order.
    """
    renderer = renderer_for(tokenizer)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    envs = [make_env(cfg) for _ in prompts]
    histories, seqs = [], []
    for env, p in zip(envs, prompts):
        h = [_message(env.reset(spec=p.spec))]
        histories.append(h)
        seqs.append(renderer.prompt_ids(h))
    rewards = [0.0] * len(prompts)
    active = list(range(len(prompts)))
    for _ in range(cfg.max_turns):
        if not active:
            break
        still = []
        for start in range(0, len(active), batch_size):
            chunk = active[start:start + batch_size]
            turns = _generate(model, pad, tokenizer.eos_token_id, [seqs[i] for i in chunk], temperature, max_new_tokens)
            for i, (turn, finished) in zip(chunk, turns):
                if not finished and overlong_reward is not None:
                    rewards[i] = overlong_reward
                    continue
                text = renderer.decode(turn)
                obs = envs[i].step(TextAction(text=text))
                if obs.done:
                    rewards[i] = float(obs.reward)
                    continue
                new = [_message(obs)]
                seqs[i] = seqs[i] + turn + renderer.observation_ids(histories[i], new)
                histories[i] += [{"role": "assistant", "content": text}] + new
                still.append(i)
        if progress is not None:
            progress(len(active) - len(still))
        active = still
    if progress is not None and active:
        progress(len(active))  # out of turns
    return rewards
