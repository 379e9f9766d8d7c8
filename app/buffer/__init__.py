"""Experience buffer and task queue on Redis Streams (see experience.py), and its records.

The names below load on first use (PEP 562 module ``__getattr__``), so that importing the
package's redis-free parts, the key layout (keys.py) and the ACL rules (acl.py) as charts8s
does, does not import redis.
"""

import importlib

_HOMES = {
    "BufferConnectionError": "app.buffer.experience",
    "ExperienceBuffer": "app.buffer.experience",
    "Group": "app.buffer.records",
    "LocalRedis": "app.buffer.redis_server",
    "Sample": "app.buffer.records",
    "Task": "app.buffer.records",
    "sample_id": "app.buffer.records",
}
__all__ = sorted(_HOMES)


def __getattr__(name: str):
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_HOMES[name]), name)
