"""Synthesize the operations manifests into dist-ops/ (apart from dist/, which `kubectl apply -f
dist/` applies whole):

    python -m charts8s.ops --env prod [--nodes 2] [--min-busbw-gbps 0] [--outdir dist-ops]

monitoring.k8s.yaml (PodMonitors and scrape NetworkPolicies; apply once, after the cluster stack
installed kube-prometheus-stack), gpu-healthcheck.k8s.yaml (apply before a long job; delete it
to run it again), node-health.k8s.yaml (continuous GPU/EFA checks with quarantine, EFA counters;
charts8s/nodehealth.py), alerts.k8s.yaml and dashboards.k8s.yaml (charts8s/alerts.py,
charts8s/dashboards.py) and prepull.k8s.yaml (the GPU images pulled when a node joins;
charts8s/prepull.py; apply again when the image tag moves). Apply gpu-healthcheck and
node-health after `kubectl apply -f dist/` (prepull uses the workloads' namespace). Inputs are
checked before anything is written.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from pathlib import Path

import cdk8s

from charts8s.alerts import AlertsChart
from charts8s.dashboards import DashboardsChart
from charts8s.healthcheck import DCGM_HOSTS, HealthCheckChart
from charts8s.monitoring import MonitoringChart
from charts8s.nodehealth import NodeHealthChart
from charts8s.prepull import PrepullChart
from charts8s.workloads import Plan, WorkloadError, load_workloads
from infra.config import ConfigError, load_config


def build(plan: Plan, outdir: str | Path, nodes: int = 2, dcgm_level: int = 2, min_busbw_gbps: float = 0.0,
          dcgm_host: str = "node", stall_minutes: int = 30) -> list[Path]:
    """Write the operations manifests (module docstring) into `outdir` (replaced whole).

    Raises:
        WorkloadError: `outdir` holds files that are not synthesized manifests.
        ValueError: a health-check argument out of range (see HealthCheckChart).
    """
    outdir = Path(outdir)
    if outdir.exists() and (not outdir.is_dir() or any(not p.name.endswith(".k8s.yaml") for p in outdir.iterdir())):
        raise WorkloadError(f"--outdir: {outdir} is not a directory of synthesized manifests")
    outdir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=outdir.parent, prefix=f".{outdir.name}."))
    try:
        app = cdk8s.App(outdir=str(tmp), yaml_output_type=cdk8s.YamlOutputType.FILE_PER_CHART)
        MonitoringChart(app, plan)
        HealthCheckChart(app, plan, nodes=nodes, dcgm_level=dcgm_level, min_busbw_gbps=min_busbw_gbps,
                         dcgm_host=dcgm_host)
        NodeHealthChart(app, plan)
        AlertsChart(app, plan, stall_minutes=stall_minutes)
        DashboardsChart(app, plan)
        PrepullChart(app, plan)
        app.synth()
        if outdir.exists():
            shutil.rmtree(outdir)
        os.replace(tmp, outdir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return sorted(outdir.glob("*.k8s.yaml"))


def main(argv: list[str] | None = None) -> int:
    """CLI entry; exit 2 with one line on stderr for bad input."""
    p = argparse.ArgumentParser(prog="charts8s.ops", description=__doc__.splitlines()[0])
    p.add_argument("--env", default=os.environ.get("MOERL_ENV", "dev"))
    p.add_argument("--config", default=None, help="deployment overrides YAML (infra)")
    p.add_argument("--workloads", default=None, help="workloads YAML (charts8s; images)")
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--dcgm-level", type=int, default=2)
    p.add_argument("--min-busbw-gbps", type=float, default=0.0)
    p.add_argument("--dcgm-host", default="node", choices=DCGM_HOSTS,
                   help="diagnostics through the node's host engine (node) or one of the Job's own (embedded)")
    p.add_argument("--stall-minutes", type=int, default=30, help="MoerlTrainingStalled: minutes without a new version")
    p.add_argument("--outdir", default="dist-ops")
    args = p.parse_args(argv)
    try:
        plan = load_workloads(load_config(args.env, args.config), args.workloads)
        files = build(plan, args.outdir, args.nodes, args.dcgm_level, args.min_busbw_gbps, args.dcgm_host,
                      args.stall_minutes)
    except (ConfigError, WorkloadError, ValueError) as e:
        print(f"charts8s.ops: {e}", file=sys.stderr)
        return 2
    for f in files:
        print(f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
