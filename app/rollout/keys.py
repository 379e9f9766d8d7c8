"""An engine's SGLang keys: one admin key per engine, kept in a file, never in argv or logs.

Why (issue 39): with one admin key for the fleet, a foothold in any worker (it parses environment
replies and runs reward code on model output) holds the weight-update routes of every engine; and
SGLang 0.5.23 hands its keys out: ``/server_info`` returns ``server_args`` with ``api_key`` and
``admin_api_key`` at the normal auth level (``srt/entrypoints/http_server.py`` ``server_info``,
``srt/utils/common.py`` ``build_server_info``), its startup log prints them
(``srt/entrypoints/engine.py`` ``_server_args_for_logging``), and the kubelet puts ``$(VAR)``
expansions in argv.

- Per engine: an engine's admin key is ``HMAC-SHA256(master, engine name)`` (`engine_admin_key`),
  the engine's name being its leader pod's (``moerl-rollout-<i>``: a StatefulSet pod, or a
  LeaderWorkerSet group's leader). Only init containers hold the master (the Secret's
  ``admin-api-key``): ``python3 -m app.rollout.keys --engine NAME --out FILE`` writes the one
  engine's keys into an in-memory volume, which its engine and its worker mount. A worker learns
  its own engine's key and no other.
- From a file: the file is SGLang's own ``--config`` YAML (``admin-api-key``, and ``api-key``
  where the engine asks callers for one), so argv shows only its path; the worker reads the same
  file (``app.engine.auth.read_config_keys``, through ``MOERL_ENGINE_KEYS_FILE``).
- Not handed out: `sglang_plugin`, a general plugin of SGLang's (entry point group
  ``sglang.srt.plugins``, declared in pyproject.toml, loaded by every SGLang process of the
  rollout image) hooks ``build_server_info`` and ``_server_args_for_logging`` so that the keys'
  values appear in neither ``/server_info`` nor the log (`redact`).

Imports nothing heavy: SGLang's processes load this module.
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import os
import sys
from pathlib import Path

import yaml

# The Secret's master of the per-engine admin keys, as the init container's variable.
ADMIN_MASTER_ENV = "MOERL_ENGINE_ADMIN_KEY_MASTER"
# The caller key the engine asks for (bench fleets; not the rollout engines: the router sends none).
API_KEY_SOURCE_ENV = "MOERL_ENGINE_API_KEY_VALUE"
# The keys file's fields: SGLang's flags, as its --config YAML spells them.
API_KEY_FIELD, ADMIN_KEY_FIELD = "api-key", "admin-api-key"
# What SGLang's server_args call them (the fields `redact` looks for).
SECRET_FIELDS = ("api_key", "admin_api_key")
REDACTED = "<redacted>"
# The hooks `sglang_plugin` registers (SGLang 0.5.23 names; tests/test_engine_keys.py checks them).
SERVER_INFO_TARGET = "sglang.srt.utils.common.build_server_info"
LOG_TARGET = "sglang.srt.entrypoints.engine._server_args_for_logging"


def engine_admin_key(master: str, engine: str) -> str:
    """The admin key of engine ``engine`` (its leader pod's name) under ``master``.

    Raises:
        ValueError: an empty master or engine name.
    """
    if not master or not engine:
        raise ValueError("an engine's admin key needs the master key and the engine's name")
    return hmac.new(master.encode(), engine.encode(), hashlib.sha256).hexdigest()


def write_keys(path: str | os.PathLike, admin_key: str, api_key: str | None = None) -> Path:
    """Write an engine's keys as SGLang's --config YAML, readable by the owner only; atomic."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        yaml.safe_dump({ADMIN_KEY_FIELD: admin_key, **({API_KEY_FIELD: api_key} if api_key else {})}, f)
    os.replace(tmp, path)
    return path


def redact(value, secrets: list[str]):
    """``value`` (dicts, lists and strings, nested) with every occurrence of ``secrets`` and every
    `SECRET_FIELDS` entry that holds one replaced by `REDACTED`."""
    if isinstance(value, dict):
        return {k: (REDACTED if k in SECRET_FIELDS and v else redact(v, secrets)) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(redact(v, secrets) for v in value)
    if isinstance(value, str):
        for s in secrets:
            value = value.replace(s, REDACTED)
    return value


def _secrets_of(info: dict) -> list[str]:
    return [v for k in SECRET_FIELDS if isinstance(v := info.get(k), str) and v]


def redact_server_info(result, *args, **kwargs):
    """AFTER hook of SGLang's ``build_server_info`` (what /server_info and the gRPC server info
    return): the keys' fields and their values anywhere else (``launch_command``) redacted."""
    return redact(result, _secrets_of(result)) if isinstance(result, dict) else result


def redact_logged_args(result, server_args=None, *args, **kwargs):
    """AFTER hook of SGLang's ``_server_args_for_logging`` (the ``server_args=`` startup line)."""
    return redact(result, _secrets_of(result)) if isinstance(result, dict) else result


def sglang_plugin() -> None:
    """SGLang general plugin (pyproject.toml entry point): register the redacting hooks."""
    # sglang: only inside an SGLang process
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(SERVER_INFO_TARGET, redact_server_info, HookType.AFTER)
    HookRegistry.register(LOG_TARGET, redact_logged_args, HookType.AFTER)


def main(argv: list[str] | None = None) -> int:
    """``python3 -m app.rollout.keys --engine NAME --out FILE``: an engine's keys file from the
    master in ``$MOERL_ENGINE_ADMIN_KEY_MASTER`` (and the caller key in
    ``$MOERL_ENGINE_API_KEY_VALUE``, when set)."""
    p = argparse.ArgumentParser(prog="python3 -m app.rollout.keys", description=main.__doc__)
    p.add_argument("--engine", required=True, help="the engine's name (its leader pod's)")
    p.add_argument("--out", required=True, help="the keys file to write")
    args = p.parse_args(argv)
    master = os.environ.get(ADMIN_MASTER_ENV, "")
    if not master:
        print(f"keys: ${ADMIN_MASTER_ENV} is empty (the Secret's admin-api-key)", file=sys.stderr)
        return 2
    write_keys(args.out, engine_admin_key(master, args.engine), os.environ.get(API_KEY_SOURCE_ENV) or None)
    print(f"keys: wrote the keys of engine {args.engine} to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
