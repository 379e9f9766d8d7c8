"""The keys of the rollout fleet: the Secret's key names, how a container reads them, and one
engine's keys file.

Keys of an engine on the pod network (multi-node engines, and one-node engines behind the router):
each engine has its own admin key, ``HMAC(master, its leader pod's name)`` (app/rollout/keys.py),
written by an init container ("keys", the only container that sees the Secret's master
``admin-api-key``) into an in-memory volume, as SGLang's ``--config`` YAML: the engine reads it
there (argv holds the path), and so does its worker (``MOERL_ENGINE_KEYS_FILE``), which thus holds
its own engine's key and no other; a multi-node engine's worker pod derives its engine's key the
same way. No API key: the router sends none on to the engines (app/rollout/router.py), and SGLang's
admin key alone still guards every weight-update, pause, flush and abort route. SGLang would hand
the keys out in ``/server_info`` and its startup log; the moerl plugin in the rollout image
(app/rollout/keys.py `sglang_plugin`) redacts both.
"""

from __future__ import annotations

from app.rollout.keys import ADMIN_MASTER_ENV, API_KEY_SOURCE_ENV
from charts8s.placement import container_security
from charts8s.workloads import Plan

# The Secret's keys (docs/cluster.md: kubectl create secret): the router's API key (workers ->
# router), the master of the engines' admin keys, the router's control-plane key (workers register engines).
API_KEY, ADMIN_API_KEY, CONTROL_KEY = "api-key", "admin-api-key", "control-plane-api-key"
# One engine's keys file, on an in-memory volume of its pod (module doc).
KEYS_VOLUME, KEYS_DIR = "keys", "/run/moerl/keys"
KEYS_FILE = f"{KEYS_DIR}/engine.yaml"
KEYS_VOLUME_SPEC = {"name": KEYS_VOLUME, "emptyDir": {"medium": "Memory", "sizeLimit": "1Mi"}}


def secret_env(secret: str, names: dict[str, str]) -> list[dict]:
    """Container variables ``names`` (Secret key -> variable) from Secret ``secret``."""
    return [{"name": var, "valueFrom": {"secretKeyRef": {"name": secret, "key": key}}} for key, var in names.items()]


def keyed_engine(container: dict) -> dict:
    """An engine container serving on the pod network: SGLang reads its keys from the pod's keys
    file (``--config``; `keys_init_container` writes it), so argv names only the file."""
    container["command"] = [*container["command"], "--config", KEYS_FILE]
    container["volumeMounts"] = [*container["volumeMounts"], keys_mount()]
    return container


def keys_mount() -> dict:
    return {"name": KEYS_VOLUME, "mountPath": KEYS_DIR, "readOnly": True}


def keys_init_container(plan: Plan, secret: str, engine: str, env: list[dict], api_key: bool = False) -> dict:
    """The init container "keys": writes engine ``engine``'s keys file (app/rollout/keys.py: its
    own admin key from the Secret's master, and with ``api_key`` the Secret's API key too) into
    the pod's keys volume. The only container that holds the master.

    engine: the engine's name, a ``$(VAR)`` of ``env`` for the kubelet to expand.
    """
    res = {"cpu": "100m", "memory": "128Mi"}
    names = {ADMIN_API_KEY: ADMIN_MASTER_ENV, **({API_KEY: API_KEY_SOURCE_ENV} if api_key else {})}
    return {
        "name": "keys", "image": plan.images["rollout"], "imagePullPolicy": "IfNotPresent",
        "command": ["python3", "-m", "app.rollout.keys", "--engine", engine, "--out", KEYS_FILE],
        "env": [*env, *secret_env(secret, names)],
        "resources": {"requests": res, "limits": res},
        "securityContext": container_security(),
        "volumeMounts": [{"name": KEYS_VOLUME, "mountPath": KEYS_DIR}],
    }
