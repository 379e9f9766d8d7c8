"""Multi-turn episodes: one GRPO group = G episodes of one task against an OpenEnv environment.

One episode (`EpisodeRunner.episode`), on its own WebSocket session (app/envs/env_client.py):

1. ``reset(spec=Task.answer, episode_id=<sample id>)``: the first observation is the prompt,
   rendered to ids by the policy's tokenizer (app/envs/chat.py);
2. generate one turn from the whole token sequence so far (the engine is driven with
   ``input_ids``, both the built-in engine and SGLang; n = 1, ``rollout.max_new_tokens``);
3. send the turn's text as the action (``{"text": ...}`` for moerl's environments; the field the
   server's ``/schema`` names, app/envs/wire.py); on ``done`` the episode ends with the
   observation's reward; otherwise the observation's ids are appended (tokenized once) and the
   next turn is generated, up to ``env.max_turns`` turns;
4. close the session.

The sample (`app.buffer.records.Sample`): ``prompt_ids`` = the first prompt; ``completion_ids``
= everything after it, turns and observations in order; ``loss_mask`` 1 on generated tokens and
0 on observation tokens; ``logprobs`` the engine's at generated tokens, 0.0 at observation
tokens; ``policy_version`` the oldest weight version of its turns (docs/ARCHITECTURE.md, "Policy version and staleness");
``finish_reason`` "stop" when the environment ended the episode, "length" when a turn hit
``max_new_tokens`` or the turns ran out.

A turn cut at ``max_new_tokens`` ends the episode with ``rollout.overlong_reward`` (as a
truncated single-turn completion; the environment is not sent a partial answer) unless that is
None, in which case the turn goes to the environment like any other. An episode that runs out
of turns without ``done`` gets reward 0.

Failures: any environment failure (no connection, the session closed mid-episode, no answer in
``env.step_timeout_s``, an error answer, a malformed answer, ``done`` without a reward or with one
outside ``rollout.reward_range``) raises
`GroupFailed`: the worker returns the task to the queue with its failures counted and publishes
nothing (app/buffer/experience.py ``fail``), so a failed episode never becomes training signal.
Engine failures raise `EngineError` as single-turn generation does (the task is released).
"""

from __future__ import annotations

import asyncio
from typing import Awaitable, Callable

import httpx

from app.buffer.health import failure_reason
from app.buffer.records import Sample, Task
from app.config import RunConfig
from app.envs.chat import ChatTemplateError
from app.envs.contract import RewardOutOfRange, episode_reward
from app.envs.env_client import EnvError, EnvSession, StepResult
from app.envs.wire import WireError, WireFormat, fetch_wire_format, http_base
from app.rollout.engine_client import EngineError, GenOutput


class GroupFailed(RuntimeError):
    """A reward or environment call of a group failed: the group must not be trained; its
    task goes back to the queue with its failures counted (`ExperienceBuffer.fail`).
    ``reason``: the cause, short and the same for equal causes (`app.buffer.health.failure_reason`),
    counted in the run's health hash."""

    def __init__(self, message: str, reason: str = ""):
        super().__init__(message)
        self.reason = reason or failure_reason("failed", message)


Generate = Callable[[list[int]], Awaitable[GenOutput]]


def _message(result: StepResult, wire: WireFormat, reset: bool = False) -> dict:
    try:
        return wire.message(result.observation, reset)
    except WireError as e:
        raise EnvError(str(e)) from None


class EpisodeRunner:
    """Runs the episodes of a worker's tasks.

    Args:
        cfg: the run config (``env``, ``rollout`` and ``run_id`` are read).
        renderer: `app.envs.chat.TextRenderer` or `ChatRenderer` of the policy's tokenizer.
        generate: one engine call ``ids -> GenOutput`` (the worker's, which holds generation
            back while weights are swapped).
        fallback_version: the engine's version when an answer carries none (callable).
        url: the environment server (default ``env.url``).
        wire: which action and observation fields carry text (app/envs/wire.py; default
            moerl's own ``text`` / ``content``); `healthy` reads it from the server's ``/schema``.
    """

    def __init__(self, cfg: RunConfig, renderer, generate: Generate, fallback_version: Callable[[], int],
                 url: str | None = None, wire: WireFormat | None = None):
        self.cfg = cfg
        self.env = cfg.env
        self.url = url or cfg.env.url
        if not self.url:
            raise ValueError("env.url: unset, and no --env-url given (moerl run and the cluster pass the "
                             "address of the environment server they start)")
        self.wire = wire or WireFormat()
        self.r = cfg.rollout
        self.renderer = renderer
        self.generate = generate
        self.fallback_version = fallback_version

    async def episode(self, task: Task, index: int) -> Sample:
        """Play episode ``index`` of ``task`` (see the module docstring).

        Raises:
            GroupFailed: an environment call failed or answered malformed.
            EngineError: the engine failed or aborted the request.
        """
        sid = task.sample_id(self.cfg.run_id, index)
        try:
            async with EnvSession(self.url, self.env.step_timeout_s) as env:
                sample = await self._play(env, task, index, sid)
                await env.close()
            return sample
        except (EnvError, ChatTemplateError) as e:
            raise GroupFailed(f"episode {sid}: {e}", failure_reason("environment", e.reason if isinstance(e, RewardOutOfRange) else str(e))) from None

    async def _play(self, env: EnvSession, task: Task, index: int, sid: str) -> Sample:
        first = await env.reset(spec=task.answer, episode_id=sid)
        if first.done:
            raise EnvError("reset ended the episode before any turn")
        history = [_message(first, self.wire, reset=True)]
        prompt = self.renderer.prompt_ids(history)
        seq, completion, mask, logprobs, versions = list(prompt), [], [], [], []
        reward, finish = 0.0, "length"
        for turn in range(self.env.max_turns):
            out = await self.generate(seq)
            if out.finish_reason not in ("stop", "length"):
                raise EngineError(f"engine ended turn {turn} of {sid} with {out.finish_reason!r}")
            if len(out.logprobs) != len(out.token_ids):
                raise EngineError(f"engine returned fewer logprobs than tokens for {sid}")
            versions.append(out.weight_version if out.weight_version is not None else self.fallback_version())
            completion += out.token_ids
            mask += [1] * len(out.token_ids)
            logprobs += out.logprobs
            seq += out.token_ids
            if out.finish_reason == "length" and self.r.overlong_reward is not None:
                reward, finish = self.r.overlong_reward, "length"
                break
            text = self.renderer.decode(out.token_ids)
            result = await env.step(self.wire.action(text))
            if result.done:
                reward, finish = episode_reward(result, self.r), "stop"
                break
            new = [_message(result, self.wire)]
            obs = self.renderer.observation_ids(history, new)  # history: before this turn
            history += [{"role": "assistant", "content": text}] + new
            completion += obs
            mask += [0] * len(obs)
            logprobs += [0.0] * len(obs)
            seq += obs
        return Sample(
            sample_id=sid, task_id=task.task_id, index=index, attempt=task.attempt, prompt_ids=prompt,
            completion_ids=completion, logprobs=logprobs, reward=float(reward), policy_version=min(versions),
            finish_reason=finish, loss_mask=mask,
        )

    async def group(self, task: Task) -> list[Sample]:
        """The G = ``task.group_size`` episodes of ``task``, played concurrently.

        Raises:
            GroupFailed: any episode's environment failed (the others are cancelled).
            EngineError: the engine failed.
        """
        episodes = [asyncio.ensure_future(self.episode(task, j)) for j in range(task.group_size)]
        try:
            return list(await asyncio.gather(*episodes))
        finally:
            for e in episodes:
                e.cancel()
            await asyncio.gather(*episodes, return_exceptions=True)

    async def health_problem(self, timeout_s: float = 5.0) -> str | None:
        """None when the environment server answers ``GET /health`` with 200, else what it did
        (``/health answered 503``, ``ConnectError: ...``)."""
        try:
            async with httpx.AsyncClient(timeout=timeout_s) as http:
                status = (await http.get(http_base(self.url) + "/health")).status_code
        except httpx.HTTPError as e:
            return f"{type(e).__name__}: {e}"[:200] if str(e) else type(e).__name__
        return None if status == 200 else f"/health answered {status}"

    async def read_wire(self, timeout_s: float = 10.0) -> WireFormat:
        """Read the server's text fields from its ``/schema`` (`app.envs.wire.wire_format`) and
        keep them for every episode.

        Raises:
            WireError: the schema has no usable text field (named); ConnectionError: no schema.
        """
        self.wire = await asyncio.to_thread(fetch_wire_format, self.url, timeout_s)
        return self.wire
