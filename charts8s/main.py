"""Synthesize the moerl workloads into dist/*.k8s.yaml.

    python -m charts8s.main --env dev [--workloads my.yaml] [--outdir dist]
    cdk8s synth            # cdk8s.yaml runs the line above; MOERL_ENV / MOERL_WORKLOADS select

Everything is checked before the first file is written (infra.config.ConfigError,
charts8s.workloads.WorkloadError), so a bad input leaves an existing dist/ untouched.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from pathlib import Path

import cdk8s

from infra.config import ConfigError, load_config
from charts8s.benchrollout import BenchRolloutChart
from charts8s.buffer import BufferChart
from charts8s.cluster import ClusterChart
from charts8s.envpool import EnvPoolChart
from charts8s.feed import FeedChart
from charts8s.fsx import FsxChart
from charts8s.kube import k8s_module
from charts8s.rewardmodel import RewardModelChart
from charts8s.rollout import RolloutChart
from charts8s.router import RouterChart
from charts8s.trainer import TrainerChart
from charts8s.workloads import Plan, WorkloadError, load_workloads


def build(plan: Plan, outdir: str | Path) -> list[Path]:
    """Write one file per chart (cluster, buffer, rollout, trainer, envpool, feed; fsx with fsx.enabled; rewardmodel when
    the run config names task.reward_model; bench-rollout-<profile> per bench_rollout profile) into
    `outdir`.

    Synthesizes into a temporary directory beside `outdir` and swaps it in, so a failure leaves
    the previous output whole. Returns the written files.

    Raises:
        WorkloadError: `outdir` is a file, a directory holding anything but ``*.k8s.yaml``, or one
            whose parent cannot hold a new directory.
    """
    k8s_module(plan.cfg.k8s_version)  # fail early when the version's generated classes are missing
    outdir = Path(outdir)
    if outdir.exists() and not outdir.is_dir():
        raise WorkloadError(f"--outdir: {outdir} exists and is not a directory")
    if outdir.is_dir():
        # The whole directory is replaced: refuse one that holds anything but earlier output.
        foreign = sorted(p.name for p in outdir.iterdir() if not p.name.endswith(".k8s.yaml"))
        if foreign:
            raise WorkloadError(f"--outdir: {outdir} holds files that are not synthesized manifests "
                                f"({', '.join(foreign[:3])}{', ...' if len(foreign) > 3 else ''}); "
                                "choose an empty or a dist/ directory")
    try:
        outdir.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=outdir.parent, prefix=f".{outdir.name}."))
    except OSError as e:
        raise WorkloadError(f"--outdir: {outdir}: cannot make a directory in {outdir.parent}: {e.strerror}") from None
    try:
        app = cdk8s.App(outdir=str(tmp), yaml_output_type=cdk8s.YamlOutputType.FILE_PER_CHART)
        ClusterChart(app, plan)
        if plan.cfg.fsx.enabled:
            FsxChart(app, plan)
        BufferChart(app, plan)
        if not (plan.run.env.name and plan.run.env.url):  # a user's env.url: served elsewhere
            EnvPoolChart(app, plan)
        RolloutChart(app, plan)
        if plan.run.rollout.router:
            RouterChart(app, plan)
        TrainerChart(app, plan)
        FeedChart(app, plan)
        if plan.run.task.reward_model:
            RewardModelChart(app, plan)
        for profile in plan.bench_layouts():
            BenchRolloutChart(app, plan, profile)
        app.synth()
        if outdir.exists():
            shutil.rmtree(outdir)
        os.replace(tmp, outdir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return sorted(outdir.glob("*.k8s.yaml"))


def main(argv: list[str] | None = None) -> int:
    """CLI entry; exit 2 with one line on stderr for a bad config or workload file."""
    p = argparse.ArgumentParser(prog="charts8s", description=__doc__.splitlines()[0])
    p.add_argument("--env", default=os.environ.get("MOERL_ENV", "dev"))
    p.add_argument("--config", default=os.environ.get("MOERL_DEPLOY_CONFIG"), help="deployment overrides YAML (infra)")
    p.add_argument("--workloads", default=os.environ.get("MOERL_WORKLOADS"), help="workloads YAML (charts8s)")
    p.add_argument("--outdir", default=os.environ.get("CDK8S_OUTDIR", "dist"))
    p.add_argument("--read-model-config", action="store_true",
                   help="read the served model's config.json from the store with this machine's AWS credentials "
                        "(an FP8 copy is then refused here, not at the engine pods' start)")
    args = p.parse_args(argv)
    try:
        plan = load_workloads(load_config(args.env, args.config), args.workloads, read_store=args.read_model_config)
        files = build(plan, args.outdir)
    except (ConfigError, WorkloadError, RuntimeError) as e:
        print(f"charts8s: {e}", file=sys.stderr)
        return 2
    for f in files:
        print(f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
