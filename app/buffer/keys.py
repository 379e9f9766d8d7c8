"""The Redis keys of one run (the layout is app/buffer/experience.py's module docstring): the
buffer's, the ACL rules' (app/buffer/acl.py) and the Redis exporter's (charts8s/buffer.py). Only
the standard library is imported: charts8s renders them without redis.
"""

from __future__ import annotations

import re

_ID_PART = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
# The keys of one run, by Redis type.
STREAM_KEYS = ("tasks", "samples", "dead")
SET_KEYS = ("issued", "seen", "dropped")
HASH_KEYS = ("stats", "policy", "health")
KEY_NAMES = STREAM_KEYS + SET_KEYS + HASH_KEYS


def buffer_keys(run_id: str, prefix: str = "moerl") -> dict[str, str]:
    """Redis key of each name in KEY_NAMES for one run: ``{prefix}:{run_id}:{name}``.

    The buffer's own layout, also what charts8s/buffer.py gives the Redis exporter to watch.
    Raises ValueError when run_id or prefix is not ``[A-Za-z0-9][A-Za-z0-9._-]*`` (named).
    """
    for name, value in (("run_id", run_id), ("prefix", prefix)):
        if not isinstance(value, str) or not _ID_PART.match(value):
            raise ValueError(f"{name} must match {_ID_PART.pattern}, got {value!r}")
    return {n: f"{prefix}:{run_id}:{n}" for n in KEY_NAMES}


def blob_key_prefix(run_id: str, prefix: str = "moerl") -> str:
    """Prefix of the run's payload keys, ``{prefix}:{run_id}:blob:`` (checked as `buffer_keys` checks)."""
    buffer_keys(run_id, prefix)
    return f"{prefix}:{run_id}:blob:"
