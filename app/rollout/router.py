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

import sys

# The router's Python package and version, the same as images/versions.toml's SGLANG_ROUTER_VERSION
# (the rollout image; tests/test_engine_router.py checks they agree) and pyproject's `router` extra.
ROUTER_PACKAGE = "sglang-router"
ROUTER_POLICIES = ("cache_aware", "power_of_two", "round_robin", "random")


def router_command(worker_urls: list[str] | None = None, *, port: int, host: str = "127.0.0.1",
                   policy: str = "cache_aware", prometheus_port: int = 29000, api_key: str | None = None,
                   python: str = "python3", request_timeout_s: float = 1800.0, log_level: str = "warn",
                   balance_abs_threshold: int | None = None,
                   discovery: tuple[dict[str, str], int, str] | None = None) -> list[str]:
    """``python -m sglang_router.launch_router`` in front of the engines.

    Args:
        worker_urls: the engines' base URLs (``--worker-urls``), or None with ``discovery``.
        port, host: where the router serves (SGLang's native API: /generate, /health, ...).
        policy: one of `ROUTER_POLICIES` (the router's ``--policy``).
        prometheus_port: the router's metrics port (it always serves one; pick a free one here).
        api_key: the engines' ``--api-key``, which the router sends to them (``--api-key``: "used for
            the authorization with the worker"); a ``$(VAR)`` for the kubelet to expand, or None.
        request_timeout_s: the router's per-request timeout (a group of long sequences takes minutes).
        balance_abs_threshold: cache_aware routes by prefix match until the engines' loads (requests
            in flight through the router) differ by more than this and by the relative threshold
            (1.5x); the router's default, 64, is more than a rollout fleet keeps in flight, so
            callers pass one worker's in-flight groups (`rollout_router_command`).
        discovery: (label selector, engine port, namespace): the router watches the namespace's pods
            with those labels (``--service-discovery``; needs pods get/list/watch) instead of URLs.

    Raises:
        ValueError: neither or both of worker_urls and discovery, or an unknown policy.
    """
    if bool(worker_urls) == (discovery is not None):
        raise ValueError("the router needs engine URLs or service discovery (one of them)")
    if policy not in ROUTER_POLICIES:
        raise ValueError(f"rollout.router_policy must be one of {list(ROUTER_POLICIES)}, got {policy!r}")
    cmd = [python, "-m", "sglang_router.launch_router", "--host", host, "--port", str(port), "--policy", policy,
           "--prometheus-port", str(prometheus_port), "--request-timeout-secs", str(int(request_timeout_s)),
           "--log-level", log_level]
    if worker_urls:
        cmd += ["--worker-urls", *worker_urls]
    else:
        selector, engine_port, namespace = discovery
        cmd += ["--service-discovery", "--selector", *(f"{k}={v}" for k, v in selector.items()),
                "--service-discovery-port", str(engine_port), "--service-discovery-namespace", namespace]
    if balance_abs_threshold is not None:
        cmd += ["--balance-abs-threshold", str(balance_abs_threshold)]
    if api_key:
        cmd += ["--api-key", api_key]
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


def local_router_command(rollout, worker_urls: list[str], port: int, prometheus_port: int) -> list[str]:
    """`rollout_router_command` for `moerl run`: this interpreter (the ``router`` extra), loopback."""
    return rollout_router_command(rollout, worker_urls, port=port, host="127.0.0.1", prometheus_port=prometheus_port,
                                  python=sys.executable)
