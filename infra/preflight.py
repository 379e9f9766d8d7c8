"""Checks to run against the target account before `cdk deploy`, for what the templates cannot
create themselves: every admin role of `admin_role_arns` that the stack does not create must exist
(EKS rejects an access entry for a missing principal, and does so after the cluster is up); every
principal of `admin_principals` must exist (IAM refuses a trust policy that names a missing one);
the permissions boundary moerl-<env>-boundary must exist (every role is created with it; the
execution policy allows no other; infra/execution_policy.py prints it).

    python -m infra.preflight --env staging [--config staging.yaml]     # exit 0 ok, 2 a problem

Uses the caller's AWS credentials (boto3's default chain; AWS_ENDPOINT_URL is honoured). Prints
one line per problem on stderr, naming the field and the ARN.
"""

from __future__ import annotations

import sys

import boto3

from infra.config import DeploymentConfig, config_of_args, config_parser


def missing_admin_roles(cfg: DeploymentConfig, iam_client) -> list[str]:
    """ARNs of admin_role_arns that neither exist in the account nor are created by the stack.

    A role of another account cannot be read from here and is reported as well (an access entry
    needs a principal of the cluster's account or one it can read).
    """
    created = set(cfg.created_admin_roles)
    missing = []
    for arn in cfg.admin_role_arns:
        if arn in created:
            continue
        account, name = arn.split(":")[4], arn.split(":role/", 1)[1].rsplit("/", 1)[-1]
        if account != cfg.account:
            missing.append(arn)
            continue
        try:
            iam_client.get_role(RoleName=name)
        except iam_client.exceptions.NoSuchEntityException:
            missing.append(arn)
    return missing


def missing_principals(cfg: DeploymentConfig, iam_client) -> list[str]:
    """ARNs of admin_principals (roles or users) that do not exist in the account."""
    missing = []
    for arn in cfg.admin_principals:
        kind, name = arn.split(":", 5)[5].split("/", 1)
        get = iam_client.get_role if kind == "role" else iam_client.get_user
        try:
            get(**{"RoleName" if kind == "role" else "UserName": name.rsplit("/", 1)[-1]})
        except iam_client.exceptions.NoSuchEntityException:
            missing.append(arn)
    return missing


def boundary_missing(cfg: DeploymentConfig, iam_client) -> bool:
    """True when the permissions boundary policy (cfg.boundary_arn) does not exist."""
    try:
        iam_client.get_policy(PolicyArn=cfg.boundary_arn)
    except iam_client.exceptions.NoSuchEntityException:
        return True
    return False


def main(argv: list[str] | None = None) -> int:
    """CLI entry; exit 2 with one line per problem on stderr."""
    p = config_parser("infra.preflight", __doc__.splitlines()[0])
    args = p.parse_args(argv)
    cfg = config_of_args(args, "infra.preflight")
    if cfg is None:
        return 2

    iam = boto3.client("iam", region_name=cfg.region)
    problems = [f"admin_role_arns: {arn} does not exist in account {cfg.account} (create it, or leave the default "
                "moerl-<env>-admin to the stack with create_admin_role)" for arn in missing_admin_roles(cfg, iam)]
    problems += [f"admin_principals: {arn} does not exist in account {cfg.account} (IAM refuses a trust policy "
                 "naming it)" for arn in missing_principals(cfg, iam)]
    if boundary_missing(cfg, iam):
        problems.append(f"the permissions boundary {cfg.boundary_arn} does not exist: create it from "
                        f"`python -m infra.execution_policy --env {cfg.env} --boundary` (README, bootstrap)")
    for line in problems:
        print(f"infra.preflight: {line}", file=sys.stderr)
    return 2 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
