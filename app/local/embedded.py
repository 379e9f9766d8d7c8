"""The embedded default: every role of a moerl job as a separate process on this machine.

The same roles run on EKS (charts8s/): a Redis experience buffer, W rollout workers each with
its own engine (SGLang in the cluster, the built-in `moerl engine` here, or SGLang where it is
installed and there is a GPU), and a trainer gang started by torchrun (EP over gloo on the CPU,
one rank per GPU over NCCL where there are GPUs; NCCL/DeepEP in the cluster). Where each role
runs on this machine's cores and GPUs is app/local/machine.py's `LocalLayout`. Only the engine
and the object store (file:// instead of s3://) differ.

`EmbeddedLoop` owns those processes; `moerl run` (app/local/run.py) and `moerl chaos` (app/local/chaos.py)
drive it. Its Redis, as the cluster's, has a password for the ``default`` user (this process: the
feeder and the audits) and an ACL user per role (app/buffer/acl.py): the trainer and each rollout
worker get their own user and password in their environment, never in run.yaml.
"""

from __future__ import annotations

import signal
import sys
import threading
import time
from pathlib import Path

import httpx

from app.buffer import ExperienceBuffer
from app.buffer.acl import ROLES, server_args
from app.names import PASSWORD_ENV, ROUTER_API_KEY_ENV, ROUTER_CONTROL_KEY_ENV, USER_ENV
from app.buffer.redis_server import LocalRedis, free_port, new_password
from app.config import RunConfig
from app.layout import default_world
from app.local.machine import LocalLayout, sglang_argv
from app.local.procs import Proc, Supervisor, moerl_argv
from app.local.report import read_steps
from app.rollout.probe import healthy
from app.rollout.router import local_router_command

# How long `moerl run` waits for a user's environment server (``env.url``) to answer: it is
# expected up before the run starts, so this only covers a server still binding its port.
USER_ENV_WAIT_S = 15.0
# Each role process uses one thread unless the layout gives the trainer and engines more (their
# share of the cores): the 2-core machine runs engines, workers and trainer ranks at once, and
# oversubscribed OpenMP threads make all of them slower.
ONE_THREAD_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


class RoleFailed(RuntimeError):
    """A role process exited with an error; the message carries the tail of its log."""

    code = 1  # `moerl run`'s exit code for it


class RoleRefused(RoleFailed):
    """A rollout role refused its input (exit 2, one line: app/cli.py) twice in a row with the
    same line: restarting it again would only repeat it (a crash loop, not a failure that passes)."""

    code = 2


class EmbeddedLoop:
    """Start, watch and stop the roles of one run on this machine.

    Args:
        cfg: the run configuration; ``buffer.redis_url`` is replaced by the local server's URL.
        run_dir: where run.yaml, logs/, metrics.jsonl and the store (unless ``store_url`` is
            set elsewhere) live.
        workers: number of rollout workers, each with its own engine process (ignored with
            ``layout``).
        layout: where each role runs (app/local/machine.py `plan_local`: trainer ranks and their
            GPUs, engine devices, threads); None: ``trainer.parallel``'s ranks and ``workers``
            CPU engines, one thread each.
    """

    def __init__(self, cfg: RunConfig, run_dir: Path, workers: int = 2, layout: LocalLayout | None = None):
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        self.cfg = cfg.model_copy(deep=True)
        self.run_dir = Path(run_dir).resolve()
        self.layout = layout
        self.workers = layout.workers if layout else workers
        self.config_path = self.run_dir / "run.yaml"
        self.sup = Supervisor(self.run_dir / "logs")
        self.redis: LocalRedis | None = None
        self.passwords = {role: new_password() for role in ROLES}  # each role's Redis user (app/buffer/acl.py)
        self.engine_ports: dict[int, int] = {}
        self.router_port: int | None = None  # with rollout.router (`start_router`)
        # The router's API key (workers' /generate) and control-plane key (their engines' registration).
        self.router_keys = {ROUTER_API_KEY_ENV: new_password(), ROUTER_CONTROL_KEY_ENV: new_password()}
        self.env_port: int | None = None  # the environment server's (`start_env`)
        # Where the workers reach the environment: a server of the user's (env.url), or the
        # `moerl env` that `start_env` starts. Passed as --env-url, never written into run.yaml,
        # so that run.yaml re-used as --config still says "moerl serves it".
        self.env_url: str | None = self.cfg.env.url
        self._watchdog_stop = threading.Event()
        self._watchdog: threading.Thread | None = None
        self._answered: set[tuple[str, int]] = set()  # (engine name, start count) seen healthy
        self._refused: dict[str, str] = {}  # a rollout role's last line when it last exited 2 (`check_roles`)

    # -- infrastructure -----------------------------------------------------------------------

    def start_redis(self, appendfsync: str = "everysec") -> str:
        """Start redis-server (append-only persistence) in run_dir/redis; returns its URL.

        ``appendfsync="always"`` (the chaos harness) makes every acknowledged write survive a
        SIGKILL of the server; ``everysec`` may lose the last second of writes.
        """
        users = server_args(self.passwords, self.cfg.run_id, self.cfg.buffer.run_prefix)
        self.redis = LocalRedis(self.run_dir / "redis", keep_dir=True, appendfsync=appendfsync,
                                password=new_password(), extra_args=users).start()
        # No password in run.yaml: each role reads its own from its environment (`role_env`).
        self.cfg.buffer.redis_url = f"redis://127.0.0.1:{self.redis.port}/0"
        self.write_config()
        return self.cfg.buffer.redis_url

    def role_env(self, role: str) -> dict[str, str]:
        """The Redis user and password of ``role`` (trainer, rollout, feed), as the environment of
        its process (app/buffer/experience.py `ExperienceBuffer.from_config` reads them)."""
        return {USER_ENV: role, PASSWORD_ENV: self.passwords[role]}

    def write_config(self) -> None:
        """Write the run config that every role process reads (atomic)."""
        self.cfg.save(self.config_path)

    def buffer(self) -> ExperienceBuffer:
        """A client of this run's experience buffer as the ``default`` (administrator) user."""
        return ExperienceBuffer.from_config(self.cfg, password=self.redis.password, username="default")

    # -- roles --------------------------------------------------------------------------------

    def start_engine(self, i: int, model_path: Path, version: int = 0) -> Proc:
        """Start engine `i` serving `model_path` as policy `version` on a free loopback port, on
        its device of the layout (an SGLang server where the layout says so)."""
        port = self.engine_ports.get(i) or free_port()
        self.engine_ports[i] = port
        if self.layout is not None and self.layout.engine == "sglang":
            argv, env = sglang_argv(self.cfg, self.layout, i, str(model_path), port, version)
            return self.sup.start(f"engine-{i}", argv, {**ONE_THREAD_ENV, **env})
        device = self.layout.engine_devices[i] if self.layout else "cpu"
        threads = self.layout.engine_threads if self.layout else 1
        # On a GPU the engine computes in the run's dtype (the published one); on the CPU in fp32.
        dtype = self.cfg.model.dtype if device.startswith("cuda") else "float32"
        argv = moerl_argv(
            "engine", "--model-path", str(model_path), "--port", str(port),
            "--weight-version", str(version), "--threads", str(threads), "--seed", str(self.cfg.task.seed + i),
            "--weight-sync-timeout", str(self.cfg.weight_sync.timeout_s), "--device", device, "--dtype", dtype,
        )
        if self.cfg.rollout.engine.max_running_requests:
            argv += ["--max-running-requests", str(self.cfg.rollout.engine.max_running_requests)]
        if self.cfg.rollout.routing_replay:
            argv.append("--enable-return-routed-experts")
        env = {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
        return self.sup.start(f"engine-{i}", argv, {**ONE_THREAD_ENV, **env})

    def start_env(self) -> Proc:
        """Start the environment server (`moerl env`, the env pool's role) on a free loopback
        port; the workers reach it at `env_url` (one server for every worker, as one Service
        is in the cluster). Wait for it with `wait_env`.

        Raises:
            ValueError: ``env.url`` names a server of the user's: moerl starts none.
        """
        if not self.cfg.env.served_by_moerl():
            raise ValueError(f"env.url is {self.cfg.env.url}: the environment is served there, not by moerl")
        port = self.env_port or free_port()
        self.env_port = port
        self.env_url = f"http://127.0.0.1:{port}"
        self.write_config()
        argv = moerl_argv("env", "--config", str(self.config_path), "--port", str(port))
        return self.sup.start("env-0", argv, ONE_THREAD_ENV)

    def wait_env(self, timeout_s: float = 120.0) -> None:
        """Block until the environment server (moerl's, or the user's at ``env.url``) answers
        /health.

        Raises:
            RoleFailed: moerl's server exited or did not become healthy within `timeout_s`.
            ConnectionError: the user's server at ``env.url`` did not answer within `timeout_s`
                (bad input, not a failed role: exit 2, nothing started).
        """
        proc = self.sup.procs.get("env-0")
        deadline = time.monotonic() + timeout_s
        last = "no answer"
        while time.monotonic() < deadline:
            if proc is not None and not proc.alive():
                raise RoleFailed(f"env-0 exited with {proc.returncode()}:\n{proc.tail()}")
            try:
                r = httpx.get(self.env_url.rstrip("/") + "/health", timeout=5)
                if r.status_code == 200:
                    return
                last = f"/health answered {r.status_code}"
            except httpx.HTTPError as e:
                last = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
            time.sleep(0.3)
        if proc is None:
            raise ConnectionError(f"env.url {self.env_url}: the environment server did not answer /health within "
                                  f"{timeout_s:.0f}s ({last}); start it first, or leave env.url empty for moerl's own")
        raise RoleFailed(f"environment server {self.env_url} not healthy after {timeout_s:.0f}s:\n{proc.tail()}")

    def ensure_env(self) -> None:
        """With ``env.name``: start `moerl env` unless it runs or ``env.url`` names the user's
        server, and wait until the server answers."""
        if not self.cfg.env.name:
            return
        if not self.cfg.env.served_by_moerl():  # the user's: up already; a typo must not wait 2 minutes
            self.wait_env(USER_ENV_WAIT_S)
            return
        if "env-0" not in self.sup.procs:
            self.start_env()
        self.wait_env()

    def engine_url(self, i: int) -> str:
        return f"http://127.0.0.1:{self.engine_ports[i]}"

    def wait_engine(self, i: int, timeout_s: float = 120.0) -> None:
        """Block until engine `i` answers /health_generate.

        Raises:
            RoleFailed: the engine exited or did not become healthy within `timeout_s`.
        """
        proc = self.sup.procs[f"engine-{i}"]
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not proc.alive():
                raise RoleFailed(f"engine-{i} exited with {proc.returncode()}:\n{proc.tail()}")
            try:
                if httpx.get(self.engine_url(i) + "/health_generate", timeout=10).status_code == 200:
                    self._answered.add((proc.name, proc.starts))
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RoleFailed(f"engine-{i} not healthy after {timeout_s:.0f}s:\n{proc.tail()}")

    def start_worker(self, i: int) -> Proc:
        """Start rollout worker `i` against engine `i`."""
        argv = moerl_argv(
            "rollout", "--config", str(self.config_path), "--engine-url", self.engine_url(i),
            "--worker-id", f"worker-{i}", "--pause-marker", str(self.pause_marker(i)),
        )
        if self.cfg.env.name:
            argv += ["--env-url", self.env_url]
        env = {**ONE_THREAD_ENV, **self.role_env("rollout")}
        if self.cfg.rollout.router:  # /generate to any engine; its own engine still gets the control calls
            argv += ["--router-url", self.router_url()]
            env.update(self.router_keys)  # and it registers its engine there
        return self.sup.start(f"worker-{i}", argv, env)

    def router_url(self) -> str:
        return f"http://127.0.0.1:{self.router_port}"

    def start_router(self, timeout_s: float = 60.0) -> Proc:
        """Start SGLang's router (app/rollout/router.py) on a free loopback port, with an API key
        and a control-plane key of its own, and wait until it answers; it starts with no engines:
        each worker registers its own (`start_worker` passes both keys).

        Raises:
            RoleFailed: the router exited, or did not answer within `timeout_s`.
        """
        self.router_port = self.router_port or free_port()
        argv = local_router_command(self.cfg.rollout, self.router_port, free_port(),
                                    api_key=self.router_keys[ROUTER_API_KEY_ENV],
                                    control_key=self.router_keys[ROUTER_CONTROL_KEY_ENV])
        proc = self.sup.start("router", argv, ONE_THREAD_ENV)
        deadline, last = time.monotonic() + timeout_s, "no answer"
        while time.monotonic() < deadline:
            if not proc.alive():
                raise RoleFailed(f"router exited with {proc.returncode()}:\n{proc.tail()}")
            try:
                r = httpx.get(self.router_url() + "/liveness", timeout=5)
                if r.status_code == 200:
                    return proc
                last = f"HTTP {r.status_code}: {r.text[:200]}"
            except httpx.TransportError as e:
                last = type(e).__name__
            time.sleep(0.5)
        raise RoleFailed(f"router not answering after {timeout_s:.0f}s ({last}):\n{proc.tail()}")

    def pause_marker(self, i: int) -> Path:
        """The file worker `i` keeps while it holds engine `i` paused for a weight update."""
        return self.run_dir / f"engine-{i}.paused"

    def start_trainer(self, resume: bool = False) -> Proc:
        """Start the trainer gang: torchrun with the layout's ranks (one per trainer GPU, or
        `default_world(trainer.parallel)` on the CPU, over gloo), its threads and GPUs."""
        nproc = self.layout.trainer_ranks if self.layout else default_world(self.cfg.trainer.parallel)
        argv = [
            sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc-per-node={nproc}", "--max-restarts=0",
            "-m", "app.cli", "train", "--config", str(self.config_path), "--run-dir", str(self.run_dir),
        ]
        if resume:
            argv.append("--resume")
        env = {**ONE_THREAD_ENV, **(self.layout.trainer_env() if self.layout else {}), **self.role_env("trainer")}
        return self.sup.start("trainer", argv, env)

    def start_rollout(self, model_path: Path) -> None:
        """Start every engine (and, with ``env.name``, the environment server), wait until each
        is healthy, then start the workers and the engine watchdog (`watch_engines`)."""
        self.ensure_env()
        for i in range(self.workers):
            self.start_engine(i, model_path)
        for i in range(self.workers):
            self.wait_engine(i)
        if self.cfg.rollout.router:
            self.start_router()
        for i in range(self.workers):
            self.start_worker(i)
        self.watch_engines()

    def watch_engines(self, period_s: float = 15.0, timeout_s: float = 30.0, strikes: int = 3) -> None:
        """Kill hung engines, as a failed liveness probe does in the cluster (charts8s/rollout.py).

        A daemon thread runs the cluster's probe (`app.rollout.probe.healthy`: the worker's pause
        marker, else ``/health_generate``) on each engine every ``period_s`` seconds; an engine
        that has answered once since it (re)started and then fails ``strikes`` probes in a row
        (error, non-200 or no answer within ``timeout_s``) gets SIGKILL. `check_roles`
        restarts it, and its worker brings it to the current policy before taking work again
        (the worker releases the tasks it had in flight). Idempotent; stopped by `close`.
        """
        if self._watchdog is not None:
            return
        self._watchdog_stop.clear()

        def run() -> None:
            misses: dict[tuple[str, int], int] = {}  # failed probes in a row per (engine, start)
            while not self._watchdog_stop.wait(period_s):
                for name, proc in list(self.sup.procs.items()):
                    if not name.startswith("engine-") or not proc.alive():
                        continue
                    key = (name, proc.starts)
                    i = int(name.split("-")[1])
                    ok = healthy(self.engine_url(i), self.pause_marker(i), timeout_s)
                    if ok:
                        self._answered.add(key)
                        misses[key] = 0
                    elif key in self._answered:  # liveness counts only after the first answer
                        misses[key] = misses.get(key, 0) + 1
                        if misses[key] >= strikes:
                            proc.signal(signal.SIGKILL)

        self._watchdog = threading.Thread(target=run, name="engine-watchdog", daemon=True)
        self._watchdog.start()

    def check_roles(self, restart_rollout: bool = True) -> None:
        """Restart a rollout worker or engine that exited (the cluster's Deployment does this),
        unless it refused its input twice in a row with the same line (`RoleRefused`).

        Raises:
            RoleFailed: the trainer exited with a non-zero code.
            RoleRefused: a rollout role exited 2 twice in a row with the same last line.
        """
        trainer = self.sup.procs.get("trainer")
        if trainer is not None and trainer.returncode() not in (None, 0):
            raise RoleFailed(f"trainer exited with {trainer.returncode()}:\n{trainer.tail(40)}")
        if not restart_rollout:
            return
        for name, proc in list(self.sup.procs.items()):
            if name.startswith(("engine-", "worker-", "env-", "router")) and not proc.alive():
                if proc.returncode() == 2:
                    line = next((x for x in reversed(proc.tail(20).splitlines()) if x.strip()), "")
                    if self._refused.get(name) == line:
                        raise RoleRefused(f"{name} exited with 2 twice:\n{line}")
                    self._refused[name] = line
                else:
                    self._refused.pop(name, None)
                proc.start()

    def trainer_done(self) -> bool:
        trainer = self.sup.procs.get("trainer")
        return trainer is not None and trainer.returncode() == 0

    def stop_rollout(self, grace_s: float | None = None, keep_env: bool = False) -> None:
        """Drain the workers (SIGTERM, as on a Spot notice), then stop the engines and, unless
        ``keep_env`` (a user's environment is played against its server for the final held-out
        evaluation), the environment server."""
        grace = self.cfg.rollout.drain_grace_s + 5 if grace_s is None else grace_s
        workers = [p for n, p in self.sup.procs.items() if n.startswith("worker-")]
        for p in workers:
            p.stop(grace)
        for n, p in self.sup.procs.items():
            if n.startswith("engine-") or n == "router" or (n.startswith("env-") and not keep_env):
                p.stop(10)

    def close(self) -> None:
        """Stop the engine watchdog, every process and redis-server."""
        self._watchdog_stop.set()
        if self._watchdog is not None:
            self._watchdog.join(timeout=60)
            self._watchdog = None
        self.sup.stop_all(grace_s=self.cfg.rollout.drain_grace_s + 5)
        if self.redis is not None:
            self.redis.stop()
            self.redis = None

    def __enter__(self) -> "EmbeddedLoop":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- metrics ------------------------------------------------------------------------------

    def metrics(self) -> list[dict]:
        """The trainer's metrics so far (rank 0's metrics.jsonl; a resumed run's newest line per step)."""
        path = self.run_dir / "metrics.jsonl"
        return read_steps(path) if path.exists() else []
