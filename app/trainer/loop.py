"""The training loop: `moerl train` (app/trainer/train.py) calls `run_training` on every rank.

The build, the step and what follows it are `app.trainer.trainer.Trainer`'s (its module docstring
holds the contracts: versions, training state and resume, the trained-sample record, metrics);
this module only loops.
"""

from __future__ import annotations

import logging
from pathlib import Path

from app.config import RunConfig
from app.trainer.intake import Stop
from app.trainer.state import TrainState
from app.trainer.trainer import Trainer

log = logging.getLogger("moerl.train")


def run_training(cfg: RunConfig, run_dir: Path, resume: bool = False) -> TrainState:
    """Train for ``trainer.steps`` steps (this rank's part). Returns the final state.

    Args:
        cfg: the run configuration.
        run_dir: where metrics.jsonl and trained.jsonl go (rank 0), and this rank's scratch
            (``trainer-publish/``) for files on their way to the store.
        resume: continue from the newest complete training state in the store (see
            app/trainer/trainer.py); without one, start from the initial weights. Either way the
            first version published is one after the newest in the store.

    Raises:
        ValueError: ``trainer.parallel`` does not fit the world or the model (app/layout.py);
            ``buffer.capacity_groups`` is smaller than ``trainer.groups_per_step``; the store
            already holds policy versions of this run and ``resume`` is False; ``run_dir`` holds
            metrics.jsonl or trained.jsonl while the store has no version of this run (an
            earlier run's records).
        TrainingError: no batch in time, too many non-finite steps in a row, a failed publish
            or save, Redis unreachable — raised on every rank with the same message (rank 0 may
            raise the original exception instead, e.g. BufferConnectionError naming the URL).
    """
    trainer = Trainer(cfg, run_dir, resume)
    try:
        trainer.start()
        while trainer.state.step < trainer.cfg.trainer.steps:
            trainer.train_step()
    except Stop:
        log.info("stop requested: ending at step %d, policy v%d", trainer.state.step, trainer.state.version)
        trainer.store_last()
    finally:
        trainer.close()
    trainer.finish()
    return trainer.state
