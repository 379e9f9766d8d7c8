"""Shared fixtures: a real redis-server and a moto S3 server over real HTTP.

- `redis_server`: URL (redis://127.0.0.1:<port>/0) of a fresh redis-server per test, append-only
  persistence on, temp data dir; stopped and removed after the test.
- `local_redis`: the same, but yields the `LocalRedis` object (for `restart()`, `kill()`, `client()`).
- `moto_s3`: endpoint URL (http://127.0.0.1:<port>) of moto's server mode, one per test session,
  with fake credentials in the environment. Create a uniquely named bucket per test.

The venv's Node.js directory (.venv/node/bin, the Makefile's NODE_BIN: Node 22 where the system's is
older) goes first on PATH, as `make` puts it, so the jsii kernels of aws-cdk-lib and cdk8s and the
IAM simulator (tests/iam.py) run on it when pytest is run by hand.

Without CUDA, Triton kernels (app/model/kernels.py) run through Triton's interpreter: triton reads
TRITON_INTERPRET when it is first imported, so it is set here, before any test module imports it.

`pytest_collection_modifyitems` puts the files with end-to-end tests first (`make test` runs two
workers; see the Makefile).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

_NODE_BIN = Path(sys.executable).parent.parent / "node" / "bin"
if _NODE_BIN.is_dir():
    os.environ["PATH"] = f"{_NODE_BIN}{os.pathsep}{os.environ['PATH']}"

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from app.buffer.redis_server import LocalRedis


def pytest_collection_modifyitems(config, items):
    """Files with end-to-end tests (marked ``slow``) first, the one with most of them first,
    each file's tests kept together and in order: `make test` hands whole files to its two
    workers in this order, so the long files start early instead of finishing last."""
    slow: dict = {}
    first_seen: dict = {}
    for i, item in enumerate(items):
        slow[item.path] = slow.get(item.path, 0) + bool(item.get_closest_marker("slow"))
        first_seen.setdefault(item.path, i)
    items.sort(key=lambda item: (-slow[item.path], first_seen[item.path]))


@pytest.fixture
def local_redis(tmp_path):
    """A started LocalRedis (no password) with its data under the test's tmp_path."""
    server = LocalRedis(tmp_path / "redis")
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def redis_server(local_redis) -> str:
    """URL of a fresh redis-server on a free loopback port."""
    return local_redis.url


_FAKE_AWS = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_SESSION_TOKEN": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}


@pytest.fixture(scope="session")
def moto_s3():
    """Endpoint URL of moto's S3 server (ThreadedMotoServer) on a free loopback port."""
    from moto.server import ThreadedMotoServer

    saved = {k: os.environ.get(k) for k in _FAKE_AWS}
    os.environ.update(_FAKE_AWS)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    try:
        yield f"http://{host}:{port}"
    finally:
        server.stop()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
