"""A local redis-server for the embedded default and the tests.

`LocalRedis` starts the system `redis-server` on a free loopback port with its own data
directory and append-only persistence (appendonly yes, appendfsync everysec), so that a
restart keeps the task queue, the leases and the published samples (issue 4). It can stop
the server gracefully (SHUTDOWN flushes the AOF), kill it (SIGKILL, a lost node) and start it
again on the same port and directory.
"""

from __future__ import annotations

import ctypes
import os
import secrets
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

REDIS_SERVER = "/usr/bin/redis-server"


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:
    # Linux: the server gets SIGTERM (a graceful shutdown) if the process that started it dies,
    # so an interrupted test or run never leaves a redis-server behind.
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def _on_exit_of_starter() -> Callable[[], None] | None:
    """`_die_with_parent` when called from the main thread, else None. PR_SET_PDEATHSIG fires when
    the *thread* that forked the child exits (prctl(2)), so a server started from a worker thread
    (e.g. `asyncio.to_thread(r.restart)`) was shut down as soon as that pool thread ended; such a
    server is only stopped by `stop()` / `shutdown()` / `kill()`."""
    return _die_with_parent if threading.current_thread() is threading.main_thread() else None


class LocalRedis:
    """A redis-server child process on 127.0.0.1 with append-only persistence.

    Use as a context manager (`with LocalRedis() as r: r.url`) or call `start()` / `stop()`.

    Args:
        data_dir: where the AOF and the log live; a temporary directory (removed by `stop()`
            unless `keep_dir`) when None.
        port: TCP port; a free one when None. `restart()` keeps it.
        password: AUTH password of the ``default`` user (requirepass); none when None.
        extra_args: more redis-server options, e.g. the role users of `app.buffer.acl.server_args`.
        appendfsync: "everysec" (default), "always" or "no".
        binary: the redis-server executable.
        start_timeout_s: how long to wait for PING after starting.

    Raises:
        FileNotFoundError: `binary` does not exist (install redis-server).
        RuntimeError: the server did not answer PING within `start_timeout_s`; the message
            quotes the end of its log.
    """

    def __init__(
        self,
        data_dir: str | os.PathLike | None = None,
        *,
        port: int | None = None,
        password: str | None = None,
        appendfsync: str = "everysec",
        binary: str = REDIS_SERVER,
        start_timeout_s: float = 10.0,
        keep_dir: bool = False,
        extra_args: list[str] | tuple[str, ...] = (),
    ):
        if not Path(binary).exists():
            found = shutil.which("redis-server")
            if found is None:
                raise FileNotFoundError(f"redis-server not found at {binary} nor on PATH")
            binary = found
        if appendfsync not in ("everysec", "always", "no"):
            raise ValueError(f"appendfsync must be everysec|always|no, got {appendfsync!r}")
        self.binary = binary
        self._own_dir = data_dir is None
        self.data_dir = Path(tempfile.mkdtemp(prefix="moerl-redis-") if data_dir is None else data_dir)
        self.port = port
        self.password = password
        self.appendfsync = appendfsync
        self.start_timeout_s = start_timeout_s
        self.keep_dir = keep_dir
        self.extra_args = list(extra_args)
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        """redis://[:password@]127.0.0.1:<port>/0"""
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    @property
    def log_path(self) -> Path:
        return self.data_dir / "redis.log"

    def _argv(self) -> list[str]:
        argv = [
            self.binary,
            "--port", str(self.port),
            "--bind", "127.0.0.1",
            "--dir", str(self.data_dir),
            "--appendonly", "yes",
            "--appendfsync", self.appendfsync,
            "--save", "",  # AOF only, no RDB snapshots
            "--daemonize", "no",
            "--logfile", str(self.log_path),
            "--pidfile", "",
        ]
        if self.password:
            argv += ["--requirepass", self.password]
        return argv + self.extra_args

    def client(self) -> redis.Redis:
        """A redis-py client for this server (for tests and admin); no retries."""
        return redis.Redis(host="127.0.0.1", port=self.port, password=self.password,
                           socket_connect_timeout=1.0, socket_timeout=5.0, retry=Retry(NoBackoff(), 0))

    def start(self) -> "LocalRedis":
        """Start the server and wait until it answers PING; a fresh free port if none was set."""
        if self.alive():
            return self
        self.data_dir.mkdir(parents=True, exist_ok=True)
        choose_port = self.port is None
        for _ in range(3 if choose_port else 1):
            if choose_port:
                self.port = free_port()
            self.proc = subprocess.Popen(
                self._argv(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                stdin=subprocess.DEVNULL, start_new_session=True, preexec_fn=_on_exit_of_starter(),
            )
            if self._wait_ready():
                return self
            self._terminate()
        raise RuntimeError(
            f"redis-server on 127.0.0.1:{self.port} did not start within {self.start_timeout_s}s; "
            f"log {self.log_path}:\n{self._log_tail()}"
        )

    def _wait_ready(self) -> bool:
        deadline = time.monotonic() + self.start_timeout_s
        client = self.client()
        try:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    return False  # exited: port taken or bad config
                try:
                    # While the AOF loads, PING answers LOADING: keep waiting.
                    if client.ping():
                        return True
                except (redis.ConnectionError, redis.BusyLoadingError, redis.TimeoutError):
                    pass
                time.sleep(0.02)
            return False
        finally:
            client.close()

    def _log_tail(self, n: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text().splitlines()[-n:])
        except OSError:
            return "(no log)"

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def _terminate(self, timeout_s: float = 10.0) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.terminate()  # redis-server treats SIGTERM as a graceful shutdown
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Stop the server gracefully (SHUTDOWN: the AOF is flushed); keeps the data directory."""
        if not self.alive():
            self.proc = None
            return
        client = self.client()
        try:
            client.shutdown()
        except (redis.ConnectionError, redis.ResponseError):
            pass  # the connection drops as the server exits; SIGTERM below covers a refusal
        finally:
            client.close()
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            pass
        self._terminate(timeout_s)

    def kill(self) -> None:
        """SIGKILL the server (a lost node): writes of the last second may be lost (everysec)."""
        if self.alive():
            self.proc.kill()
            self.proc.wait()
        self.proc = None

    def restart(self, *, graceful: bool = True) -> "LocalRedis":
        """Stop (SHUTDOWN, or SIGKILL if not `graceful`) and start again on the same port and dir."""
        if graceful:
            self.shutdown()
        else:
            self.kill()
        return self.start()

    def stop(self) -> None:
        """Shut down and remove the temporary data directory (unless given or `keep_dir`)."""
        self.shutdown()
        if self._own_dir and not self.keep_dir:
            shutil.rmtree(self.data_dir, ignore_errors=True)

    def __enter__(self) -> "LocalRedis":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def new_password() -> str:
    """A random AUTH password for a local server."""
    return secrets.token_urlsafe(18)
