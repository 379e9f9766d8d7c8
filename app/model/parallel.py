"""Who this process is in expert parallelism (EP), and which dispatcher backend it uses.

Experts are split evenly over the ranks of the EP group: rank r holds global experts
[r * E_local, (r + 1) * E_local). The backend moves tokens between ranks:
`local` (EP size 1, the reference), `alltoall` (torch.distributed.all_to_all_single, gloo on CPU or
NCCL on GPU) or `deepep` (DeepEP kernels, NVLink/RDMA, GPU only).
"""

from __future__ import annotations

import ctypes
import importlib.metadata
import importlib.util
import logging
import os
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


def deepep_unavailable_reason(group: dist.ProcessGroup | None = None, hidden_size: int | None = None) -> str | None:
    """Why the DeepEP backend cannot run here, or None if it can.

    Checked in this order (the first failure is the reason): the `deep_ep` module is installed
    (PyPI `sgl-deep-ep` or a source build); CUDA is available; the EP group uses NCCL; the GPU is
    sm90+ (DeepEP README, "Requirements"); `hidden_size`, when given, is a width DeepEP's kernels
    accept (`app.model.dispatch.deepep.hidden_size_error`); `import deep_ep` succeeds (the wheel
    checks there that torch's CUDA major is the one it was built for and that the NCCL library
    loaded is the one it links: deep_ep/prerequisites.py:34, deep_ep/__init__.py:54-76); and, for
    an `sgl-deep-ep` wheel, the versions its metadata pins (`deepep_pin_mismatch`). A failed import
    is reported with its exception type and message.
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
    if hidden_size is not None:
        from app.model.dispatch.deepep import hidden_size_error

        reason = hidden_size_error(hidden_size)
        if reason:
            return f"config.hidden_size={reason}"
    try:
        import deep_ep  # noqa: F401, PLC0415 - optional GPU-only dependency; importing runs its checks
    except Exception as e:  # noqa: BLE001 - any failure (ImportError, AssertionError, OSError) is the reason
        return f"import deep_ep failed: {type(e).__name__}: {e}"
    try:
        deepep = importlib.metadata.distribution("sgl-deep-ep")
    except importlib.metadata.PackageNotFoundError:
        return None  # a source build: built against whatever NCCL and torch it found
    loaded = loaded_nccl_version()
    if loaded is None:
        return "no libnccl is mapped into this process, so the NCCL version DeepEP would use is unknown"
    return deepep_pin_mismatch(deepep.version, deepep.requires or [], importlib.metadata.version("torch"),
                               importlib.metadata.requires("torch") or [], loaded)


def loaded_nccl_version() -> tuple[int, int, int] | None:
    """(major, minor, patch) of the libnccl this process has mapped, from its own `ncclGetVersion`;
    None when none is mapped.

    `torch.cuda.nccl.version()` is the version torch was compiled against (torch/csrc/cuda/nccl.cpp
    returns NCCL_MAJOR/MINOR/PATCH), not the library loaded; DeepEP checks the loaded one. Paths are
    read from /proc/self/maps as deep_ep/__init__.py:62-67 does.
    """
    try:
        with open("/proc/self/maps") as f:
            paths = sorted({line.split()[-1] for line in f if "libnccl.so" in line and "/" in line})
    except OSError:
        return None
    if not paths:
        return None
    code = ctypes.c_int()
    if ctypes.CDLL(paths[0]).ncclGetVersion(ctypes.byref(code)) != 0:
        return None
    # NCCL_VERSION(X, Y, Z) = X * 10000 + Y * 100 + Z since NCCL 2.9 (nccl.h).
    return code.value // 10000, code.value % 10000 // 100, code.value % 100


def deepep_pin_mismatch(deepep_version: str, deepep_requires: list[str], torch_version: str,
                        torch_requires: list[str], loaded_nccl: tuple[int, ...]) -> str | None:
    """Why an `sgl-deep-ep` wheel cannot work with this torch and NCCL, or None.

    The wheel's `Requires-Dist` pins torch exactly (0.1.2.post1: `torch==2.14.1`; its C++ extension
    is built against that release), and the wheel is built against the NCCL that torch release pins
    (0.1.2.post1's `_C` compares the loaded NCCL with 23007 = 2.30.7). Below NCCL 2.31 DeepEP needs
    the loaded NCCL to be exactly that version (csrc/kernels/backend/nccl.cu:104 in DeepEP dd758ca:
    "Prior to NCCL 2.31, NCCL compile-time and runtime versions must be the same").

    Args:
        deepep_version / deepep_requires: the wheel's version and Requires-Dist lines.
        torch_version / torch_requires: the installed torch's version and Requires-Dist lines.
        loaded_nccl: (major, minor, patch) of the NCCL this process loaded (`loaded_nccl_version`).
    """
    from packaging.requirements import Requirement
    from packaging.version import Version

    def pins(lines: list[str]) -> dict[str, Requirement]:
        reqs = (Requirement(line) for line in lines)
        return {r.name.lower(): r for r in reqs if r.marker is None or r.marker.evaluate({"extra": ""})}

    torch_pin = pins(deepep_requires).get("torch")
    if torch_pin is not None and not torch_pin.specifier.contains(torch_version, prereleases=True):
        return (f"sgl-deep-ep {deepep_version} is built for {torch_pin} (its Requires-Dist), this process "
                f"has torch {torch_version}")
    for name, req in pins(torch_requires).items():
        exact = [s.version for s in req.specifier if s.operator == "=="]
        if name.startswith("nvidia-nccl-cu") and exact:
            need = Version(exact[0]).release
            if need < (2, 31) and tuple(loaded_nccl[:3]) != need:
                return (f"sgl-deep-ep {deepep_version} needs NCCL {exact[0]} exactly (torch {torch_version} "
                        f"pins it; below 2.31 DeepEP requires the NCCL it was built with), this process "
                        f"loaded NCCL {'.'.join(map(str, loaded_nccl[:3]))}")
    return None


def collective_device(group: dist.ProcessGroup | None = None) -> torch.device:
    """The device whose tensors a collective over ``group`` (default: the world) must use.

    An NCCL group takes only CUDA tensors, and so does the ``cuda:gloo`` test layout (several
    ranks on one GPU: app/trainer/train.py); a CPU-tensor collective there raises "No backend
    type associated with device type cpu". A gloo group on CPU takes CPU tensors. The rule is
    torch's own for object collectives (``distributed_c10d._get_object_coll_device``: the
    group's one device type, or cpu when the group has a CPU backend among several), with the
    CUDA device made concrete as this process's current GPU.
    """
    group = group if group is not None else dist.group.WORLD
    types = {d.type for d in group._device_types}
    if "cuda" in types and "cpu" not in types:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


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
        reason = deepep_unavailable_reason(group, hidden_size)
        if backend == "deepep" and reason:
            raise ValueError(f"trainer.parallel.ep_backend='deepep' cannot run here: {reason}")
        if backend == "auto":
            # Every rank must take the same choice: a reason on any rank is a reason on all.
            flag = torch.tensor([reason is not None], dtype=torch.int32, device=collective_device(group))
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
            if flag.item() and reason is None:
                reason = "another EP rank cannot run it (that rank's log says why)"
            if reason is None:
                from app.model.dispatch.deepep import trial_reason

                reason = trial_reason(group)
            backend = "alltoall" if reason else "deepep"
            if not _logged_auto:
                _logged_auto = True
                if reason:
                    log.warning("trainer.parallel.ep_backend=auto: using alltoall because %s (%s)", reason,
                                gin_note(size))
                else:
                    log.info("trainer.parallel.ep_backend=auto: using deepep (%s)", gin_note(size))
    return EPContext(group=group, rank=rank, size=size, backend=backend)
