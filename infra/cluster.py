"""Cluster stack: EKS (aws_eks_v2), one managed node group per pool, add-ons, device plugins,
the LeaderWorkerSet controller, the monitoring stack, and the Pod Identity roles of the trainer
and the rollout workers.

Node groups are built from `cfg.pools` only (no Auto Mode, no default capacity). Every group
runs in the private subnet of `cfg.az`. GPU groups use the AL2023 NVIDIA AMI; EFA groups get an
L1 launch template with one EFA interface per network card (infra/instances.py), card 0 /
device 0 an EFA-with-ENA interface (the node's IP interface; EFA-only is not allowed as primary)
and the other cards device 1, EFA-only, following "Maximize network bandwidth on Amazon EC2
instances with multiple network cards" (EC2 user guide). A pool with hugepages_2mi reserves
them through MIME user data in its launch template; a pool with local_storage RAID0 gets a
nodeadm NodeConfig part that stripes its NVMe instance store. Add-ons: the VPC CNI (network
policies enforced), CoreDNS, kube-proxy, the Pod Identity agent, the EBS CSI driver (the buffer's
volume, Prometheus' volume) and the EKS node monitoring agent (GPU, NVLink, kernel and network
conditions that node auto repair acts on; without it auto repair sees only NodeReady).

Monitoring is kube-prometheus-stack in the cluster, not Amazon Managed Service for Prometheus
with ADOT: ServiceMonitors are the interface the DCGM exporter chart and charts8s already speak,
it needs no extra AWS service, interface endpoint or IAM role in a private cluster, and it is what
awslabs/ai-on-eks runs. Prometheus keeps 15 days on a gp3 volume; a run's own figures also land in
its S3 prefix (app/metrics.py), so nothing of a run depends on the Prometheus volume.
"""

from __future__ import annotations

import importlib

import yaml
from aws_cdk import Fn, Stack
from aws_cdk import aws_ec2 as ec2
from aws_cdk import aws_eks_v2 as eks
from aws_cdk import aws_iam as iam
from aws_cdk import aws_kms as kms
from constructs import Construct

from infra.addons import DCGM_HOSTENGINE_PORT, EKS_ADDONS, addon_versions  # noqa: F401  (re-exported)
from infra.charts import (DCGM_EXPORTER, EFA_DEVICE_PLUGIN, GRAFANA_DASHBOARD_LABEL, KUBE_PROMETHEUS_STACK,  # noqa: F401
                          LWS, MONITORING_NAMESPACE, NVIDIA_DEVICE_PLUGIN, VOLCANO)
from infra.config import (ACCELERATOR_LABEL, EFA_LABEL, GPU_TAINT_KEY, POOL_TAINT_KEY, DeploymentConfig,
                          NodePool)
from infra.instances import INSTANCE_TABLE
from infra.network import NetworkStack
from infra.storage import StorageStack

# Every GPU pool's taints, tolerated by node-level GPU DaemonSets (taints are declared in infra/config.py).
GPU_DAEMONSET_TOLERATIONS = [
    {"key": GPU_TAINT_KEY, "operator": "Exists", "effect": "NoSchedule"},
    {"key": POOL_TAINT_KEY, "operator": "Exists", "effect": "NoSchedule"},
]

# configurationValues per add-on (each add-on's schema: `aws eks describe-addon-configuration`).
ADDON_CONFIG: dict[str, dict] = {
    # The VPC CNI's network policy agent enforces the NetworkPolicies charts8s ships.
    "vpc-cni": {"enableNetworkPolicy": "true"},
    # The node plugin must run on every pool (all but system are tainted) to mount volumes there;
    # the default StorageClass (gp3, encrypted) holds Prometheus' volume.
    "aws-ebs-csi-driver": {"node": {"tolerateAllTaints": True}, "defaultStorageClass": {"enabled": True}},
    # The agent's DCGM server has no tolerations by default (chart values `dcgmAgent.tolerations: []`)
    # and every GPU pool is tainted: without these no GPU health check runs on a GPU node. The
    # add-on accepts dcgmAgent.tolerations (configuration.schema.json of v1.6.7, DCGMAgent).
    "eks-node-monitoring-agent": {"dcgmAgent": {"tolerations": GPU_DAEMONSET_TOLERATIONS}},
}
# Node auto repair of the training pool (AWS::EKS::Nodegroup NodeRepairConfig). A repair reboots or
# replaces one node, and Volcano then restarts the whole gang from its last checkpoint, so: one
# node at a time, and no action for the XIDs that an application fault raises (13: graphics engine
# exception, 31: GPU memory page fault; NVIDIA XID catalog: restart the application) and that the
# job's own restart already clears. Reasons are the agent's "NvidiaXID%dError"
# (eks-node-monitoring-agent pkg/reasons/reasons.go) on its AcceleratedHardwareReady condition.
# Agent v1.6.7 raises XID conditions only for its well-known list (monitors/nvidia/dcgm/
# dcgm_policies.go), which holds neither 13 nor 31; the overrides keep a later agent from rebooting
# a gang over them.
TRAIN_REPAIR_NO_ACTION_XIDS = (13, 31)
TRAIN_REPAIR_WAIT_MINS = 10
TRAIN_MAX_PARALLEL_REPAIRS = 1
# The areas of a run (app.storage.store.run_area) the trainer writes; nothing else under run_prefix.
TRAINER_WRITE_AREAS = ("policy", "train", "trainer", "metrics", "tensorboard")
# nodeadm (AL2023) configuration document of a node's launch template (awslabs/amazon-eks-ami,
# nodeadm API node.eks.aws/v1alpha1); EKS merges it with the NodeConfig it writes itself.
NODECONFIG_CONTENT_TYPE = "application/node.eks.aws"
# The EBS CSI controller's service account (EKS user guide, "Amazon EBS CSI driver").
EBS_CSI_SERVICE_ACCOUNT = "ebs-csi-controller-sa"
USER_DATA_BOUNDARY = "==MOERL=="
ROOT_DEVICE = "/dev/xvda"  # root volume of the AL2023 EKS AMIs

_EFFECTS = {
    "NoSchedule": eks.TaintEffect.NO_SCHEDULE,
    "PreferNoSchedule": eks.TaintEffect.PREFER_NO_SCHEDULE,
    "NoExecute": eks.TaintEffect.NO_EXECUTE,
}
_CAPACITY = {
    "ON_DEMAND": eks.CapacityType.ON_DEMAND,
    "SPOT": eks.CapacityType.SPOT,
    "CAPACITY_BLOCK": eks.CapacityType.CAPACITY_BLOCK,
}


def ami_type(pool: NodePool) -> str:
    """EKS AMI type for the pool (CloudFormation spelling): AL2023 NVIDIA on GPU pools, standard otherwise."""
    arch = "ARM_64" if pool.specs[0].arch == "arm64" else "x86_64"
    return f"AL2023_{arch}_{'NVIDIA' if pool.gpu else 'STANDARD'}"


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


def node_config(pool: NodePool) -> dict:
    """The nodeadm NodeConfig document of `pool` ({} when it sets nothing).

    instance.localStorage.strategy RAID0: nodeadm's setup-local-disks builds one RAID0 XFS volume
    from the NVMe instance-store disks, mounts it under /mnt/k8s-disks/0 and bind-mounts
    /var/lib/kubelet (emptyDir volumes), /var/lib/containerd (images) and /var/log/pods onto it.
    """
    if pool.local_storage == "none":
        return {}
    return {"apiVersion": "node.eks.aws/v1alpha1", "kind": "NodeConfig",
            "spec": {"instance": {"localStorage": {"strategy": pool.local_storage}}}}


def _hugepages_script(mib: int) -> str:
    pages = mib // 2
    return "\n".join([
        "#!/bin/bash",
        "set -euo pipefail",
        f"echo 'vm.nr_hugepages = {pages}' > /etc/sysctl.d/90-moerl-hugepages.conf",
        f"sysctl -w vm.nr_hugepages={pages}",
        # Fragmented memory can leave the kernel short; say so in the console log, fail the part.
        f'got=$(cat /proc/sys/vm/nr_hugepages); [ "$got" -ge {pages} ] || '
        f'{{ echo "moerl: reserved $got of {pages} hugepages" >&2; exit 1; }}',
    ])


def user_data(pool: NodePool) -> str | None:
    """MIME multi-part user data of `pool`'s launch template, or None when it needs none.

    Parts: the nodeadm NodeConfig (see node_config) and, with hugepages_2mi, a shell part that
    reserves the 2 MiB hugepages. EKS merges its own NodeConfig part into a managed node group's
    MIME user data (AL2023, no custom AMI). NodeConfig has no sysctl field, so the shell part sets
    vm.nr_hugepages: cloud-init runs it in cloud-final, and nodeadm-run.service
    (After=cloud-final.service) starts the kubelet afterwards, so the kubelet reports the pages as
    hugepages-2Mi capacity; the sysctl.d file keeps the setting across reboots. Sources: nodeadm
    docs (awslabs.github.io/amazon-eks-ami/nodeadm), Kubernetes "Manage HugePages".
    """
    parts = []
    doc = node_config(pool)
    if doc:
        parts.append((NODECONFIG_CONTENT_TYPE, "---\n" + yaml.safe_dump(doc, sort_keys=False)))
    if pool.hugepages_2mi:
        parts.append(('text/x-shellscript; charset="us-ascii"', _hugepages_script(pool.hugepages_2mi)))
    if not parts:
        return None
    lines = ["MIME-Version: 1.0", f'Content-Type: multipart/mixed; boundary="{USER_DATA_BOUNDARY}"', ""]
    for content_type, body in parts:
        lines += [f"--{USER_DATA_BOUNDARY}", f"Content-Type: {content_type}", "", body.rstrip("\n"), ""]
    return "\n".join([*lines, f"--{USER_DATA_BOUNDARY}--", ""])


def update_config(pool: NodePool) -> eks.CfnNodegroup.UpdateConfigProperty:
    """The node group's update behaviour (AWS::EKS::Nodegroup UpdateConfig).

    Fixed capacity (Capacity Block, ODCR, placement group; NodePool.fixed_capacity): the MINIMAL
    strategy, which terminates old nodes before it launches new ones, where the DEFAULT one first
    launches max(2 x AZs, maxUnavailable) extra nodes that the reservation or the placement group
    cannot hold (EKS user guide, "Understand each phase of node updates"; EKS API
    NodegroupUpdateConfig: "useful ... with hardware accelerators such as GPUs"). Every pool
    replaces `max_unavailable_percent` of its nodes at once when set, else one (EKS's default).
    """
    strategy = "MINIMAL" if pool.fixed_capacity else "DEFAULT"
    if pool.max_unavailable_percent:
        return eks.CfnNodegroup.UpdateConfigProperty(max_unavailable_percentage=pool.max_unavailable_percent,
                                                     update_strategy=strategy)
    return eks.CfnNodegroup.UpdateConfigProperty(max_unavailable=1, update_strategy=strategy)


def node_repair_config(pool: NodePool) -> eks.CfnNodegroup.NodeRepairConfigProperty:
    """Node auto repair on every pool; on train-gpu one repair at a time and no action on the XIDs
    of TRAIN_REPAIR_NO_ACTION_XIDS (AWS::EKS::NodeGroup NodeRepairConfig: an override needs all
    four of its fields)."""
    if pool.name != "train-gpu":
        return eks.CfnNodegroup.NodeRepairConfigProperty(enabled=True)
    return eks.CfnNodegroup.NodeRepairConfigProperty(
        enabled=True, max_parallel_nodes_repaired_count=TRAIN_MAX_PARALLEL_REPAIRS,
        node_repair_config_overrides=[
            eks.CfnNodegroup.NodeRepairConfigOverridesProperty(
                node_monitoring_condition="AcceleratedHardwareReady", node_unhealthy_reason=f"NvidiaXID{x}Error",
                repair_action="NoAction", min_repair_wait_time_mins=TRAIN_REPAIR_WAIT_MINS)
            for x in TRAIN_REPAIR_NO_ACTION_XIDS
        ])


def efa_interfaces(count: int, security_groups: list[str]) -> list[ec2.CfnLaunchTemplate.NetworkInterfaceProperty]:
    """Launch-template interfaces for `count` EFA network cards.

    Card 0 device 0: EFA with ENA (InterfaceType "efa"), the primary interface with the node IP.
    Cards 1..count-1, device 1: "efa-only". No subnet: EKS places the node in the group's
    subnets. Every interface carries `security_groups` (cluster SG and EFA SG).
    """
    return [
        ec2.CfnLaunchTemplate.NetworkInterfaceProperty(
            network_card_index=i,
            device_index=0 if i == 0 else 1,
            interface_type="efa" if i == 0 else "efa-only",
            groups=security_groups,
            delete_on_termination=True,
        )
        for i in range(count)
    ]


class ClusterStack(Stack):
    """EKS cluster of one environment. Attributes: cluster, addons (dict name -> Addon), nodegroups
    (dict pool -> Nodegroup), launch_templates (dict pool -> CfnLaunchTemplate), trainer_role,
    rollout_role, ebs_csi_role."""

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
            # this stack, before its entry. Trusted by this account: an operator's or CI's principal
            # may assume it where its own IAM policy allows sts:AssumeRole on it.
            self.admin_roles[arn] = iam.Role(
                self, "AdminRole", role_name=f"{cfg.name_prefix}-admin",
                assumed_by=iam.AccountPrincipal(cfg.account),
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

        self.node_role = iam.Role(
            self, "NodeRole",
            assumed_by=iam.ServicePrincipal("ec2.amazonaws.com"),
            managed_policies=[
                iam.ManagedPolicy.from_aws_managed_policy_name(n)
                for n in ("AmazonEKSWorkerNodePolicy", "AmazonEKS_CNI_Policy",
                          "AmazonEC2ContainerRegistryPullOnly", "AmazonSSMManagedInstanceCore")
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
            self._nodegroup(pool, network)
        # CoreDNS and the EBS CSI controller need somewhere to run before their add-ons report healthy.
        self.addons["coredns"].node.add_dependency(self.nodegroups["system"])
        self.addons["aws-ebs-csi-driver"].node.add_dependency(self.nodegroups["system"])

        self._device_plugins()
        self._controllers_and_monitoring()
        self._pod_identity(storage)

    def _nodegroup(self, pool: NodePool, network: NetworkStack) -> None:
        cfg = self.cfg
        data: dict = dict(
            block_device_mappings=[
                ec2.CfnLaunchTemplate.BlockDeviceMappingProperty(
                    device_name=ROOT_DEVICE,
                    ebs=ec2.CfnLaunchTemplate.EbsProperty(
                        volume_type="gp3", volume_size=pool.disk_size_gib, encrypted=True,
                        delete_on_termination=True, iops=3000, throughput=250,
                    ),
                )
            ],
            # IMDSv2 only; hop limit 1 keeps pods (not on the host network) off the node role.
            metadata_options=ec2.CfnLaunchTemplate.MetadataOptionsProperty(
                http_endpoint="enabled", http_tokens="required", http_put_response_hop_limit=1,
            ),
        )
        if pool.efa:
            # With interfaces in the template EKS adds no security group itself: name both.
            groups = [self.cluster.cluster_security_group_id, network.efa_sg.security_group_id]
            data["network_interfaces"] = efa_interfaces(pool.efa_interfaces, groups)
        if pool.placement_group_name:
            # An existing cluster placement group (an ODCR made in it serves only launches into it).
            data["placement"] = ec2.CfnLaunchTemplate.PlacementProperty(group_name=pool.placement_group_name)
        elif pool.placement_group:
            pg = ec2.CfnPlacementGroup(self, f"{pool.name}-placement", strategy="cluster")
            data["placement"] = ec2.CfnLaunchTemplate.PlacementProperty(group_name=pg.ref)
        if pool.capacity_reservation_id:
            data["capacity_reservation_specification"] = ec2.CfnLaunchTemplate.CapacityReservationSpecificationProperty(
                capacity_reservation_target=ec2.CfnLaunchTemplate.CapacityReservationTargetProperty(
                    capacity_reservation_id=pool.capacity_reservation_id
                )
            )
        text = user_data(pool)
        if text:
            data["user_data"] = Fn.base64(text)
        if pool.capacity_block:
            # EKS user guide, "Create a managed node group with Capacity Blocks for ML": the launch
            # template holds the market type, the reservation and the instance type; the create
            # request is rejected otherwise (and then the node group names no instance types).
            data["instance_market_options"] = ec2.CfnLaunchTemplate.InstanceMarketOptionsProperty(
                market_type="capacity-block"
            )
            (data["instance_type"],) = pool.instance_types
        lt = ec2.CfnLaunchTemplate(
            self, f"{pool.name}-template",
            launch_template_name=f"{cfg.name_prefix}-{pool.name}",
            launch_template_data=ec2.CfnLaunchTemplate.LaunchTemplateDataProperty(**data),
        )
        ng = eks.Nodegroup(
            self, f"{pool.name}-nodes",
            cluster=self.cluster,
            nodegroup_name=f"{cfg.name_prefix}-{pool.name}",
            node_role=self.node_role,
            # Managed Spot groups created on Kubernetes 1.28+ use the price-capacity-optimized
            # allocation strategy, with Capacity Rebalancing: EKS cordons and drains a node that
            # gets a rebalance recommendation (EKS user guide, managed node group capacity types).
            capacity_type=_CAPACITY[pool.capacity_type],
            # Created at create_size (GPU pools: 0) and scaled afterwards with `python -m infra.scale`.
            min_size=pool.initial_sizes[0],
            max_size=pool.initial_sizes[2],
            desired_size=pool.initial_sizes[1],
            labels=dict(pool.labels),
            taints=[eks.TaintSpec(key=t.key, value=t.value, effect=_EFFECTS[t.effect]) for t in pool.taints],
            subnets=network.node_subnets,
            launch_template_spec=eks.LaunchTemplateSpec(id=lt.ref, version=lt.attr_latest_version_number),
            enable_node_auto_repair=True,
            # Never replace training nodes past a PodDisruptionBudget; other pools may be forced.
            force_update=pool.name != "train-gpu",
        )
        # Instance types and AMI type go on the L1 resource: the L2 cannot parse names such as
        # p6-b200.48xlarge and guesses the architecture from a GPU list that lacks p5en. A type in
        # the launch template (Capacity Blocks) forbids types on the node group (EKS user guide,
        # "Customize managed nodes with launch templates").
        cfn_ng: eks.CfnNodegroup = ng.node.default_child  # type: ignore[assignment]
        cfn_ng.instance_types = None if pool.capacity_block else list(pool.instance_types)
        cfn_ng.ami_type = ami_type(pool)
        cfn_ng.update_config = update_config(pool)
        cfn_ng.node_repair_config = node_repair_config(pool)
        if cfg.node_groups_exist and pool.scaled_after_create:
            # After the first deploy `infra.scale` owns the size: with DesiredSize out of the template,
            # CloudFormation takes no action on it (EKS API, NodegroupScalingConfig.desiredSize), so a
            # later change of min or max never resets a running gang to the size it was created at.
            cfn_ng.add_property_deletion_override("ScalingConfig.DesiredSize")
        ng.node.add_dependency(self.addons["vpc-cni"])
        self.nodegroups[pool.name] = ng
        self.launch_templates[pool.name] = lt

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
        )
        self.lws.node.add_dependency(self.nodegroups["system"])

        everywhere = [{"operator": "Exists"}]  # node-level DaemonSets run on every (tainted) pool
        repo, chart, version = KUBE_PROMETHEUS_STACK
        self.prometheus = eks.HelmChart(
            self, "KubePrometheusStack", cluster=self.cluster, repository=repo, chart=chart, version=version,
            release="kube-prometheus-stack", namespace=MONITORING_NAMESPACE, create_namespace=True, wait=True,
            values={
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
            },
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
        self.ebs_csi_role = iam.Role(
            self, "EbsCsiRole",
            assumed_by=self._pod_principal("kube-system", EBS_CSI_SERVICE_ACCOUNT),
            description="EBS CSI controller: create, attach and delete EBS volumes",
            managed_policies=[iam.ManagedPolicy.from_aws_managed_policy_name("service-role/AmazonEBSCSIDriverPolicy")],
        )
        addon = self.addons["aws-ebs-csi-driver"]
        # The L2 Addon has no Pod Identity prop; the L1 property lets EKS manage the association.
        cfn: eks.CfnAddon = addon.node.default_child  # type: ignore[assignment]
        cfn.pod_identity_associations = [eks.CfnAddon.PodIdentityAssociationProperty(
            service_account=EBS_CSI_SERVICE_ACCOUNT, role_arn=self.ebs_csi_role.role_arn)]
        addon.node.add_dependency(self.addons["eks-pod-identity-agent"])

    def _pod_identity(self, storage: StorageStack) -> None:
        """Pod Identity: the trainer writes only the run areas app/ writes under run_prefix/; both
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
        self.trainer_role = iam.Role(self, "TrainerRole", role_name=cfg.pod_role_name("trainer"),
                                     assumed_by=self._pod_principal(cfg.namespace, cfg.trainer_service_account),
                                     description="moerl trainer: write its run areas, read models and data")
        self.trainer_role.add_to_policy(list_prefixes)
        self.trainer_role.add_to_policy(read_shared)
        self.trainer_role.add_to_policy(iam.PolicyStatement(actions=["s3:GetObject"], resources=[runs]))
        self.trainer_role.add_to_policy(iam.PolicyStatement(
            actions=["s3:PutObject", "s3:DeleteObject", "s3:AbortMultipartUpload", "s3:ListMultipartUploadParts"],
            resources=[f"{bucket_arn}/{cfg.run_prefix}/*/{area}/*" for area in TRAINER_WRITE_AREAS],
        ))
        self.trainer_role.add_to_policy(iam.PolicyStatement(
            actions=["kms:Decrypt", "kms:GenerateDataKey"], resources=[storage.key.key_arn]))

        self.rollout_role = iam.Role(self, "RolloutRole", role_name=cfg.pod_role_name("rollout"),
                                     assumed_by=self._pod_principal(cfg.namespace, cfg.rollout_service_account),
                                     description="moerl rollout workers and feed: read runs, models and data")
        self.rollout_role.add_to_policy(list_prefixes)
        self.rollout_role.add_to_policy(read_shared)
        self.rollout_role.add_to_policy(iam.PolicyStatement(actions=["s3:GetObject"], resources=[runs]))
        self.rollout_role.add_to_policy(iam.PolicyStatement(actions=["kms:Decrypt"], resources=[storage.key.key_arn]))

        for id, sa, role in (("TrainerIdentity", cfg.trainer_service_account, self.trainer_role),
                             ("RolloutIdentity", cfg.rollout_service_account, self.rollout_role)):
            assoc = eks.CfnPodIdentityAssociation(
                self, id, cluster_name=self.cluster.cluster_name, namespace=cfg.namespace,
                service_account=sa, role_arn=role.role_arn,
            )
            assoc.node.add_dependency(self.addons["eks-pod-identity-agent"])
