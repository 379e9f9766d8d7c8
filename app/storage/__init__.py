"""Object store for artifacts (file:// and s3://) and the policy-version layout on it."""

from app.storage.done import mark_done, read_done
from app.storage.policy import (download_policy, latest_policy_version, policy_versions,
                                prune_policies, publish_policy)
from app.storage.store import ObjectStore, open_store

__all__ = ["ObjectStore", "download_policy", "latest_policy_version", "mark_done", "open_store", "read_done",
           "policy_versions", "prune_policies", "publish_policy"]
