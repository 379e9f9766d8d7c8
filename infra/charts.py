"""The Helm charts infra/ installs, each pinned to a version its repository publishes.

(repository, chart, version) per chart; upgrades are a reviewed change, not a side effect of a
deploy. tests/test_infra_charts.py checks every pin against the repository index entries recorded
in tests/data/helm-index/ (see the README there for the date and how to refresh them).
"""

from __future__ import annotations

NVIDIA_DEVICE_PLUGIN = ("https://nvidia.github.io/k8s-device-plugin", "nvidia-device-plugin", "0.20.0")
# Chart v0.5.30 runs device-plugin image v0.5.20; the chart's instance list is replaced by ours anyway.
EFA_DEVICE_PLUGIN = ("https://aws.github.io/eks-charts", "aws-efa-k8s-device-plugin", "v0.5.30")
# Gang scheduler of the trainer job (charts8s/trainer.py renders a Volcano Job).
VOLCANO = ("https://volcano-sh.github.io/helm-charts", "volcano", "1.15.1")
# The Kubernetes versions Volcano's compatibility matrix marks exactly compatible for the pinned
# line (volcano-sh/volcano README "Kubernetes compatibility", row "Volcano v1.15", at commit
# ed72c7c8, 2026-08-20: 1.24 to 1.35; 1.36 only for master, and no release newer than v1.15.1).
VOLCANO_KUBERNETES = ("1.15", tuple(f"1.{m}" for m in range(24, 36)))
# Kubernetes versions the config accepts although the matrix does not list them, each with the
# decision. This is the one place that decides which cluster versions run Volcano; the config
# refuses any other (infra.config.DeploymentConfig) and docs/deploy-aws.md's "Checked only on a real
# account" list names each entry.
VOLCANO_UNLISTED_KUBERNETES = {
    "1.36": "kept rather than held at 1.35: 1.36 is the newest EKS standard-support version, nodeadm's "
            "graceful shutdown and the recorded add-on pins are for 1.36, Volcano's master lists 1.36; "
            "the gang scheduling of the trainer on 1.36 is checked on the first deploy",
}
# LeaderWorkerSet controller (multi-node SGLang engines; charts8s renders the LWS objects).
# kubernetes-sigs/lws pushes its chart as an OCI artifact (hack/push-chart.sh; install docs:
# `helm install lws oci://registry.k8s.io/lws/charts/lws --version=0.10.0`).
LWS = ("oci://registry.k8s.io/lws/charts/lws", "lws", "0.10.0")
# Prometheus operator, Prometheus, Alertmanager, Grafana, node exporter, kube-state-metrics.
KUBE_PROMETHEUS_STACK = ("https://prometheus-community.github.io/helm-charts", "kube-prometheus-stack", "88.5.3")
# GPU metrics (DCGM) for Prometheus, with its own ServiceMonitor.
DCGM_EXPORTER = ("https://nvidia.github.io/dcgm-exporter/helm-charts", "dcgm-exporter", "4.8.2")

# The FSx for Lustre CSI driver's node plugin (infra/config.py FsxConfig; installed only with
# fsx.enabled): chart 1.17.0 runs driver v1.9.0. Static volumes only (charts8s/fsx.py), so the
# chart's controller (dynamic provisioning, which would need an IAM role) is left out.
FSX_CSI_DRIVER = ("https://kubernetes-sigs.github.io/aws-fsx-csi-driver", "aws-fsx-csi-driver", "1.17.0")

HELM_CHARTS = (NVIDIA_DEVICE_PLUGIN, EFA_DEVICE_PLUGIN, VOLCANO, LWS, KUBE_PROMETHEUS_STACK, DCGM_EXPORTER,
               FSX_CSI_DRIVER)
MONITORING_NAMESPACE = "monitoring"
# The health checks' and node-health agents' namespace (charts8s/healthcheck.py, charts8s/nodehealth.py):
# DCGM clients besides the exporter (the DCGM host engine's policy, infra/cluster.py).
HEALTH_NAMESPACE = "moerl-health"
# The label kube-prometheus-stack's Grafana sidecar loads dashboard ConfigMaps by (grafana chart
# values sidecar.dashboards.label / labelValue; set explicitly in infra/cluster.py, used by
# charts8s/dashboards.py).
GRAFANA_DASHBOARD_LABEL = ("grafana_dashboard", "1")

# The images of the charts above that pull from a registry with an ECR pull-through cache rule
# (infra/config.py PULL_THROUGH_CACHE, CREDENTIALED_CACHE), as each chart's values.yaml names them
# at its pinned version (subcharts under their key): (values path, registry value or None when
# repository holds the host, repository). "basic.image_registry" is Volcano's one registry value
# for its images' names. Recorded with its sources in tests/data/chart-images.yaml.
# nvidia-device-plugin and dcgm-exporter pull from nvcr.io (not an upstream ECR caches) and the EFA
# plugin from EKS's ECR account: they are not listed.
CHART_IMAGES: dict[str, tuple[tuple[str, str | None, str], ...]] = {
    "kube-prometheus-stack": (
        ("crds.upgradeJob.image.busybox", "docker.io", "busybox"),
        ("crds.upgradeJob.image.kubectl", "registry.k8s.io", "kubectl"),
        ("alertmanager.alertmanagerSpec.image", "quay.io", "prometheus/alertmanager"),
        ("prometheusOperator.admissionWebhooks.deployment.image", "quay.io", "prometheus-operator/admission-webhook"),
        ("prometheusOperator.admissionWebhooks.patch.image", "ghcr.io", "jkroepke/kube-webhook-certgen"),
        ("prometheusOperator.image", "quay.io", "prometheus-operator/prometheus-operator"),
        ("prometheusOperator.prometheusConfigReloader.image", "quay.io", "prometheus-operator/prometheus-config-reloader"),
        ("prometheusOperator.thanosImage", "quay.io", "thanos/thanos"),
        ("prometheus.prometheusSpec.image", "quay.io", "prometheus/prometheus"),
        ("thanosRuler.thanosRulerSpec.image", "quay.io", "thanos/thanos"),
        ("kube-state-metrics.image", "registry.k8s.io", "kube-state-metrics/kube-state-metrics"),
        ("kube-state-metrics.kubeRBACProxy.image", "quay.io", "brancz/kube-rbac-proxy"),
        ("prometheus-node-exporter.image", "quay.io", "prometheus/node-exporter"),
        ("prometheus-node-exporter.kubeRBACProxy.image", "quay.io", "brancz/kube-rbac-proxy"),
        ("prometheus-node-exporter.permissionInitContainer.image", "quay.io", "prometheus/busybox"),
        ("grafana.image", "docker.io", "grafana/grafana"),
        ("grafana.testFramework.image", "docker.io", "bats/bats"),
        ("grafana.downloadDashboardsImage", "docker.io", "curlimages/curl"),
        ("grafana.initChownData.image", "docker.io", "library/busybox"),
        ("grafana.sidecar.image", "quay.io", "kiwigrid/k8s-sidecar"),
        ("grafana.imageRenderer.image", "docker.io", "grafana/grafana-image-renderer"),
    ),
    "lws": (
        ("image.manager", None, "registry.k8s.io/lws/lws"),
    ),
    "volcano": (
        ("basic.image_registry", "docker.io", "volcanosh/vc-webhook-manager"),
        ("basic.image_registry", "docker.io", "volcanosh/vc-agent"),
        ("basic.image_registry", "docker.io", "volcanosh/vc-agent-scheduler"),
        ("basic.image_registry", "docker.io", "volcanosh/vc-controller-manager"),
        ("basic.image_registry", "docker.io", "volcanosh/vc-scheduler"),
    ),
    "aws-fsx-csi-driver": (
        ("image", None, "public.ecr.aws/fsx-csi-driver/aws-fsx-csi-driver"),
        ("sidecars.livenessProbe.image", None, "public.ecr.aws/csi-components/livenessprobe"),
        ("sidecars.nodeDriverRegistrar.image", None, "public.ecr.aws/csi-components/csi-node-driver-registrar"),
        ("sidecars.provisioner.image", None, "public.ecr.aws/csi-components/csi-provisioner"),
        ("sidecars.resizer.image", None, "public.ecr.aws/csi-components/csi-resizer"),
    ),
}


def cached_image_values(cfg, chart: str) -> dict:
    """Helm values that point `chart`'s images at this account's ECR pull-through cache
    (`cfg.cached_image`, a DeploymentConfig); images of registries without a rule stay as they are.
    Nested by the values path: {"prometheus": {"prometheusSpec": {"image": {"registry": ..., "repository": ...}}}}.
    """
    out: dict = {}
    for path, registry, repository in CHART_IMAGES.get(chart, ()):
        ref = f"{registry}/{repository}" if registry else repository
        cached = cfg.cached_image(f"{ref}:tag").removesuffix(":tag")
        if cached == ref:
            continue
        *parents, leaf = path.split(".")
        node = out
        for key in parents:
            node = node.setdefault(key, {})
        host, _, repo = cached.partition("/")
        if leaf == "image_registry":  # one registry value in front of the chart's image names
            node[leaf] = cached.removesuffix("/" + repository)
        elif registry:
            node[leaf] = {"registry": host, "repository": repo}
        else:
            node[leaf] = {"repository": cached}
    return out
