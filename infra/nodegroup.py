"""One EKS managed node group per pool of infra/config.py: its launch template (root volume, IMDSv2,
EFA interfaces, placement, capacity reservation, nodeadm user data) and the node group itself
(labels, taints, capacity type, sizes, update and repair behaviour), made in the cluster stack.

Every group runs in the private subnet of `cfg.az`. GPU groups use the AL2023 NVIDIA AMI; EFA
groups get an L1 launch template with one EFA interface per network card (infra/instances.py),
card 0 / device 0 an EFA-with-ENA interface (the node's IP interface; EFA-only is not allowed as
primary) and the other cards device 1, EFA-only, following "Maximize network bandwidth on Amazon
EC2 instances with multiple network cards" (EC2 user guide). A pool with hugepages_2mi reserves
them through MIME user data in its launch template; a pool with local_storage RAID0 gets a
nodeadm NodeConfig part that stripes its NVMe instance store.
"""

from __future__ import annotations

import yaml
from aws_cdk import Fn
from aws_cdk import aws_ec2 as ec2
from aws_cdk import aws_eks_v2 as eks
from aws_cdk import aws_iam as iam
from constructs import Construct

from infra.config import DeploymentConfig, NodePool
from infra.network import NetworkStack

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
# nodeadm (AL2023) configuration document of a node's launch template (awslabs/amazon-eks-ami,
# nodeadm API node.eks.aws/v1alpha1); EKS merges it with the NodeConfig it writes itself.
NODECONFIG_CONTENT_TYPE = "application/node.eks.aws"
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

    Fixed capacity (Capacity Block, ODCR, placement group; NodePool.fixed_capacity) and every GPU
    pool: the MINIMAL strategy, which terminates old nodes before it launches new ones, where the
    DEFAULT one first launches max(2 x AZs, maxUnavailable) extra nodes (EKS user guide,
    "Understand each phase of node updates"; EKS API NodegroupUpdateConfig: "useful ... with
    hardware accelerators such as GPUs"). A reservation or placement group cannot hold them, and
    the Spot rollout pool would ask for 8 extra p5 nodes at 25 % of 32, which Spot often cannot
    supply: the update, and the stack update with it, would fail. Every pool replaces
    `max_unavailable_percent` of its nodes at once when set, else one (EKS's default).
    """
    strategy = "MINIMAL" if pool.fixed_capacity or pool.gpu else "DEFAULT"
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


def add_nodegroup(scope: Construct, pool: NodePool, *, cfg: DeploymentConfig, cluster: eks.ICluster,
                  node_role: iam.IRole, network: NetworkStack,
                  after: Construct) -> tuple[eks.Nodegroup, ec2.CfnLaunchTemplate]:
    """The launch template and managed node group of `pool`, made in `scope` (the cluster stack).

    Logical ids stay those of constructs made directly in the stack (`<pool>-template`,
    `<pool>-nodes`, `<pool>-placement`): a new construct level would rename them, and
    CloudFormation would then replace every named node group (a replacement of a resource with
    a fixed name fails). `after`: what every node group waits for (the VPC CNI add-on: nodes
    without it never become Ready). Returns (node group, launch template).
    """
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
        groups = [cluster.cluster_security_group_id, network.efa_sg.security_group_id]
        data["network_interfaces"] = efa_interfaces(pool.efa_interfaces, groups)
    if pool.placement_group_name:
        # An existing cluster placement group (an ODCR made in it serves only launches into it).
        data["placement"] = ec2.CfnLaunchTemplate.PlacementProperty(group_name=pool.placement_group_name)
    elif pool.placement_group:
        pg = ec2.CfnPlacementGroup(scope, f"{pool.name}-placement", strategy="cluster")
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
        scope, f"{pool.name}-template",
        launch_template_name=f"{cfg.name_prefix}-{pool.name}",
        launch_template_data=ec2.CfnLaunchTemplate.LaunchTemplateDataProperty(**data),
    )
    ng = eks.Nodegroup(
        scope, f"{pool.name}-nodes",
        cluster=cluster,
        nodegroup_name=f"{cfg.name_prefix}-{pool.name}",
        node_role=node_role,
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
    ng.node.add_dependency(after)
    return ng, lt
