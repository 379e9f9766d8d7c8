"""Object store for artifacts (file:// and s3://) and the policy-version layout on it."""

from app.storage.policy import (download_policy, latest_policy_version, policy_versions,
                                prune_policies, publish_policy)
from app.storage.store import ObjectStore, open_store

__all__ = ["ObjectStore", "download_policy", "latest_policy_version", "open_store",
           "policy_versions", "prune_policies", "publish_policy"]
