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
    placement_group_name: moerl-reserved-pg
  rollout-gpu:
    instance_types: [p5.48xlarge, p5e.48xlarge]
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
        # Created at create_size (issue 15 item 4: GPU pools empty, scaled by infra.scale afterwards).
        lo, want, hi = pool.initial_sizes
        assert ng["ScalingConfig"] == {"MinSize": lo, "MaxSize": hi, "DesiredSize": want}
        assert ng["AmiType"] == ("AL2023_x86_64_NVIDIA" if pool.gpu else "AL2023_x86_64_STANDARD")
        assert ng["NodeRepairConfig"] == {"Enabled": True}
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
    assert json.loads(cni["Properties"]["ConfigurationValues"]) == {"enableNetworkPolicy": "true"}


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
    assert set(assocs) == {cfg.trainer_service_account, cfg.rollout_service_account}
    assert {a["Namespace"] for a in assocs.values()} == {cfg.namespace}
    policies = cl.to_json()["Resources"]

    def actions_on_objects(sa: str) -> set[str]:
        role = assocs[sa]["RoleArn"]["Fn::GetAtt"][0]
        acts = set()
        for r in policies.values():
            if r["Type"] == "AWS::IAM::Policy" and {"Ref": role} in r["Properties"]["Roles"]:
                for st in r["Properties"]["PolicyDocument"]["Statement"]:
                    if f"/{cfg.run_prefix}/*" in json.dumps(st["Resource"]):
                        acts |= set([st["Action"]] if isinstance(st["Action"], str) else st["Action"])
        return acts

    trainer, rollout = actions_on_objects(cfg.trainer_service_account), actions_on_objects(cfg.rollout_service_account)
    assert {"s3:GetObject", "s3:PutObject"} <= trainer
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
    builds = [r["Properties"]["Source"]["BuildSpec"] for r in resources(t, "AWS::CodeBuild::Project").values()]
    assert any("make test" in b for b in builds)


# ---------------------------------------------------------------- cfn-lint and cdk-nag


def test_synth_needs_no_lookups(pipeline, variant):
    """Offline synth: the cloud assembly asks the CLI for no context (AZs, AMIs, VPCs)."""
    for synth in (pipeline, variant):
        for manifest in synth.outdir.rglob("manifest.json"):
            assert "missing" not in json.loads(manifest.read_text()), manifest


def test_cfn_lint_zero_errors(pipeline, variant):
    files = pipeline.template_files() + variant.template_files()
    assert len(files) == 1 + 3 * 3 + 3
    proc = subprocess.run([sys.executable, "-m", "cfnlint", "--format", "json", *map(str, files)],
                          capture_output=True, text=True, timeout=600)
    findings = json.loads(proc.stdout or "[]")
    errors = [f for f in findings if f["Level"] == "Error"]
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


def test_capacity_block_uses_the_existing_placement_group(variant):
    """An ODCR or Capacity Block made in a cluster placement group serves launches into that group."""
    cl = Template.from_stack(variant.stacks["cluster"])
    lt = launch_template(cl, by_name(cl, variant.cfg)["train-gpu"])
    assert lt["Placement"] == {"GroupName": "moerl-reserved-pg"}
    cl.resource_count_is("AWS::EC2::PlacementGroup", 0)


@pytest.mark.parametrize("env", ENVS)
def test_gpu_groups_created_empty(pipeline, env):
    cfg = pipeline.cfgs[env]
    for name, ng in by_name(tpl(pipeline, env, "cluster"), cfg).items():
        if cfg.pools[name].gpu:
            assert ng["ScalingConfig"]["DesiredSize"] == 0 == ng["ScalingConfig"]["MinSize"], name


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
    assert all(ng["NodeRepairConfig"] == {"Enabled": True} for ng in by_name(cl, pipeline.cfgs["prod"]).values())


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
