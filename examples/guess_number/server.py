"""Serve `GuessNumberEnv` with OpenEnv's own server, as its author would deploy it.

    python -m examples.guess_number.server [--host 127.0.0.1] [--port 8091]
"""

from __future__ import annotations

import argparse

from openenv.core.env_server import create_fastapi_app

from examples.guess_number.env import GuessAction, GuessNumberEnv, GuessObservation


def app():
    """OpenEnv's FastAPI app for the environment (WebSocket /ws, /health, /schema)."""
    return create_fastapi_app(GuessNumberEnv, GuessAction, GuessObservation, max_concurrent_envs=512,
                              env_name="guess-number", mode="production")


if __name__ == "__main__":
    import uvicorn

    parser = argparse.ArgumentParser()
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8091)
    args = parser.parse_args()
    uvicorn.run(app(), host=args.host, port=args.port, log_level="warning")
