"""`moerl env`: serve the run's environment (``env.name``) over OpenEnv's protocol.

``env.name`` is one of moerl's environments or an OpenEnv ``Environment`` class of your own,
``package.module:Class`` (importable where `moerl env` runs: the repository root, or a package
installed in the env image); its ``reset`` must take ``spec`` (`user_environment`).

    moerl env --config run.yaml [--host 0.0.0.0] [--port 8090]

Why OpenEnv (meta-pytorch/OpenEnv, the ``openenv`` package on PyPI): it is the protocol that
puts an environment in a service of its own, one container per environment, which is what the
env pool is (a Deployment on env-cpu behind a Service, scaled apart from the rollout engines),
and TRL and other trainers already speak it, so these environments are usable outside moerl
and OpenEnv environments inside it. The other two references keep the environment in the
trainer's process: ``verifiers`` (Prime Intellect) runs the agent loop and the model traffic
itself (an interception server in front of an OpenAI-style API), so the worker would lose the
token ids and logprobs it must keep per token; TorchTitan's RL experiment
(``torchtitan/experiments/rl/environment/``: ``MessageEnv`` init/step in message space,
``TokenEnv`` rendering messages to token ids) is an in-process interface with no wire format.
Its split is kept: environments speak messages (text), the worker owns tokens
(app/envs/chat.py renders them with the policy's tokenizer).

The app is OpenEnv's own: ``openenv.core.env_server.create_fastapi_app`` over the environment
class (app/envs/environments.py), in OpenEnv's production mode, so only its stateful routes are
served: ``GET /health``, ``/schema``, ``/metadata`` and the WebSocket ``/ws`` (one session, one
environment instance, per connection: ``{"type": "reset" | "step" | "state" | "close", "data"}``
in, ``{"type": "observation" | "state" | "error", "data"}`` out; OpenEnv
``core/env_server/http_server.py``). Stateless HTTP ``/reset`` and ``/step`` (a fresh
environment per request) are of no use to a multi-turn episode and are not served. Sessions are
capped at ``env.max_sessions``.

Episode timeout: `EpisodeDeadline` wraps the app; a WebSocket session open longer than
``env.episode_timeout_s`` is closed by the server (close code `EPISODE_TIMEOUT_CODE`), and
OpenEnv's handler, cancelled, destroys the session's environment. A worker that vanished
drops its TCP connection, which ends the session the same way (uvicorn pings idle sockets).
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import logging
import os
import sys
import typing
from pathlib import Path

import typer
import uvicorn

from app.config import IMPORT_PATH, RunConfig
from app.envs.rewards import _gym_scorer
from app.logs import setup_logging

log = logging.getLogger("moerl.env")

EPISODE_TIMEOUT_CODE = 4408  # WebSocket close code (4000-4999: application-defined, RFC 6455 §7.4.2)


class EpisodeDeadline:
    """ASGI middleware: a WebSocket connection lives at most ``timeout_s`` seconds.

    At the deadline the inner handler is cancelled (OpenEnv's ``/ws`` handler then destroys
    its session in its ``finally``) and the socket is closed with `EPISODE_TIMEOUT_CODE`.
    HTTP requests pass through untouched.

    Args:
        app: the ASGI app (OpenEnv's FastAPI app).
        timeout_s: episode limit in seconds (``env.episode_timeout_s``).
    """

    def __init__(self, app, timeout_s: float):
        if timeout_s <= 0:
            raise ValueError(f"env.episode_timeout_s must be > 0, got {timeout_s}")
        self.app = app
        self.timeout_s = timeout_s
        self.expired = 0  # sessions closed at the deadline

    async def __call__(self, scope, receive, send):
        if scope["type"] != "websocket":
            return await self.app(scope, receive, send)
        expired = False
        closed = False
        timeout_close = {"type": "websocket.close", "code": EPISODE_TIMEOUT_CODE, "reason": "episode timeout"}

        async def guarded_send(message):
            nonlocal closed
            if message["type"] == "websocket.close":
                if closed:
                    return
                closed = True
                if expired:  # OpenEnv's handler closes as it unwinds: say why
                    message = timeout_close
            await send(message)

        inner = asyncio.ensure_future(self.app(scope, receive, guarded_send))
        done, _ = await asyncio.wait({inner}, timeout=self.timeout_s)
        if done:
            return inner.result()
        expired = True
        self.expired += 1
        log.warning("episode open for %.0f s: closing its session", self.timeout_s)
        inner.cancel()
        try:
            await inner
        except (asyncio.CancelledError, Exception):  # noqa: BLE001 - the handler is being torn down
            pass
        if not closed:
            try:
                await guarded_send(timeout_close)
            except Exception:  # noqa: BLE001 - the client may be gone already
                pass


def takes_spec(env_cls) -> bool:
    """Whether ``env_cls.reset`` (or ``reset_async``, when overridden) accepts ``spec``: OpenEnv's
    server passes a reset only the keyword arguments its signature names (``**kwargs`` takes all),
    and silently drops the rest (``http_server.py`` ``_get_valid_kwargs``)."""
    # openenv: the env extra (pyproject.toml); `moerl run` imports this module without it
    from openenv.core.env_server.interfaces import Environment

    method = env_cls.reset_async if env_cls.reset_async is not Environment.reset_async else env_cls.reset
    params = inspect.signature(method).parameters
    return "spec" in params or any(p.kind is p.VAR_KEYWORD for p in params.values())


def user_environment(path: str):
    """``(environment class, action class, observation class)`` of ``env.name`` = an import path
    ``package.module:Class`` naming an OpenEnv ``Environment`` subclass; the action and
    observation classes are its type arguments (``Environment[MyAction, MyObservation, State]``)
    or, failing that, the annotations of its ``step``.

    Raises:
        ValueError: the module or class cannot be imported, is not an ``Environment``, its types
            cannot be found, it does not support concurrent sessions, or its ``reset`` does not
            take ``spec`` (each named).
    """
    # openenv: the env extra (see takes_spec)
    from openenv.core.env_server.interfaces import Environment
    from openenv.core.env_server.types import Action, Observation

    module_name, _, attr = path.partition(":")
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.append(os.getcwd())  # as `python -m` has it: the `moerl` script's path lacks it
    try:
        env_cls = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"env.name: cannot import {path!r}: {type(e).__name__}: {e}") from None
    if not (isinstance(env_cls, type) and issubclass(env_cls, Environment)):
        raise ValueError(f"env.name: {path!r} is not an OpenEnv Environment subclass "
                         "(openenv.core.env_server.interfaces.Environment)")
    action_cls = observation_cls = None
    for base in getattr(env_cls, "__orig_bases__", ()):
        args = typing.get_args(base)
        if typing.get_origin(base) is Environment and len(args) >= 2:
            action_cls, observation_cls = args[0], args[1]
    if not (isinstance(action_cls, type) and isinstance(observation_cls, type)):
        try:
            hints = typing.get_type_hints(env_cls.step)
        except Exception:  # noqa: BLE001 - unresolvable annotations: reported below
            hints = {}
        action_cls, observation_cls = hints.get("action"), hints.get("return")
    if not (isinstance(action_cls, type) and issubclass(action_cls, Action)
            and isinstance(observation_cls, type) and issubclass(observation_cls, Observation)):
        raise ValueError(f"env.name: {path!r} names no Action and Observation types: subclass "
                         "Environment[YourAction, YourObservation, State], or annotate step(self, action: "
                         "YourAction) -> YourObservation")
    if not getattr(env_cls, "SUPPORTS_CONCURRENT_SESSIONS", False):
        raise ValueError(f"env.name: {path}.SUPPORTS_CONCURRENT_SESSIONS is False (OpenEnv's default): moerl plays up "
                         "to env.max_sessions episodes at once on one server, one instance each; set "
                         "SUPPORTS_CONCURRENT_SESSIONS = True on the class (its instances must share no state)")
    if not takes_spec(env_cls):
        raise ValueError(f"env.name: {path}.reset takes no 'spec': moerl sends each episode's problem as "
                         "reset(spec=...), and the G episodes of a GRPO group must play the same one; OpenEnv "
                         "would drop it silently. Add spec (or **kwargs) to reset")
    return env_cls, action_cls, observation_cls


def build_app(cfg: RunConfig):
    """The ASGI app serving environment ``cfg.env.name`` (OpenEnv app inside `EpisodeDeadline`):
    one of moerl's (the task's verifier is imported here, so the first episode does not pay for
    it) or an OpenEnv ``Environment`` class of the user's (`user_environment`), made with no
    arguments per session.

    Raises:
        ValueError: ``env.name`` unset, or not a built-in nor a usable import path (named).
    """
    # openenv, the env extra (see takes_spec), and moerl's environments, which are built on it
    from openenv.core.env_server import create_fastapi_app

    from app.envs.environments import ENVIRONMENTS, TextAction, TextObservation

    if cfg.env.name in ENVIRONMENTS:
        env_cls = ENVIRONMENTS[cfg.env.name]
        action_cls, observation_cls = TextAction, TextObservation
        if cfg.task.source == "reasoning-gym":
            _gym_scorer(cfg.task.name)

        def factory():
            return env_cls(cfg.env)
    elif cfg.env.name and IMPORT_PATH.match(cfg.env.name):
        env_cls, action_cls, observation_cls = user_environment(cfg.env.name)

        def factory():
            return env_cls()
    else:
        raise ValueError(f"env.name: {cfg.env.name!r} is not one of {sorted(ENVIRONMENTS)} nor an import path "
                         "package.module:Class (moerl env serves one)")
    factory.__name__ = env_cls.__name__
    app = create_fastapi_app(factory, action_cls, observation_cls, max_concurrent_envs=cfg.env.max_sessions,
                             env_name=cfg.env.name, mode="production")
    return EpisodeDeadline(app, cfg.env.episode_timeout_s)


cli = typer.Typer(add_completion=False, help="Serve the run's environment over OpenEnv's WebSocket protocol.")


@cli.command()
def env(
    config: Path = typer.Option(..., "--config", help="Run configuration (YAML) naming env.name."),
    host: str = typer.Option("127.0.0.1", "--host"),
    port: int = typer.Option(8090, "--port", min=1, max=65535),
) -> None:
    """Serve ``env.name`` on ``host:port`` (``ws://host:port/ws``) until SIGTERM."""
    setup_logging()
    try:
        cfg = RunConfig.load(config)
        app = build_app(cfg)
    except (FileNotFoundError, ValueError) as e:
        raise typer.BadParameter(str(e), param_hint="--config") from None
    uvicorn.run(app, host=host, port=port, log_level="warning", ws_ping_interval=20.0, ws_ping_timeout=20.0)
