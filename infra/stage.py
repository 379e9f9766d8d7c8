"""The stacks of one environment, added to an App (direct `cdk synth -c env=dev`) or to a Stage
(the promotion pipeline)."""

from __future__ import annotations

from aws_cdk import Environment, Stage, Tags
from aws_cdk import aws_iam as iam
from constructs import Construct

from infra.cluster import ClusterStack
from infra.config import DeploymentConfig
from infra.nag import acknowledge, acknowledgements, add_nag
from infra.network import NetworkStack
from infra.storage import StorageStack


def add_env_stacks(scope: Construct, cfg: DeploymentConfig) -> dict[str, object]:
    """Add the network, storage and cluster stacks of `cfg` to `scope`.

    Stack names: moerl-<env>-network, moerl-<env>-storage, moerl-<env>-cluster.
    Returns {"network": NetworkStack, "storage": StorageStack, "cluster": ClusterStack}.
    """
    env = Environment(account=cfg.account, region=cfg.region)
    p = cfg.name_prefix
    network = NetworkStack(scope, "Network", cfg=cfg, env=env, stack_name=f"{p}-network",
                           description=f"moerl {cfg.env}: VPC, S3 endpoint, EFA security group")
    storage = StorageStack(scope, "Storage", cfg=cfg, network=network, env=env, stack_name=f"{p}-storage",
                           description=f"moerl {cfg.env}: checkpoint/artifact buckets, ECR repositories")
    cluster = ClusterStack(scope, "Cluster", cfg=cfg, network=network, storage=storage, env=env,
                           stack_name=f"{p}-cluster",
                           description=f"moerl {cfg.env}: EKS cluster, node groups, add-ons, Pod Identity")
    stacks = {"network": network, "storage": storage, "cluster": cluster}
    for kind, stack in stacks.items():
        # Every role the stack makes (its own, the custom-resource providers' and the kubectl
        # handler's) carries the boundary the execution policy requires (infra/execution_policy.py).
        iam.PermissionsBoundary.of(stack).apply(
            iam.ManagedPolicy.from_managed_policy_arn(stack, "PermissionsBoundary", cfg.boundary_arn))
        Tags.of(stack).add("project", "moerl")
        Tags.of(stack).add("environment", cfg.env)
        acknowledge(stack, acknowledgements(kind, cfg))
    return stacks


class EnvStage(Stage):
    """One environment as a pipeline stage. Attribute: stacks (see add_env_stacks)."""

    def __init__(self, scope: Construct, id: str, *, cfg: DeploymentConfig, **kw) -> None:
        super().__init__(scope, id, env=Environment(account=cfg.account, region=cfg.region), **kw)
        self.stacks = add_env_stacks(self, cfg)
        add_nag(self)
