"""Object store for artifacts (file:// and s3://) and the policy-version layout on it.

`open_store` lives here, above the interface (store.py) and both backends (file.py, s3.py), so
that no backend module imports another one back."""

from app.storage.done import mark_done, read_done
from app.storage.file import FileStore
from app.storage.policy import (download_policy, latest_policy_version, policy_versions,
                                prune_policies, publish_policy)
from app.storage.store import ObjectStore

__all__ = ["ObjectStore", "download_policy", "latest_policy_version", "mark_done", "open_store", "read_done",
           "policy_versions", "prune_policies", "publish_policy"]


def open_store(url: str, **kwargs) -> ObjectStore:
    """Open the object store at `url`.

    Args:
        url: ``file:///abs/path``, ``file://rel/path`` (relative to the current directory, made
            absolute now) or ``s3://bucket[/prefix]``.
        kwargs: passed to S3Store (endpoint_url, sse, kms_key_id, multipart_threshold, ...).
    Raises:
        ValueError: an unknown scheme or an empty path/bucket, naming the URL.
    """
    if url.startswith("file://"):
        path = url[len("file://"):]
        if not path:
            raise ValueError(f"store URL {url!r} has no path")
        if kwargs:
            raise ValueError(f"file store {url!r} takes no options, got {sorted(kwargs)}")
        return FileStore(path)
    if url.startswith("s3://"):
        # boto3: only for an s3:// store
        from app.storage.s3 import S3Store

        bucket, _, prefix = url[len("s3://"):].partition("/")
        if not bucket:
            raise ValueError(f"store URL {url!r} has no bucket")
        return S3Store(bucket, prefix.strip("/"), **kwargs)
    raise ValueError(f"store URL {url!r}: scheme must be file:// or s3://")
