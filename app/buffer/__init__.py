"""Experience buffer and task queue on Redis Streams (see experience.py), and its records."""

from app.buffer.experience import BufferConnectionError, ExperienceBuffer
from app.buffer.records import Group, Sample, Task, sample_id
from app.buffer.redis_server import LocalRedis

__all__ = ["BufferConnectionError", "ExperienceBuffer", "Group", "LocalRedis", "Sample", "Task",
           "sample_id"]
