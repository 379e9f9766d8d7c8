"""Which dispatcher backend this process uses in expert parallelism (EP): `init_ep`.

`EPContext` (who this process is in EP) and `collective_device` are defined in
app/model/dispatch/__init__.py and the DeepEP checks (`deepep_unavailable_reason`) in
app/model/dispatch/deepep.py, below this module: the dispatchers need them and must not import
this module back. `EPContext` and `collective_device` are importable from here too, the name
most callers use.

Experts are split evenly over the ranks of the EP group: rank r holds global experts
[r * E_local, (r + 1) * E_local). The backend moves tokens between ranks:
`local` (EP size 1, the reference), `alltoall` (torch.distributed.all_to_all_single, gloo on CPU or
NCCL on GPU) or `deepep` (DeepEP kernels, NVLink/RDMA, GPU only).
"""

from __future__ import annotations

import logging
import os

import torch
import torch.distributed as dist

from app.config import ParallelConfig
from app.model.dispatch import EPContext, collective_device, deepep

log = logging.getLogger(__name__)

BACKENDS = ("local", "alltoall", "deepep")


_logged_auto = False


def deepep_gin_env(ep: int, ranks_per_node: int) -> dict[str, str]:
    """The trainer's environment for DeepEP by layout: ``EP_DISABLE_GIN=1`` when every EP group
    lies within one node, else nothing.

    EP is the innermost dimension of the trainer's mesh (app/layout.py: ``[dp_replicate,
    efsdp, ep]``) and torchrun numbers a node's ranks consecutively, so the EP groups are
    node-local exactly when ``ep`` divides the ranks per node. DeepEP then moves tokens over
    NVLink only; the sgl-deep-ep 0.1.2.post1 buffer otherwise asserts that NCCL has a GIN
    backend for more than one rank ("NCCL GIN is unavailable ...", unless EP_DISABLE_GIN is set
    in its ``_C`` extension), which NCCL 2.30.7 between p5en GPUs does not give, so `auto` would
    fall back to all-to-all. Across nodes GIN is what DeepEP uses: not disabled.
    """
    return {"EP_DISABLE_GIN": "1"} if ep > 1 and ranks_per_node % ep == 0 else {}


def gin_note(ep: int, ranks_per_node: int | None = None) -> str:
    """Why DeepEP does or does not need NCCL GIN for EP groups of ``ep`` ranks (for `auto`'s
    log line); ``ranks_per_node`` defaults to torchrun's LOCAL_WORLD_SIZE."""
    per_node = ranks_per_node or int(os.environ.get("LOCAL_WORLD_SIZE", ep))
    disabled = os.environ.get("EP_DISABLE_GIN", "0") not in ("", "0")
    if per_node % ep == 0:
        return (f"EP groups of {ep} ranks within a node (NVLink): NCCL GIN "
                + ("disabled (EP_DISABLE_GIN=1)" if disabled else "not disabled: set EP_DISABLE_GIN=1"))
    return (f"EP groups of {ep} ranks span nodes of {per_node}: DeepEP needs NCCL GIN"
            + (", but EP_DISABLE_GIN is set" if disabled else ""))


def init_ep(cfg: ParallelConfig, group: dist.ProcessGroup | None = None, hidden_size: int | None = None) -> EPContext:
    """Resolve the EP part of ``trainer.parallel`` into an EPContext.

    Args:
        cfg: ``trainer.parallel`` (``ep``, ``ep_backend``). ``ep`` 1 always gives the `local` backend.
        group: EP process group (the ``ep`` dimension of the trainer's device mesh,
            app/trainer/parallel.py); defaults to the default (world) group when ``ep`` > 1.
        hidden_size: the model's hidden size, when known: `auto` then also falls back to
            `alltoall` for widths DeepEP's kernels reject.

    Returns:
        The EPContext; `backend` is never "auto". For `auto` (a collective over the group, so
        that every rank takes the same choice): `deepep` if DeepEP can run on every rank
        (`deepep_unavailable_reason`, then a small buffer built and destroyed on every rank:
        `app.model.dispatch.deepep.trial_reason`), else `alltoall`; the reason (for a failed
        `import deep_ep`, its exception) is logged once per process.

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
        reason = deepep.deepep_unavailable_reason(group, hidden_size)
        if backend == "deepep" and reason:
            raise ValueError(f"trainer.parallel.ep_backend='deepep' cannot run here: {reason}")
        if backend == "auto":
            # Every rank must take the same choice: a reason on any rank is a reason on all.
            flag = torch.tensor([reason is not None], dtype=torch.int32, device=collective_device(group))
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
            if flag.item() and reason is None:
                reason = "another EP rank cannot run it (that rank's log says why)"
            if reason is None:
                reason = deepep.trial_reason(group)
            backend = "alltoall" if reason else "deepep"
            if not _logged_auto:
                _logged_auto = True
                if reason:
                    log.warning("trainer.parallel.ep_backend=auto: using alltoall because %s (%s)", reason,
                                gin_note(size))
                else:
                    log.info("trainer.parallel.ep_backend=auto: using deepep (%s)", gin_note(size))
    return EPContext(group=group, rank=rank, size=size, backend=backend)
