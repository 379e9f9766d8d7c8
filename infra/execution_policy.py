"""The CloudFormation execution policy of a target account: what the deploy role may do, in place
of AdministratorAccess (`cdk bootstrap --cloudformation-execution-policies`), and the permissions
boundary every role the stacks create carries.

    python -m infra.execution_policy --env prod [--config prod.yaml] > moerl-cfn-execution.json
    python -m infra.execution_policy --env prod [--config prod.yaml] --boundary > moerl-prod-boundary.json
    aws iam create-policy --policy-name moerl-prod-boundary --policy-document file://moerl-prod-boundary.json
    aws iam create-policy --policy-name moerl-cfn-execution --policy-document file://moerl-cfn-execution.json
    npx aws-cdk@<infra/cdk-cli pin> bootstrap aws://<account>/<region> --trust <tooling account> \\
        --cloudformation-execution-policies arn:aws:iam::<account>:policy/moerl-cfn-execution

CloudFormation acts with this role on every resource of the environment's stacks, so the policy
names the services of those resources (SERVICES: every resource type the stacks synthesize, and
the Lambda-backed custom resources they invoke) and scopes IAM to what the stacks create: roles
and instance profiles whose names start with the environment's prefix (CloudFormation names a
role `<stack name>-<logical id>-<suffix>`, and the stacks are `moerl-<env>-*`; the named ones
are `moerl-<env>-trainer-<h>|rollout|admin`), passing only those roles, and the service-linked
roles EKS, EC2 Spot, ECR (its pull-through cache's among them) and FSx use. A role is created
only with the boundary moerl-<env>-boundary (DeploymentConfig.boundary_arn; infra/stage.py puts
it on every role), which the policy cannot change or remove, and AWS managed policies are
attached only from MANAGED_POLICIES, the ones the stacks attach: a role the deploy role makes
can never do more than the boundary, which excludes IAM writes and Organizations. A data
repository association of FSx creates and fills its own service-linked role with the caller's
rights (AWSServiceRoleForFSxS3Access_<file system>; aws-fsx-csi-driver docs/install.md): the
policy allows that on the role path of that service only. No user, group, access key or
account-wide IAM change is allowed. tests/test_infra_stacks.py checks every synthesized resource
type against it and evaluates the deploy's IAM requests under it with an IAM policy simulator.
"""

from __future__ import annotations

import json
import sys

from infra.config import DeploymentConfig, config_of_args, config_parser

# CloudFormation resource-type service -> IAM action prefix, for every type the stacks create.
SERVICES = {"EC2": "ec2", "ECR": "ecr", "EKS": "eks", "FSx": "fsx", "KMS": "kms", "Lambda": "lambda",
            "Logs": "logs", "S3": "s3", "SSM": "ssm"}
# Service-linked roles the resources need (each service's user guide, "Using service-linked roles").
SERVICE_LINKED = ("eks.amazonaws.com", "eks-nodegroup.amazonaws.com", "spot.amazonaws.com",
                  "ecr.amazonaws.com", "pullthroughcache.ecr.amazonaws.com", "autoscaling.amazonaws.com",
                  "fsx.amazonaws.com", "s3.data-source.lustre.fsx.amazonaws.com")
# The role path of the service-linked role a data repository association creates and then fills
# (attached and inline policies) with the caller's rights.
FSX_S3_SERVICE_ROLES = "role/aws-service-role/s3.data-source.lustre.fsx.amazonaws.com/*"
# The AWS managed policies the stacks attach to their roles (tests/test_infra_stacks.py checks
# every ManagedPolicyArns of every synthesized role is here).
MANAGED_POLICIES = ("AmazonEKSClusterPolicy", "AmazonEKSWorkerNodePolicy", "AmazonEC2ContainerRegistryPullOnly",
                    "AmazonSSMManagedInstanceCore", "AmazonEKS_CNI_Policy", "service-role/AmazonEBSCSIDriverPolicy",
                    "service-role/AWSLambdaBasicExecutionRole", "service-role/AWSLambdaVPCAccessExecutionRole",
                    "AmazonEC2ContainerRegistryReadOnly", "AmazonElasticContainerRegistryPublicReadOnly")
# Actions on this environment's roles beyond creating them, attaching managed policies and
# setting the boundary (each of those has its own condition below).
_IAM_ROLE_ACTIONS = ["iam:DeleteRole", "iam:GetRole", "iam:UpdateRole", "iam:TagRole",
                     "iam:UntagRole", "iam:UpdateAssumeRolePolicy", "iam:PutRolePolicy", "iam:GetRolePolicy",
                     "iam:DeleteRolePolicy", "iam:DetachRolePolicy",
                     "iam:ListRolePolicies", "iam:ListAttachedRolePolicies", "iam:ListRoleTags",
                     "iam:PassRole", "iam:CreateInstanceProfile", "iam:DeleteInstanceProfile",
                     "iam:GetInstanceProfile", "iam:AddRoleToInstanceProfile", "iam:RemoveRoleFromInstanceProfile",
                     "iam:ListInstanceProfilesForRole"]


def execution_policy(cfg: DeploymentConfig) -> dict:
    """The IAM policy document (dict) CloudFormation may use to deploy `cfg`'s stacks."""
    arn = f"arn:aws:iam::{cfg.account}"
    roles = f"{arn}:role/{cfg.name_prefix}-*"
    return {"Version": "2012-10-17", "Statement": [
        {"Sid": "StackServices", "Effect": "Allow", "Action": [f"{p}:*" for p in sorted(SERVICES.values())],
         "Resource": "*"},
        {"Sid": "ThisEnvironmentsRoles", "Effect": "Allow", "Action": _IAM_ROLE_ACTIONS,
         "Resource": [roles, f"{arn}:instance-profile/{cfg.name_prefix}-*"]},
        {"Sid": "RolesOnlyWithTheBoundary", "Effect": "Allow",
         "Action": ["iam:CreateRole", "iam:PutRolePermissionsBoundary"], "Resource": roles,
         "Condition": {"StringEquals": {"iam:PermissionsBoundary": cfg.boundary_arn}}},
        {"Sid": "OnlyTheStacksManagedPolicies", "Effect": "Allow", "Action": "iam:AttachRolePolicy", "Resource": roles,
         "Condition": {"ArnEquals": {"iam:PolicyARN": [f"arn:aws:iam::aws:policy/{p}" for p in MANAGED_POLICIES]}}},
        {"Sid": "ServiceLinkedRoles", "Effect": "Allow", "Action": "iam:CreateServiceLinkedRole", "Resource": "*",
         "Condition": {"StringEquals": {"iam:AWSServiceName": list(SERVICE_LINKED)}}},
        {"Sid": "FsxDataRepositoryRole", "Effect": "Allow", "Action": ["iam:AttachRolePolicy", "iam:PutRolePolicy"],
         "Resource": f"{arn}:{FSX_S3_SERVICE_ROLES}"},
        {"Sid": "ReadIam", "Effect": "Allow", "Action": ["iam:GetPolicy", "iam:GetPolicyVersion"],
         "Resource": "arn:aws:iam::aws:policy/*"},
    ]}


def boundary_policy(cfg: DeploymentConfig) -> dict:
    """The permissions boundary of every role the stacks create (moerl-<env>-boundary): anything
    but IAM, Organizations and account changes, plus reading IAM and creating service-linked
    roles (the EKS cluster role's AmazonEKSClusterPolicy creates ELB's). A role's own policies
    still decide what it may do; this caps what the deploy role can hand any of them."""
    return {"Version": "2012-10-17", "Statement": [
        {"Sid": "AllButIamAndOrganizations", "Effect": "Allow",
         "NotAction": ["iam:*", "organizations:*", "account:*"], "Resource": "*"},
        {"Sid": "ReadIamAndServiceLinkedRoles", "Effect": "Allow",
         "Action": ["iam:Get*", "iam:List*", "iam:CreateServiceLinkedRole"], "Resource": "*"},
    ]}


def main(argv: list[str] | None = None) -> int:
    """CLI entry: print the policy JSON (or the boundary's); exit 2 with one line on stderr for a bad config."""
    p = config_parser("infra.execution_policy", __doc__.splitlines()[0])
    p.add_argument("--boundary", action="store_true",
                   help="print the permissions boundary of the stacks' roles (moerl-<env>-boundary) instead")
    args = p.parse_args(argv)
    cfg = config_of_args(args, "infra.execution_policy")
    if cfg is None:
        return 2
    print(json.dumps((boundary_policy if args.boundary else execution_policy)(cfg), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
