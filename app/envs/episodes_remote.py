"""Episodes against an environment server, played where the model is: held-out evaluation and
warm-up demonstrations of an environment moerl does not ship (``env.name`` an import path, or
``env.url`` a server of your own).

The built-in environments are played in process (app/envs/episodes_local.py); a user's
environment is reached the way the rollout workers reach it: one WebSocket session per episode
(app/envs/env_client.py), ``reset(spec=...)``, one ``step`` per policy turn, its text fields as
its ``/schema`` names them (app/envs/wire.py). Token layout and rewards are the workers':
prompt = the reset observation, each turn ends with ``<eos>``, an episode that runs out of
``env.max_turns`` gets 0, a turn cut at ``max_new_tokens`` gets ``rollout.overlong_reward``.

* `play`: one episode per prompt, the model generating each turn (greedy at temperature 0),
  batched over the episodes still running (left-padded, ``model.generate``).
* `demonstrations`: the warm-up's examples from ``env.demos_path``, a JSONL of
  ``{"spec": <the episode's problem>, "actions": ["turn", ...]}``: each row is played against
  the environment (the actions sent in order until it says done), and its tokens are the
  episode's with loss mask 1 on the actions and their ``<eos>``, 0 on the observations. A row
  whose ``actions`` is None (``env.demos_from_env``) takes them from the reset observation's
  OpenEnv ``metadata``, ``{"demonstration": ["turn", ...]}``: the environment's own solution of
  its episode, which the policy never reads (only the observation's text field is rendered).

Any failure of the environment (no connection, an error answer, no text field) raises
`EnvError`: an evaluation or warm-up never counts a failed episode as a score.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

from app.config import RolloutConfig
from app.envs.chat import renderer_for
from app.envs.contract import episode_reward
from app.envs.env_client import EnvError, EnvSession, StepResult
from app.envs.wire import WireError, WireFormat


def _msg(wire: WireFormat, result: StepResult, reset: bool = False) -> dict:
    try:
        return wire.message(result.observation, reset)
    except WireError as e:
        raise EnvError(str(e)) from None


def spec_text(spec: Any) -> str:
    """The spec as the workers send it (``Task.answer`` is a string): JSON text unless a string."""
    return spec if isinstance(spec, str) else json.dumps(spec)


async def _play_chunk(model, tokenizer, specs: list[str], env_cfg, url: str, wire: WireFormat, temperature: float,
                      max_new_tokens: int, overlong_reward: float | None, rollout) -> list[float]:
    # torch and openenv (episodes_local): only where episodes are played; `moerl run`'s driver
    # imports this module (its demonstrations, the warm-up key) without them
    from app.envs.episodes_local import _generate

    renderer = renderer_for(tokenizer)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    sessions = [EnvSession(url, env_cfg.step_timeout_s) for _ in specs]
    try:
        await asyncio.gather(*(s.__aenter__() for s in sessions))
        firsts = await asyncio.gather(*(s.reset(spec=sp, episode_id=f"eval-{i}")
                                        for i, (s, sp) in enumerate(zip(sessions, specs))))
        histories = [[_msg(wire, f, reset=True)] for f in firsts]
        seqs = [renderer.prompt_ids(h) for h in histories]
        rewards = [0.0] * len(specs)
        active = [i for i, f in enumerate(firsts) if not f.done]
        for _ in range(env_cfg.max_turns):
            if not active:
                break
            # In a thread: the event loop must keep answering the sessions' keepalive pings while the
            # model generates (a loaded CPU took longer than the server's ping timeout, which then
            # closed every session: "keepalive ping timeout", code 1011).
            turns = await asyncio.to_thread(_generate, model, pad, tokenizer.eos_token_id, [seqs[i] for i in active],
                                            temperature, max_new_tokens)
            sending = []
            for i, (turn, finished) in zip(active, turns):
                if not finished and overlong_reward is not None:
                    rewards[i] = overlong_reward
                    continue
                sending.append((i, turn, renderer.decode(turn)))
            results = await asyncio.gather(*(sessions[i].step(wire.action(text)) for i, _, text in sending))
            active = []
            for (i, turn, text), result in zip(sending, results):
                if result.done:
                    try:
                        rewards[i] = episode_reward(result, rollout)
                    except EnvError as e:
                        raise EnvError(f"env.url {url}: {e}") from None
                    continue
                new = [_msg(wire, result)]
                seqs[i] = seqs[i] + turn + renderer.observation_ids(histories[i], new)
                histories[i] += [{"role": "assistant", "content": text}] + new
                active.append(i)
        return rewards
    finally:
        await asyncio.gather(*(s.close(check=False) for s in sessions), return_exceptions=True)


def play(model, tokenizer, prompts, env_cfg, url: str, wire: WireFormat, temperature: float, max_new_tokens: int,
         overlong_reward: float | None = 0.0, batch_size: int = 64, rollout=None, progress=None) -> list[float]:
    """The reward of one episode per prompt (``Prompt.spec`` is each reset's spec), in order;
    ``batch_size`` episodes (sessions) at a time, their turns generated as one batch. Each
    reward must be a number within ``rollout.reward_range`` (a `RolloutConfig`; default its
    default), as in training (`app.envs.contract.episode_reward`). ``progress(n)`` is called as
    each batch of ``n`` episodes ends.

    Raises:
        EnvError: an environment call failed or answered malformed, or a reward broke the rule.
    """
    import torch  # only where episodes are played (see _play_chunk)

    rollout = rollout or RolloutConfig()
    rewards: list[float] = []
    with torch.no_grad():
        for start in range(0, len(prompts), batch_size):
            chunk = [p.spec for p in prompts[start:start + batch_size]]
            rewards += asyncio.run(_play_chunk(model, tokenizer, chunk, env_cfg, url, wire, temperature,
                                               max_new_tokens, overlong_reward, rollout))
            if progress is not None:
                progress(len(chunk))
    return rewards


def load_demos(path: str | Path) -> list[dict]:
    """Rows of a demonstrations JSONL (module docstring); blank lines are skipped.

    Raises:
        FileNotFoundError: no such file. ValueError: a row that is not ``{"spec", "actions":
            [str, ...]}`` (names the file and line), or no row at all.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"env.demos_path: {path} does not exist")
    rows = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"env.demos_path: {path}:{n}: not JSON ({e})") from None
        actions = row.get("actions") if isinstance(row, dict) else None
        if not (isinstance(actions, list) and actions and all(isinstance(a, str) for a in actions)) or "spec" not in row:
            raise ValueError(f'env.demos_path: {path}:{n}: expected {{"spec": ..., "actions": ["turn", ...]}}')
        rows.append(row)
    if not rows:
        raise ValueError(f"env.demos_path: {path} holds no demonstration")
    return rows


def own_demonstration(first: StepResult, url: str) -> list[str]:
    """The turns of the reset observation's ``metadata["demonstration"]`` (``env.demos_from_env``).

    Raises:
        EnvError: no such list of strings (names the URL and what the metadata held).
    """
    meta = first.metadata or first.observation.get("metadata") or {}
    actions = meta.get("demonstration") if isinstance(meta, dict) else None
    if not (isinstance(actions, list) and actions and all(isinstance(a, str) for a in actions)):
        raise EnvError(f"env.demos_from_env: {url}: the reset observation's metadata has no 'demonstration' "
                       f"list of turns (it has {sorted(meta) if isinstance(meta, dict) else meta!r})")
    return actions


def own_demo_rows(specs: list[str]) -> list[dict]:
    """`demonstrations` rows for ``env.demos_from_env``: each spec, its turns from the environment."""
    return [{"spec": spec, "actions": None} for spec in specs]


async def _demo_chunk(rows: list[dict], tokenizer, env_cfg, url: str, wire: WireFormat) -> list[tuple[list[int], list[int]]]:
    renderer = renderer_for(tokenizer)

    async def one(i: int, row: dict) -> tuple[list[int], list[int]]:
        async with EnvSession(url, env_cfg.step_timeout_s) as env:
            first = await env.reset(spec=spec_text(row["spec"]), episode_id=f"demo-{i}")
            history = [_msg(wire, first, reset=True)]
            ids = renderer.prompt_ids(history)
            mask = [0] * len(ids)
            actions = row["actions"] if row["actions"] is not None else own_demonstration(first, url)
            for text in actions:
                turn = list(tokenizer(text, add_special_tokens=False)["input_ids"]) + [tokenizer.eos_token_id]
                ids += turn
                mask += [1] * len(turn)
                result = await env.step(wire.action(text))
                if result.done:
                    break
                new = [_msg(wire, result)]
                o = renderer.observation_ids(history, new)
                history += [{"role": "assistant", "content": text}] + new
                ids += o
                mask += [0] * len(o)
            return ids, mask

    return list(await asyncio.gather(*(one(i, r) for i, r in enumerate(rows))))


def demonstrations(rows: list[dict], tokenizer, env_cfg, url: str, wire: WireFormat,
                   batch_size: int = 32) -> list[tuple[list[int], list[int]]]:
    """``(ids, mask)`` of every demonstration row, played against the server at ``url``,
    ``batch_size`` sessions at a time (a user's server may be one small process).

    Raises:
        EnvError: an environment call failed.
    """
    out = []
    for start in range(0, len(rows), batch_size):
        out += asyncio.run(_demo_chunk(rows[start:start + batch_size], tokenizer, env_cfg, url, wire))
    return out
