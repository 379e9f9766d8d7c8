"""The trainer's device mesh and how the policy is sharded over it (FSDP2 + expert parallelism).

The layout rule is app/layout.py; this module turns a checked `Layout` into a device mesh and
applies it to a model, in the way torchtitan composes FSDP2 with EP
(``torchtitan/experiments/llama4/infra/parallelize.py: apply_fsdp``,
``torchtitan/distributed/expert_parallel.py``):

* mesh ``[dp_replicate, efsdp, ep]`` (EP innermost, so an EP group is consecutive ranks: the
  GPUs of one node when ep <= 8); the dense FSDP mesh flattens ``efsdp x ep`` into ``dp_shard``;
* routed experts become DTensors of global shape ``[E, ...]`` sharded ``Shard(0)`` over ``ep``
  (this rank keeps its ``E / ep`` experts), then FSDP2 shards them over ``efsdp`` (dim 0, or dim 1
  when the local experts do not divide evenly), one FSDP unit per MoE layer's experts;
* each MoE router is an FSDP unit of its own that computes in fp32 (the router stays fp32);
* each decoder layer is an FSDP unit, the root (embeddings, final norm, LM head) another;
* mixed precision: fp32 master weights, ``param_dtype`` = ``model.dtype`` (bf16 on GPUs) for
  compute, ``reduce_dtype`` fp32 for the gradient reduce-scatter (`MixedPrecisionPolicy`);
* gradient division is off: the loss is already normalised by the global completion-token
  count (app/trainer/step.py), so the reduce-scatter SUMs;
* activation checkpointing per decoder layer through transformers' own
  ``activation_checkpointing_enable`` (non-reentrant); ``selective`` keeps the all-to-all outputs
  of dispatch and combine for the recompute (torchtitan's selective policy keeps the same ops).

The returned module is the original transformers model (parameter names unchanged), with FSDP's
hooks; `register_fsdp_forward_method` makes ``sequence_logprobs`` gather the root unit too.
"""

from __future__ import annotations

import logging
import os
import socket
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method
from torch.distributed.tensor import DTensor, Replicate, Shard

from app.layout import Layout
from app.model.dispatch.exchange_cache import checkpoint_contexts
from app.model.moe import MoEBlock
from app.model.parallel import EPContext
from app.trainer import TrainingError

log = logging.getLogger(__name__)


# Several trainer ranks on one GPU, over a device-strict gloo group ("cuda:gloo"): every
# collective sees CUDA tensors and refuses host ones, as NCCL does, so the multi-rank code runs
# as it would on several GPUs, only slower (gloo stages through the host). NCCL itself refuses
# two ranks on one device. For tests and debugging on one GPU; never a production layout.
SHARED_GPU_ENV = "MOERL_SHARED_GPU"


def shared_gpu() -> bool:
    """True when ``MOERL_SHARED_GPU=1``: trainer ranks share GPUs over cuda:gloo."""
    return os.environ.get(SHARED_GPU_ENV, "") == "1"


def gpu_of(local_rank: int, local_world: int, gpus: int, shared: bool) -> int:
    """The GPU index of a local rank: its own (one rank per GPU), or, with ``shared``, the
    ranks spread in equal blocks over the ``gpus`` (4 ranks on 1 GPU: all on 0; on 2: 0 0 1 1).

    Raises:
        TrainingError: without ``shared``, a local rank that has no GPU of its own.
    """
    if shared:
        return local_rank * gpus // max(local_world, 1)
    if local_rank >= gpus:
        raise TrainingError(f"LOCAL_RANK {local_rank} has no GPU of its own ({gpus} visible): NCCL refuses two "
                            f"ranks on one GPU; start one rank per GPU, or set {SHARED_GPU_ENV}=1 to share GPUs "
                            "over a cuda:gloo group (tests and debugging only)")
    return local_rank


def init_distributed(timeout_s: float) -> tuple[int, int, torch.device]:
    """Join (or, outside torchrun, create a one-rank) process group: nccl on GPU (cuda:gloo when
    ranks share a GPU, `SHARED_GPU_ENV`), gloo on CPU.

    Returns:
        ``(rank, world_size, device)``.

    Raises:
        TrainingError: a rank without a GPU of its own under NCCL (`gpu_of`).
    """
    if "RANK" not in os.environ:  # plain `python -m app.cli train`: a group of one
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0",
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    cuda = torch.cuda.is_available()
    shared = cuda and shared_gpu()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cpu")
    if cuda:
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))
        device = torch.device("cuda", gpu_of(local_rank, local_world, torch.cuda.device_count(), shared))
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        backend = ("cuda:gloo" if shared else "nccl") if cuda else "gloo"
        # device_id binds NCCL's communicator to this GPU now (DeepEP can then reuse it).
        dist.init_process_group(backend=backend, timeout=timedelta(seconds=timeout_s),
                                device_id=device if cuda and not shared else None)
    return dist.get_rank(), dist.get_world_size(), device


def on_rank0(fn, rank: int):
    """Run ``fn()`` on rank 0 only and return its result there (None elsewhere).

    If it raises, rank 0 re-raises the original exception and every other rank raises a
    `TrainingError` with the same message, so no rank is left waiting for a dead peer.
    """
    box: list = [None]
    result = error = None
    if rank == 0:
        try:
            result = fn()
        except Exception as e:
            error = e
            box[0] = f"{type(e).__name__}: {e}"
    if dist.get_world_size() > 1:
        dist.broadcast_object_list(box, src=0)
    if error is not None:
        raise error
    if box[0] is not None:
        raise TrainingError(f"rank 0 failed: {box[0]}")
    return result


def broadcast_from_rank0(value, rank: int):
    """``value`` of rank 0 on every rank (a pickled broadcast; small objects only)."""
    box = [value if rank == 0 else None]
    if dist.get_world_size() > 1:
        dist.broadcast_object_list(box, src=0)
    return box[0]


def gather(t: DTensor, placements=None) -> torch.Tensor:
    """This rank's local tensor of ``t`` redistributed to ``placements`` (default: Replicate on
    every mesh dimension, i.e. the full tensor). Collective over ``t``'s mesh.

    DTensor's own ``redistribute``, except in the shared-GPU layout (cuda:gloo, `SHARED_GPU_ENV`):
    gloo cannot all-gather CUDA tensors through DTensor's functional collectives (the process
    dies with SIGSEGV; pytorch/pytorch#132709, seen on the H200 with torch 2.11), so there the
    gather runs on a host copy of the shard over gloo CPU groups of the same mesh
    (`_host_mesh`) and the result goes back to the GPU. FSDP2's own all-gathers and
    reduce-scatters, the EP all-to-alls and the step's reductions stay on CUDA tensors.
    """
    placements = placements or [Replicate()] * t.device_mesh.ndim
    if t.device.type != "cuda" or not shared_gpu():
        return t.redistribute(t.device_mesh, placements).to_local()
    host = _host_mesh(t.device_mesh)
    local = DTensor.from_local(t.to_local().cpu(), host, t.placements, shape=t.shape, stride=t.stride())
    return local.redistribute(host, placements).to_local().to(t.device)


def p2p_group(mesh: DeviceMesh, dim: str) -> dist.ProcessGroup | None:
    """The group that `send_block`/`recv_block` use between ranks of one group of ``mesh``'s
    dimension ``dim``: None (the default group) except in the shared-GPU layout
    (`SHARED_GPU_ENV`), where it is that dimension's group of ``mesh``'s gloo twin (`_host_mesh`):
    gloo cannot send a CUDA tensor (its TCP pair hands the device address to ``writev``, which
    fails with EFAULT, "Bad address": seen on the H200 with torch 2.11). Collective on its first
    call for a mesh: every rank calls it, also those that send nothing."""
    if mesh.device_type == "cuda" and shared_gpu():
        return _host_mesh(mesh).get_group(dim)
    return None


def send_block(t: torch.Tensor, dst: int, group: dist.ProcessGroup | None) -> None:
    """Send ``t`` (any shape and dtype) to global rank ``dst`` over `p2p_group`'s ``group``: the
    tensor itself, or over a host twin's group its host copy."""
    dist.send(t.contiguous() if group is None else t.contiguous().cpu(), dst=dst, group=group)


def recv_block(like: torch.Tensor, src: int, group: dist.ProcessGroup | None) -> torch.Tensor:
    """What `send_block` on global rank ``src`` sent: a tensor of ``like``'s shape, dtype and
    device."""
    out = torch.empty_like(like) if group is None else torch.empty(like.shape, dtype=like.dtype)
    dist.recv(out, src=src, group=group)
    return out.to(like.device)


_HOST_MESHES: dict[tuple, DeviceMesh] = {}


def _host_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """A CPU twin of ``mesh`` over gloo groups of the same ranks (made once per mesh; the first
    call is collective: every rank creates every group, in the same order)."""
    key = (tuple(mesh.mesh.flatten().tolist()), tuple(mesh.mesh.shape), mesh.mesh_dim_names)
    if key not in _HOST_MESHES:
        me = dist.get_rank()
        groups = []
        for d in range(mesh.ndim):
            mine = None
            slices = mesh.mesh.movedim(d, -1).reshape(-1, mesh.mesh.shape[d])
            for ranks in slices.tolist():
                g = dist.new_group(ranks, backend="gloo")
                if me in ranks:
                    mine = g
            groups.append(mine)
        _HOST_MESHES[key] = DeviceMesh.from_group(groups, "cpu", mesh=mesh.mesh, mesh_dim_names=mesh.mesh_dim_names)
    return _HOST_MESHES[key]


@dataclass
class TrainerMesh:
    """The trainer's meshes.

    Attributes:
        layout: the checked layout.
        world: ``[dp_replicate, efsdp, ep]`` mesh of every trainer rank.
        dense: FSDP mesh of non-expert parameters: ``[dp_shard]``, or ``[dp_replicate, dp_shard]``
            (HSDP) when dp_replicate > 1.
        experts: FSDP mesh of expert parameters: ``[efsdp]`` or ``[dp_replicate, efsdp]``.
        ep: the EP mesh ``[ep]`` (its group is the dispatchers' process group).
    """

    layout: Layout
    world: DeviceMesh
    dense: DeviceMesh
    experts: DeviceMesh
    ep: DeviceMesh

    def ep_context(self, backend: str) -> EPContext:
        """This rank's `EPContext` for ``backend`` (already resolved: local, alltoall or deepep)."""
        if self.layout.ep == 1:
            return EPContext.local()
        return EPContext(group=self.ep.get_group(), rank=self.ep.get_local_rank(), size=self.layout.ep,
                         backend=backend)


def build_mesh(layout: Layout, device_type: str) -> TrainerMesh:
    """The meshes of ``layout`` over the initialised default process group (collective).

    Raises:
        ValueError: the process group's size is not ``layout.world``.
    """
    if dist.get_world_size() != layout.world:
        raise ValueError(f"trainer.parallel describes {layout.world} ranks but {dist.get_world_size()} were started")
    world = init_device_mesh(device_type, (layout.dp_replicate, layout.efsdp, layout.ep),
                             mesh_dim_names=("dp_replicate", "efsdp", "ep"))
    hsdp = layout.dp_replicate > 1
    if hsdp:  # a mesh of its own: dense parameters never share a DTensor op with the experts
        dense = init_device_mesh(device_type, (layout.dp_replicate, layout.dp_shard),
                                 mesh_dim_names=("dp_replicate", "dp_shard"))
    else:
        dense = world["efsdp", "ep"]._flatten("dp_shard")
    experts = world["dp_replicate", "efsdp"] if hsdp else world["efsdp"]
    return TrainerMesh(layout=layout, world=world, dense=dense, experts=experts, ep=world["ep"])


def expert_modules(model: nn.Module) -> list[nn.Module]:
    """Every MoE layer's routed experts (`app.model.experts.GroupedExperts`), in a policy or a critic."""
    return [m.experts for m in model.modules() if isinstance(m, MoEBlock)]


def shard_experts_over_ep(model: nn.Module, mesh: TrainerMesh) -> None:
    """Turn each expert parameter [E_local, ...] into a DTensor of global shape [E, ...] placed
    ``Shard(0)`` on the EP mesh (no copy: this rank's block is the local tensor)."""
    for experts in expert_modules(model):
        for name, p in list(experts.named_parameters(recurse=False)):
            if isinstance(p, DTensor):
                continue
            d = DTensor.from_local(p.data, mesh.ep, [Shard(0)], run_check=False)
            setattr(experts, name, nn.Parameter(d, requires_grad=p.requires_grad))


def expert_placement(block: nn.Module, efsdp: int):
    """FSDP placement of a MoE layer's experts over efsdp ranks: dim 0 (whole experts) when its
    E_local experts split evenly; else dim 1 (rows of every expert, as torchtitan does when
    efsdp x ep > E) when those split evenly; else dim 0 with FSDP's padding. Returns a
    ``shard_placement_fn`` or None (FSDP's default, dim 0)."""
    experts = block.experts
    if block.num_local_experts % efsdp == 0:
        return None
    if all(p.shape[1] % efsdp == 0 for p in experts.parameters()):
        return lambda p: Shard(1)
    return None


def apply_activation_checkpointing(model: nn.Module, mode: str) -> None:
    """Per decoder layer: ``full`` recomputes the layer in backward, ``selective`` keeps the
    dispatch/combine all-to-all outputs (app/model/dispatch/exchange_cache.py); ``none`` does nothing.

    Raises:
        ValueError: unknown mode.
    """
    if mode == "none":
        return
    kwargs: dict = {"use_reentrant": False}
    if mode == "selective":
        kwargs["context_fn"] = checkpoint_contexts
    elif mode != "full":
        raise ValueError(f"trainer.activation_checkpointing must be none, full or selective, got {mode!r}")
    model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)


def parallelize(model: nn.Module, mesh: TrainerMesh, compute_dtype: torch.dtype,
                activation_checkpointing: str = "none") -> nn.Module:
    """Shard ``model`` (fp32 master weights; a policy from `app.model.policy.build_policy`, or a
    critic whose ``trunk`` is the policy's decoder stack) over ``mesh``, in place.

    Args:
        model: the module; its parameters may be on the meta device (materialise with
            ``to_empty`` afterwards) or already on the training device.
        mesh: from `build_mesh`.
        compute_dtype: ``param_dtype`` of the FSDP mixed-precision policy (fp32 or bf16).
        activation_checkpointing: none | full | selective.

    Returns:
        ``model`` (FSDP-wrapped in place).

    Raises:
        ValueError: parameters are not fp32 (master weights must be), or an unknown AC mode.
    """
    bad = next(((n, p.dtype) for n, p in model.named_parameters() if p.dtype != torch.float32), None)
    if bad:
        raise ValueError(f"master weights must be float32; {bad[0]} is {bad[1]}")

    causal_lm = hasattr(model, "lm_head")
    trunk = model.model if causal_lm else model.trunk
    apply_activation_checkpointing(model if causal_lm else trunk, activation_checkpointing)
    if not hasattr(trunk, "layers"):
        raise ValueError(f"{type(trunk).__name__} has no .layers: not a transformers decoder stack")

    shard_experts_over_ep(model, mesh)
    # cast_forward_inputs=False (as torchtitan's decoders): each module casts what it needs itself
    # (the router upcasts to fp32, the experts keep their gate weights in fp32), and an activation
    # checkpoint's recompute, which runs without FSDP's forward hooks, sees the same dtypes.
    mp = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32, cast_forward_inputs=False)
    fp32 = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32, cast_forward_inputs=False)
    # With one shard there is nothing to free after forward: keep the unsharded copies (saves the
    # backward's re-gather); with several, reshard (the memory FSDP exists for).
    reshard = mesh.layout.dp_shard > 1 or mesh.layout.dp_replicate > 1
    for layer in trunk.layers:
        block = layer.mlp
        if isinstance(block, MoEBlock):
            fully_shard(block.gate, mesh=mesh.dense, mp_policy=fp32, reshard_after_forward=reshard)
            fully_shard(block.experts, mesh=mesh.experts, mp_policy=mp, reshard_after_forward=reshard,
                        shard_placement_fn=expert_placement(block, mesh.layout.efsdp))
        fully_shard(layer, mesh=mesh.dense, mp_policy=mp, reshard_after_forward=reshard)
    fully_shard(model, mesh=mesh.dense, mp_policy=mp, reshard_after_forward=reshard)
    if causal_lm:
        register_fsdp_forward_method(model, "sequence_logprobs")
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_gradient_divide_factor(1.0)
            m.set_force_sum_reduction_for_comms(True)  # a plain SUM (gloo has no PREMUL_SUM)
    return model

