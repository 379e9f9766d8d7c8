"""Storage stack: checkpoint and artifacts buckets, their access-log bucket, ECR repositories and
the ECR pull-through cache rules of the public registries the cluster's charts pull from.

Data survives `cdk destroy` when `cfg.retain_data` (required in prod); in dev the buckets and
repositories are emptied and removed with the stack.

The data buckets refuse the Pod Identity roles (the trainer's, one per trainer_runs entry, and the
rollout's; named by DeploymentConfig.trainer_identities and pod_role_name) any request that does
not come through the VPC's S3 gateway endpoint (aws:SourceVpce; S3 user guide, "Controlling access
from VPC endpoints with bucket policies"): credentials taken from a pod do not work from outside
the VPC. Operators, the
pipeline and CloudFormation are not fenced.
"""

from __future__ import annotations

from aws_cdk import CfnOutput, Duration, RemovalPolicy, Stack
from aws_cdk import aws_ec2 as ec2
from aws_cdk import aws_ecr as ecr
from aws_cdk import aws_fsx as fsx
from aws_cdk import aws_iam as iam
from aws_cdk import aws_kms as kms
from aws_cdk import aws_s3 as s3
from aws_cdk import custom_resources as cr
from constructs import Construct

from infra.config import DeploymentConfig
from infra.network import NO_TRAFFIC_EGRESS, NetworkStack

# Lustre's ports: LNet on TCP 988 and 1018-1023, from the clients and between the file servers
# (FSx for Lustre user guide, "File system access control with Amazon VPC").
LUSTRE_PORTS = ((988, 988), (1018, 1023))
# The FSx service-linked role that a data repository association reads S3 with (FSx for Lustre
# user guide, "Using service-linked roles": AWSServiceRoleForFSxS3Access_<file system id>).
FSX_S3_ROLE_PATH = "aws-service-role/s3.data-source.lustre.fsx.amazonaws.com/"
# Root squash of every client ("UID:GID"): root on a node acts as nobody on the file system.
FSX_ROOT_SQUASH = "65534:65534"
# Lustre version of a PERSISTENT_2 file system with data repository associations (2.12 or later).
FSX_LUSTRE_VERSION = "2.15"
# Lifecycle figures (days) for old object versions and abandoned multipart uploads.
NONCURRENT_VERSION_DAYS = 30
INCOMPLETE_UPLOAD_DAYS = 7
UNTAGGED_IMAGE_DAYS = 14
TAGGED_IMAGES_KEPT = 50


class StorageStack(Stack):
    """Buckets, KMS key and ECR repositories of one environment.

    Attributes: key (kms.Key), checkpoint_bucket, artifacts_bucket, logs_bucket (s3.Bucket),
    repositories (dict role -> ecr.Repository), cache_rules (dict upstream host -> CfnPullThroughCacheRule).
    """

    def __init__(self, scope: Construct, id: str, *, cfg: DeploymentConfig, network: NetworkStack, **kw) -> None:
        super().__init__(scope, id, **kw)
        retain = cfg.retain_data
        removal = RemovalPolicy.RETAIN if retain else RemovalPolicy.DESTROY

        self.key = kms.Key(
            self, "DataKey", enable_key_rotation=True, removal_policy=removal,
            description=f"moerl {cfg.env}: checkpoints, artifacts and images",
        )
        # Server access logs: the log bucket must use SSE-S3 (SSE-KMS is not a supported
        # encryption for a server-access-log destination).
        self.logs_bucket = s3.Bucket(
            self, "AccessLogs",
            bucket_name=cfg.logs_bucket,
            encryption=s3.BucketEncryption.S3_MANAGED,
            block_public_access=s3.BlockPublicAccess.BLOCK_ALL,
            enforce_ssl=True,
            object_ownership=s3.ObjectOwnership.BUCKET_OWNER_ENFORCED,
            lifecycle_rules=[s3.LifecycleRule(id="expire-logs", expiration=Duration.days(365))],
            removal_policy=removal,
            auto_delete_objects=not retain,
        )
        self.checkpoint_bucket = self._data_bucket("Checkpoints", cfg.checkpoint_bucket, "checkpoints/", removal, retain)
        self.artifacts_bucket = self._data_bucket("Artifacts", cfg.artifacts_bucket, "artifacts/", removal, retain)
        pod_roles = [f"arn:{self.partition}:iam::{cfg.account}:role/{name}"
                     for name in [*(role for role, _ in cfg.trainer_identities.values()), cfg.pod_role_name("rollout")]]
        for bucket in (self.checkpoint_bucket, self.artifacts_bucket):
            bucket.add_to_resource_policy(iam.PolicyStatement(
                sid="PodRolesOnlyThroughTheVpcEndpoint", effect=iam.Effect.DENY, principals=[iam.AnyPrincipal()],
                actions=["s3:*"], resources=[bucket.bucket_arn, bucket.arn_for_objects("*")],
                conditions={"ArnEquals": {"aws:PrincipalArn": pod_roles},
                            "StringNotEquals": {"aws:SourceVpce": network.s3_endpoint.vpc_endpoint_id}}))

        # Nodes pull the public chart images through ECR (interface endpoints) instead of the NAT;
        # the first pull of a tag creates its repository under the prefix (ECR user guide, "Sync an
        # upstream registry with an Amazon ECR private registry").
        self.cache_rules = {
            host: ecr.CfnPullThroughCacheRule(self, f"Cache-{prefix}", ecr_repository_prefix=prefix,
                                              upstream_registry_url=host,
                                              credential_arn=cfg.pull_through_secrets.get(host))
            for host, prefix in cfg.cache_prefixes.items()
        }

        self.fsx = self._file_system(cfg, network) if cfg.fsx.enabled else None

        self.repositories: dict[str, ecr.Repository] = {}
        for role, name in cfg.image_repos.items():
            self.repositories[role] = ecr.Repository(
                self, f"{role.capitalize()}Repository",
                repository_name=name,
                image_scan_on_push=True,
                image_tag_mutability=ecr.TagMutability.IMMUTABLE,
                encryption=ecr.RepositoryEncryption.KMS,
                encryption_key=self.key,
                lifecycle_rules=[
                    ecr.LifecycleRule(
                        rule_priority=1, description="drop untagged images",
                        tag_status=ecr.TagStatus.UNTAGGED, max_image_age=Duration.days(UNTAGGED_IMAGE_DAYS),
                    ),
                    ecr.LifecycleRule(
                        rule_priority=2, description="keep the newest tagged images",
                        tag_status=ecr.TagStatus.ANY, max_image_count=TAGGED_IMAGES_KEPT,
                    ),
                ],
                removal_policy=removal,
                empty_on_delete=not retain,
            )

    def _data_bucket(self, id: str, name: str, log_prefix: str, removal: RemovalPolicy, retain: bool) -> s3.Bucket:
        return s3.Bucket(
            self, id,
            bucket_name=name,
            versioned=True,
            encryption=s3.BucketEncryption.KMS,
            encryption_key=self.key,
            bucket_key_enabled=True,
            block_public_access=s3.BlockPublicAccess.BLOCK_ALL,
            enforce_ssl=True,
            object_ownership=s3.ObjectOwnership.BUCKET_OWNER_ENFORCED,
            server_access_logs_bucket=self.logs_bucket,
            server_access_logs_prefix=log_prefix,
            lifecycle_rules=[
                s3.LifecycleRule(
                    id="old-versions-and-uploads",
                    noncurrent_version_expiration=Duration.days(NONCURRENT_VERSION_DAYS),
                    abort_incomplete_multipart_upload_after=Duration.days(INCOMPLETE_UPLOAD_DAYS),
                )
            ],
            removal_policy=removal,
            auto_delete_objects=not retain,
        )

    def _file_system(self, cfg: DeploymentConfig, network: NetworkStack) -> fsx.CfnFileSystem:
        """FSx for Lustre (PERSISTENT_2, one AZ: the nodes' subnet) linked to the checkpoint bucket's
        models_prefix/ (a data repository association, imported on creation and kept current as
        objects change; nothing is exported: S3 stays the source of truth and pods mount the file
        system read-only, charts8s/fsx.py). Datasets stay on S3: the feed alone reads them, once.

        Its security group admits Lustre only from the EFA security group, which only the GPU pools'
        nodes carry (trainer and rollout, the pods that mount it), and from itself (file servers),
        and sends Lustre only to those two: nothing else in or out. The EFA group in turn admits
        Lustre from the file system's group, as the FSx guide's client rules ask ("Lustre client VPC
        security group rules": the servers call back to clients on 988 and 1018-1023 for lock
        callbacks and recovery). Root is squashed to 65534 on every client (root_squash), so
        root on a node cannot write the imported models (owned by root, mode 0644).
        Attributes: fsx_sg. Outputs FsxFileSystemId, FsxMountName: FsxConfig.file_system_id and
        mount_name for charts8s.
        """
        self.fsx_sg = ec2.SecurityGroup(self, "FsxSecurityGroup", vpc=network.vpc, allow_all_outbound=False,
                                        description="FSx for Lustre: LNet from the GPU nodes and between file servers")
        for lo, hi in LUSTRE_PORTS:
            port, ports = (ec2.Port.tcp(lo), f"{lo}") if hi == lo else (ec2.Port.tcp_range(lo, hi), f"{lo}-{hi}")
            for peer, who in ((network.efa_sg, "GPU nodes"), (self.fsx_sg, "file servers")):
                self.fsx_sg.add_ingress_rule(peer, port, f"Lustre {ports} from {who}")
                self.fsx_sg.add_egress_rule(peer, port, f"Lustre {ports} to {who}")
            # The EFA group's rules live here, beside the FSx group: the network stack cannot refer to
            # this stack (it already refers to the network's).
            rule = dict(group_id=network.efa_sg.security_group_id, ip_protocol="tcp", from_port=lo, to_port=hi)
            ec2.CfnSecurityGroupIngress(self, f"EfaFromFsx{lo}", **rule, source_security_group_id=self.fsx_sg.security_group_id,
                                        description=f"Lustre {ports} from the FSx file servers")
            ec2.CfnSecurityGroupEgress(self, f"EfaToFsx{lo}", **rule, destination_security_group_id=self.fsx_sg.security_group_id,
                                       description=f"Lustre {ports} to the FSx file servers")
        # Every egress rule above names a group, so each is a resource of its own and the group has
        # no inline egress: EC2 would keep its default allow-all rule (see infra/network.py).
        cfn_sg: ec2.CfnSecurityGroup = self.fsx_sg.node.default_child  # type: ignore[assignment]
        cfn_sg.add_property_override("SecurityGroupEgress", [NO_TRAFFIC_EGRESS])
        (subnet,) = network.vpc.select_subnets(subnet_type=network.node_subnets.subnet_type,
                                                availability_zones=[cfg.az]).subnet_ids
        fs = fsx.CfnFileSystem(
            self, "Fsx", file_system_type="LUSTRE", file_system_type_version=FSX_LUSTRE_VERSION,
            storage_capacity=cfg.fsx.storage_gib, storage_type="SSD", subnet_ids=[subnet],
            security_group_ids=[self.fsx_sg.security_group_id], kms_key_id=self.key.key_id,
            lustre_configuration=fsx.CfnFileSystem.LustreConfigurationProperty(
                deployment_type="PERSISTENT_2", per_unit_storage_throughput=cfg.fsx.mbps_per_tib,
                data_compression_type="LZ4",
                # a cache of S3: nothing to back up
                automatic_backup_retention_days=0),
        )
        fs.apply_removal_policy(RemovalPolicy.DESTROY)
        links = []
        for prefix in (cfg.models_prefix,):
            link = fsx.CfnDataRepositoryAssociation(
                self, f"FsxLink-{prefix.replace('/', '-')}", file_system_id=fs.ref,
                file_system_path=f"/{prefix}", data_repository_path=f"s3://{cfg.checkpoint_bucket}/{prefix}/",
                batch_import_meta_data_on_create=True,
                s3=fsx.CfnDataRepositoryAssociation.S3Property(
                    auto_import_policy=fsx.CfnDataRepositoryAssociation.AutoImportPolicyProperty(
                        events=["NEW", "CHANGED", "DELETED"])),
            )
            link.node.add_dependency(self.checkpoint_bucket)
            links.append(link)
        self._root_squash(fs, links)
        # The associations' service-linked role reads the bucket's SSE-KMS objects through S3.
        self.key.add_to_resource_policy(iam.PolicyStatement(
            sid="FsxDataRepositoryReadsThroughS3", principals=[iam.AnyPrincipal()],
            actions=["kms:Decrypt", "kms:DescribeKey"], resources=["*"],
            conditions={"StringEquals": {"aws:PrincipalAccount": cfg.account, "kms:ViaService": f"s3.{cfg.region}.amazonaws.com"},
                        "ArnLike": {"aws:PrincipalArn": f"arn:{self.partition}:iam::{cfg.account}:role/{FSX_S3_ROLE_PATH}*"}}))
        CfnOutput(self, "FsxFileSystemId", value=fs.ref, description="fsx.file_system_id of the deployment config")
        CfnOutput(self, "FsxMountName", value=fs.attr_lustre_mount_name, description="fsx.mount_name of the deployment config")
        return fs

    def _root_squash(self, fs: fsx.CfnFileSystem, after: list) -> None:
        """Root squash on the file system (FSx API UpdateFileSystem, LustreConfiguration.
        RootSquashConfiguration): AWS::FSx::FileSystem has no such property, so CDK's
        AwsCustomResource makes the one SDK call, once the data repository links exist (FSx takes
        one update at a time)."""
        squash = cr.AwsCustomResource(
            self, "FsxRootSquash",
            on_update=cr.AwsSdkCall(
                service="FSx", action="updateFileSystem",
                parameters={"FileSystemId": fs.ref,
                            "LustreConfiguration": {"RootSquashConfiguration": {"RootSquash": FSX_ROOT_SQUASH}}},
                physical_resource_id=cr.PhysicalResourceId.of(f"{fs.ref}-root-squash")),
            policy=cr.AwsCustomResourcePolicy.from_sdk_calls(resources=[fs.attr_resource_arn]),
            install_latest_aws_sdk=False)
        for dep in after:
            squash.node.add_dependency(dep)
