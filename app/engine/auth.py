"""SGLang 0.5.23's HTTP keys for the built-in engine (``--api-key``, ``--admin-api-key``, or both
from ``--config``), decided as ``sglang/srt/utils/auth.py`` ``decide_request_auth`` decides
(tests/test_engine_keys.py compares the two on every case):

- ``/health*``, ``/ready*``, ``/metrics*`` and OPTIONS: always open (probes, Prometheus);
- the admin routes (`ADMIN_ROUTES`, SGLang's ``@auth_level(AuthLevel.ADMIN_OPTIONAL)`` among the
  routes this engine serves): the admin key when one is set, else the API key when one is set,
  else open; the API key is refused there once an admin key is set;
- every other route: the API key when one is set, else open (an admin key alone opens nothing
  else).

A refusal answers as SGLang's middleware: 401 ``{"error": "Unauthorized"}``.
"""

from __future__ import annotations

import secrets
from pathlib import Path

import yaml

# The routes this engine serves that SGLang 0.5.23 marks ADMIN_OPTIONAL (srt/entrypoints/http_server.py).
ADMIN_ROUTES = frozenset({
    "/update_weights_from_disk", "/init_weights_update_group", "/destroy_weights_update_group",
    "/begin_weight_update", "/end_weight_update", "/update_weights_from_distributed",
    "/pause_generation", "/continue_generation", "/flush_cache", "/abort_request",
})
OPEN_PREFIXES = ("/health", "/ready", "/metrics")
# The keys in an SGLang --config YAML (either spelling of the flag, as its ConfigArgumentMerger reads them).
CONFIG_KEYS = {"api-key": "api_key", "api_key": "api_key", "admin-api-key": "admin_api_key",
               "admin_api_key": "admin_api_key"}


def _bearer(header: str | None, expected: str) -> bool:
    if not header:
        return False
    scheme, sep, token = header.partition(" ")
    return bool(sep) and scheme.lower() == "bearer" and secrets.compare_digest(token, expected)


def allowed(method: str, path: str, authorization: str | None, api_key: str | None, admin_api_key: str | None) -> bool:
    """Whether SGLang would let this request through (module doc)."""
    if method == "OPTIONS" or path.startswith(OPEN_PREFIXES):
        return True
    if path in ADMIN_ROUTES:
        if admin_api_key:
            return _bearer(authorization, admin_api_key)
        return _bearer(authorization, api_key) if api_key else True
    return _bearer(authorization, api_key) if api_key else True


def read_config_keys(path: str | Path) -> tuple[str | None, str | None]:
    """(api key, admin key) of an SGLang ``--config`` YAML that holds only keys (what
    app/rollout/keys.py writes); None for a key it does not set.

    Raises:
        ValueError: not a mapping, a field other than the two keys, or a key that is not a
            non-empty string (the message names the file and the field).
    """
    data = yaml.safe_load(Path(path).read_text()) or {}
    if not isinstance(data, dict):
        raise ValueError(f"{path}: a --config file is a YAML mapping")
    keys: dict[str, str | None] = {"api_key": None, "admin_api_key": None}
    for field, value in data.items():
        if field not in CONFIG_KEYS:
            raise ValueError(f"{path}: {field!r}: the built-in engine reads only {sorted(set(CONFIG_KEYS))} from --config")
        if not (isinstance(value, str) and value):
            raise ValueError(f"{path}: {field} must be a non-empty string")
        keys[CONFIG_KEYS[field]] = value
    return keys["api_key"], keys["admin_api_key"]
