"""Scale node groups to their configured sizes after `cdk deploy`, and to 0 before a deploy that
replaces the nodes of a fixed-capacity group: prints the AWS CLI commands (one definition of
sizes: infra/config.py).

    python -m infra.scale --env prod [--config prod.yaml]            # up to min/desired/max
    python -m infra.scale --env prod --before-update                 # fixed-capacity groups to 0

GPU node groups are created empty (NodePool.create_size) so that CloudFormation does not wait
for GPU capacity; `aws eks update-nodegroup-config` then sets the sizes (EKS user guide,
"Create a managed node group with Capacity Blocks for ML": desired size 0 at create, scale with
update-nodegroup-config; a Capacity Block group must be at desired size 0 while it is upgraded).

Fixed capacity (`NodePool.fixed_capacity`: a Capacity Block, an On-Demand Capacity Reservation or
a cluster placement group) holds exactly the pool's nodes, and a managed node group update first
launches max(2 x AZs, maxUnavailable) more (EKS user guide, "Understand each phase of node
updates"): the launch fails and so does the stack update. Such groups use the MINIMAL update
strategy (old nodes terminated first; infra/cluster.py), and the procedure before a deploy that
changes their launch template or AMI is: stop the job (its last checkpoint is its resume point),
`--before-update | sh`, wait for the group to reach 0 nodes, `cdk deploy`, then the scale-up
commands. Pipe the output to `sh` once it reads right.
"""

from __future__ import annotations

import shlex
import sys

from infra.config import DeploymentConfig, NodePool, config_of_args, config_parser


def nodegroup_name(cfg: DeploymentConfig, pool: NodePool) -> str:
    """The EKS node group name of `pool` (infra/cluster.py names every group this way)."""
    return f"{cfg.name_prefix}-{pool.name}"


def scale_command(cfg: DeploymentConfig, pool: NodePool, min_size: int, desired: int, max_size: int) -> list[str]:
    """argv of `aws eks update-nodegroup-config` setting `pool`'s node group to the given sizes."""
    return ["aws", "eks", "update-nodegroup-config", "--region", cfg.region, "--cluster-name", cfg.name_prefix,
            "--nodegroup-name", nodegroup_name(cfg, pool),
            "--scaling-config", f"minSize={min_size},maxSize={max_size},desiredSize={desired}"]


def scale_up_commands(cfg: DeploymentConfig) -> list[list[str]]:
    """Commands that bring every pool created below its configured size to min/desired/max."""
    return [scale_command(cfg, p, p.min_size, p.desired_size, p.max_size)
            for p in cfg.pools.values() if p.scaled_after_create]


def before_update_commands(cfg: DeploymentConfig) -> list[list[str]]:
    """Commands that scale every fixed-capacity pool (Capacity Block, ODCR, placement group) to 0
    nodes, to run before a deploy that replaces its nodes (module docstring)."""
    return [scale_command(cfg, p, 0, 0, p.max_size) for p in cfg.pools.values() if p.fixed_capacity]


def main(argv: list[str] | None = None) -> int:
    """CLI entry; exit 2 with one line on stderr for a bad config."""
    p = config_parser("infra.scale", __doc__.splitlines()[0])
    p.add_argument("--before-update", action="store_true", help="scale fixed-capacity groups (Capacity Block, ODCR, placement group) to 0")
    args = p.parse_args(argv)
    cfg = config_of_args(args, "infra.scale")
    if cfg is None:
        return 2
    commands = before_update_commands(cfg) if args.before_update else scale_up_commands(cfg)
    for argv_ in commands:
        print(shlex.join(argv_))
    return 0


if __name__ == "__main__":
    sys.exit(main())
