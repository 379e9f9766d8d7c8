"""Who this process is in expert parallelism (EP), and which dispatcher backend it uses.

Experts are split evenly over the ranks of the EP group: rank r holds global experts
[r * E_local, (r + 1) * E_local). The backend moves tokens between ranks:
`local` (EP size 1, the reference), `alltoall` (torch.distributed.all_to_all_single, gloo on CPU or
NCCL on GPU) or `deepep` (DeepEP kernels, NVLink/RDMA, GPU only).
"""

from __future__ import annotations

import importlib.util
import logging
from dataclasses import dataclass

import torch
import torch.distributed as dist

from app.config import ParallelConfig

log = logging.getLogger(__name__)

BACKENDS = ("local", "alltoall", "deepep")


@dataclass
class EPContext:
    """This process's place in expert parallelism.

    Attributes:
        group: the EP process group (None for EP size 1).
        rank: rank inside `group` (0 for EP size 1); it owns experts [rank * E_local, (rank + 1) * E_local).
        size: number of EP ranks.
        backend: resolved dispatcher backend, one of "local", "alltoall", "deepep".
    """

    group: dist.ProcessGroup | None
    rank: int
    size: int
    backend: str

    @classmethod
    def local(cls) -> "EPContext":
        """EP size 1: every expert lives in this process."""
        return cls(group=None, rank=0, size=1, backend="local")


def deepep_unavailable_reason(group: dist.ProcessGroup | None = None) -> str | None:
    """Why the DeepEP backend cannot run here, or None if it can.

    DeepEP needs the `deep_ep` module (PyPI `sgl-deep-ep` or a source build), CUDA tensors, an
    NCCL process group and Hopper-class GPUs (sm90; DeepEP README, "Requirements").
    """
    if importlib.util.find_spec("deep_ep") is None:
        return "the deep_ep module is not installed (pip install sgl-deep-ep in GPU images)"
    if not torch.cuda.is_available():
        return "CUDA is not available"
    if group is not None and dist.get_backend(group) != "nccl":
        return f"the EP process group uses {dist.get_backend(group)!r}, DeepEP needs 'nccl'"
    major, minor = torch.cuda.get_device_capability()
    if major < 9:
        return f"GPU compute capability {major}.{minor} < 9.0 (DeepEP targets sm90+)"
    return None


_logged_auto = False


def init_ep(cfg: ParallelConfig, group: dist.ProcessGroup | None = None) -> EPContext:
    """Resolve the EP part of ``trainer.parallel`` into an EPContext.

    Args:
        cfg: ``trainer.parallel`` (``ep``, ``ep_backend``). ``ep`` 1 always gives the `local` backend.
        group: EP process group (the ``ep`` dimension of the trainer's device mesh,
            app/trainer/parallel.py); defaults to the default (world) group when ``ep`` > 1.

    Returns:
        The EPContext; `backend` is never "auto". For `auto`: `deepep` if DeepEP can run here,
        else `alltoall` (the reason is logged once per process).

    Raises:
        RuntimeError: ``ep`` > 1 but torch.distributed is not initialized.
        ValueError: the group size differs from ``ep``, ``ep_backend`` is "local" with
            ``ep`` > 1, or ``ep_backend`` is "deepep" where DeepEP cannot run (reason given).
    """
    global _logged_auto
    if cfg.ep == 1:
        if cfg.ep_backend not in ("auto", "local"):
            log.info("trainer.parallel.ep=1: using the local dispatcher instead of %r", cfg.ep_backend)
        return EPContext.local()
    if cfg.ep_backend == "local":
        raise ValueError(f"trainer.parallel.ep_backend='local' needs trainer.parallel.ep=1, got ep={cfg.ep}")
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            f"trainer.parallel.ep={cfg.ep} needs torch.distributed initialized (start the trainer with torchrun)"
        )
    group = group if group is not None else dist.group.WORLD
    size = dist.get_world_size(group)
    if size != cfg.ep:
        raise ValueError(f"trainer.parallel.ep={cfg.ep} but the EP process group has {size} ranks")
    rank = dist.get_rank(group)
    backend = cfg.ep_backend
    if backend in ("auto", "deepep"):
        reason = deepep_unavailable_reason(group)
        if backend == "deepep" and reason:
            raise ValueError(f"trainer.parallel.ep_backend='deepep' cannot run here: {reason}")
        if backend == "auto":
            backend = "alltoall" if reason else "deepep"
            if not _logged_auto:
                _logged_auto = True
                if reason:
                    log.warning("trainer.parallel.ep_backend=auto: using alltoall because %s", reason)
                else:
                    log.info("trainer.parallel.ep_backend=auto: using deepep")
    return EPContext(group=group, rank=rank, size=size, backend=backend)
