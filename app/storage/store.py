"""The object store interface (`open_store(url)` in app/storage/__init__.py picks the backend).

Artifacts (policy versions, training state) live in an object store addressed by a URL:
``file:///abs/path`` or ``file://rel/path`` (the embedded default) and ``s3://bucket/prefix``
(the cluster). Keys are '/'-separated paths relative to the store's root. Every write becomes
visible only when complete: file stores write a temporary name and rename it; an S3 object
appears atomically when its PutObject or CompleteMultipartUpload succeeds.
"""

from __future__ import annotations

import abc
import os
from pathlib import Path


def check_key(key: str, what: str = "key") -> str:
    """Return `key` if it is a clean relative '/'-path; else raise ValueError naming it."""
    if not isinstance(key, str) or not key:
        raise ValueError(f"{what} must be a non-empty string, got {key!r}")
    parts = key.split("/")
    if key.startswith("/") or "\\" in key or any(p in ("", ".", "..") for p in parts):
        raise ValueError(f"{what} {key!r} must be a relative '/'-path without empty, '.' or '..' parts")
    return key


def run_area(run_id: str, area: str) -> str:
    """Key prefix of one area of a run, '<run_id>/<area>/' (e.g. 'policy', 'train').

    Raises:
        ValueError: run_id is not a clean key or contains '/'.
    """
    check_key(run_id, "run_id")
    if "/" in run_id:
        raise ValueError(f"run_id {run_id!r} must not contain '/'")
    return f"{run_id}/{area}/"


def check_range(key: str, offset: int, length: int, got: int) -> None:
    """Raise ValueError unless ``got`` == ``length`` bytes were read at ``offset`` of `key`."""
    if got != length:
        raise ValueError(f"{key}: range {offset}+{length} is past the end of the object ({got} bytes read)")


def check_prefix(prefix: str) -> str:
    """A list/delete prefix: '' (everything) or a key, optionally ending with '/'."""
    if prefix:
        check_key(prefix.rstrip("/") or "/", "prefix")
    return prefix


class ObjectStore(abc.ABC):
    """A flat key -> bytes store with atomic writes.

    Missing keys raise FileNotFoundError naming the key's URI; bad keys raise ValueError.
    """

    url: str

    @abc.abstractmethod
    def put_file(self, local_path: str | os.PathLike, key: str) -> None:
        """Upload a local file to `key` (visible only once complete)."""

    @abc.abstractmethod
    def get_file(self, key: str, local_path: str | os.PathLike) -> Path:
        """Download `key` to `local_path` (temporary name, then rename); returns the path."""

    @abc.abstractmethod
    def put_bytes(self, key: str, data: bytes) -> None:
        """Write `data` to `key` atomically."""

    @abc.abstractmethod
    def get_bytes(self, key: str) -> bytes:
        """Read the whole object at `key`."""

    @abc.abstractmethod
    def get_range(self, key: str, offset: int, length: int) -> bytes:
        """Read ``length`` bytes of `key` from byte ``offset`` (an HTTP Range GET on S3).

        Raises:
            FileNotFoundError: no object at `key`.
            ValueError: a negative offset or length, or a range past the object's end.
        """

    @abc.abstractmethod
    def exists(self, key: str) -> bool:
        """True if an object is stored at `key`."""

    @abc.abstractmethod
    def list(self, prefix: str = "") -> list[str]:
        """Sorted keys that start with `prefix` (a string prefix, as S3 ListObjectsV2)."""

    @abc.abstractmethod
    def delete_prefix(self, prefix: str) -> int:
        """Delete every key starting with the non-empty `prefix`; returns how many."""

    def uri(self, key: str = "") -> str:
        """The URL of `key` (or of the root when empty)."""
        return f"{self.url.rstrip('/')}/{key}" if key else self.url
