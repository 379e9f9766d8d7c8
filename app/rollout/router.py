"""The router in front of the rollout engines: SGLang's router (PyPI ``sglang-router``, the Rust
"SGLang Model Gateway"), one command for `moerl run` and the cluster.

Why: a worker pinned to one engine leaves that engine idle whenever its own requests wait on an
environment or a reward, while another engine queues. With ``rollout.router`` on, every worker
sends its ``/generate`` calls to the router, which spreads them over all engines (policy
``rollout.router_policy``; ``cache_aware`` by default: a request goes to the engine whose prefix
cache holds most of its prompt unless the loads differ by more than the balance thresholds, then
to the least loaded; ``sglang_router/router_args.py``). `moerl bench rollout --router-url`
measures what that changes.

What does NOT go through the router: a worker still owns one engine (``--engine-url``) and sends
it, directly, every control call: ``/model_info`` (the version that engine serves), pause,
``/flush_cache``, weight updates (disk or network), continue, ``/health_generate``. Every engine
gets every update from its own worker, and the version is per engine.

Keys and registration, as the sglang-router 0.3.2 binary behaves (measured; tests/test_engine_router.py
runs it): ``--api-key`` guards the router's own data plane (/generate without ``Authorization:
Bearer <key>`` is answered 401), and the router sends no key to the engines, so an engine behind it
serves /generate without SGLang's ``--api-key`` and keeps only its own admin key. Its control plane
(``/workers``, ``/flush_cache``) takes only the ``--control-plane-api-keys`` (role admin; the API
key is refused there). The router starts with no engines: each worker registers its own engine
(`RouterRegistration`: ``POST /workers`` with the control-plane key) once the engine is healthy and
serves the current version, checks every `REGISTER_EVERY_S` seconds that the router still lists it
(a restarted router forgets), and removes it (``DELETE /workers/{id}``) when it drains. A static
``--worker-urls`` list would drop for good an engine not healthy within the router's
``--worker-startup-timeout-secs`` of its own start.

The version contract with the router: a request can land on any engine, so a sample's
``policy_version`` is the ``meta_info.weight_version`` of the answer (SGLang writes the serving
engine's version into every answer, ``managers/tokenizer_manager.py``; the built-in engine does
the same), never the worker's own engine's version. An engine paused for its update also holds
requests other workers routed to it; ``retract`` or ``in_place`` would resume them on the new
weights and mix two versions in one sequence, so with the router the pause mode must be
``abort`` (`app.config.RolloutConfig` refuses anything else), and a worker sends an aborted
request again (the router then picks an engine; the paused one runs it only after its update,
entirely on the new version).
"""

from __future__ import annotations

import logging
import sys

import httpx

from app.config import ROUTER_POLICIES

log = logging.getLogger("moerl.rollout")

# The router's Python package and version, the same as images/versions.toml's SGLANG_ROUTER_VERSION
# (the rollout image; tests/test_engine_router.py checks they agree) and pyproject's `router` extra.
ROUTER_PACKAGE = "sglang-router"
# The control-plane key's id and name in the router's ``--control-plane-api-keys`` ("id:name:role:key").
CONTROL_KEY_ID = "moerl-workers"
REGISTER_EVERY_S = 15.0  # how often a worker checks that the router still lists its engine


def router_command(worker_urls: list[str] | None = None, *, port: int, host: str = "127.0.0.1",
                   policy: str = "cache_aware", prometheus_port: int = 29000, api_key: str | None = None,
                   control_key: str | None = None, python: str = "python3", request_timeout_s: float = 1800.0,
                   log_level: str = "warn", balance_abs_threshold: int | None = None,
                   discovery: tuple[dict[str, str], int, str] | None = None) -> list[str]:
    """``python -m sglang_router.launch_router`` in front of the engines.

    Args:
        worker_urls: engines' base URLs known at start (``--worker-urls``); None: the workers
            register their engines (`RouterRegistration`), or ``discovery``.
        port, host: where the router serves (SGLang's native API: /generate, /health, ...).
        policy: one of `ROUTER_POLICIES` (the router's ``--policy``).
        prometheus_port: the router's metrics port (it always serves one; pick a free one here).
        api_key: the key the router asks of its callers on /generate (``--api-key``; it sends none to
            the engines); a ``$(VAR)`` for the kubelet to expand, or None.
        control_key: the only key its control plane (/workers, /flush_cache) takes
            (``--control-plane-api-keys``, role admin, id `CONTROL_KEY_ID`); None: the API key
            opens it too.
        request_timeout_s: the router's per-request timeout (a group of long sequences takes minutes).
        balance_abs_threshold: cache_aware routes by prefix match until the engines' loads (requests
            in flight through the router) differ by more than this and by the relative threshold
            (1.5x); the router's default, 64, is more than a rollout fleet keeps in flight, so
            callers pass one worker's in-flight groups (`rollout_router_command`).
        discovery: (label selector, engine port, namespace): the router watches the namespace's pods
            with those labels (``--service-discovery``; needs pods get/list/watch) instead of URLs.

    Raises:
        ValueError: both worker_urls and discovery, or an unknown policy.
    """
    if worker_urls and discovery is not None:
        raise ValueError("the router takes engine URLs or service discovery, not both")
    if policy not in ROUTER_POLICIES:
        raise ValueError(f"rollout.router_policy must be one of {list(ROUTER_POLICIES)}, got {policy!r}")
    cmd = [python, "-m", "sglang_router.launch_router", "--host", host, "--port", str(port), "--policy", policy,
           "--prometheus-port", str(prometheus_port), "--request-timeout-secs", str(int(request_timeout_s)),
           "--log-level", log_level]
    if worker_urls:
        cmd += ["--worker-urls", *worker_urls]
    elif discovery is not None:
        selector, engine_port, namespace = discovery
        cmd += ["--service-discovery", "--selector", *(f"{k}={v}" for k, v in selector.items()),
                "--service-discovery-port", str(engine_port), "--service-discovery-namespace", namespace]
    if balance_abs_threshold is not None:
        cmd += ["--balance-abs-threshold", str(balance_abs_threshold)]
    if api_key:
        cmd += ["--api-key", api_key]
    if control_key:
        cmd += ["--control-plane-api-keys", f"{CONTROL_KEY_ID}:rollout-workers:admin:{control_key}"]
    return cmd


def rollout_router_command(rollout, worker_urls: list[str] | None = None, **kwargs) -> list[str]:
    """`router_command` as a run's ``rollout`` section (`app.config.RolloutConfig`) sets it: its
    policy, its request timeout, and load balancing once engines differ by more than a quarter of
    one worker's in-flight groups (``rollout.inflight_tasks()``): pinning lets them differ by up to
    a whole worker's (one worker waiting on its environment, the other busy)."""
    return router_command(worker_urls, policy=rollout.router_policy, request_timeout_s=rollout.request_timeout_s,
                          balance_abs_threshold=balance_threshold(rollout), **kwargs)


def balance_threshold(rollout) -> int:
    """The router's ``--balance-abs-threshold`` for a run: a quarter of one worker's in-flight groups."""
    return max(1, rollout.inflight_tasks() // 4)


def local_router_command(rollout, port: int, prometheus_port: int, api_key: str, control_key: str) -> list[str]:
    """`rollout_router_command` for `moerl run`: this interpreter (the ``router`` extra), loopback,
    no engines at start (each worker registers its own)."""
    return rollout_router_command(rollout, port=port, host="127.0.0.1", prometheus_port=prometheus_port,
                                  python=sys.executable, api_key=api_key, control_key=control_key)


class RouterRegistration:
    """One worker's engine in the router's list (module doc): `ensure` registers it unless the
    router lists it already, `remove` takes it out.

    Args:
        router_url: the router's base URL.
        engine_url: the engine's URL as the router reaches it (a pod name on the cluster, not the
            worker's loopback).
        control_key: the router's control-plane key (`CONTROL_KEY_ID`'s).
        timeout_s: per call.
    """

    def __init__(self, router_url: str, engine_url: str, control_key: str, timeout_s: float = 10.0):
        self.router_url = router_url.rstrip("/")
        self.engine_url = engine_url.rstrip("/")
        self.worker_id: str | None = None  # the router's id of the engine, once registered
        self._http = httpx.AsyncClient(base_url=self.router_url, timeout=timeout_s,
                                       headers={"Authorization": f"Bearer {control_key}"})

    async def listed(self) -> str | None:
        """The router's id of the engine if it lists it, else None.

        Raises:
            httpx.HTTPError: no answer, or not 200 (a refused key: 401 or 403).
        """
        r = await self._http.get("/workers")
        r.raise_for_status()
        return next((w["id"] for w in r.json().get("workers", []) if w.get("url", "").rstrip("/") == self.engine_url),
                    None)

    async def ensure(self) -> bool:
        """Register the engine unless listed (the router answers 202 and adds it in the background,
        checking its health first); True when listed or accepted. A failure is logged, not raised:
        the next call tries again."""
        try:
            self.worker_id = await self.listed()
            if self.worker_id is None:
                r = await self._http.post("/workers", json={"url": self.engine_url})
                r.raise_for_status()
                self.worker_id = r.json().get("worker_id")
                # The router adds it in the background once it answers there: listed at the next call.
                log.info("asked the router %s to add engine %s", self.router_url, self.engine_url)
            return True
        except (httpx.HTTPError, ValueError) as e:
            log.warning("could not register engine %s with the router %s: %s", self.engine_url, self.router_url, e)
            return False

    async def remove(self) -> bool:
        """Take the engine out of the router's list (a draining worker); True once the router
        accepted. A failure is logged, not raised (the router's health checks drop a dead engine)."""
        try:
            worker_id = await self.listed()  # not the id it had: the router may have restarted since
            if worker_id is not None:
                (await self._http.delete(f"/workers/{worker_id}")).raise_for_status()
                log.info("removed engine %s from the router %s", self.engine_url, self.router_url)
            self.worker_id = None
            return True
        except (httpx.HTTPError, ValueError) as e:
            log.warning("could not remove engine %s from the router %s: %s", self.engine_url, self.router_url, e)
            return False

    async def aclose(self) -> None:
        await self._http.aclose()
