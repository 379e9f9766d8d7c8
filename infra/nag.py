"""cdk-nag (AwsSolutions pack) registration and the acknowledgements, each with its reason.

cdk-nag 3 runs as a CDK policy-validation plugin: synth stops on any finding that is not
acknowledged, so a successful synth means zero unacknowledged errors (the report is written to
<outdir>/validation-report.json).
"""

from __future__ import annotations

from aws_cdk import Acknowledgment, Stack, Validations
from cdk_nag import AwsSolutionsChecks
from constructs import Construct

from infra.cluster import trainer_write_resources
from infra.config import DeploymentConfig, PipelineConfig

_AWS_POLICY = "AwsSolutions::AwsSolutions-IAM4[Policy::arn:<AWS::Partition>:iam::aws:policy/{}]"
_KUBECTL = ("made by aws_eks_v2's kubectl provider (aws-cdk-lib), which installs the device-plugin "
            "Helm charts; its IAM and runtime are maintained by the CDK team")

# Findings acknowledged in every cluster stack, with the reason.
CLUSTER_ACKNOWLEDGEMENTS: dict[str, str] = {
    _AWS_POLICY.format("AmazonEKSClusterPolicy"):
        "The EKS cluster service role needs AmazonEKSClusterPolicy (EKS user guide, cluster IAM role); "
        "AWS keeps it in step with the EKS control plane.",
    _AWS_POLICY.format("AmazonEKSWorkerNodePolicy"):
        "Node IAM role: required for kubelet registration and Pod Identity (EKS user guide, node IAM role).",
    _AWS_POLICY.format("AmazonEKS_CNI_Policy"):
        "VPC CNI role (Pod Identity of aws-node, not the node role): the CNI assigns pod IPs and EFA/ENA "
        "interfaces with it (EKS user guide); AWS keeps it in step with the CNI.",
    _AWS_POLICY.format("AmazonEC2ContainerRegistryPullOnly"):
        "Node IAM role: pull-only ECR access for images, the narrowest AWS policy for it.",
    _AWS_POLICY.format("AmazonSSMManagedInstanceCore"):
        "Node IAM role: SSM Session Manager replaces SSH for node debugging (no key pairs, no port 22).",
    _AWS_POLICY.format("service-role/AmazonEBSCSIDriverPolicy"):
        "EBS CSI controller (Pod Identity): AWS's policy for the driver; its create and delete actions are "
        "conditioned on the driver's own volume tags, and AWS keeps it in step with driver releases.",
    _AWS_POLICY.format("service-role/AWSLambdaBasicExecutionRole"): f"Lambda logging for functions {_KUBECTL}.",
    _AWS_POLICY.format("service-role/AWSLambdaVPCAccessExecutionRole"):
        f"The kubectl handler runs in the VPC to reach the private cluster endpoint; {_KUBECTL}.",
    _AWS_POLICY.format("AmazonEC2ContainerRegistryReadOnly"): f"Pulls Helm charts from OCI registries; {_KUBECTL}.",
    'AwsSolutions::AwsSolutions-IAM4[Policy::{"Fn::If":["ClusterKubectlProviderHandlerHasEcrPublic69E09706",'
    '{"Fn::Join":["",["arn:",{"Ref":"AWS::Partition"},":iam::aws:policy/AmazonElasticContainerRegistryPublicReadOnly"]]},'
    '{"Ref":"AWS::NoValue"}]}]': f"Conditional ECR Public read for chart pulls; {_KUBECTL}.",
    "AwsSolutions::AwsSolutions-L1": f"Lambda runtime of the kubectl handler is pinned by aws-cdk-lib; {_KUBECTL}.",
    "AwsSolutions::AwsSolutions-IAM5[Resource::<ClusterKubectlProviderHandler2E05C68A.Arn>:*]":
        f"The provider framework invokes any version of its own handler function; {_KUBECTL}.",
}


def acknowledgements(kind: str, cfg: DeploymentConfig) -> dict[str, str]:
    """Acknowledged finding id -> reason for one stack kind ("network" | "storage" | "cluster" | "pipeline")."""
    if kind == "network":
        return {"CloudFormation-Validate::W3010":
                "AZ names are fixed on purpose: every node group must sit in the one configured AZ "
                f"({cfg.az}) and the control plane in {cfg.control_plane_azs}; synth makes no lookups.",
                "AwsSolutions::AwsSolutions-EC23":
                "The interface endpoints' security groups admit TCP 443 from the VPC CIDR only "
                f"({cfg.vpc_cidr}, a Fn::GetAtt cdk-nag cannot resolve); nothing outside the VPC reaches them."}
    if kind == "storage":
        return {_AWS_POLICY.format("service-role/AWSLambdaBasicExecutionRole"):
                "Logging of the function of aws-cdk-lib's AwsCustomResource that turns on the FSx file "
                "system's root squash (one fsx:UpdateFileSystem call on that file system)."} if cfg.fsx.enabled else {}
    if kind != "cluster":
        return {}

    bucket = f"arn:<AWS::Partition>:s3:::{cfg.checkpoint_bucket}"
    prefixes = {f"{bucket}/{p}/*": f"the '{p}/' prefix" for p in (cfg.run_prefix, cfg.models_prefix, cfg.data_prefix)}
    prefixes.update({arn: f"one area of a run of trainer_runs ({arn.removeprefix(bucket + '/')})"
                     for entry in cfg.trainer_runs for arn in trainer_write_resources(cfg, bucket, entry)})
    repos = {f"arn:<AWS::Partition>:ecr:{cfg.region}:{cfg.account}:repository/{p}/*": p for p in cfg.cache_prefixes.values()}
    public = {
        "AwsSolutions::AwsSolutions-EKS1":
            f"The API endpoint is public only to the configured CIDR blocks {cfg.public_endpoint_cidrs} "
            "(public_endpoint_cidrs), so operators outside the VPC can apply the workload manifests.",
    } if cfg.public_endpoint_cidrs else {}
    return {
        **public,
        **CLUSTER_ACKNOWLEDGEMENTS,
        **{f"AwsSolutions::AwsSolutions-IAM5[Resource::{arn}]":
           f"Pod Identity roles reach only objects under {what} of the checkpoint bucket; runs, models and "
           "datasets are named at run time, so the key ends in a wildcard." for arn, what in prefixes.items()},
        **{f"AwsSolutions::AwsSolutions-IAM5[Resource::{arn}]":
           f"Nodes create and import only the repositories of the '{p}' pull-through cache rule; the first pull "
           "of an upstream image names its repository." for arn, p in repos.items()},
    }


_PIPELINE = ("made by CDK Pipelines (aws-cdk-lib pipelines.CodePipeline) for its own artifact bucket, "
             "KMS key, CodeBuild projects and cross-account deploy roles; scoped by the library to this pipeline")


def pipeline_acknowledgements(pcfg: PipelineConfig) -> dict[str, str]:
    """Acknowledged finding id -> reason for the pipeline stack (ids carry the tooling account/region)."""
    iam5 = "AwsSolutions::AwsSolutions-IAM5[{}]"
    out = {
        "AwsSolutions::AwsSolutions-S1":
            "The pipeline artifact bucket holds only build outputs for this pipeline; its access is "
            "already recorded by CloudTrail data events of the tooling account.",
    }
    for action in ("kms:GenerateDataKey*", "kms:ReEncrypt*", "s3:Abort*", "s3:DeleteObject*",
                   "s3:GetBucket*", "s3:GetObject*", "s3:List*"):
        out[iam5.format(f"Action::{action}")] = f"Action groups on the pipeline's own bucket and key, {_PIPELINE}."
    a, r = pcfg.account, pcfg.region
    for resource in (
        "*",  # cross-account role assumption by the deploy actions and CodeBuild report setup
        "<PipelineArtifactsBucketAEA9A052.Arn>/*",
        f"arn:*:iam::{a}:role/*",
        f"arn:<AWS::Partition>:codebuild:{r}:{a}:report-group/*",
        f"arn:<AWS::Partition>:codebuild:{r}:{a}:report-group/<PipelineBuildSynthCdkBuildProject6BEFA8E6>-*",
        f"arn:<AWS::Partition>:codebuild:{r}:{a}:report-group/<PipelineUpdatePipelineSelfMutationDAA41400>-*",
        f"arn:<AWS::Partition>:logs:{r}:{a}:log-group:/aws/codebuild/*",
        f"arn:<AWS::Partition>:logs:{r}:{a}:log-group:/aws/codebuild/<PipelineBuildSynthCdkBuildProject6BEFA8E6>:*",
        f"arn:<AWS::Partition>:logs:{r}:{a}:log-group:/aws/codebuild/<PipelineUpdatePipelineSelfMutationDAA41400>:*",
        # the infra test job before the first stage (infra/pipeline.py)
        f"arn:<AWS::Partition>:codebuild:{r}:{a}:report-group/<PipelineDevInfraTestsBFD081A0>-*",
        f"arn:<AWS::Partition>:logs:{r}:{a}:log-group:/aws/codebuild/<PipelineDevInfraTestsBFD081A0>:*",
    ):
        out[iam5.format(f"Resource::{resource}")] = f"Resource pattern {_PIPELINE}."
    return out


def add_nag(scope: Construct) -> None:
    """Register the AwsSolutions pack on an App or Stage (plugins do not cross Stage boundaries)."""
    Validations.of(scope).add_plugins(
        AwsSolutionsChecks(scope, verbose=True, write_suppressions_to_cloud_formation=True)
    )


def acknowledge(stack: Stack, rules: dict[str, str]) -> None:
    """Acknowledge `rules` (finding id -> reason) on `stack`; each reason goes into the template."""
    for rule, reason in rules.items():
        Validations.of(stack).acknowledge(Acknowledgment(id=rule, reason=reason))
