"""Storage stack: checkpoint and artifacts buckets, their access-log bucket, ECR repositories and
the ECR pull-through cache rules of the public registries the cluster's charts pull from.

Data survives `cdk destroy` when `cfg.retain_data` (required in prod); in dev the buckets and
repositories are emptied and removed with the stack.

The data buckets refuse the Pod Identity roles (trainer, rollout; named by
DeploymentConfig.pod_role_name) any request that does not come through the VPC's S3 gateway
endpoint (aws:SourceVpce; S3 user guide, "Controlling access from VPC endpoints with bucket
policies"): credentials taken from a pod do not work from outside the VPC. Operators, the
pipeline and CloudFormation are not fenced.
"""

from __future__ import annotations

from aws_cdk import Duration, RemovalPolicy, Stack
from aws_cdk import aws_ecr as ecr
from aws_cdk import aws_iam as iam
from aws_cdk import aws_kms as kms
from aws_cdk import aws_s3 as s3
from constructs import Construct

from infra.config import DeploymentConfig
from infra.network import NetworkStack

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
        pod_roles = [f"arn:{self.partition}:iam::{cfg.account}:role/{cfg.pod_role_name(r)}" for r in ("trainer", "rollout")]
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
