"""The CloudFormation execution policy of a target account: what the deploy role may do, in place
of AdministratorAccess (`cdk bootstrap --cloudformation-execution-policies`).

    python -m infra.execution_policy --env prod [--config prod.yaml] > moerl-cfn-execution.json
    aws iam create-policy --policy-name moerl-cfn-execution --policy-document file://moerl-cfn-execution.json
    npx aws-cdk@<infra/cdk-cli pin> bootstrap aws://<account>/<region> --trust <tooling account> \\
        --cloudformation-execution-policies arn:aws:iam::<account>:policy/moerl-cfn-execution

CloudFormation acts with this role on every resource of the environment's stacks, so the policy
names the services of those resources (SERVICES: every resource type the stacks synthesize, and
the Lambda-backed custom resources they invoke) and scopes IAM to what the stacks create: roles
and instance profiles whose names start with the environment's prefix (CloudFormation names a
role `<stack name>-<logical id>-<suffix>`, and the stacks are `moerl-<env>-*`; the named ones
are `moerl-<env>-trainer|rollout|admin`), passing only those roles, and the service-linked roles
EKS, EC2 Spot and ECR use. No user, group, access key or account-wide IAM change is allowed.
tests/test_infra_pipeline.py checks every synthesized resource type against it.
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
                  "ecr.amazonaws.com", "autoscaling.amazonaws.com", "fsx.amazonaws.com",
                  "s3.data-source.lustre.fsx.amazonaws.com")
_IAM_ROLE_ACTIONS = ["iam:CreateRole", "iam:DeleteRole", "iam:GetRole", "iam:UpdateRole", "iam:TagRole",
                     "iam:UntagRole", "iam:UpdateAssumeRolePolicy", "iam:PutRolePolicy", "iam:GetRolePolicy",
                     "iam:DeleteRolePolicy", "iam:AttachRolePolicy", "iam:DetachRolePolicy",
                     "iam:ListRolePolicies", "iam:ListAttachedRolePolicies", "iam:ListRoleTags",
                     "iam:PassRole", "iam:CreateInstanceProfile", "iam:DeleteInstanceProfile",
                     "iam:GetInstanceProfile", "iam:AddRoleToInstanceProfile", "iam:RemoveRoleFromInstanceProfile",
                     "iam:ListInstanceProfilesForRole"]


def execution_policy(cfg: DeploymentConfig) -> dict:
    """The IAM policy document (dict) CloudFormation may use to deploy `cfg`'s stacks."""
    arn = f"arn:aws:iam::{cfg.account}"
    return {"Version": "2012-10-17", "Statement": [
        {"Sid": "StackServices", "Effect": "Allow", "Action": [f"{p}:*" for p in sorted(SERVICES.values())],
         "Resource": "*"},
        {"Sid": "ThisEnvironmentsRoles", "Effect": "Allow", "Action": _IAM_ROLE_ACTIONS,
         "Resource": [f"{arn}:role/{cfg.name_prefix}-*", f"{arn}:instance-profile/{cfg.name_prefix}-*"]},
        {"Sid": "ServiceLinkedRoles", "Effect": "Allow", "Action": "iam:CreateServiceLinkedRole", "Resource": "*",
         "Condition": {"StringEquals": {"iam:AWSServiceName": list(SERVICE_LINKED)}}},
        {"Sid": "ReadIam", "Effect": "Allow", "Action": ["iam:GetPolicy", "iam:GetPolicyVersion"],
         "Resource": "arn:aws:iam::aws:policy/*"},
    ]}


def main(argv: list[str] | None = None) -> int:
    """CLI entry: print the policy JSON; exit 2 with one line on stderr for a bad config."""
    p = config_parser("infra.execution_policy", __doc__.splitlines()[0])
    args = p.parse_args(argv)
    cfg = config_of_args(args, "infra.execution_policy")
    if cfg is None:
        return 2
    print(json.dumps(execution_policy(cfg), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
