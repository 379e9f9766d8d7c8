"""The EKS managed add-ons infra/ creates, each pinned to a version EKS publishes for the
cluster's Kubernetes version.

An add-on created without `addonVersion` gets whatever EKS calls that add-on's default on the day
of the deploy, so two deploys of one commit can run different software. A pin makes an upgrade a
reviewed change, like the Helm chart pins in infra/charts.py. tests/test_infra_addons.py checks
every pin against the observations recorded in tests/data/eks-addon-versions.yaml (source and
date per entry). Refresh, per Kubernetes version and add-on (needs an AWS account):

    aws eks describe-addon-versions --kubernetes-version 1.36 --addon-name vpc-cni \
      --query 'addons[0].addonVersions[].[addonVersion, compatibilities[0].defaultVersion]'

kube-proxy is built per Kubernetes minor (v1.36.x for 1.36); the others publish one build line
for several minors, but each build still lists the minors it supports.
"""

from __future__ import annotations

EKS_ADDONS = ("vpc-cni", "coredns", "kube-proxy", "eks-pod-identity-agent", "aws-ebs-csi-driver",
              "eks-node-monitoring-agent")

# Kubernetes minor -> add-on -> addonVersion. A minor the config accepts but this table lacks fails
# the synth (addon_versions) instead of deploying unpinned add-ons.
ADDON_VERSIONS: dict[str, dict[str, str]] = {
    "1.36": {
        "vpc-cni": "v1.22.4-eksbuild.3",
        "coredns": "v1.14.3-eksbuild.23",
        "kube-proxy": "v1.36.0-eksbuild.25",
        "eks-pod-identity-agent": "v1.3.10-eksbuild.3",
        "aws-ebs-csi-driver": "v1.66.0-eksbuild.1",
        "eks-node-monitoring-agent": "v1.6.7-eksbuild.1",
    },
}


# The DCGM version of the host engine that each pinned eks-node-monitoring-agent runs on GPU nodes
# (its dcgm-server DaemonSet; v1.6.7: image eks/observability/dcgm-exporter:4.5.2-4.8.1-ubuntu22.04,
# aws/eks-node-monitoring-agent charts/eks-node-monitoring-agent/values.yaml at v1.6.7). DCGM clients
# (dcgmi of the diagnostics Job, the exporter) are kept at this version.
NODE_AGENT_DCGM = {"v1.6.7-eksbuild.1": "4.5.2"}
# The port of the DCGM host engine (nv-hostengine) the node monitoring agent runs on every GPU node:
# its dcgm-server DaemonSet binds every interface (`-b ALL`) on hostPort 5555
# (aws/eks-node-monitoring-agent v1.6.7, charts/eks-node-monitoring-agent/templates/dcgm-daemonset.yaml).
# The DCGM exporter (`DCGM_REMOTE_HOSTENGINE_INFO`, dcgm-exporter pkg/cmd/app.go) and the diagnostics
# Job (`dcgmi diag --host`, charts8s/healthcheck.py) connect to it instead of starting their own:
# one host engine per node, so profiling counters and health watches are not split between three.
DCGM_HOSTENGINE_PORT = 5555


def addon_versions(k8s_version: str) -> dict[str, str]:
    """The pinned `addonVersion` of every add-on in EKS_ADDONS for Kubernetes `k8s_version` ("1.36").

    Raises ValueError naming k8s_version and this file when the version has no pins, or a pin is
    missing for one of EKS_ADDONS.
    """
    pins = ADDON_VERSIONS.get(k8s_version)
    if pins is None:
        raise ValueError(f"k8s_version {k8s_version}: no EKS add-on versions pinned in infra/addons.py "
                         f"(pinned: {', '.join(sorted(ADDON_VERSIONS))}); record them from "
                         f"`aws eks describe-addon-versions --kubernetes-version {k8s_version}`")
    missing = [name for name in EKS_ADDONS if name not in pins]
    if missing:
        raise ValueError(f"k8s_version {k8s_version}: infra/addons.py pins no version for {', '.join(missing)}")
    return {name: pins[name] for name in EKS_ADDONS}
