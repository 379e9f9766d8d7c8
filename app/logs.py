"""Logging of moerl's role processes: INFO lines of moerl's own loggers, not of the libraries'
requests.

httpx logs every request at INFO ("HTTP Request: POST .../generate 200 OK"): with the rollout
workers polling and generating, that was most of a TorchX run's output (26,387 lines in three
minutes) and buried the trainer's one line per step. Request loggers are set to WARNING unless
``MOERL_LOG_REQUESTS=1``.
"""

from __future__ import annotations

import logging
import os
import sys

# Libraries that log one line per request or connection at INFO.
REQUEST_LOGGERS = ("httpx", "httpcore", "urllib3", "botocore", "websockets", "uvicorn.access")


def setup_logging(fmt: str = "%(asctime)s %(name)s %(levelname)s %(message)s", stream=None) -> None:
    """``logging.basicConfig`` at INFO with ``fmt`` (on stderr unless ``stream``), request
    loggers at WARNING (module docstring)."""
    logging.basicConfig(level=logging.INFO, format=fmt, stream=stream or sys.stderr)
    if os.environ.get("MOERL_LOG_REQUESTS") != "1":
        for name in REQUEST_LOGGERS:
            logging.getLogger(name).setLevel(logging.WARNING)
