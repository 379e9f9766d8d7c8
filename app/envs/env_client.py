"""The rollout worker's client of an OpenEnv environment server (`moerl env`, or any OpenEnv env).

OpenEnv's own client (``openenv.core.EnvClient``) is not used in the worker: ``openenv``
depends on gradio, fastmcp and openai, which the rollout image (SGLang's base, whose packages
moerl's install must not replace; tests/test_images.py) does not take; and its client reconnects
silently when the server closed the socket, which must never let an episode continue on a new
session. This client speaks the same wire protocol with the same library (``websockets``),
and tests/test_envs_protocol.py checks every message it sends against OpenEnv's own message
types and runs it against OpenEnv's own server.

Protocol (OpenEnv ``core/env_server/types.py``, ``http_server.py``; one WebSocket per episode at
``ws://HOST:PORT/ws``):
  -> ``{"type": "reset", "data": {...reset kwargs}}``   <- ``{"type": "observation", "data": D}``
  -> ``{"type": "step", "data": {...action fields}}``   <- ``{"type": "observation", "data": D}``
  -> ``{"type": "state"}``                              <- ``{"type": "state", "data": {...State fields}}``
  -> ``{"type": "close"}``                              (the server ends the session)
  <- ``{"type": "error", "data": {"message", "code"}}`` on any failure;
  ``D = {"observation": {...observation fields}, "reward": float | None, "done": bool,
  "metadata"?: {...}}`` (``serialization.serialize_observation``).

Every failure is an `EnvError`: no connection, a socket closed mid-episode (the env pod died,
or the server's episode deadline closed it), no answer within ``step_timeout_s``, an error
answer, or a malformed one. The worker fails the episode's group on it (never trains on it).
"""

from __future__ import annotations

import asyncio
import json
import math
from dataclasses import dataclass, field
from typing import Any

import websockets
from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidURI
from websockets.protocol import State


class EnvError(RuntimeError):
    """An environment call failed (see the module docstring); the message names the URL.
    ``code`` is the server's error code (OpenEnv's ``WSErrorCode``, e.g. ``CAPACITY_REACHED``)
    when it answered with an error, else None."""

    def __init__(self, message: str, code: str | None = None):
        super().__init__(message)
        self.code = code


# OpenEnv's error code of a session refused because the server holds its most sessions
# (``WSErrorCode.CAPACITY_REACHED``, core/env_server/types.py).
CAPACITY_REACHED = "CAPACITY_REACHED"


@dataclass
class StepResult:
    """One observation: ``observation`` fields (e.g. role, content), ``reward``, ``done``."""

    observation: dict[str, Any]
    reward: float | None
    done: bool
    metadata: dict[str, Any] = field(default_factory=dict)


def ws_url(base_url: str) -> str:
    """``http://h:p`` / ``ws://h:p`` -> ``ws://h:p/ws`` (https -> wss).

    Raises:
        ValueError: not an http(s):// or ws(s):// URL.
    """
    url = base_url.rstrip("/")
    for http, ws in (("http://", "ws://"), ("https://", "wss://")):
        if url.startswith(http):
            url = ws + url[len(http):]
    if not url.startswith(("ws://", "wss://")):
        raise ValueError(f"env.url must be http(s):// or ws(s)://, got {base_url!r}")
    return url if url.endswith("/ws") else url + "/ws"


def parse_observation(message: Any, where: str) -> StepResult:
    """Read one server message as an observation.

    Raises:
        EnvError: an error answer, or not ``{"type": "observation", "data": {observation: dict,
            reward: finite number | None, done: bool}}``.
    """
    if not isinstance(message, dict):
        raise EnvError(f"{where}: answer is not a JSON object")
    if message.get("type") == "error":
        data = message.get("data") or {}
        raise EnvError(f"{where}: server error {data.get('code', '?')}: {str(data.get('message', ''))[:300]}",
                       code=str(data.get("code")) if data.get("code") is not None else None)
    data = message.get("data")
    if message.get("type") != "observation" or not isinstance(data, dict):
        raise EnvError(f"{where}: expected an observation, got {str(message)[:200]}")
    obs, reward, done = data.get("observation"), data.get("reward"), data.get("done")
    if not isinstance(obs, dict) or not isinstance(done, bool):
        raise EnvError(f"{where}: observation must be an object and done a bool: {str(data)[:200]}")
    if reward is not None and (isinstance(reward, bool) or not isinstance(reward, (int, float))
                               or not math.isfinite(reward)):
        raise EnvError(f"{where}: reward {reward!r} is not a finite number")
    return StepResult(obs, None if reward is None else float(reward), done, data.get("metadata") or {})


class EnvSession:
    """One episode: one WebSocket session on an OpenEnv server (async context manager).

    Args:
        base_url: the server, ``http://host:port`` (``env.url``).
        step_timeout_s: the longest wait for one answer (connect included).
    """

    def __init__(self, base_url: str, step_timeout_s: float = 10.0):
        self.url = ws_url(base_url)
        self.timeout_s = step_timeout_s
        self._ws = None

    async def __aenter__(self) -> "EnvSession":
        try:
            self._ws = await asyncio.wait_for(
                websockets.connect(self.url, open_timeout=self.timeout_s, max_size=16 * 2**20, proxy=None),
                self.timeout_s)
        except (OSError, asyncio.TimeoutError, InvalidHandshake, InvalidURI) as e:
            raise EnvError(f"cannot open an episode at {self.url}: {type(e).__name__}: {e}") from None
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close(check=False)

    async def _call(self, message: dict, what: str) -> StepResult:
        raw = await self._exchange(message, what)
        try:
            return parse_observation(json.loads(raw), f"{self.url} {what}")
        except ValueError:
            raise EnvError(f"{self.url}: {what} answer is not JSON: {str(raw)[:200]}") from None

    async def _exchange(self, message: dict, what: str) -> str:
        if self._ws is None:
            raise EnvError(f"{self.url}: {what} on a closed session")
        try:
            await self._ws.send(json.dumps(message))
            raw = await asyncio.wait_for(self._ws.recv(), self.timeout_s)
        except asyncio.TimeoutError:
            await self._abandon()
            raise EnvError(f"{self.url}: no answer to {what} within {self.timeout_s:.0f} s") from None
        except ConnectionClosed as e:
            # OpenEnv answers a session it refuses (at capacity, a failed factory) with an error
            # and closes at once, often before our message is sent: read that answer, if any.
            last = await self._last_words()
            self._ws = None
            if last is not None:
                return last
            code, reason = (e.rcvd.code, e.rcvd.reason) if e.rcvd else (None, "")
            raise EnvError(f"{self.url}: session closed during {what} (code {code}): {reason or 'no reason'}") from None
        except OSError as e:
            await self._abandon()
            raise EnvError(f"{self.url}: {what} failed: {type(e).__name__}: {e}") from None
        return raw

    async def _last_words(self) -> str | None:
        """A message the server sent before it closed the socket, or None."""
        try:
            return await asyncio.wait_for(self._ws.recv(), 1.0)
        except (ConnectionClosed, asyncio.TimeoutError, OSError):
            return None

    async def reset(self, **kwargs: Any) -> StepResult:
        """Start the episode (OpenEnv ``reset``; kwargs go to the environment's ``reset``)."""
        return await self._call({"type": "reset", "data": kwargs}, "reset")

    async def step(self, action: dict[str, Any]) -> StepResult:
        """Send one action (its fields, e.g. ``{"text": ...}``) and read the observation."""
        return await self._call({"type": "step", "data": action}, "step")

    async def state(self) -> dict[str, Any]:
        """The environment's ``State`` fields (OpenEnv ``state``: ``episode_id``, ``step_count``, ...).

        Raises:
            EnvError: an error answer, or not ``{"type": "state", "data": {...}}``.
        """
        raw = await self._exchange({"type": "state"}, "state")
        try:
            message = json.loads(raw)
        except ValueError:
            raise EnvError(f"{self.url}: state answer is not JSON: {str(raw)[:200]}") from None
        if isinstance(message, dict) and message.get("type") == "error":
            data = message.get("data") or {}
            raise EnvError(f"{self.url} state: server error {data.get('code', '?')}: {str(data.get('message', ''))[:300]}")
        if not isinstance(message, dict) or message.get("type") != "state" or not isinstance(message.get("data"), dict):
            raise EnvError(f"{self.url}: expected a state, got {str(message)[:200]}")
        return message["data"]

    async def _abandon(self) -> None:
        ws, self._ws = self._ws, None
        if ws is not None:
            try:
                await asyncio.wait_for(ws.close(), 2.0)
            except Exception:  # noqa: BLE001 - the socket is being dropped anyway
                pass

    async def close(self, check: bool = True) -> None:
        """End the session: ``{"type": "close"}``, then the close handshake.

        Raises:
            EnvError: with ``check``, the server had closed the session already (its pod died
                or the episode deadline passed): the episode did not live to its end.
        """
        ws = self._ws
        if ws is None:
            return
        gone = ws.state in (State.CLOSING, State.CLOSED)
        try:
            await ws.send(json.dumps({"type": "close"}))
        except Exception:  # noqa: BLE001 - already gone
            gone = True
        await self._abandon()
        if gone and check:
            raise EnvError(f"{self.url}: the server closed the session before the episode ended "
                           f"(code {ws.close_code})")
