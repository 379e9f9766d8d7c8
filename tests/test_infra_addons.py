"""The EKS managed add-ons are pinned to versions EKS publishes for the cluster's Kubernetes
version (issue 15 item 10).

Each pin in infra/addons.py must be a version recorded in tests/data/eks-addon-versions.yaml for
that Kubernetes version by a source that saw it as EKS's default, in the EKS user guide's table, or
installed on such a cluster (not merely pinned in someone's configuration). Every environment's
Kubernetes version needs a full set of pins. The synthesized templates carry them:
tests/test_infra_stacks.py::test_every_addon_is_pinned. No synth here.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from infra.addons import ADDON_VERSIONS, EKS_ADDONS, addon_versions
from infra.config import ENVS, load_config

ROOT = Path(__file__).resolve().parents[1]
RECORD = yaml.safe_load((ROOT / "tests" / "data" / "eks-addon-versions.yaml").read_text())
# Kinds of observation that show a build exists for a minor; "pinned" and "published" do not.
EVIDENCE = {"default", "docs-latest", "installed"}
PINS = [(k8s, name, version) for k8s, pins in ADDON_VERSIONS.items() for name, version in pins.items()]


def test_record_is_dated_and_every_entry_has_a_source():
    assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", RECORD["recorded"])
    for k8s, addons in RECORD["kubernetes"].items():
        for name, entries in addons.items():
            for e in entries:
                assert e["source"] and e["kind"] in EVIDENCE | {"pinned", "published"}, (k8s, name, e)
                assert "seen" not in e or re.fullmatch(r"\d{4}-\d{2}-\d{2}", e["seen"]), (k8s, name, e)


@pytest.mark.parametrize("env", ENVS)
def test_every_environment_has_a_pin_for_every_addon(env):
    k8s = load_config(env).k8s_version
    assert set(addon_versions(k8s)) == set(EKS_ADDONS)


@pytest.mark.parametrize("k8s,name,version", PINS, ids=[f"{k}-{n}" for k, n, _ in PINS])
def test_pinned_version_is_recorded_for_its_kubernetes_version(k8s, name, version):
    assert re.fullmatch(r"v\d+\.\d+\.\d+-eksbuild\.\d+", version), f"{name} {version}: not an EKS add-on version"
    entries = RECORD["kubernetes"].get(k8s, {}).get(name, [])
    kinds = {e["kind"] for e in entries if e["version"] == version}
    assert kinds & EVIDENCE, (f"{name} {version} on Kubernetes {k8s}: recorded only as {sorted(kinds) or 'nothing'} "
                              f"(recorded: {sorted({e['version'] for e in entries})})")


@pytest.mark.parametrize("k8s", sorted(ADDON_VERSIONS))
def test_kube_proxy_matches_the_control_plane_minor(k8s):
    """kube-proxy is built per Kubernetes minor and must not run ahead of or far behind the
    control plane (EKS user guide, "Manage kube-proxy"; Kubernetes version skew policy)."""
    assert ADDON_VERSIONS[k8s]["kube-proxy"].startswith(f"v{k8s}.")


def test_unpinned_kubernetes_version_is_refused():
    with pytest.raises(ValueError, match=r"k8s_version 1\.31: no EKS add-on versions pinned in infra/addons\.py"):
        addon_versions("1.31")


def test_refresh_is_documented_and_readme_no_longer_says_unpinned():
    readme = (ROOT / "docs" / "deploy-aws.md").read_text()
    assert "aws eks describe-addon-versions --kubernetes-version" in readme
    assert "tests/data/eks-addon-versions.yaml" in readme and "infra/addons.py" in readme
    assert "they are not pinned" not in readme and "default version for the cluster version" not in readme
