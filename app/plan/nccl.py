"""GPU memory of the trainer's NCCL communicators: the buffers of each group it uses, per peer and channel.

NCCL allocates these with its own allocator (cuMem), outside torch's caching allocator:
``torch.cuda.max_memory_allocated`` never sees them, ``nvidia-smi`` does. They are counted in the
plan's device overhead, not in its tensors. Sources, NCCL 2.30.7 (the trainer image's,
images/versions.toml; NVIDIA/nccl at v2.30.7):

- ``src/init.cc`` ``computeBuffSizes`` with the defaults above it: per protocol, LL
  ``NCCL_LL_LINES_PER_THREAD * NCCL_LL_MAX_NTHREADS * NCCL_STEPS * 16`` = 8 * 512 * 8 * 16 =
  512 KiB, LL128 ``NCCL_LL128_ELEMS_PER_THREAD * NCCL_LL128_MAX_NTHREADS * NCCL_STEPS * 8`` =
  120 * 640 * 8 * 8 = 4.69 MiB, Simple ``NCCL_BUFFSIZE`` = 4 MiB (``src/include/device.h`` for
  the constants);
- ``src/transport/p2p.cc`` ``p2pRecvSetup`` / ``p2pSendSetup``: one connection's receive side holds
  all three protocol buffers (the Simple one moves to the send side with P2P read, the total is
  the same), its send side a small ``ncclSendMem``; with cuMem each allocation is rounded up to
  the 2 MiB granularity: 10 MiB + 2 MiB = 12 MiB per connection, which is what NCCL reports
  allocating for an intra-node all-to-all on 8 x H100 (NVIDIA/nccl issue 1685: allocations of
  10485760 and 2097152 bytes, 32 channels per pair of GPUs);
- a ring collective (all-gather, reduce-scatter, all-reduce) connects each GPU to one next and one
  previous peer per channel: ``ring channels x 12 MiB``; NCCL logs 32 ring channels inside an
  H100/H200 NVSwitch node and 16 across nodes (issue 1685; issues 1453 and 1538, 2-3 node H100
  rings ``Channel xx/16``);
- NVLink SHARP (NVLS, ``src/transport/nvls.cc`` ``ncclNvlsBufferSetup``) on NVSwitch nodes adds
  ``nvlsChannels (16 on sm90) x 2 x NVLS_CHUNKSIZE (128 KiB) x NCCL_STEPS x nHeads`` = 32 MiB per
  local rank of the group;
- send/receive (``all_to_all_single``: one send and one receive per peer) connects every peer on
  ``p2pnChannelsPerPeer`` channels (``src/graph/paths.cc`` ``ncclTopoComputeP2pChannelsPerPeer``,
  ``ncclTopoComputeP2pChannels``): 32 inside an NVSwitch node (the 36 of 18 NVLinks rounded to a
  power of two and capped by the 32 p2p channels); with a peer across the network, the minimum
  over peers of ``max(NICs, netBw / 14 GB/s)``: 4 on p5en (2 x 200 Gbit/s EFA per GPU), halved
  while ``channels x ceil(peers / 8)`` exceeds 32. Inter-node p2p uses NCCL's shared buffers
  (``NCCL_NET_SHARED_BUFFERS``), so 12 MiB per (peer, channel) is an upper bound there.

Buffers are made when a group first runs an algorithm (``NCCL_RUNTIME_CONNECT`` = 1), so only
the groups and algorithms the trainer uses are counted. Not counted: the weight-push group to the
engines (app/weight_group.py), NCCL's fixed per-communicator state (work FIFOs, proxy), and tree
connections (all-reduces of a few bytes).
"""

from __future__ import annotations

import math

from app.layout import Layout
from app.plan.term import Term

MIB = 1024**2
CUMEM_GRANULARITY = 2 * MIB
NCCL_STEPS = 8
LL_BYTES = 8 * 512 * NCCL_STEPS * 16
LL128_BYTES = 120 * 640 * NCCL_STEPS * 8
SIMPLE_BYTES = 4 * MIB  # NCCL_BUFFSIZE default
SEND_MEM_BYTES = 4096  # sizeof(struct ncclSendMem), rounded up to the granularity below anyway
RING_CHANNELS_IN_NODE = 32
RING_CHANNELS_ACROSS_NODES = 16
NVLS_CHANNELS = 16
NVLS_CHUNK = 128 * 1024
P2P_CHANNELS = 32
P2P_CHANNELS_PER_NVLINK_PEER = 32
P2P_CHANNELS_PER_NET_PEER = 4  # p5en: 2 EFA NICs of 200 Gbit/s per GPU = 50 GB/s / 14 GB/s per channel


def _align(n: int, to: int) -> int:
    return -(-n // to) * to


def connection_bytes() -> int:
    """One connection's receive buffers (LL + LL128 + Simple) and send memory, each rounded up to
    cuMem's 2 MiB: 12 MiB with NCCL's defaults."""
    return _align(LL_BYTES + LL128_BYTES + SIMPLE_BYTES, CUMEM_GRANULARITY) + _align(SEND_MEM_BYTES, CUMEM_GRANULARITY)


def p2p_channels_per_peer(size: int, nodes: int) -> int:
    """``p2pnChannelsPerPeer`` of a group of ``size`` ranks on ``nodes`` nodes (module docstring)."""
    if nodes == 1:
        return min(P2P_CHANNELS, P2P_CHANNELS_PER_NVLINK_PEER)
    per = P2P_CHANNELS_PER_NET_PEER
    while per * math.ceil(size / 8) > P2P_CHANNELS and per > 1:
        per //= 2
    return per


def group_bytes(name: str, size: int, local: int, ring: bool = True, p2p: bool = False,
                nvls: bool = True) -> Term:
    """One communicator's buffers on one GPU.

    Args:
        name: what the group is.
        size: ranks in the group (1: no communicator buffers).
        local: ranks of the group on this node.
        ring: it runs ring collectives (all-gather, reduce-scatter, all-reduce).
        p2p: it runs send/receive (``all_to_all_single``) with every peer.
        nvls: NVLS may serve its collectives (NVSwitch nodes, more than one local rank).
    """
    if size <= 1:
        return Term(f"NCCL {name} (1 rank: no buffers)", 0, "0")
    nodes = max(1, size // max(local, 1))
    conn = connection_bytes()
    parts, formula = 0, []
    if ring:
        ch = RING_CHANNELS_IN_NODE if nodes == 1 else RING_CHANNELS_ACROSS_NODES
        parts += ch * conn
        formula.append(f"ring {ch} ch x {conn // MIB} MiB")
    if ring and nvls and local > 1:
        nv = NVLS_CHANNELS * 2 * NVLS_CHUNK * NCCL_STEPS * local
        parts += nv
        formula.append(f"NVLS {NVLS_CHANNELS} ch x 2 x {NVLS_CHUNK * NCCL_STEPS // MIB} MiB x {local} heads")
    if p2p:
        per = p2p_channels_per_peer(size, nodes)
        parts += (size - 1) * per * conn
        formula.append(f"p2p {size - 1} peers x {per} ch x {conn // MIB} MiB")
    where = "1 node" if nodes == 1 else f"{nodes} nodes"
    return Term(f"NCCL {name} ({size} ranks, {where})", parts, " + ".join(formula))


def trainer_groups(layout: Layout, gpus_per_node: int, ep_backend: str) -> list[Term]:
    """The NCCL buffers of every group a trainer rank uses (app/trainer/parallel.py ``build_mesh``:
    mesh ``[dp_replicate, efsdp, ep]`` with EP innermost, so an EP group is consecutive ranks).

    - the default group (world): the step's all-reduces (app/trainer/step.py);
    - ``dp_shard`` (non-expert FSDP2 all-gather / reduce-scatter), ``efsdp`` (the experts'), and
      with HSDP the replica groups of the dense and the expert meshes (all-reduce);
    - ``ep``: all-to-all (send/receive with every peer) for ``alltoall``; for ``deepep`` only its
      all-reduces (DeepEP's own buffer is a term of the plan).
    """
    g, lay = gpus_per_node, layout

    def local(size: int, stride: int) -> int:  # ranks of a group of `size` ranks `stride` apart on one node
        return max(1, min(size, g // stride)) if stride < g else 1

    out = [group_bytes("world group (step all-reduces)", lay.world, local(lay.world, 1), nvls=False),
           group_bytes("dp_shard group (FSDP2 all-gather/reduce-scatter)", lay.dp_shard, local(lay.dp_shard, 1))]
    if lay.efsdp > 1:
        out.append(group_bytes("efsdp group (experts' FSDP2)", lay.efsdp, local(lay.efsdp, lay.ep)))
    if lay.dp_replicate > 1:
        for mesh in ("dense", "expert"):
            out.append(group_bytes(f"dp_replicate group of the {mesh} mesh (HSDP all-reduce)", lay.dp_replicate,
                                   local(lay.dp_replicate, lay.dp_shard)))
    if lay.ep > 1:
        a2a = ep_backend == "alltoall"
        out.append(group_bytes(f"ep group ({'all-to-all' if a2a else 'all-reduce'})", lay.ep, local(lay.ep, 1),
                               ring=not a2a, p2p=a2a))
    return out
