"""Synthesized CDK templates: one synth of the promotion pipeline (dev, staging, prod stages) and
one of a dev variant with other GPU types, shared by every test in this module.

Covers issue 5: single-AZ node groups, EFA interface layout per instance type, security groups
on interfaces, self-referencing EFA rules, bucket settings, labels/taints equal to the config,
Spot on rollout and not on training, add-ons (EBS CSI with Pod Identity, VPC CNI network policies)
and pinned charts, hugepages reserved by train-gpu user data, Pod Identity scope, the pipeline,
cfn-lint (zero errors) and cdk-nag AwsSolutions (zero unacknowledged findings, every
acknowledgement with a reason).
"""

from __future__ import annotations

import contextlib
import email
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

os.environ.setdefault("JSII_SILENCE_WARNING_DEPRECATED_NODE_VERSION", "1")
from aws_cdk import App  # noqa: E402
from aws_cdk.assertions import Match, Template  # noqa: E402

from infra.addons import addon_versions  # noqa: E402
from infra.app import build_app  # noqa: E402
from infra.cluster import (EBS_CSI_SERVICE_ACCOUNT, EFA_DEVICE_PLUGIN, EKS_ADDONS,  # noqa: E402
                           NVIDIA_DEVICE_PLUGIN, VOLCANO)
from infra.config import ENVS, DeploymentConfig, load_config, load_pipeline_config  # noqa: E402
from infra.instances import INSTANCE_TABLE  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
PIPELINE_YAML = "tests/data/pipeline.yaml"  # relative to ROOT, as the pipeline's synth step reads it
VARIANT_YAML = """
admin_role_arns: ["arn:aws:iam::111111111111:role/platform-admin"]
public_endpoint_cidrs: ["203.0.113.0/24"]
pools:
  train-gpu:
    instance_types: [p6-b200.48xlarge]
    capacity_type: CAPACITY_BLOCK
    capacity_reservation_id: cr-0123456789abcdef0
    placement_group: false
  rollout-gpu:
    instance_types: [p5.48xlarge, p5e.48xlarge]
    placement_group: true
    placement_group_name: moerl-reserved-pg
pull_through_secrets:
  registry-1.docker.io: arn:aws:secretsmanager:us-east-2:111111111111:secret:ecr-pullthroughcache/docker-hub-AbCdEf
"""


class Synth:
    """Templates (dict) and Template objects of one synthesized app."""

    def __init__(self, app: App, outdir: Path):
        self.assembly = app.synth()
        self.outdir = outdir

    def template_files(self) -> list[Path]:
        return sorted(self.outdir.rglob("*.template.json"))

    def reports(self) -> list[dict]:
        return [json.loads(p.read_text()) for p in sorted(self.outdir.rglob("validation-report.json"))]


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory):
    out = tmp_path_factory.mktemp("cdk-pipeline")
    with contextlib.chdir(ROOT):
        app = build_app("pipeline", PIPELINE_YAML, app=App(outdir=str(out)))
        synth = Synth(app, out)
        synth.pcfg, configs = load_pipeline_config(PIPELINE_YAML)
    stack = app.node.find_child("Pipeline")
    synth.pipeline_stack = stack
    synth.stages = stack.stages
    synth.cfgs = {c.env: c for c in configs}
    return synth


@pytest.fixture(scope="module")
def variant(tmp_path_factory):
    out = tmp_path_factory.mktemp("cdk-variant")
    f = out / "variant.yaml"
    f.write_text(VARIANT_YAML)
    app = build_app("dev", str(f), app=App(outdir=str(out / "cdk.out")))
    synth = Synth(app, out / "cdk.out")
    synth.cfg = load_config("dev", f)
    synth.stacks = {k: app.node.find_child(k.capitalize()) for k in ("network", "storage", "cluster")}
    return synth


def tpl(pipeline, env: str, kind: str) -> Template:
    return Template.from_stack(pipeline.stages[env].stacks[kind])


def resources(t: Template, type_: str) -> dict[str, dict]:
    return t.find_resources(type_)


def by_name(t: Template, cfg: DeploymentConfig) -> dict[str, dict]:
    """Node group properties keyed by pool name."""
    out = {}
    for r in resources(t, "AWS::EKS::Nodegroup").values():
        p = r["Properties"]
        out[p["NodegroupName"].removeprefix(cfg.name_prefix + "-")] = p
    return out


def launch_template(t: Template, ng: dict) -> dict:
    lt_id = ng["LaunchTemplate"]["Id"]["Ref"]
    return t.to_json()["Resources"][lt_id]["Properties"]["LaunchTemplateData"]


def subnet_azs(network: Template, cluster: Template, subnets: list) -> set[str]:
    """Resolve node-group subnet imports to the AZs of the subnets in the network template."""
    net = network.to_json()
    exports = {o["Export"]["Name"]: o["Value"]["Ref"] for o in net["Outputs"].values()
               if "Export" in o and "Ref" in o["Value"]}
    return {net["Resources"][exports[s["Fn::ImportValue"]]]["Properties"]["AvailabilityZone"] for s in subnets}


# ---------------------------------------------------------------- network


@pytest.mark.parametrize("env", ENVS)
def test_network_control_plane_two_azs_nodes_one_az(pipeline, env):
    cfg = pipeline.cfgs[env]
    net, cl = tpl(pipeline, env, "network"), tpl(pipeline, env, "cluster")
    cluster = next(iter(resources(cl, "AWS::EKS::Cluster").values()))["Properties"]
    cp_azs = subnet_azs(net, cl, cluster["ResourcesVpcConfig"]["SubnetIds"])
    assert cp_azs == set(cfg.control_plane_azs) and len(cp_azs) >= 2
    groups = by_name(cl, cfg)
    assert set(groups) == set(cfg.pools)
    for name, ng in groups.items():
        assert subnet_azs(net, cl, ng["Subnets"]) == {cfg.az}, name


def test_network_s3_endpoint_and_lb_subnet_tags(pipeline):
    net = tpl(pipeline, "prod", "network")
    net.has_resource_properties("AWS::EC2::VPCEndpoint", {
        "VpcEndpointType": "Gateway",
        "ServiceName": Match.object_like({"Fn::Join": Match.array_with([Match.array_with([".s3"])])}),
    })
    subnets = resources(net, "AWS::EC2::Subnet").values()
    tags = [{t["Key"]: t["Value"] for t in s["Properties"]["Tags"]} for s in subnets]
    public = [t for t in tags if t.get("aws-cdk:subnet-type") == "Public"]
    private = [t for t in tags if t.get("aws-cdk:subnet-type") == "Private"]
    assert len(public) == len(private) == 2
    assert all(t.get("kubernetes.io/role/elb") == "1" for t in public)
    assert all(t.get("kubernetes.io/role/internal-elb") == "1" for t in private)


def test_network_efa_security_group_references_itself(pipeline):
    net = tpl(pipeline, "prod", "network")
    sgs = {k: v for k, v in resources(net, "AWS::EC2::SecurityGroup").items() if k.startswith("EfaSecurityGroup")}
    assert len(sgs) == 1
    (sg_id, sg), = sgs.items()
    # No default allow-all egress: a group created without inline egress keeps EC2's allow-all rule,
    # so the inline egress must exist and match nothing; the self rule is a separate resource.
    assert sg["Properties"]["SecurityGroupEgress"] == [{
        "CidrIp": "255.255.255.255/32", "Description": "Disallow all traffic",
        "IpProtocol": "icmp", "FromPort": 252, "ToPort": 86}]
    me = {"Fn::GetAtt": [sg_id, "GroupId"]}
    net.has_resource_properties("AWS::EC2::SecurityGroupIngress",
                                {"IpProtocol": "-1", "GroupId": me, "SourceSecurityGroupId": me})
    net.has_resource_properties("AWS::EC2::SecurityGroupEgress",
                                {"IpProtocol": "-1", "GroupId": me, "DestinationSecurityGroupId": me})


# ---------------------------------------------------------------- cluster and node groups


@pytest.mark.parametrize("env", ENVS)
def test_cluster_version_explicit_node_groups_no_auto_mode(pipeline, env):
    cfg = pipeline.cfgs[env]
    cl = tpl(pipeline, env, "cluster")
    cl.has_resource_properties("AWS::EKS::Cluster", {
        "Version": cfg.k8s_version,
        "ComputeConfig": {"Enabled": False},
        "AccessConfig": {"AuthenticationMode": Match.string_like_regexp("API")},
        "ResourcesVpcConfig": Match.object_like({"EndpointPublicAccess": False}),
    })
    assert tuple(int(x) for x in cfg.k8s_version.split(".")) >= (1, 31)
    cl.resource_count_is("AWS::EKS::Nodegroup", len(cfg.pools))


@pytest.mark.parametrize("env", ENVS)
def test_node_groups_match_config(pipeline, env):
    cfg = pipeline.cfgs[env]
    cl = tpl(pipeline, env, "cluster")
    for name, ng in by_name(cl, cfg).items():
        pool = cfg.pools[name]
        assert ng["Labels"] == pool.labels
        want = [{"Key": t.key, "Value": t.value, "Effect": {"NoSchedule": "NO_SCHEDULE"}[t.effect]} for t in pool.taints]
        assert ng["Taints"] == want
        assert ng["InstanceTypes"] == pool.instance_types
        assert ng["CapacityType"] == pool.capacity_type
        # Created at create_size (issue 15 item 4: GPU pools empty, scaled by infra.scale afterwards);
        # once the groups exist, DesiredSize of those pools is left out (issue 27 item 4).
        lo, want, hi = pool.initial_sizes
        scaling = {"MinSize": lo, "MaxSize": hi, "DesiredSize": want}
        if cfg.node_groups_exist and pool.scaled_after_create:
            del scaling["DesiredSize"]
        assert ng["ScalingConfig"] == scaling
        assert ng["AmiType"] == ("AL2023_x86_64_NVIDIA" if pool.gpu else "AL2023_x86_64_STANDARD")
        assert ng["NodeRepairConfig"]["Enabled"] is True
        assert "DiskSize" not in ng  # the launch template holds the root volume
        lt = launch_template(cl, ng)
        assert lt["MetadataOptions"]["HttpTokens"] == "required"
        (root,) = lt["BlockDeviceMappings"]
        assert root["Ebs"]["VolumeType"] == "gp3" and root["Ebs"]["Encrypted"] is True
        assert root["Ebs"]["VolumeSize"] == pool.disk_size_gib
    groups = by_name(cl, cfg)
    assert groups["rollout-gpu"]["CapacityType"] == "SPOT"
    assert groups["train-gpu"]["CapacityType"] != "SPOT"


def _check_efa_layout(cl: Template, ng: dict, count: int):
    lt = launch_template(cl, ng)
    nics = lt["NetworkInterfaces"]
    assert len(nics) == count
    assert [n["NetworkCardIndex"] for n in nics] == list(range(count))
    assert (nics[0]["DeviceIndex"], nics[0]["InterfaceType"]) == (0, "efa")
    assert all((n["DeviceIndex"], n["InterfaceType"]) == (1, "efa-only") for n in nics[1:])
    for n in nics:
        assert "SubnetId" not in n
        groups = n["Groups"]
        assert len(groups) == 2
        assert {"Fn::GetAtt": [next(iter(resources(cl, "AWS::EKS::Cluster"))), "ClusterSecurityGroupId"]} in groups
        assert any("EfaSecurityGroup" in json.dumps(g) for g in groups)
    return lt


def test_efa_layout_p5en_training_and_rollout(pipeline):
    cfg = pipeline.cfgs["prod"]
    cl = tpl(pipeline, "prod", "cluster")
    groups = by_name(cl, cfg)
    lt = _check_efa_layout(cl, groups["train-gpu"], INSTANCE_TABLE["p5en.48xlarge"].efa_interfaces)
    assert len(lt["NetworkInterfaces"]) == 16
    assert "Ref" in lt["Placement"]["GroupName"]
    cl.has_resource_properties("AWS::EC2::PlacementGroup", {"Strategy": "cluster"})
    _check_efa_layout(cl, groups["rollout-gpu"], cfg.pools["rollout-gpu"].efa_interfaces)
    for name in ("env-cpu", "buffer-mem", "system"):
        assert "NetworkInterfaces" not in launch_template(cl, groups[name])


def test_efa_layout_p6_b200_and_p5_capacity_block(variant):
    cfg = variant.cfg
    cl = Template.from_stack(variant.stacks["cluster"])
    groups = by_name(cl, cfg)
    lt = _check_efa_layout(cl, groups["train-gpu"], 8)  # p6-b200: 8 network cards
    assert lt["InstanceMarketOptions"] == {"MarketType": "capacity-block"}
    assert lt["CapacityReservationSpecification"] == {
        "CapacityReservationTarget": {"CapacityReservationId": "cr-0123456789abcdef0"}}
    # EKS user guide, Capacity Blocks with managed node groups: the launch template carries the
    # instance type, and a type in the launch template forbids InstanceTypes on the node group.
    assert lt["InstanceType"] == "p6-b200.48xlarge"
    assert "InstanceTypes" not in groups["train-gpu"]
    assert groups["train-gpu"]["CapacityType"] == "CAPACITY_BLOCK"
    assert groups["train-gpu"]["ScalingConfig"]["DesiredSize"] == 0
    _check_efa_layout(cl, groups["rollout-gpu"], 32)  # p5 and p5e: 32 network cards


def test_access_entries_and_restricted_public_endpoint(variant, pipeline):
    cl = Template.from_stack(variant.stacks["cluster"])
    entries = [r["Properties"] for r in resources(cl, "AWS::EKS::AccessEntry").values()
               if r["Properties"]["PrincipalArn"] == "arn:aws:iam::111111111111:role/platform-admin"]
    assert len(entries) == 1
    (policy,) = entries[0]["AccessPolicies"]
    assert policy["AccessScope"] == {"Type": "cluster"}
    assert "AmazonEKSClusterAdminPolicy" in json.dumps(policy["PolicyArn"])
    cl.has_resource_properties("AWS::EKS::Cluster", {"ResourcesVpcConfig": Match.object_like(
        {"EndpointPublicAccess": True, "EndpointPrivateAccess": True, "PublicAccessCidrs": ["203.0.113.0/24"]})})


def test_addons_and_pinned_device_plugins(pipeline):
    cl = tpl(pipeline, "prod", "cluster")
    names = {r["Properties"]["AddonName"] for r in resources(cl, "AWS::EKS::Addon").values()}
    assert names == set(EKS_ADDONS)
    charts = {r["Properties"]["Chart"]: r["Properties"] for r in resources(cl, "Custom::AWSCDK-EKS-HelmChart").values()}
    for repo, chart, version in (NVIDIA_DEVICE_PLUGIN, EFA_DEVICE_PLUGIN, VOLCANO):
        assert charts[chart]["Version"] == version and charts[chart]["Repository"] == repo
    nvidia = json.loads(charts["nvidia-device-plugin"]["Values"])
    efa = json.loads(charts["aws-efa-k8s-device-plugin"]["Values"])
    term = nvidia["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    assert term == [{"matchExpressions": [{"key": "moerl.dev/accelerator", "operator": "In", "values": ["nvidia"]}]}]
    assert efa["nodeSelector"] == {"moerl.dev/efa": "true"}
    assert {"p5.48xlarge", "p5e.48xlarge", "p5en.48xlarge", "p6-b200.48xlarge"} <= set(efa["supportedInstanceLabels"]["values"])
    for values in (nvidia, efa):
        keys = {t["key"] for t in values["tolerations"]}
        assert {"nvidia.com/gpu", "moerl.dev/pool"} <= keys


@pytest.mark.parametrize("env", ENVS)
def test_every_addon_is_pinned(pipeline, env):
    """No add-on is left to EKS's default of the day: each carries its pin from infra/addons.py."""
    cl, cfg = tpl(pipeline, env, "cluster"), pipeline.cfgs[env]
    versions = {r["Properties"]["AddonName"]: r["Properties"].get("AddonVersion")
                for r in resources(cl, "AWS::EKS::Addon").values()}
    assert versions == addon_versions(cfg.k8s_version)


def addon(t: Template, name: str) -> tuple[str, dict]:
    """(logical id, resource) of the EKS add-on `name`."""
    (hit,) = [(k, r) for k, r in resources(t, "AWS::EKS::Addon").items() if r["Properties"]["AddonName"] == name]
    return hit


@pytest.mark.parametrize("env", ENVS)
def test_vpc_cni_enforces_network_policies(pipeline, env):
    """charts8s ships NetworkPolicies; the VPC CNI's policy agent must be on to enforce them."""
    _, cni = addon(tpl(pipeline, env, "cluster"), "vpc-cni")
    # issue 28 item 8 adds strict mode (test_vpc_cni_strict_mode_...) to the policy agent being on
    assert json.loads(cni["Properties"]["ConfigurationValues"]) == {
        "enableNetworkPolicy": "true", "env": {"NETWORK_POLICY_ENFORCING_MODE": "strict"}}


def _chart_values_paths(values: dict, config: dict, path: str = "") -> list[str]:
    """The paths of `config` that the chart's values.yaml does not declare."""
    missing = []
    for k, v in config.items():
        if k not in values:
            missing.append(path + k)
        elif isinstance(v, dict):
            missing += _chart_values_paths(values[k] or {}, v, f"{path}{k}.")
    return missing


@pytest.mark.parametrize("env", ENVS)
def test_vpc_cni_strict_mode_and_every_system_namespace_has_a_policy(pipeline, env):
    """Issue 28 item 8: strict mode (a new pod is denied until its policies exist), with values the
    add-on's chart declares (aws-vpc-cni values.yaml at the pinned v1.22.4), and an allow-all policy
    in every namespace of the stack's own pods, applied before any node group exists."""
    import yaml

    from infra.cluster import ADDON_CONFIG, SYSTEM_NAMESPACES
    cl = tpl(pipeline, env, "cluster")
    values = yaml.safe_load((ROOT / "tests/data/aws-vpc-cni-v1.22.4-values.yaml").read_text())
    assert addon_versions(pipeline.cfgs[env].k8s_version)["vpc-cni"].startswith("v1.22.4-")
    config = ADDON_CONFIG["vpc-cni"]
    assert _chart_values_paths(values, config) == []
    assert values["env"]["NETWORK_POLICY_ENFORCING_MODE"] == "standard" and values["nodeAgent"]["enabled"] is True
    assert config["env"]["NETWORK_POLICY_ENFORCING_MODE"] == "strict"
    # the namespaces of every Helm chart the stack installs, and kube-system's add-ons
    charts = {r["Properties"]["Namespace"] for r in resources(cl, "Custom::AWSCDK-EKS-HelmChart").values()}
    assert charts | {"kube-system"} == set(SYSTEM_NAMESPACES)
    (mid, manifest), = [(k, r) for k, r in resources(cl, "Custom::AWSCDK-EKS-KubernetesResource").items()
                        if "SystemNetworkPolicies" in k]
    docs = json.loads(_resolve(manifest["Properties"]["Manifest"], pipeline.cfgs[env]))
    policies = {d["metadata"]["namespace"]: d["spec"] for d in docs if d["kind"] == "NetworkPolicy"
                and d["metadata"]["name"] == "allow-all"}
    assert set(policies) == set(SYSTEM_NAMESPACES)
    # every pod but the DCGM host engine's (issue 39 item 9: its own policy, tests/test_recipe_matrix.py)
    dcgm = {"matchExpressions": [{"key": "k8s-app", "operator": "NotIn", "values": ["dcgm-server"]}]}
    assert all(p == {"podSelector": dcgm if ns == "kube-system" else {}, "policyTypes": ["Ingress", "Egress"],
                     "ingress": [{}], "egress": [{}]} for ns, p in policies.items())
    for ng in resources(cl, "AWS::EKS::Nodegroup").values():
        assert mid in ng["DependsOn"]


@pytest.mark.parametrize("env", ENVS)
def test_vpc_cni_policy_on_aws_node_not_the_node_role(pipeline, env):
    """Issue 28 item 8: AmazonEKS_CNI_Policy through Pod Identity on kube-system/aws-node (EKS user
    guide), not on the node role, where every process on a node could use it."""
    cfg = pipeline.cfgs[env]
    cl = tpl(pipeline, env, "cluster")
    res = cl.to_json()["Resources"]
    cni_id, cni = addon(cl, "vpc-cni")
    (assoc,) = cni["Properties"]["PodIdentityAssociations"]
    assert assoc["ServiceAccount"] == "aws-node"
    role = res[assoc["RoleArn"]["Fn::GetAtt"][0]]["Properties"]
    assert role["AssumeRolePolicyDocument"]["Statement"][0]["Condition"] == {"StringEquals": {
        "aws:SourceAccount": cfg.account, "aws:RequestTag/eks-cluster-name": cfg.name_prefix,
        "aws:RequestTag/kubernetes-namespace": "kube-system", "aws:RequestTag/kubernetes-service-account": "aws-node"}}
    (policy,) = role["ManagedPolicyArns"]
    assert json.dumps(policy).endswith(':iam::aws:policy/AmazonEKS_CNI_Policy"]]}')
    agent_id, _ = addon(cl, "eks-pod-identity-agent")
    assert agent_id in cni["DependsOn"]
    (node_role,) = [r for r in resources(cl, "AWS::IAM::Role").values()
                    if r["Properties"]["AssumeRolePolicyDocument"]["Statement"][0]["Principal"] == {"Service": "ec2.amazonaws.com"}]
    assert "AmazonEKS_CNI_Policy" not in json.dumps(node_role["Properties"]["ManagedPolicyArns"])
    assert "AmazonEKSWorkerNodePolicy" in json.dumps(node_role["Properties"]["ManagedPolicyArns"])


def test_ebs_csi_driver_with_pod_identity(pipeline):
    """The buffer's StorageClass (provisioner ebs.csi.aws.com) needs the EBS CSI add-on and its IAM."""
    cl = tpl(pipeline, "prod", "cluster")
    res = cl.to_json()["Resources"]
    _, ebs = addon(cl, "aws-ebs-csi-driver")
    (assoc,) = ebs["Properties"]["PodIdentityAssociations"]
    assert assoc["ServiceAccount"] == EBS_CSI_SERVICE_ACCOUNT == "ebs-csi-controller-sa"
    role = res[assoc["RoleArn"]["Fn::GetAtt"][0]]["Properties"]
    assert role["AssumeRolePolicyDocument"]["Statement"] == [{
        "Action": ["sts:AssumeRole", "sts:TagSession"], "Effect": "Allow",
        "Principal": {"Service": "pods.eks.amazonaws.com"},
        # issue 15 item 10: this account, this cluster, the controller's service account only
        "Condition": {"StringEquals": {
            "aws:SourceAccount": pipeline.cfgs["prod"].account,
            "aws:RequestTag/eks-cluster-name": "moerl-prod",
            "aws:RequestTag/kubernetes-namespace": "kube-system",
            "aws:RequestTag/kubernetes-service-account": "ebs-csi-controller-sa"}}}]
    (policy,) = role["ManagedPolicyArns"]
    assert json.dumps(policy).endswith(':iam::aws:policy/service-role/AmazonEBSCSIDriverPolicy"]]}')
    # The association needs the Pod Identity agent; the controller needs the system nodes.
    agent_id, _ = addon(cl, "eks-pod-identity-agent")
    system_ng = next(k for k, r in resources(cl, "AWS::EKS::Nodegroup").items()
                     if r["Properties"]["NodegroupName"].endswith("-system"))
    assert {agent_id, system_ng} <= set(ebs["DependsOn"])
    # The node plugin runs on every (tainted) pool that may mount a volume.
    assert json.loads(ebs["Properties"]["ConfigurationValues"])["node"]["tolerateAllTaints"] is True
    # cdk-nag's IAM4 on the AWS managed policy is acknowledged, with its reason, not ignored.
    iam4 = [v for r in pipeline.reports() for p in r["pluginReports"] for v in p["suppressedViolations"]
            if "AmazonEBSCSIDriverPolicy" in v["ruleName"]]
    assert iam4 and all(v["ruleName"].startswith("AwsSolutions-IAM4") and "EBS CSI" in v["reason"] for v in iam4)


def _user_data_parts(lt: dict) -> list:
    """MIME parts of a launch template's user data ([] when it has none)."""
    if "UserData" not in lt:
        return []
    msg = email.message_from_string(lt["UserData"]["Fn::Base64"])
    assert msg.is_multipart() and msg.get_content_type() == "multipart/mixed"
    return msg.get_payload()


@pytest.mark.parametrize("env", ENVS)
def test_train_gpu_nodes_reserve_hugepages(pipeline, env):
    """The pool's hugepages_2mi (the figure the trainer pods request) is set by launch-template user data."""
    cfg = pipeline.cfgs[env]
    cl = tpl(pipeline, env, "cluster")
    for name, ng in by_name(cl, cfg).items():
        mib = cfg.pools[name].hugepages_2mi
        lt = launch_template(cl, ng)
        scripts = [p for p in _user_data_parts(lt) if p.get_content_type() == "text/x-shellscript"]
        if not mib:
            assert scripts == [], name
            continue
        (part,) = scripts
        script = part.get_payload()
        assert script.startswith("#!/bin/bash") and f"sysctl -w vm.nr_hugepages={mib // 2}\n" in script
        assert f"vm.nr_hugepages = {mib // 2}" in script  # persisted under /etc/sysctl.d
    assert cfg.pools["train-gpu"].hugepages_2mi > 0


def test_pod_identity_trainer_rw_rollout_ro(pipeline):
    cfg = pipeline.cfgs["prod"]
    cl = tpl(pipeline, "prod", "cluster")
    assocs = {r["Properties"]["ServiceAccount"]: r["Properties"] for r in resources(cl, "AWS::EKS::PodIdentityAssociation").values()}
    trainer_sas = {sa for _, sa in cfg.trainer_identities.values()}
    assert len(trainer_sas) == len(cfg.trainer_runs) == 2  # tests/data/pipeline.yaml: r1, dsv3-*
    assert set(assocs) == trainer_sas | {cfg.rollout_service_account}
    assert {a["Namespace"] for a in assocs.values()} == {cfg.namespace}
    policies = cl.to_json()["Resources"]

    def actions_on_objects(sa: str) -> set[str]:
        role = assocs[sa]["RoleArn"]["Fn::GetAtt"][0]
        acts = set()
        for r in policies.values():
            if r["Type"] == "AWS::IAM::Policy" and {"Ref": role} in r["Properties"]["Roles"]:
                for st in r["Properties"]["PolicyDocument"]["Statement"]:
                    if f"/{cfg.run_prefix}/" in json.dumps(st["Resource"]):  # runs/* or runs/<run>/<area>/*
                        acts |= set([st["Action"]] if isinstance(st["Action"], str) else st["Action"])
        return acts

    rollout = actions_on_objects(cfg.rollout_service_account)
    for sa in trainer_sas:
        assert {"s3:GetObject", "s3:PutObject"} <= actions_on_objects(sa), sa
    assert rollout == {"s3:GetObject"}
    cl.has_resource_properties("AWS::IAM::Role", {"AssumeRolePolicyDocument": {"Statement": [Match.object_like(
        {"Action": ["sts:AssumeRole", "sts:TagSession"], "Principal": {"Service": "pods.eks.amazonaws.com"}})]}})


# ---------------------------------------------------------------- storage


@pytest.mark.parametrize("env", ["dev", "prod"])
def test_checkpoint_bucket_settings(pipeline, env):
    cfg = pipeline.cfgs[env]
    st = tpl(pipeline, env, "storage")
    buckets = {r["Properties"]["BucketName"]: (k, r) for k, r in resources(st, "AWS::S3::Bucket").items()}
    key, ckpt = buckets[cfg.checkpoint_bucket]
    p = ckpt["Properties"]
    assert p["VersioningConfiguration"] == {"Status": "Enabled"}
    sse = p["BucketEncryption"]["ServerSideEncryptionConfiguration"][0]["ServerSideEncryptionByDefault"]
    assert sse["SSEAlgorithm"] == "aws:kms" and "KMSMasterKeyID" in sse
    assert p["PublicAccessBlockConfiguration"] == {k: True for k in (
        "BlockPublicAcls", "BlockPublicPolicy", "IgnorePublicAcls", "RestrictPublicBuckets")}
    assert p["LoggingConfiguration"]["DestinationBucketName"] == {"Ref": buckets[cfg.logs_bucket][0]}
    (rule,) = p["LifecycleConfiguration"]["Rules"]
    assert rule["NoncurrentVersionExpiration"]["NoncurrentDays"] > 0
    assert rule["AbortIncompleteMultipartUpload"]["DaysAfterInitiation"] > 0
    st.has_resource_properties("AWS::S3::BucketPolicy", {
        "Bucket": {"Ref": key},
        "PolicyDocument": {"Statement": Match.array_with([Match.object_like(
            {"Effect": "Deny", "Condition": {"Bool": {"aws:SecureTransport": "false"}}})])},
    })
    want = "Retain" if env == "prod" else "Delete"
    for name in (cfg.checkpoint_bucket, cfg.artifacts_bucket, cfg.logs_bucket):
        assert buckets[name][1]["DeletionPolicy"] == want
    auto_delete = st.find_resources("Custom::S3AutoDeleteObjects")
    assert (len(auto_delete) == 3) == (env == "dev")


def test_ecr_repositories(pipeline):
    cfg = pipeline.cfgs["prod"]
    st = tpl(pipeline, "prod", "storage")
    repos = {r["Properties"]["RepositoryName"]: r["Properties"] for r in resources(st, "AWS::ECR::Repository").values()}
    assert set(repos) == set(cfg.image_repos.values())
    for p in repos.values():
        assert p["ImageScanningConfiguration"] == {"ScanOnPush": True}
        assert p["ImageTagMutability"] == "IMMUTABLE"
        rules = json.loads(p["LifecyclePolicy"]["LifecyclePolicyText"])["rules"]
        assert {r["selection"]["tagStatus"] for r in rules} == {"untagged", "any"}


# ---------------------------------------------------------------- pipeline


def test_pipeline_promotes_dev_staging_prod_with_approval(pipeline):
    t = Template.from_stack(pipeline.pipeline_stack)
    (p,) = resources(t, "AWS::CodePipeline::Pipeline").values()
    stages = [s["Name"] for s in p["Properties"]["Stages"]]
    assert stages.index("Dev") < stages.index("Staging") < stages.index("Prod")
    prod = next(s for s in p["Properties"]["Stages"] if s["Name"] == "Prod")
    approvals = [a for a in prod["Actions"] if a["ActionTypeId"]["Category"] == "Approval"]
    assert len(approvals) == 1
    first_deploy = min(a["RunOrder"] for a in prod["Actions"] if a["ActionTypeId"]["Category"] == "Deploy")
    assert approvals[0]["RunOrder"] < first_deploy
    dev = next(s for s in p["Properties"]["Stages"] if s["Name"] == "Dev")
    tests = [a for a in dev["Actions"] if a["Name"] == "InfraTests"]
    assert tests and tests[0]["RunOrder"] < min(a["RunOrder"] for a in dev["Actions"] if a["ActionTypeId"]["Category"] == "Deploy")


# ---------------------------------------------------------------- cfn-lint and cdk-nag


def test_synth_needs_no_lookups(pipeline, variant):
    """Offline synth: the cloud assembly asks the CLI for no context (AZs, AMIs, VPCs)."""
    for synth in (pipeline, variant):
        for manifest in synth.outdir.rglob("manifest.json"):
            assert "missing" not in json.loads(manifest.read_text()), manifest


def test_cfn_lint_zero_errors(pipeline, variant):
    files = pipeline.template_files() + variant.template_files()
    assert len(files) == 1 + 3 * 3 + 3
    # The console script: `python -m cfnlint` has no __main__ and printed nothing, which read as no errors.
    proc = subprocess.run([str(Path(sys.executable).parent / "cfn-lint"), "--format", "json", *map(str, files)],
                          capture_output=True, text=True, timeout=600)
    # exit status bits: 2 errors, 4 warnings, 8 informational (cfn-lint README); anything else is a crash
    assert proc.returncode & ~(2 | 4 | 8) == 0, proc.stderr[-2000:]
    findings = json.loads(proc.stdout)
    assert findings, "cfn-lint reported nothing at all (the W3010 fixed-AZ warning is always there)"
    errors = [f for f in findings if f["Level"] == "Error"]
    # CDK Pipelines (aws-cdk-lib) writes each deploy action's Configuration.RoleArn as an Fn::Join,
    # which CloudFormation resolves; cfn-lint's E3703 asks for Fn::Sub there. Nothing of ours.
    cdk_pipelines = [f for f in errors if f["Rule"]["Id"] == "E3703" and f["Filename"].endswith("/Pipeline.template.json")
                     and f["Location"]["Path"][-2:] == ["Configuration", "RoleArn"]]
    assert cdk_pipelines, "the known CDK Pipelines finding moved: review the allowance above"
    errors = [f for f in errors if f not in cdk_pipelines]
    assert errors == [], json.dumps(errors[:5], indent=1)


def test_cdk_nag_zero_unacknowledged_and_reasons(pipeline, variant):
    reports = pipeline.reports() + variant.reports()
    assert reports
    suppressed = 0
    for report in reports:
        for plugin in report["pluginReports"]:
            assert plugin["conclusion"] == "success", plugin["violations"][:3]
            assert plugin["violations"] == [], plugin["pluginName"]
            for v in plugin.get("suppressedViolations", []):
                suppressed += 1
                assert len(v["reason"].split()) >= 6, v["ruleName"]
    assert suppressed > 0
    # The acknowledgements are also written into the templates as cdk_nag metadata.
    meta = 0
    for f in pipeline.template_files():
        for r in json.loads(f.read_text())["Resources"].values():
            for rule in r.get("Metadata", {}).get("cdk_nag", {}).get("rules_to_suppress", []):
                meta += 1
                assert rule["reason"].strip()
    assert meta > 0


def test_cdk_app_entry_synthesizes_one_environment(tmp_path):
    """The command cdk.json gives the npm CLI (`cdk synth -c env=staging`), run as the CLI would."""
    app_cmd = json.loads((ROOT / "cdk.json").read_text())["app"]
    assert app_cmd.endswith("-m infra.app")
    env = dict(os.environ, CDK_OUTDIR=str(tmp_path), CDK_CONTEXT_JSON=json.dumps({"env": "staging"}))
    proc = subprocess.run([sys.executable, "-m", "infra.app"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    names = {a["properties"]["stackName"] for a in manifest["artifacts"].values()
             if a["type"] == "aws:cloudformation:stack"}
    assert names == {"moerl-staging-network", "moerl-staging-storage", "moerl-staging-cluster"}


@pytest.mark.parametrize("version, says", [("1.20", "k8s_version"), ("1.34", "1.34")])
def test_cdk_app_entry_reports_a_bad_config_in_one_line(tmp_path, version, says):
    """Below the floor (a config error) or a version this checkout has no kubectl layer or add-on pins
    for: exit 2 with one line naming it, before anything is written."""
    cfg = tmp_path / "dev.yaml"
    cfg.write_text(f"k8s_version: '{version}'\n")
    env = dict(os.environ, CDK_OUTDIR=str(tmp_path / "out"),
               CDK_CONTEXT_JSON=json.dumps({"env": "dev", "config": str(cfg)}))
    env.pop("MOERL_TRACEBACK", None)
    proc = subprocess.run([sys.executable, "-m", "infra.app"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 2, proc.stderr[-2000:]
    # one line of ours (jsii may print its Node.js support banner before it)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("moerl infra: error:")]
    assert "Traceback" not in proc.stderr and len(errors) == 1 and says in errors[0], proc.stderr[-2000:]
    assert not (tmp_path / "out" / "manifest.json").exists()


# ---------------------------------------------------------------- issue 15


def test_existing_placement_group_is_used_and_capacity_block_has_none(variant):
    """An ODCR made in a cluster placement group serves launches into that group; a Capacity Block
    launches into none (issue 27 item 3: the config refuses the combination)."""
    cl = Template.from_stack(variant.stacks["cluster"])
    groups = by_name(cl, variant.cfg)
    assert launch_template(cl, groups["rollout-gpu"])["Placement"] == {"GroupName": "moerl-reserved-pg"}
    assert "Placement" not in launch_template(cl, groups["train-gpu"])
    cl.resource_count_is("AWS::EC2::PlacementGroup", 0)


@pytest.mark.parametrize("env", ENVS)
def test_gpu_groups_created_empty(pipeline, env):
    cfg = pipeline.cfgs[env]
    for name, ng in by_name(tpl(pipeline, env, "cluster"), cfg).items():
        if cfg.pools[name].gpu:
            # prod's groups exist (tests/data/pipeline.yaml): no DesiredSize, nothing to reset
            assert ng["ScalingConfig"].get("DesiredSize", 0) == 0 == ng["ScalingConfig"]["MinSize"], name


def test_kubectl_layer_matches_the_control_plane(pipeline):
    cl = tpl(pipeline, "prod", "cluster")
    cl.has_resource_properties("AWS::EKS::Cluster", {"Version": "1.36"})
    layers = [r["Properties"].get("Description", "") for r in resources(cl, "AWS::Lambda::LayerVersion").values()]
    assert any(d.startswith("/opt/kubectl/kubectl 1.36.") for d in layers), layers


@pytest.mark.parametrize("env", ENVS)
def test_gpu_nodes_stripe_instance_store_with_nodeadm(pipeline, env):
    """nodeadm NodeConfig localStorage RAID0 on GPU pools: images and emptyDir volumes on NVMe."""
    import yaml

    cfg = pipeline.cfgs[env]
    cl = tpl(pipeline, env, "cluster")
    for name, ng in by_name(cl, cfg).items():
        parts = [p for p in _user_data_parts(launch_template(cl, ng)) if p.get_content_type() == "application/node.eks.aws"]
        if not cfg.pools[name].gpu:
            assert parts == [], name
            continue
        (part,) = parts
        doc = yaml.safe_load(part.get_payload())
        assert doc == {"apiVersion": "node.eks.aws/v1alpha1", "kind": "NodeConfig",
                       "spec": {"instance": {"localStorage": {"strategy": "RAID0"}}}}


def test_rollout_nodes_get_every_efa_card(pipeline):
    cfg = pipeline.cfgs["prod"]
    cl = tpl(pipeline, "prod", "cluster")
    lt = launch_template(cl, by_name(cl, cfg)["rollout-gpu"])
    assert len(lt["NetworkInterfaces"]) == 32 == min(INSTANCE_TABLE[t].efa_interfaces for t in cfg.pools["rollout-gpu"].instance_types)


def test_node_monitoring_agent_backs_auto_repair(pipeline):
    cl = tpl(pipeline, "prod", "cluster")
    names = {r["Properties"]["AddonName"] for r in resources(cl, "AWS::EKS::Addon").values()}
    assert "eks-node-monitoring-agent" in names
    assert all(ng["NodeRepairConfig"]["Enabled"] is True for ng in by_name(cl, pipeline.cfgs["prod"]).values())


@pytest.mark.parametrize("env", ["staging", "prod"])
def test_staging_and_prod_have_an_admin_access_entry(pipeline, env):
    cfg = pipeline.cfgs[env]
    entries = {r["Properties"]["PrincipalArn"] for r in resources(tpl(pipeline, env, "cluster"), "AWS::EKS::AccessEntry").values()
               if isinstance(r["Properties"]["PrincipalArn"], str)}
    assert cfg.admin_role_arns and set(cfg.admin_role_arns) <= entries


def test_interface_endpoints_beside_the_s3_gateway(pipeline):
    net = tpl(pipeline, "prod", "network")
    services = set()
    for r in resources(net, "AWS::EC2::VPCEndpoint").values():
        p = r["Properties"]
        if p.get("VpcEndpointType") == "Interface":
            assert p["PrivateDnsEnabled"] is True
            services.add(json.dumps(p["ServiceName"]).rsplit(".", 1)[-1].strip('"]}'))
    assert services == {"eks-auth", "sts", "ecr.api", "ecr.dkr", "logs"} or \
        {"eks-auth", "sts", "api", "dkr", "logs"} <= services, services


def test_pod_identity_trust_is_scoped_to_account_cluster_and_service_account(pipeline):
    cfg = pipeline.cfgs["prod"]
    cl = tpl(pipeline, "prod", "cluster")
    res = cl.to_json()["Resources"]
    assocs = {r["Properties"]["ServiceAccount"]: r["Properties"] for r in resources(cl, "AWS::EKS::PodIdentityAssociation").values()}
    for sa, assoc in assocs.items():
        (st,) = res[assoc["RoleArn"]["Fn::GetAtt"][0]]["Properties"]["AssumeRolePolicyDocument"]["Statement"]
        assert st["Condition"] == {"StringEquals": {
            "aws:SourceAccount": cfg.account, "aws:RequestTag/eks-cluster-name": "moerl-prod",
            "aws:RequestTag/kubernetes-namespace": cfg.namespace, "aws:RequestTag/kubernetes-service-account": sa}}


def test_helm_charts_are_the_pinned_set_and_monitoring_waits_for_crds(pipeline):
    from infra.charts import HELM_CHARTS
    cl = tpl(pipeline, "prod", "cluster")
    charts = {k: r for k, r in resources(cl, "Custom::AWSCDK-EKS-HelmChart").items()}
    got = {(r["Properties"]["Repository"], r["Properties"]["Chart"], r["Properties"]["Version"]) for r in charts.values()}
    assert got == set(HELM_CHARTS)
    by_chart = {r["Properties"]["Chart"]: (k, r) for k, r in charts.items()}
    kps_id, kps = by_chart["kube-prometheus-stack"]
    assert kps_id in by_chart["dcgm-exporter"][1]["DependsOn"]
    values = json.loads(kps["Properties"]["Values"])["prometheus"]["prometheusSpec"]
    assert values["serviceMonitorSelectorNilUsesHelmValues"] is False and values["podMonitorSelectorNilUsesHelmValues"] is False
    # issue 27 item 14: the PrometheusRule of charts8s/alerts.py has no release label, and Grafana
    # loads the dashboards of charts8s/dashboards.py by the label declared in infra/charts.py
    from infra.charts import GRAFANA_DASHBOARD_LABEL
    assert values["ruleSelectorNilUsesHelmValues"] is False
    sidecar = json.loads(kps["Properties"]["Values"])["grafana"]["sidecar"]["dashboards"]
    assert (sidecar["label"], sidecar["labelValue"]) == GRAFANA_DASHBOARD_LABEL and sidecar["enabled"] is True
    dcgm = json.loads(by_chart["dcgm-exporter"][1]["Properties"]["Values"])
    assert dcgm["nodeSelector"] == {"moerl.dev/accelerator": "nvidia"} and dcgm["serviceMonitor"]["enabled"] is True


def test_pipeline_synth_reads_its_config_file_on_a_sized_machine(pipeline):
    t = Template.from_stack(pipeline.pipeline_stack)
    synth = [r["Properties"] for r in resources(t, "AWS::CodeBuild::Project").values()
             if "cdk synth" in r["Properties"]["Source"]["BuildSpec"]]
    (p,) = synth
    assert f"cdk synth -c env=pipeline -c config={PIPELINE_YAML}" in p["Source"]["BuildSpec"]
    assert p["Environment"]["ComputeType"] == "BUILD_GENERAL1_LARGE"
    assert pipeline.pcfg.account == "444455556666"
    assert pipeline.pipeline_stack.account == "444455556666"
    assert [pipeline.stages[e].stacks["cluster"].account for e in ENVS] == ["111122223333", "222233334444", "333344445555"]


def test_pipeline_refuses_a_missing_or_outside_config(tmp_path):
    from infra.config import ConfigError
    with pytest.raises(ConfigError, match="needs -c config="):
        build_app("pipeline")
    with pytest.raises(ConfigError, match="inside the repository"):
        build_app("pipeline", str(ROOT / PIPELINE_YAML))


# ---------------------------------------------------------------- issue 27 (first deploy) and 28 (IAM, S3 fence)


def _resolve(value, cfg: DeploymentConfig):
    """A template value with Fn::Join / Ref AWS::Partition / AWS::Region / AWS::AccountId made plain."""
    if isinstance(value, dict) and "Fn::Join" in value:
        sep, parts = value["Fn::Join"]
        return sep.join(str(_resolve(p, cfg)) for p in parts)
    if isinstance(value, dict) and "Ref" in value:
        return {"AWS::Partition": "aws", "AWS::Region": cfg.region, "AWS::AccountId": cfg.account}.get(value["Ref"], value)
    if isinstance(value, list):
        return [_resolve(v, cfg) for v in value]
    if isinstance(value, dict):
        return {k: _resolve(v, cfg) for k, v in value.items()}
    return value


def role_policy(t: Template, cfg: DeploymentConfig, role_logical_id: str) -> dict:
    """Every identity statement attached to a role (AWS::IAM::Policy resources), resolved."""
    statements = []
    for r in resources(t, "AWS::IAM::Policy").values():
        if {"Ref": role_logical_id} in r["Properties"]["Roles"]:
            statements += r["Properties"]["PolicyDocument"]["Statement"]
    return {"Version": "2012-10-17", "Statement": _resolve(statements, cfg)}


def test_default_admin_role_is_created_before_its_access_entry(pipeline):
    """Issue 27 item 1: EKS rejects an access entry for a missing principal, after the cluster is up."""
    cfg = pipeline.cfgs["prod"]
    cl = tpl(pipeline, "prod", "cluster")
    assert cfg.admin_role_arns == [cfg.default_admin_role_arn] and cfg.create_admin_role
    (role_id, role), = [(k, r) for k, r in resources(cl, "AWS::IAM::Role").items()
                        if r["Properties"].get("RoleName") == "moerl-prod-admin"]
    (st,) = role["Properties"]["AssumeRolePolicyDocument"]["Statement"]
    assert st["Action"] == "sts:AssumeRole" and _resolve(st["Principal"]["AWS"], cfg) == f"arn:aws:iam::{cfg.account}:root"
    (entry,) = [r for r in resources(cl, "AWS::EKS::AccessEntry").values()
                if r["Properties"]["PrincipalArn"] == cfg.default_admin_role_arn]
    assert role_id in entry["DependsOn"]
    # staging names an existing role of its own (tests/data/pipeline.yaml): nothing is created for it
    st_roles = {r["Properties"].get("RoleName") for r in resources(tpl(pipeline, "staging", "cluster"), "AWS::IAM::Role").values()}
    assert "platform-admin" not in st_roles and "moerl-staging-admin" not in st_roles


@pytest.mark.parametrize("env", ENVS)
def test_desired_size_is_left_to_infra_scale_once_the_groups_exist(pipeline, env):
    """Issue 27 item 4: a template that keeps DesiredSize 0 resets a scaled gang on the next scaling
    change; with node_groups_exist (prod in tests/data/pipeline.yaml) GPU groups carry none."""
    cfg = pipeline.cfgs[env]
    assert cfg.node_groups_exist == (env == "prod")
    for name, ng in by_name(tpl(pipeline, env, "cluster"), cfg).items():
        pool = cfg.pools[name]
        assert ("DesiredSize" in ng["ScalingConfig"]) == (not (cfg.node_groups_exist and pool.gpu)), name
        assert {"MinSize", "MaxSize"} <= set(ng["ScalingConfig"]), name


def test_fixed_capacity_pools_update_without_a_surge_and_spot_rollout_in_rounds(pipeline, variant):
    """Issue 27 items 2 and 11, issue 39 item 3: MINIMAL (old nodes first) where a placement group
    or reservation holds exactly the pool, and on the Spot GPU rollout pool, whose DEFAULT update
    would first launch 8 extra Spot p5 nodes (25 % of 32); 25 % of its nodes at a time, not one."""
    cfg = pipeline.cfgs["prod"]
    groups = by_name(tpl(pipeline, "prod", "cluster"), cfg)
    assert groups["train-gpu"]["UpdateConfig"] == {"MaxUnavailable": 1, "UpdateStrategy": "MINIMAL"}
    assert cfg.pools["rollout-gpu"].capacity_type == "SPOT" and not cfg.pools["rollout-gpu"].fixed_capacity
    assert groups["rollout-gpu"]["UpdateConfig"] == {"MaxUnavailablePercentage": 25, "UpdateStrategy": "MINIMAL"}
    for name in ("env-cpu", "buffer-mem", "system"):
        assert groups[name]["UpdateConfig"]["UpdateStrategy"] == "DEFAULT"
    cb = by_name(Template.from_stack(variant.stacks["cluster"]), variant.cfg)
    assert cb["train-gpu"]["UpdateConfig"]["UpdateStrategy"] == "MINIMAL"  # Capacity Block
    assert cb["rollout-gpu"]["UpdateConfig"]["UpdateStrategy"] == "MINIMAL"  # existing placement group


def test_training_pool_repairs_one_node_and_ignores_application_xids(pipeline):
    """Issue 27 item 7: one repair restarts the whole gang; no reboot for XID 13/31."""
    cfg = pipeline.cfgs["prod"]
    groups = by_name(tpl(pipeline, "prod", "cluster"), cfg)
    rc = groups["train-gpu"]["NodeRepairConfig"]
    assert rc["Enabled"] is True and rc["MaxParallelNodesRepairedCount"] == 1
    assert {(o["NodeMonitoringCondition"], o["NodeUnhealthyReason"], o["RepairAction"]) for o in rc["NodeRepairConfigOverrides"]} == {
        ("AcceleratedHardwareReady", "NvidiaXID13Error", "NoAction"), ("AcceleratedHardwareReady", "NvidiaXID31Error", "NoAction")}
    # AWS::EKS::Nodegroup NodeRepairConfigOverrides: "If you use this, you must specify all the values."
    assert all(set(o) == {"NodeMonitoringCondition", "NodeUnhealthyReason", "RepairAction", "MinRepairWaitTimeMins"}
               for o in rc["NodeRepairConfigOverrides"])
    assert groups["rollout-gpu"]["NodeRepairConfig"] == {"Enabled": True}


def test_node_monitoring_agent_dcgm_runs_on_tainted_gpu_nodes(pipeline):
    """Issue 27 item 6: the agent's DCGM server tolerates every GPU pool's taints, with values the
    add-on's own configuration schema (v1.6.7, tests/data) accepts."""
    import jsonschema
    cfg = pipeline.cfgs["prod"]
    _, agent = addon(tpl(pipeline, "prod", "cluster"), "eks-node-monitoring-agent")
    assert agent["Properties"]["AddonVersion"].startswith("v1.6.7-")
    values = json.loads(agent["Properties"]["ConfigurationValues"])
    schema = json.loads((ROOT / "tests/data/eks-node-monitoring-agent-v1.6.7.configuration.schema.json").read_text())
    jsonschema.validate(values, schema)
    with pytest.raises(jsonschema.ValidationError):  # the schema can refuse: an unknown key under dcgmAgent
        jsonschema.validate({"dcgmAgent": {"toleration": []}}, schema)
    tolerations = values["dcgmAgent"]["tolerations"]

    def tolerated(taint) -> bool:  # Kubernetes: key matches, operator Exists (or Equal and value), effect matches
        return any(t["key"] == taint.key and t.get("effect") in (None, taint.effect) and
                   (t["operator"] == "Exists" or t.get("value") == taint.value) for t in tolerations)
    for pool in cfg.pools.values():
        if pool.gpu:
            assert pool.taints and all(tolerated(t) for t in pool.taints), pool.name


def test_dcgm_exporter_uses_the_node_host_engine(pipeline):
    """Issue 27 item 6: one host engine per node: the exporter connects to the agent's (port 5555)."""
    from infra.cluster import DCGM_HOSTENGINE_PORT
    cl = tpl(pipeline, "prod", "cluster")
    (dcgm,) = [r for r in resources(cl, "Custom::AWSCDK-EKS-HelmChart").values() if r["Properties"]["Chart"] == "dcgm-exporter"]
    env = json.loads(dcgm["Properties"]["Values"])["extraEnv"]
    assert env[0] == {"name": "NODE_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.hostIP"}}}
    assert env[1] == {"name": "DCGM_REMOTE_HOSTENGINE_INFO", "value": f"$(NODE_IP):{DCGM_HOSTENGINE_PORT}"}
    assert DCGM_HOSTENGINE_PORT == 5555


def test_ec2_and_ssm_endpoints_so_pod_networking_skips_the_nat(pipeline):
    """Issue 27 item 8: the VPC CNI's ipamd calls the EC2 API; Session Manager needs ssm, ssmmessages, ec2messages."""
    net = tpl(pipeline, "prod", "network")
    services = {json.dumps(r["Properties"]["ServiceName"]).rsplit(".", 1)[-1].strip('"]}')
                for r in resources(net, "AWS::EC2::VPCEndpoint").values() if r["Properties"].get("VpcEndpointType") == "Interface"}
    assert {"ec2", "ssm", "ssmmessages", "ec2messages"} <= services, services


def test_pull_through_cache_rules_and_the_nodes_may_fill_them(pipeline):
    """Issue 27 item 8: public chart images come through ECR, not the one NAT."""
    from infra.config import PULL_THROUGH_CACHE
    cfg = pipeline.cfgs["prod"]
    rules = {r["Properties"]["UpstreamRegistryUrl"]: r["Properties"]["EcrRepositoryPrefix"]
             for r in resources(tpl(pipeline, "prod", "storage"), "AWS::ECR::PullThroughCacheRule").values()}
    assert rules == PULL_THROUGH_CACHE and {"registry.k8s.io", "quay.io"} <= set(rules)
    assert cfg.cached_image("quay.io/prometheus/prometheus:v3.7.0") == \
        f"{cfg.account}.dkr.ecr.us-east-2.amazonaws.com/quay/prometheus/prometheus:v3.7.0"
    assert cfg.cached_image("nvcr.io/nvidia/k8s/dcgm-exporter:4.5.3") == "nvcr.io/nvidia/k8s/dcgm-exporter:4.5.3"
    cl = tpl(pipeline, "prod", "cluster")
    (node_role,) = [k for k, r in resources(cl, "AWS::IAM::Role").items()
                    if r["Properties"]["AssumeRolePolicyDocument"]["Statement"][0]["Principal"] == {"Service": "ec2.amazonaws.com"}]
    from moto.iam.access_control import IAMPolicy, PermissionResult
    policy = IAMPolicy(json.dumps(role_policy(cl, cfg, node_role)))
    repo = f"arn:aws:ecr:us-east-2:{cfg.account}:repository/quay/prometheus/prometheus"
    assert policy.is_action_permitted("ecr:BatchImportUpstreamImage", repo) == PermissionResult.PERMITTED
    assert policy.is_action_permitted("ecr:CreateRepository", repo.replace("/quay/", "/moerl/")) != PermissionResult.PERMITTED


def _at(values: dict, path: str):
    for key in path.split("."):
        values = values.get(key, {}) if isinstance(values, dict) else {}
    return values


def test_chart_images_come_through_the_pull_through_cache(pipeline, variant):
    """Issue 27 item 8: every image of an installed chart whose registry has a cache rule is pulled
    from this account's ECR (the chart's own values keys, recorded from each values.yaml at the
    pinned version); registries without a rule (Docker Hub and ghcr.io without credentials) stay."""
    import yaml

    from infra.charts import CHART_IMAGES, HELM_CHARTS
    recorded = yaml.safe_load((ROOT / "tests/data/chart-images.yaml").read_text())
    assert {c: [list(i) for i in imgs] for c, imgs in CHART_IMAGES.items()} == {
        c: [["basic.image_registry" if c == "volcano" else p, r, rep] for p, r, rep in d["images"]] for c, d in recorded.items()}
    assert set(CHART_IMAGES) <= {c for _, c, _ in HELM_CHARTS}
    for t, cfg in ((tpl(pipeline, "prod", "cluster"), pipeline.cfgs["prod"]), (Template.from_stack(variant.stacks["cluster"]), variant.cfg)):
        ecr = f"{cfg.account}.dkr.ecr.{cfg.region}.amazonaws.com"
        charts = {r["Properties"]["Chart"]: json.loads(r["Properties"].get("Values") or "{}")
                  for r in resources(t, "Custom::AWSCDK-EKS-HelmChart").values()}
        cached = 0
        for chart, images in CHART_IMAGES.items():
            if chart not in charts:
                continue  # aws-fsx-csi-driver without fsx
            for path, registry, repository in images:
                host = registry or repository.split("/", 1)[0]
                got = _at(charts[chart], path)
                if host in ("docker.io", "ghcr.io") and not cfg.pull_through_secrets.get(
                        {"docker.io": "registry-1.docker.io"}.get(host, host)):
                    assert got == {} or "registry" not in got, (chart, path)
                    continue
                want = cfg.cached_image(f"{registry}/{repository}:1" if registry else f"{repository}:1").removesuffix(":1")
                assert want.startswith(ecr + "/"), want
                if path.endswith("image_registry"):
                    assert f"{got}/{repository}" == want, (chart, path)
                elif registry:
                    assert f"{got['registry']}/{got['repository']}" == want and got["registry"] == ecr, (chart, path)
                else:
                    assert got["repository"] == want, (chart, path)
                cached += 1
        assert cached >= 15
    vol = json.loads([r for r in resources(Template.from_stack(variant.stacks["cluster"]), "Custom::AWSCDK-EKS-HelmChart").values()
                      if r["Properties"]["Chart"] == "volcano"][0]["Properties"]["Values"])
    assert vol == {"basic": {"image_registry": "111111111111.dkr.ecr.us-east-2.amazonaws.com/docker-hub"}}


def test_credentialed_pull_through_cache_rule_names_its_secret(variant):
    """Docker Hub (and ghcr.io) are cached only with the account's credentials (ECR user guide)."""
    cfg = variant.cfg
    rules = {r["Properties"]["UpstreamRegistryUrl"]: r["Properties"]
             for r in resources(Template.from_stack(variant.stacks["storage"]), "AWS::ECR::PullThroughCacheRule").values()}
    assert rules["registry-1.docker.io"] == {"EcrRepositoryPrefix": "docker-hub", "UpstreamRegistryUrl": "registry-1.docker.io",
                                             "CredentialArn": cfg.pull_through_secrets["registry-1.docker.io"]}
    assert "CredentialArn" not in rules["quay.io"] and "ghcr.io" not in rules
    assert cfg.cached_image("docker.io/volcanosh/vc-scheduler:v1.15.0") == \
        "111111111111.dkr.ecr.us-east-2.amazonaws.com/docker-hub/volcanosh/vc-scheduler:v1.15.0"
    assert cfg.cached_image("docker.io/redis:7.4") == "111111111111.dkr.ecr.us-east-2.amazonaws.com/docker-hub/library/redis:7.4"
    assert cfg.cached_image("ghcr.io/oliver006/redis_exporter:v1.88.0") == "ghcr.io/oliver006/redis_exporter:v1.88.0"


def test_s3_endpoint_admits_only_this_accounts_buckets(pipeline):
    """Issue 28 item 5: the gateway endpoint's policy (no policy: every bucket of every account)."""
    cfg = pipeline.cfgs["prod"]
    (ep,) = [r["Properties"] for r in resources(tpl(pipeline, "prod", "network"), "AWS::EC2::VPCEndpoint").values()
             if r["Properties"].get("VpcEndpointType") == "Gateway"]
    statements = {s["Sid"]: s for s in _resolve(ep["PolicyDocument"]["Statement"], cfg)}
    assert statements["ThisAccountsBuckets"]["Condition"] == {"StringEquals": {"aws:ResourceAccount": cfg.account}}
    assert statements["EcrImageLayers"] == {"Sid": "EcrImageLayers", "Effect": "Allow", "Principal": {"AWS": "*"},
                                            "Action": "s3:GetObject", "Resource": "arn:aws:s3:::prod-us-east-2-starport-layer-bucket/*"}
    # issue 39 item 1: reads of registry.k8s.io's blob bucket of the region (the LWS chart)
    assert statements["KubernetesRegistryBlobs"] == {
        "Sid": "KubernetesRegistryBlobs", "Effect": "Allow", "Principal": {"AWS": "*"}, "Action": "s3:GetObject",
        "Resource": "arn:aws:s3:::prod-registry-k8s-io-us-east-2/*"}
    assert set(statements) == {"ThisAccountsBuckets", "EcrImageLayers", "KubernetesRegistryBlobs"}


def test_data_buckets_refuse_pod_roles_outside_the_vpc_endpoint(pipeline):
    """Issue 28 item 5: credentials taken from a pod do not work from anywhere else (aws:SourceVpce)."""
    cfg = pipeline.cfgs["prod"]
    st, cl, net = tpl(pipeline, "prod", "storage"), tpl(pipeline, "prod", "cluster"), tpl(pipeline, "prod", "network")
    names = {r["Properties"].get("RoleName") for r in resources(cl, "AWS::IAM::Role").values()}
    pod_roles = [*(role for role, _ in cfg.trainer_identities.values()), cfg.pod_role_name("rollout")]
    assert set(pod_roles) <= names
    (gw_id,) = [k for k, r in resources(net, "AWS::EC2::VPCEndpoint").items() if r["Properties"].get("VpcEndpointType") == "Gateway"]
    exports = {o["Export"]["Name"]: o["Value"] for o in net.to_json()["Outputs"].values() if "Export" in o}
    buckets = {k: r["Properties"]["BucketName"] for k, r in resources(st, "AWS::S3::Bucket").items()}
    fenced = set()
    for r in resources(st, "AWS::S3::BucketPolicy").values():
        for s in r["Properties"]["PolicyDocument"]["Statement"]:
            if s.get("Sid") != "PodRolesOnlyThroughTheVpcEndpoint":
                continue
            assert s["Effect"] == "Deny" and s["Action"] == "s3:*"
            assert _resolve(s["Condition"]["ArnEquals"]["aws:PrincipalArn"], cfg) == [
                f"arn:aws:iam::{cfg.account}:role/{name}" for name in pod_roles]
            vpce = s["Condition"]["StringNotEquals"]["aws:SourceVpce"]
            assert exports[vpce["Fn::ImportValue"]] == {"Ref": gw_id}
            fenced.add(buckets[r["Properties"]["Bucket"]["Ref"]])
    assert fenced == {cfg.checkpoint_bucket, cfg.artifacts_bucket}


def test_pod_roles_write_only_their_run_areas_and_read_models_and_data(pipeline):
    """Issue 28 item 6, evaluated by moto's IAM policy engine on the synthesized statements: the keys
    app/ writes (policy versions, training state, done marker, metrics) are writable by the trainer
    only; base models and datasets are readable by both and writable by neither."""
    from moto.iam.access_control import IAMPolicy, PermissionResult

    from app.storage.done import done_key
    from app.storage.policy import latest_key, version_prefix
    from app.trainer.state import step_prefix
    cfg = pipeline.cfgs["prod"]
    cl = tpl(pipeline, "prod", "cluster")
    roles = {r["Properties"]["RoleName"]: k for k, r in resources(cl, "AWS::IAM::Role").items() if "RoleName" in r["Properties"]}
    trainer = IAMPolicy(json.dumps(role_policy(cl, cfg, roles[cfg.trainer_identities["r1"][0]])))
    rollout = IAMPolicy(json.dumps(role_policy(cl, cfg, roles["moerl-prod-rollout"])))
    obj = f"arn:aws:s3:::{cfg.checkpoint_bucket}/"
    run = f"{cfg.run_prefix}/"
    written = [version_prefix("r1", 3) + "model-00001-of-00002.safetensors", latest_key("r1"),
               step_prefix("r1", 10) + "rng0.pt", done_key("r1"),
               run + "r1/metrics/metrics.jsonl", run + "r1/tensorboard/events.out"]
    written = [k if k.startswith(run) else run + k for k in written]
    shared = [f"{cfg.models_prefix}/Qwen3-30B-A3B/config.json", f"{cfg.data_prefix}/gsm8k/train.jsonl"]
    ok = PermissionResult.PERMITTED
    for key in written:
        assert trainer.is_action_permitted("s3:PutObject", obj + key) == ok, key
        assert rollout.is_action_permitted("s3:PutObject", obj + key) != ok, key
    for key in shared:
        for role in (trainer, rollout):
            assert role.is_action_permitted("s3:GetObject", obj + key) == ok, key
            assert role.is_action_permitted("s3:PutObject", obj + key) != ok, key
            assert role.is_action_permitted("s3:DeleteObject", obj + key) != ok, key
    assert rollout.is_action_permitted("s3:GetObject", obj + written[0]) == ok
    assert trainer.is_action_permitted("s3:PutObject", obj + run + "r1/elsewhere/x") != ok  # only app's areas
    assert trainer.is_action_permitted("s3:DeleteObjectVersion", obj + written[0]) != ok  # versions stay recoverable


def test_trainer_writes_only_the_runs_it_is_deployed_for(pipeline):
    """Issue 28 item 6, issue 39 item 9: writes are scoped per run, not to every run under runs/ nor
    to every run of trainer_runs: each entry has its own role and service account, so a foothold in
    one run's trainer cannot overwrite another run's versions or training state (the runs of one
    family share their entry's)."""
    from moto.iam.access_control import IAMPolicy, PermissionResult

    from app.storage.policy import version_prefix
    from app.trainer.state import step_prefix
    from infra.config import ConfigError, default_config, validate_config
    ok = PermissionResult.PERMITTED
    obj = "arn:aws:s3:::{}/runs/"
    cases = {"prod": {"r1": ["r1"], "dsv3-*": ["dsv3-a", "dsv3-2node"]}, "dev": {"dev": ["dev"]}}
    others = ["r2", "r10", "dsv4"]
    for env, entries in cases.items():
        cfg = pipeline.cfgs[env]
        assert list(cfg.trainer_identities) == list(entries)
        cl = tpl(pipeline, env, "cluster")
        roles = {r["Properties"]["RoleName"]: k for k, r in resources(cl, "AWS::IAM::Role").items() if "RoleName" in r["Properties"]}
        assocs = {r["Properties"]["ServiceAccount"]: r["Properties"]["RoleArn"]["Fn::GetAtt"][0]
                  for r in resources(cl, "AWS::EKS::PodIdentityAssociation").values()}
        for entry, (role_name, sa) in cfg.trainer_identities.items():
            assert assocs[sa] == roles[role_name] and len(role_name) <= 64
            trainer = IAMPolicy(json.dumps(role_policy(cl, cfg, roles[role_name])))
            for run in [r for rs in entries.values() for r in rs] + others:
                for key in (version_prefix(run, 3) + "model.safetensors", step_prefix(run, 10) + "rng0.pt"):
                    want = run in entries[entry]
                    assert (trainer.is_action_permitted("s3:PutObject", obj.format(cfg.checkpoint_bucket) + key) == ok) is want, (env, entry, key)
                    assert trainer.is_action_permitted("s3:GetObject", obj.format(cfg.checkpoint_bucket) + key) == ok
        for entry, runs in entries.items():  # the trainer of a run uses its entry's account
            assert all(cfg.trainer_service_account_of(run) == cfg.trainer_identities[entry][1] for run in runs)
    prod = pipeline.cfgs["prod"]  # a run no entry names: an account without an association (no credentials)
    assert prod.trainer_entry("r2") is None
    assert prod.trainer_service_account_of("r2") not in {sa for _, sa in prod.trainer_identities.values()}
    wide = validate_config({**default_config("dev"), "trainer_runs": ["*", "a-*", "a-b"]})
    assert [wide.trainer_entry(r) for r in ("a-b", "a-c", "z")] == ["a-b", "a-*", "*"]
    data = default_config("prod")
    assert data.get("trainer_runs") is None and validate_config(data).trainer_runs == ["dev"]
    for runs, says in ((["*"], "allowed in dev only"), (["Run_1"], "neither a run id"), ([], "at least 1")):
        with pytest.raises(ConfigError, match=says):
            validate_config({**data, "trainer_runs": runs})
    assert validate_config({**default_config("dev"), "trainer_runs": ["*"]}).trainer_runs == ["*"]


def test_fsx_lustre_linked_to_models_and_data_reached_only_from_gpu_nodes(pipeline):
    """Issue 27 item 12: PERSISTENT_2 in the nodes' one AZ, KMS-encrypted, linked (import only) to the
    bucket's models/ prefix; Lustre's ports admitted from the EFA security group (the
    trainer and rollout nodes) and the file servers only; the CSI node plugin on those pools only;
    off by default (dev, staging): no file system, no driver."""
    from infra.cluster import FSX_POOLS
    from infra.storage import LUSTRE_PORTS
    cfg = pipeline.cfgs["prod"]
    st, net, cl = tpl(pipeline, "prod", "storage"), tpl(pipeline, "prod", "network"), tpl(pipeline, "prod", "cluster")
    (fs_id, fs), = resources(st, "AWS::FSx::FileSystem").items()
    p = fs["Properties"]
    assert (p["LustreConfiguration"]["DeploymentType"], p["StorageCapacity"], p["LustreConfiguration"]["PerUnitStorageThroughput"]) == \
        ("PERSISTENT_2", cfg.fsx.storage_gib, cfg.fsx.mbps_per_tib) == ("PERSISTENT_2", 4800, 500)
    assert subnet_azs(net, st, p["SubnetIds"]) == {cfg.az} and len(p["SubnetIds"]) == 1
    (key_id,) = resources(st, "AWS::KMS::Key")
    assert p["KmsKeyId"] == {"Ref": key_id}
    links = {(r["Properties"]["FileSystemPath"], r["Properties"]["DataRepositoryPath"]): r["Properties"]
             for r in resources(st, "AWS::FSx::DataRepositoryAssociation").values()}
    bucket = f"s3://{cfg.checkpoint_bucket}/"
    assert set(links) == {(f"/{cfg.models_prefix}", f"{bucket}{cfg.models_prefix}/")}  # datasets: the feed reads S3
    for link in links.values():
        assert link["FileSystemId"] == {"Ref": fs_id} and "AutoExportPolicy" not in link["S3"]  # S3 is the source of truth
    (sg_ref,) = p["SecurityGroupIds"]
    sg_id = sg_ref["Fn::GetAtt"][0]
    efa_export = [o["Export"]["Name"] for k, o in net.to_json()["Outputs"].items() if "EfaSecurityGroup" in k]
    rules = [r["Properties"] for r in resources(st, "AWS::EC2::SecurityGroupIngress").values()
             if r["Properties"]["GroupId"] == {"Fn::GetAtt": [sg_id, "GroupId"]}]
    assert {(r["FromPort"], r["ToPort"]) for r in rules} == set(LUSTRE_PORTS) == {(988, 988), (1018, 1023)}
    sources = {json.dumps(r["SourceSecurityGroupId"]) for r in rules}
    assert all(r["IpProtocol"] == "tcp" and "CidrIp" not in r for r in rules)
    assert sources == {json.dumps({"Fn::ImportValue": e}) for e in efa_export} | {json.dumps({"Fn::GetAtt": [sg_id, "GroupId"]})}
    assert "SecurityGroupIngress" not in resources(st, "AWS::EC2::SecurityGroup")[sg_id]["Properties"]
    # the pools that mount it carry the EFA security group (the config refuses fsx otherwise)
    assert all(cfg.pools[p].efa for p in FSX_POOLS)
    (csi,) = [r["Properties"] for r in resources(cl, "Custom::AWSCDK-EKS-HelmChart").values()
              if r["Properties"]["Chart"] == "aws-fsx-csi-driver"]
    values = json.loads(csi["Values"])
    assert values["nodeComponentOnly"] is True
    (term,) = values["node"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    assert term == {"matchExpressions": [{"key": "moerl.dev/pool", "operator": "In", "values": list(FSX_POOLS)}]}
    outputs = {k: o for k, o in st.to_json()["Outputs"].items() if k.startswith("Fsx")}
    assert set(outputs) == {"FsxFileSystemId", "FsxMountName"}
    for env in ("dev", "staging"):
        assert not pipeline.cfgs[env].fsx.enabled
        assert not resources(tpl(pipeline, env, "storage"), "AWS::FSx::FileSystem")
        assert "aws-fsx-csi-driver" not in json.dumps(resources(tpl(pipeline, env, "cluster"), "Custom::AWSCDK-EKS-HelmChart"))


def test_fsx_clients_take_lustre_callbacks_its_egress_is_closed_and_root_is_squashed(pipeline):
    """Issue 39 item 4: the FSx guide's client rules: the clients' group (EFA, which the trainer and
    rollout nodes carry) admits 988 and 1018-1023 from the file system's group (lock callbacks and
    recovery come from the servers); the file system's group has no egress but Lustre to its
    clients and itself (EC2's default allow-all egress stayed before, as every egress rule names a
    group); root squash on, so root on a node cannot rewrite /fsx/models unseen in S3."""
    from infra.network import NO_TRAFFIC_EGRESS
    from infra.storage import FSX_ROOT_SQUASH, LUSTRE_PORTS
    st, net = tpl(pipeline, "prod", "storage"), tpl(pipeline, "prod", "network")
    (fs_id, fs), = resources(st, "AWS::FSx::FileSystem").items()
    (sg_ref,) = fs["Properties"]["SecurityGroupIds"]
    fsx_sg = {"Fn::GetAtt": [sg_ref["Fn::GetAtt"][0], "GroupId"]}
    (efa_export,) = [o["Export"]["Name"] for k, o in net.to_json()["Outputs"].items() if "EfaSecurityGroup" in k]
    efa_sg = {"Fn::ImportValue": efa_export}
    ports = set(LUSTRE_PORTS)

    def rules(kind: str, group: dict, peer_key: str, peer: dict) -> set:
        return {(r["Properties"]["FromPort"], r["Properties"]["ToPort"]) for r in resources(st, kind).values()
                if r["Properties"]["GroupId"] == group and r["Properties"].get(peer_key) == peer
                and r["Properties"]["IpProtocol"] == "tcp"}
    assert rules("AWS::EC2::SecurityGroupIngress", efa_sg, "SourceSecurityGroupId", fsx_sg) == ports
    assert rules("AWS::EC2::SecurityGroupEgress", efa_sg, "DestinationSecurityGroupId", fsx_sg) == ports
    group = resources(st, "AWS::EC2::SecurityGroup")[sg_ref["Fn::GetAtt"][0]]["Properties"]
    assert group["SecurityGroupEgress"] == [NO_TRAFFIC_EGRESS]
    egress = [r["Properties"] for r in resources(st, "AWS::EC2::SecurityGroupEgress").values() if r["Properties"]["GroupId"] == fsx_sg]
    assert {json.dumps(r["DestinationSecurityGroupId"]) for r in egress} == {json.dumps(efa_sg), json.dumps(fsx_sg)}
    assert {(r["FromPort"], r["ToPort"]) for r in egress} == ports and all("CidrIp" not in r for r in egress)
    (squash,) = resources(st, "Custom::AWS").values()
    sep, parts = squash["Properties"]["Create"]["Fn::Join"]
    call = json.loads(sep.join("fs-0123" if p == {"Ref": fs_id} else p for p in parts))
    assert (call["service"], call["action"]) == ("FSx", "updateFileSystem") and FSX_ROOT_SQUASH == "65534:65534"
    assert call["parameters"] == {"FileSystemId": "fs-0123",
                                  "LustreConfiguration": {"RootSquashConfiguration": {"RootSquash": FSX_ROOT_SQUASH}}}
    links = set(resources(st, "AWS::FSx::DataRepositoryAssociation"))
    assert links and links <= set(squash["DependsOn"])  # FSx takes one update at a time
    for env in ("dev", "staging"):
        assert not resources(tpl(pipeline, env, "storage"), "Custom::AWS")


@pytest.mark.parametrize("fsx, says", [
    ({"storage_gib": 3600}, "not a PERSISTENT_2 capacity"), ({"storage_gib": 600}, "greater than or equal to 1200"),
    ({"mbps_per_tib": 200}, "not a PERSISTENT_2 throughput"), ({"file_system_id": "fsx-1"}, "fs-"),
])
def test_fsx_sizes_are_the_ones_fsx_allows(fsx, says):
    """FSx API CreateFileSystem: PERSISTENT_2 SSD takes 1200 GiB or multiples of 2400 GiB and 125,
    250, 500 or 1000 MB/s/TiB; anything else fails the config, naming the field."""
    from infra.config import ConfigError, default_config, validate_config
    data = default_config("prod")
    with pytest.raises(ConfigError, match=f"fsx.*{says}"):
        validate_config({**data, "fsx": {"enabled": True, **fsx}})
    for gib in (1200, 2400, 9600):
        assert validate_config({**data, "fsx": {"enabled": True, "storage_gib": gib}}).fsx.storage_gib == gib
    no_efa = default_config("prod")
    no_efa["pools"]["rollout-gpu"]["efa"] = False
    with pytest.raises(ConfigError, match="fsx.enabled.*rollout-gpu"):
        validate_config({**no_efa, "fsx": {"enabled": True}})


def _buildspecs(t: Template) -> dict[str, dict]:
    return {k: json.loads(r["Properties"]["Source"]["BuildSpec"]) for k, r in resources(t, "AWS::CodeBuild::Project").items()}


def test_synth_job_installs_only_locked_packages_and_runs_no_tests(pipeline):
    """Issue 27 item 5 and issue 28 item 7: the job whose output deploys installs the CLI from its
    npm lock and the Python packages by hash, and runs the synth only; the tests run in a job of
    their own before the first stage; self-mutation and asset jobs use pinned CLIs."""
    from infra.pipeline import CDK_ASSETS_VERSION, CDK_CLI_VERSION
    specs = _buildspecs(Template.from_stack(pipeline.pipeline_stack))
    (synth,) = [s for k, s in specs.items() if "Synth" in k]
    cmds = [c for phase in synth["phases"].values() for c in phase.get("commands", [])]
    assert cmds[0] == "npm ci --prefix infra/cdk-cli --ignore-scripts"
    assert ".venv/bin/pip install --require-hashes --no-deps -r infra/requirements-synth.txt" in cmds
    assert not any("make" in c or "pytest" in c or "npm install" in c for c in cmds), cmds
    (tests,) = [s for k, s in specs.items() if "InfraTests" in k]
    assert [c for phase in tests["phases"].values() for c in phase.get("commands", [])] == ["make test-infra"]
    installs = [c for k, s in specs.items() for phase in s["phases"].values() for c in phase.get("commands", [])
                if "npm install -g" in c]
    assert installs and all(c in (f"npm install -g aws-cdk@{CDK_CLI_VERSION}", f"npm install -g cdk-assets@{CDK_ASSETS_VERSION}")
                            for c in installs), installs
    makefile = (ROOT / "Makefile").read_text()
    assert "test-infra: $(STAMP)\n\t$(BIN)/python -m pytest -q tests/test_infra_*.py tests/test_ops_charts.py" in makefile


def test_every_pipeline_job_runs_node_22(pipeline):
    """Issue 39 item 5: jsii and the CDK CLI print Node 20's end-of-life notice on every call; every
    CodeBuild job of the pipeline selects Node 22 (the Makefile's major) and the synth lock's Python."""
    from infra.pipeline import RUNTIMES, SYNTH_PYTHON
    specs = _buildspecs(Template.from_stack(pipeline.pipeline_stack))
    assert len(specs) >= 4  # synth, tests, self-mutation, asset publishing
    for name, spec in specs.items():
        assert spec["phases"]["install"]["runtime-versions"] == {"nodejs": "22", "python": "3.11"} == RUNTIMES, name
    assert SYNTH_PYTHON == "python3.11"


def test_execution_policy_covers_every_synthesized_resource_and_no_more(pipeline):
    """Issue 28 item 7: the scoped CloudFormation execution policy (instead of AdministratorAccess)
    admits an action of every service the stacks' resource types belong to, and refuses IAM beyond
    this environment's roles."""
    from moto.iam.access_control import IAMPolicy, PermissionResult

    from infra.execution_policy import SERVICES, execution_policy, main
    ok = PermissionResult.PERMITTED
    for env in ENVS:
        cfg = pipeline.cfgs[env]
        policy = IAMPolicy(json.dumps(execution_policy(cfg)))
        types = {r["Type"] for kind in ("network", "storage", "cluster") for r in tpl(pipeline, env, kind).to_json()["Resources"].values()}
        services = {t.split("::")[1] for t in types if t.startswith("AWS::")}
        assert services - {"IAM"} <= set(SERVICES), sorted(services - set(SERVICES))
        for svc in services - {"IAM"}:
            assert policy.is_action_permitted(f"{SERVICES[svc]}:Create{svc}Thing") == ok, svc
        acct = f"arn:aws:iam::{cfg.account}"
        assert policy.is_action_permitted("iam:CreateRole", f"{acct}:role/moerl-{env}-cluster-NodeRoleABC-1X2Y") == ok
        assert policy.is_action_permitted("iam:PassRole", f"{acct}:role/moerl-{env}-trainer") == ok
        assert policy.is_action_permitted("iam:CreateRole", f"{acct}:role/someone-else") != ok
        assert policy.is_action_permitted("iam:CreateUser", f"{acct}:user/x") != ok
        assert policy.is_action_permitted("iam:CreateAccessKey", f"{acct}:user/x") != ok
        assert policy.is_action_permitted("organizations:LeaveOrganization") != ok
    assert main(["--env", "nowhere"]) == 2


# ---------------------------------------------------------------- access: the deploy's requests
# Evaluated by iam-simulate (tests/iam.py) on the synthesized policies: the gateway endpoint's, the
# buckets', the roles', the execution policy and the boundary (issue 39 items 1, 2, 8).

VPCE = "vpce-0a1b2c3d4e5f60718"  # the gateway endpoint's id, which the buckets' policies import
K8S_REGISTRY_ACCOUNT = "513428760722"  # the Kubernetes project's registry account (kubernetes/k8s.io)
OTHER_ACCOUNT = "999988887777"


def _rendered(value, cfg: DeploymentConfig, buckets: dict[str, str]):
    """_resolve, plus a bucket's Fn::GetAtt Arn (logical id -> name in `buckets`), the imports of
    the endpoint's id (VPCE) and the data key's ARN, Fn::Sub of the partition and the first branch
    of an Fn::If made plain."""
    if isinstance(value, list):
        return [_rendered(v, cfg, buckets) for v in value]
    if not isinstance(value, dict):
        return value
    if "Fn::GetAtt" in value and value["Fn::GetAtt"][0] in buckets:
        return f"arn:aws:s3:::{buckets[value['Fn::GetAtt'][0]]}"
    if "Fn::ImportValue" in value:
        export = value["Fn::ImportValue"]
        if "VpcS3" in export:
            return VPCE
        assert "DataKey" in export, export
        return f"arn:aws:kms:{cfg.region}:{cfg.account}:key/0a1b2c3d-4e5f-6071-8293-a4b5c6d7e8f9"
    if "Fn::If" in value:  # the kubectl provider's ECR Public policy, where the partition has it
        return _rendered(value["Fn::If"][1], cfg, buckets)
    if "Fn::Sub" in value:
        return value["Fn::Sub"].replace("${AWS::Partition}", "aws")
    if "Fn::Join" in value:
        sep, parts = value["Fn::Join"]
        return sep.join(str(_rendered(p, cfg, buckets)) for p in parts)
    if "Ref" in value:
        return _resolve(value, cfg)
    return {k: _rendered(v, cfg, buckets) for k, v in value.items()}


def _access(pipeline, env: str) -> dict:
    """The rendered policies of `env`: endpoint, bucket policy per bucket name, role policies by role name."""
    cfg = pipeline.cfgs[env]
    net, st, cl = (tpl(pipeline, env, k) for k in ("network", "storage", "cluster"))
    (ep,) = [r["Properties"] for r in resources(net, "AWS::EC2::VPCEndpoint").values()
             if r["Properties"].get("VpcEndpointType") == "Gateway"]
    buckets = {k: r["Properties"]["BucketName"] for k, r in resources(st, "AWS::S3::Bucket").items()}
    bucket_policies = {buckets[r["Properties"]["Bucket"]["Ref"]]: _rendered(r["Properties"]["PolicyDocument"], cfg, buckets)
                       for r in resources(st, "AWS::S3::BucketPolicy").values()}
    roles = {r["Properties"]["RoleName"]: _rendered(role_policy(cl, cfg, k), cfg, buckets)
             for k, r in resources(cl, "AWS::IAM::Role").items() if "RoleName" in r["Properties"]}
    return {"cfg": cfg, "endpoint": _resolve(ep["PolicyDocument"], cfg), "buckets": bucket_policies, "roles": roles}


def _public_read(bucket: str) -> dict:
    """A bucket policy that lets anyone read (the registry's buckets: kubernetes/k8s.io's terraform,
    'publicly-readable regional S3 buckets')."""
    return {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Principal": "*", "Action": "s3:GetObject",
                                                    "Resource": f"arn:aws:s3:::{bucket}/*"}]}


def test_first_deploy_s3_requests_pass_the_gateway_endpoint_and_exfiltration_does_not(pipeline):
    """Issue 39 item 1: the kubectl handler's `helm pull oci://registry.k8s.io/lws/charts/lws` from
    the private subnets follows archeio's redirect to the region's registry bucket (an unsigned
    GET through the gateway endpoint); the endpoint refused it, and the cluster stack would roll
    back at LeaderWorkerSet. The same policies still admit the pods' own traffic and refuse a
    trainer's credentials writing to another account's bucket or used outside the VPC."""
    from iam import ALLOWED, ANONYMOUS, request, simulate

    from infra.network import REGISTRY_K8S_IO_BUCKETS, s3_endpoint_statements
    a = _access(pipeline, "prod")
    cfg, ep = a["cfg"], a["endpoint"]
    registry = REGISTRY_K8S_IO_BUCKETS[cfg.region]
    layer = f"prod-{cfg.region}-starport-layer-bucket"
    trainer = f"arn:aws:iam::{cfg.account}:role/{cfg.trainer_identities['r1'][0]}"
    rollout = f"arn:aws:iam::{cfg.account}:role/{cfg.pod_role_name('rollout')}"
    ckpt = cfg.checkpoint_bucket

    def pod(principal: str, action: str, key: str, *, inside: bool = True, bucket: str = ckpt,
            account: str = cfg.account, resource_policy: dict | None = None) -> dict:
        context = {"aws:PrincipalArn": principal, "aws:PrincipalAccount": cfg.account, "aws:ResourceAccount": account,
                   "aws:SecureTransport": "true", **({"aws:SourceVpce": VPCE} if inside else {})}
        role = principal.rsplit("/", 1)[1]
        return request(action, f"arn:aws:s3:::{bucket}/{key}", account, principal=principal,
                       identity=[a["roles"][role]], endpoint=ep if inside else None, context=context,
                       resource_policy=a["buckets"][bucket] if resource_policy is None else resource_policy)

    blob = "containers/images/sha256:9d4c2a"
    cases = {
        # the deploy's pulls through the endpoint (unsigned: helm, and ECR's presigned layer URLs)
        "lws chart blob": (request("s3:GetObject", f"arn:aws:s3:::{registry}/{blob}", K8S_REGISTRY_ACCOUNT,
                                   principal=ANONYMOUS, resource_policy=_public_read(registry), endpoint=ep,
                                   context={"aws:ResourceAccount": K8S_REGISTRY_ACCOUNT}), True),
        "ecr image layer": (request("s3:GetObject", f"arn:aws:s3:::{layer}/sha256/9d4c2a", OTHER_ACCOUNT,
                                    principal=ANONYMOUS, resource_policy=_public_read(layer), endpoint=ep,
                                    context={"aws:ResourceAccount": OTHER_ACCOUNT}), True),
        # the pods' own traffic
        "trainer writes its run": (pod(trainer, "s3:PutObject", "runs/r1/policy/v3/model.safetensors"), True),
        "rollout reads a model": (pod(rollout, "s3:GetObject", "models/Qwen3-30B-A3B/config.json"), True),
        # what the fences refuse
        "trainer outside the vpc": (pod(trainer, "s3:PutObject", "runs/r1/policy/v3/x", inside=False), False),
        "trainer writes another run": (pod(trainer, "s3:PutObject", "runs/dsv3-a/policy/v3/x"), False),
        "trainer to a foreign bucket": (pod(trainer, "s3:PutObject", "stolen/model.safetensors", bucket="attacker-drop",
                                            account=OTHER_ACCOUNT, resource_policy={"Version": "2012-10-17", "Statement": [
                                                {"Effect": "Allow", "Principal": "*", "Action": "s3:PutObject",
                                                 "Resource": "arn:aws:s3:::attacker-drop/*"}]}), False),
        "any other public bucket": (request("s3:GetObject", "arn:aws:s3:::attacker-tools/payload", OTHER_ACCOUNT,
                                            principal=ANONYMOUS, resource_policy=_public_read("attacker-tools"),
                                            endpoint=ep, context={"aws:ResourceAccount": OTHER_ACCOUNT}), False),
    }
    got = simulate([sim for sim, _ in cases.values()])
    assert {name: d == ALLOWED for name, d in zip(cases, got)} == {name: want for name, (_, want) in cases.items()}, got
    # archeio's table: one region's bucket has a name of its own; another region's is not reached
    # through this region's endpoint (a gateway endpoint serves its own region), so none is admitted
    assert REGISTRY_K8S_IO_BUCKETS["eu-west-2"] == "767373bbdcb8270361b96548387bf2a9ad0d48758c35-eu-west-2"
    assert [s.sid for s in s3_endpoint_statements("1", "eu-west-2")][-1] == "KubernetesRegistryBlobs"
    assert "KubernetesRegistryBlobs" not in [s.sid for s in s3_endpoint_statements("1", "me-south-1")]


def _template_roles(pipeline, env: str) -> list[tuple[str, str, list[str], int]]:
    """(role ARN, boundary ARN, managed policy ARNs, inline policies) of every role of `env`'s
    stacks, as CloudFormation would create them (a role without RoleName gets <stack>-<id>-<suffix>)."""
    cfg = pipeline.cfgs[env]
    out = []
    for kind in ("network", "storage", "cluster"):
        t = tpl(pipeline, env, kind)
        inline = {}
        for r in resources(t, "AWS::IAM::Policy").values():
            for ref in r["Properties"]["Roles"]:
                inline[ref["Ref"]] = inline.get(ref["Ref"], 0) + 1
        for k, r in resources(t, "AWS::IAM::Role").items():
            p = r["Properties"]
            name = p.get("RoleName") or f"{cfg.name_prefix}-{kind}-{k}"[:56] + "-1A2B3C4D"
            arns = _rendered(p.get("ManagedPolicyArns", []), cfg, {})
            out.append((f"arn:aws:iam::{cfg.account}:role/{name}", _resolve(p.get("PermissionsBoundary"), cfg), arns,
                        inline.get(k, 0)))
    return out


def test_the_execution_policy_admits_every_iam_request_of_a_deploy_and_no_escalation(pipeline):
    """Issue 39 items 2 and 8: the scoped execution policy (the role CloudFormation deploys with)
    evaluated against the IAM requests the stacks make: each role created with the boundary, each
    of its managed policies attached, its inline policies put; FSx's data repository link creating
    and filling AWSServiceRoleForFSxS3Access_<fs> (refused before: its attach and put were scoped to
    moerl-<env>-* only), ECR's pull-through cache service-linked role (missing before). And what it
    must refuse: a role without the boundary or with another one, the boundary removed, a managed
    policy outside the stacks' (AdministratorAccess), a role outside the prefix."""
    from iam import ALLOWED, request, simulate

    from infra.execution_policy import MANAGED_POLICIES, execution_policy
    for env in ("prod", "dev"):
        cfg = pipeline.cfgs[env]
        acct = cfg.account
        deployer = f"arn:aws:iam::{acct}:role/cdk-hnb659fds-cfn-exec-role-{acct}-{cfg.region}"
        policy = execution_policy(cfg)

        def ask(action: str, resource: str, **context) -> dict:
            return request(action, resource, acct, principal=deployer, identity=[policy], context=context)

        cases: dict[str, tuple[dict, bool]] = {}
        roles = _template_roles(pipeline, env)
        assert roles and all(boundary == cfg.boundary_arn for _, boundary, _, _ in roles), roles
        for arn, boundary, managed, inline in roles:
            cases[f"create {arn}"] = (ask("iam:CreateRole", arn, **{"iam:PermissionsBoundary": boundary}), True)
            cases[f"pass {arn}"] = (ask("iam:PassRole", arn), True)
            for m in managed:
                assert m.removeprefix("arn:aws:iam::aws:policy/") in MANAGED_POLICIES, m
                cases[f"attach {m} to {arn}"] = (ask("iam:AttachRolePolicy", arn, **{"iam:PolicyARN": m}), True)
            if inline:
                cases[f"inline policy of {arn}"] = (ask("iam:PutRolePolicy", arn), True)
        fsx_role = f"arn:aws:iam::{acct}:role/aws-service-role/s3.data-source.lustre.fsx.amazonaws.com/AWSServiceRoleForFSxS3Access_fs-0123456789abcdef0"
        ptc_role = f"arn:aws:iam::{acct}:role/aws-service-role/pullthroughcache.ecr.amazonaws.com/AWSServiceRoleForECRPullThroughCache"
        mine = f"arn:aws:iam::{acct}:role/{cfg.name_prefix}-cluster-EvilRole-1A2B3C4D"
        cases.update({
            "fsx link: its service-linked role": (ask("iam:CreateServiceLinkedRole", fsx_role, **{
                "iam:AWSServiceName": "s3.data-source.lustre.fsx.amazonaws.com"}), True),
            "fsx link: attach to it": (ask("iam:AttachRolePolicy", fsx_role, **{
                "iam:PolicyARN": "arn:aws:iam::aws:policy/aws-service-role/AmazonFSxServiceRolePolicy"}), True),
            "fsx link: inline policy": (ask("iam:PutRolePolicy", fsx_role), True),
            "pull-through cache role": (ask("iam:CreateServiceLinkedRole", ptc_role, **{
                "iam:AWSServiceName": "pullthroughcache.ecr.amazonaws.com"}), True),
            "role without a boundary": (ask("iam:CreateRole", mine), False),
            "role with another boundary": (ask("iam:CreateRole", mine, **{
                "iam:PermissionsBoundary": f"arn:aws:iam::{acct}:policy/wide-open"}), False),
            "boundary removed": (ask("iam:DeleteRolePermissionsBoundary", mine), False),
            "boundary replaced": (ask("iam:PutRolePermissionsBoundary", mine, **{
                "iam:PermissionsBoundary": f"arn:aws:iam::{acct}:policy/wide-open"}), False),
            "boundary rewritten": (ask("iam:CreatePolicyVersion", cfg.boundary_arn), False),
            "administrator attached": (ask("iam:AttachRolePolicy", mine, **{
                "iam:PolicyARN": "arn:aws:iam::aws:policy/AdministratorAccess"}), False),
            "role outside the prefix": (ask("iam:CreateRole", f"arn:aws:iam::{acct}:role/someone-else", **{
                "iam:PermissionsBoundary": cfg.boundary_arn}), False),
            "service role of another path": (ask("iam:AttachRolePolicy", f"arn:aws:iam::{acct}:role/aws-service-role/x/y", **{
                "iam:PolicyARN": "arn:aws:iam::aws:policy/AdministratorAccess"}), False),
            "a user": (ask("iam:CreateUser", f"arn:aws:iam::{acct}:user/x"), False),
        })
        got = simulate([sim for sim, _ in cases.values()])
        wrong = {name: d for (name, (_, want)), d in zip(cases.items(), got) if (d == ALLOWED) != want}
        assert not wrong, (env, wrong)


def test_the_boundary_caps_any_role_the_deploy_role_can_make(pipeline):
    """Issue 39 item 8: whatever inline policy the deploy role puts on a moerl-<env>-* role (it may
    put any), the boundary it must carry leaves no IAM write, Organizations or account change:
    the deploy role cannot mint an administrator."""
    from iam import ALLOWED, request, simulate

    from infra.execution_policy import boundary_policy, main
    cfg = pipeline.cfgs["prod"]
    acct = cfg.account
    role = f"arn:aws:iam::{acct}:role/{cfg.name_prefix}-cluster-Minted-1A2B3C4D"
    everything = {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "*", "Resource": "*"}]}
    cases = {
        ("iam:CreateUser", f"arn:aws:iam::{acct}:user/backdoor"): False,
        ("iam:CreateAccessKey", f"arn:aws:iam::{acct}:user/admin"): False,
        ("iam:AttachRolePolicy", role): False,
        ("iam:PutRolePolicy", role): False,
        ("iam:DeleteRolePermissionsBoundary", role): False,
        ("iam:UpdateAssumeRolePolicy", f"arn:aws:iam::{acct}:role/{cfg.name_prefix}-admin"): False,
        ("iam:PassRole", f"arn:aws:iam::{acct}:role/OrganizationAccountAccessRole"): False,
        ("organizations:LeaveOrganization", "*"): False,
        ("s3:GetObject", f"arn:aws:s3:::{cfg.checkpoint_bucket}/models/x"): True,
        ("ec2:AssignPrivateIpAddresses", f"arn:aws:ec2:{cfg.region}:{acct}:network-interface/eni-0123456789abcdef0"): True,
        ("iam:CreateServiceLinkedRole", f"arn:aws:iam::{acct}:role/aws-service-role/elasticloadbalancing.amazonaws.com/AWSServiceRoleForElasticLoadBalancing"): True,
    }
    sims = [request(action, resource, acct, principal=role, identity=[everything], boundary=boundary_policy(cfg),
                    context={"iam:AWSServiceName": "elasticloadbalancing.amazonaws.com"} if "ServiceLinked" in action else {})
            for action, resource in cases]
    got = simulate(sims)
    assert {k: d == ALLOWED for k, d in zip(cases, got)} == cases, got
    assert main(["--env", "prod", "--boundary"]) == 0


def test_the_admin_role_trusts_named_or_tagged_principals_not_the_whole_account(pipeline):
    """Issue 39 item 8: moerl-<env>-admin (cluster-admin through its access entry) trusted the
    account root: any principal allowed sts:AssumeRole by its own policy became cluster-admin. Now
    only principals tagged moerl-cluster-admin=moerl-<env>, or the admin_principals named."""
    from iam import ALLOWED, request, simulate

    from infra.config import ADMIN_PRINCIPAL_TAG, ConfigError, default_config, validate_config
    cfg = pipeline.cfgs["prod"]
    acct = cfg.account
    (admin,) = [r for r in resources(tpl(pipeline, "prod", "cluster"), "AWS::IAM::Role").values()
                if r["Properties"].get("RoleName") == f"{cfg.name_prefix}-admin"]
    trust = _resolve(admin["Properties"]["AssumeRolePolicyDocument"], cfg)
    may_assume = {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "sts:AssumeRole", "Resource": "*"}]}
    target = cfg.default_admin_role_arn

    def assume(principal: str, tags: dict) -> dict:
        return request("sts:AssumeRole", target, acct, principal=principal, identity=[may_assume], resource_policy=trust,
                       context={"aws:PrincipalArn": principal, "aws:PrincipalAccount": acct,
                                **{f"aws:PrincipalTag/{k}": v for k, v in tags.items()}})

    someone = f"arn:aws:iam::{acct}:role/ci-runner"
    got = simulate([assume(someone, {}), assume(someone, {ADMIN_PRINCIPAL_TAG: cfg.name_prefix}),
                    assume(someone, {ADMIN_PRINCIPAL_TAG: "moerl-dev"})])
    assert got[0] != ALLOWED and got[1] == ALLOWED and got[2] != ALLOWED, got
    # named principals instead of the tag
    data = {**default_config("prod"), "admin_principals": [f"arn:aws:iam::{default_config('prod')['account']}:role/platform-admin"]}
    named = validate_config(data)
    from infra.cluster import admin_principal
    assert admin_principal(named).policy_fragment.principal_json == {"AWS": named.admin_principals}
    assert admin_principal(named).policy_fragment.conditions == {}
    with pytest.raises(ConfigError, match="admin_principals"):
        validate_config({**data, "admin_principals": ["platform-admin"]})
