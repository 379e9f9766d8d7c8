"""`moerl train --config run.yaml`: one trainer rank, started by torchrun on every GPU (or CPU
process) of the trainer gang.

The pieces, as torchtitan lays them out: the parallel layout (app/layout.py, app/trainer/parallel.py),
the modules (models.py), the step (step.py: loss, backward, clip, optimizer; the losses in
grpo.py and ppo.py), the trainer (trainer.py: build, step, ledger and metrics, and the loop;
intake.py: batches from the buffer), training state (state.py) and publishing (publish.py).
"""

from __future__ import annotations

import json
import os
import threading
from dataclasses import asdict
from pathlib import Path

import torch.distributed as dist
import typer

from app.config import RunConfig
from app.logs import setup_logging
from app.metrics import export_forever
from app.model.dispatch.deepep import release_buffers
from app.trainer import TrainingError
from app.trainer.trainer import Trainer

cli = typer.Typer(add_completion=False, help="Run a GRPO trainer rank (start with torchrun).")


@cli.command()
def train(
    config: Path = typer.Option(..., "--config", exists=True, dir_okay=False, help="Run config YAML."),
    resume: bool = typer.Option(False, "--resume", help="Continue from the newest training state."),
    run_dir: Path = typer.Option(None, "--run-dir", help="Where metrics.jsonl goes; default runs/<run_id>."),
    metrics_port: int = typer.Option(0, "--metrics-port", min=0, max=65535,
                                     help="Rank 0 serves Prometheus /metrics here and copies metrics.jsonl "
                                          "and tensorboard/ to the run's store prefix each minute; 0: off."),
    metrics_addr: str = typer.Option("0.0.0.0", "--metrics-addr", help="Address rank 0's /metrics listens on."),
) -> None:
    """Run one trainer rank. Start every rank with torchrun (world = trainer.parallel's
    dp_replicate x dp_shard; app/layout.py)."""
    setup_logging(f"%(asctime)s rank{os.environ.get('RANK', '0')} %(message)s")
    state = None
    stop_export, exporter = threading.Event(), None
    try:
        cfg = RunConfig.load(config)
        run_dir = run_dir or Path("runs") / cfg.run_id
        if metrics_port and int(os.environ.get("RANK", "0")) == 0:
            exporter = threading.Thread(target=export_forever, args=(run_dir, cfg.run_id, metrics_port, cfg.store_url),
                                        kwargs={"stop": stop_export, "addr": metrics_addr}, daemon=True, name="metrics")
            exporter.start()
        state = Trainer(cfg, run_dir, resume).train()
        release_buffers()  # DeepEP's destroy is collective: every rank, before the group goes
    except (TrainingError, ValueError, ConnectionError, TimeoutError, FileNotFoundError) as e:
        # Bad input or a run-ending condition: one clear line, no traceback.
        typer.echo(f"moerl train (rank {os.environ.get('RANK', '0')}): {e}", err=True)
        raise SystemExit(1) from None  # (typer.Exit escapes app.cli's click group)
    finally:
        stop_export.set()  # a last copy of the figures to the store
        if exporter is not None:
            exporter.join(timeout=60)
        if dist.is_initialized():
            dist.destroy_process_group()
    if state is not None and int(os.environ.get("RANK", "0")) == 0:
        typer.echo(json.dumps({"done": True, **asdict(state)}))
