"""`moerl env`: serve the run's environment (``env.name``) over OpenEnv's protocol.

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
import logging
from pathlib import Path

import typer

from app.config import RunConfig

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


def build_app(cfg: RunConfig):
    """The ASGI app serving environment ``cfg.env.name`` (OpenEnv app inside `EpisodeDeadline`).

    The task's verifier is imported here, so the first episode does not pay for it.

    Raises:
        ValueError: ``env.name`` unset or unknown.
    """
    from openenv.core.env_server import create_fastapi_app

    from app.envs.environments import ENVIRONMENTS, TextAction, TextObservation
    from app.envs.rewards import _gym_scorer

    if cfg.env.name not in ENVIRONMENTS:
        raise ValueError(f"env.name: {cfg.env.name!r} is not one of {sorted(ENVIRONMENTS)} (moerl env serves one)")
    env_cls = ENVIRONMENTS[cfg.env.name]
    _gym_scorer(cfg.task.name)

    def factory():
        return env_cls(cfg.env)

    factory.__name__ = env_cls.__name__
    app = create_fastapi_app(factory, TextAction, TextObservation, max_concurrent_envs=cfg.env.max_sessions,
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
    import uvicorn

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        cfg = RunConfig.load(config)
        app = build_app(cfg)
    except (FileNotFoundError, ValueError) as e:
        raise typer.BadParameter(str(e), param_hint="--config") from None
    uvicorn.run(app, host=host, port=port, log_level="warning", ws_ping_interval=20.0, ws_ping_timeout=20.0)
