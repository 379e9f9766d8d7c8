"""Weight-sync traffic budget (issue 21, item 4): what one policy version costs to ship from the
trainer to every rollout node, over the network or through S3, and how often it can be published
without letting rollouts go staler than ``buffer.max_staleness``.

Bytes per version (`version_bytes`): every parameter of the policy in the publish dtype (the
router included; what `app/trainer/publish.py` writes is a cast of the fp32 master weights), plus
DeepSeek-V3's ``e_score_correction_bias`` [E] in fp32 per MoE layer. The FP8 figure
(`fp8_version_bytes`) is the layout of the official DeepSeek-V3 checkpoint (its
``quantization_config``: e4m3 weights, one fp32 ``weight_scale_inv`` per 128 x 128 block) applied
to every linear weight and routed expert; embeddings, LM head, norms and the router stay bf16.

Per version, with V bytes, N_t trainer nodes, N_r rollout nodes, B the per-node link (EFA) rate,
R the per-node S3 rate, P the publish interval in steps and t_s the trainer step time:

- direct push: every trainer node sends its 1/N_t of the version to every rollout node; the
  trainer nodes' links carry ``V * N_r / N_t`` each: ``t = V * N_r / (N_t * B)``.
- broadcast tree: the version travels a binary tree of rollout nodes rooted at the trainer,
  pipelined in buckets of `BUCKET_BYTES` (NCCL broadcast, as SGLang's
  ``update_weights_from_distributed`` receives it); every link carries V once:
  ``t = (V + depth * bucket) / B`` with ``depth = ceil(log2(N_r + 1))``.
- S3: the trainer nodes upload the version (``V / (N_t * R)``), then every rollout node downloads
  it (``V / R``, nodes in parallel): ``t = V / (N_t * R) + V / R``. S3 bytes per version:
  ``V`` written + ``V * N_r`` read; the network paths write ``V`` (the durable copy) and read
  nothing (an engine that restarts reads one more V).
- Delivery latency ``L = t + load_s`` (the engines' pause-load-resume, measured separately).

Staleness: version v is published at ``v * P * t_s`` and served from ``L`` later until v + 1
arrives, so a rollout with version v starts before ``(v + 1) * P * t_s + L``. It reaches the buffer
after the generation time G and waits at most one step t_s for the trainer to take it, so it is
taken before ``(v + 1) * P * t_s + L + G + t_s``, when the trainer holds at most version
``v + ceil((L + G + t_s) / (P * t_s))``. The worst-case staleness is therefore
``s = ceil((L + G + t_s) / (P * t_s))`` (1 for an instant fleet publishing every step, as it
should be), and ``s <= max_staleness`` needs ``P >= (L + G + t_s) / (max_staleness * t_s)``; P must
also leave a sync the time to finish (``P * t_s >= L``). max_staleness 0 cannot be met by an
asynchronous fleet.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from transformers import PretrainedConfig

from app.model.config import DEEPSEEK_V3_FP8_BLOCK, moe_layer_ids, num_routed_experts
from app.plan.params import param_shapes
from infra.config import FSX_PER_UNIT_MBPS, fsx_capacity_error  # the file system's allowed values, declared once

BUCKET_BYTES = 1024**3  # broadcast pipeline bucket (assumption; Miles/slime bucket sizes are of this order)
# p5en.48xlarge: 3200 Gbps of EFA per node (Amazon EC2 P5en instance page; infra/instances.py
# lists its 16 EFA network cards).
LINK_GBPS_P5EN = 3200.0
# Default S3 rate per node: each S3 connection tops out at 5 Gbps ("Maximizing Amazon S3 transfer
# throughput to Amazon EC2 instances", AWS re:Post), and S3 traffic leaves through the ENA
# interface of one network card (the EFA cards carry no S3 traffic; EC2 user guide, "Maximize
# network bandwidth on accelerated instances"), a p5en card being 3200 / 16 = 200 Gbps. 100 Gbps
# (20 parallel ranged GETs at the cap, half the card) is what we assume a tuned client reaches.
S3_GBPS_PER_NODE = 100.0


def version_bytes(config: PretrainedConfig, dtype_bytes: int = 2) -> int:
    """Bytes of one published version in a dtype of ``dtype_bytes`` (see the module docstring)."""
    n = sum(p.numel for p in param_shapes(config)) * dtype_bytes
    if config.model_type == "deepseek_v3":
        n += 4 * num_routed_experts(config) * len(moe_layer_ids(config))
    return n


def fp8_version_bytes(config: PretrainedConfig, block: tuple[int, int] = DEEPSEEK_V3_FP8_BLOCK) -> int:
    """Bytes of one version in DeepSeek-V3's FP8 checkpoint layout (module docstring)."""
    bo, bi = block
    n = 0
    for p in param_shapes(config):
        if p.role == "experts":  # per expert: gate and up [I, H] each, or down [H, I]
            e, rows, cols = p.shape
            mats = [(rows // 2, cols), (rows // 2, cols)] if p.name.endswith("gate_up_proj") else [(rows, cols)]
            n += sum(e * (r * c + 4 * math.ceil(r / bo) * math.ceil(c / bi)) for r, c in mats)
        elif p.role in ("attention", "mlp", "shared") and len(p.shape) == 2:
            r, c = p.shape
            n += r * c + 4 * math.ceil(r / bo) * math.ceil(c / bi)
        else:
            n += 2 * p.numel
    if config.model_type == "deepseek_v3":
        n += 4 * num_routed_experts(config) * len(moe_layer_ids(config))
    return n


@dataclass(frozen=True)
class TrafficInput:
    """The fleet and the schedule.

    Attributes:
        trainer_nodes: N_t.
        rollout_nodes: N_r (every rollout node receives every version).
        link_gbps: per-node network rate B, Gbit/s.
        s3_gbps_per_node: per-node S3 rate R, Gbit/s.
        step_s: trainer step time t_s, seconds.
        publish_every: P, steps between versions.
        max_staleness: ``buffer.max_staleness``.
        generation_s: G, seconds from a rollout's start to its group in the buffer.
        load_s: engine-side load time per version, seconds.
    """

    trainer_nodes: int
    rollout_nodes: int
    link_gbps: float = LINK_GBPS_P5EN
    s3_gbps_per_node: float = S3_GBPS_PER_NODE
    step_s: float = 60.0
    publish_every: int = 1
    max_staleness: int = 1
    generation_s: float = 60.0
    load_s: float = 0.0

    def check(self) -> None:
        """Raises ValueError naming the CLI flag that is out of range (NaN and infinity included)."""
        checks = [
            (self.trainer_nodes >= 1, f"--nodes must be >= 1, got {self.trainer_nodes}"),
            (self.rollout_nodes >= 1, f"--rollout-nodes must be >= 1, got {self.rollout_nodes}"),
            (0 < self.link_gbps < math.inf, f"--link-gbps must be finite and > 0, got {self.link_gbps}"),
            (0 < self.s3_gbps_per_node < math.inf,
             f"--s3-gbps-per-node must be finite and > 0, got {self.s3_gbps_per_node}"),
            (0 < self.step_s < math.inf, f"--step-s must be finite and > 0, got {self.step_s}"),
            (self.publish_every >= 1, f"--publish-every must be >= 1, got {self.publish_every}"),
            (self.max_staleness >= 0, f"--max-staleness must be >= 0, got {self.max_staleness}"),
            (0 <= self.generation_s < math.inf, f"--generation-s must be finite and >= 0, got {self.generation_s}"),
            (0 <= self.load_s < math.inf, f"--load-s must be finite and >= 0, got {self.load_s}"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)


@dataclass(frozen=True)
class Path:
    """One way of shipping a version.

    Attributes:
        name: ``broadcast tree``, ``direct push`` or ``S3``.
        link_bytes: bytes on the busiest node link per version.
        seconds: transfer time per version.
        latency_s: transfer + load: publish to served.
        s3_bytes: bytes written to + read from S3 per version.
    """

    name: str
    link_bytes: int
    seconds: float
    latency_s: float
    s3_bytes: int


def staleness(latency_s: float, t: TrafficInput, publish_every: int | None = None) -> int:
    """Worst-case staleness ``ceil((L + G + t_s) / (P * t_s))`` (module docstring)."""
    p = t.publish_every if publish_every is None else publish_every
    return math.ceil((latency_s + t.generation_s + t.step_s) / (p * t.step_s))


def min_publish_every(latency_s: float, t: TrafficInput) -> int | None:
    """Smallest P with ``staleness <= max_staleness`` and ``P * t_s >= L``; None if none exists."""
    if t.max_staleness < 1:
        return None
    x = latency_s + t.generation_s + t.step_s
    return max(math.ceil(x / (t.max_staleness * t.step_s)), math.ceil(latency_s / t.step_s), 1)


def paths(nbytes: int, t: TrafficInput) -> list[Path]:
    """The three ways to ship ``nbytes`` per version to the fleet."""
    t.check()
    link = t.link_gbps * 1e9 / 8
    s3 = t.s3_gbps_per_node * 1e9 / 8
    depth = math.ceil(math.log2(t.rollout_nodes + 1))
    tree = (nbytes + depth * min(BUCKET_BYTES, nbytes)) / link
    direct = nbytes * t.rollout_nodes / (t.trainer_nodes * link)
    via_s3 = nbytes / (t.trainer_nodes * s3) + nbytes / s3
    return [
        Path("broadcast tree", nbytes, tree, tree + t.load_s, nbytes),
        Path("direct push", math.ceil(nbytes * t.rollout_nodes / t.trainer_nodes), direct, direct + t.load_s, nbytes),
        Path("S3", nbytes, via_s3, via_s3 + t.load_s, nbytes * (1 + t.rollout_nodes)),
    ]


def versions_per_hour(t: TrafficInput, publish_every: int | None = None) -> float:
    """``3600 / (P * t_s)``."""
    p = t.publish_every if publish_every is None else publish_every
    return 3600.0 / (p * t.step_s)


# ---------------------------------------------------------------- start-up reads (issue 27 item 12)
#
# Where each role reads its start-up bytes from, and how long a node takes, by estimate:
#
# - rollout node start: the base model (FP8 for the DeepSeek-V3 engines, else the publish dtype),
#   every node of N_r; trainer start: the base weights, every trainer node its 1/N_t shard of the
#   checkpoint; trainer resume: the training state (`STATE_BYTES_PER_PARAM`: fp32 master weights and
#   AdamW's two fp32 moments, app/trainer/state.py), each trainer node its 1/N_t.
# - From S3, N nodes reading the same keys at once: each node at most R, and all together at most
#   the request rate of one prefix (`S3_GETS_PER_PREFIX` GET/s, S3 user guide "Best practices design
#   patterns: optimizing Amazon S3 performance") times the ranged-GET part size `S3_PART_BYTES`:
#   per-node rate = min(R, S3_GETS_PER_PREFIX * part / N).
# - From FSx for Lustre (PERSISTENT_2, S3-linked): the file system's throughput is its capacity
#   times the per-unit throughput (125/250/500/1000 MB/s/TiB; FSx for Lustre user guide,
#   "Managing throughput capacity"), shared by the N readers, each at most the client rate
#   `FSX_CLIENT_GBPS`: per-node rate = min(client, capacity * per-unit / N). The first read of a
#   file that is still only in S3 imports it (lazy load): estimated as one S3 read of the bytes at
#   the file system's rate, paid once per file, not per node.
# Each row reads from whichever is faster; a restart or a node added later reads alone (N = 1).

STATE_BYTES_PER_PARAM = 12  # fp32 master (4) + AdamW exp_avg (4) + exp_avg_sq (4)
S3_GETS_PER_PREFIX = 5500  # GET/HEAD requests per second per partitioned prefix
S3_PART_BYTES = 16 * 1024**2  # ranged-GET part size assumed for a tuned client
# Lustre over the node's ENA interface, as for S3 (see S3_GBPS_PER_NODE): the same assumption.
FSX_CLIENT_GBPS = 100.0


@dataclass(frozen=True)
class Startup:
    """One start-up read: `role`, `nbytes` each node reads, `nodes` reading at once, seconds per
    node from S3 and from FSx (None without a file system), and `reads_from` ("S3" or "FSx")."""

    role: str
    nbytes: int
    nodes: int
    s3_s: float
    fsx_s: float | None
    reads_from: str


def s3_rate(nodes: int, s3_gbps_per_node: float = S3_GBPS_PER_NODE) -> float:
    """Bytes/s each of `nodes` concurrent readers of one prefix gets from S3."""
    return min(s3_gbps_per_node * 1e9 / 8, S3_GETS_PER_PREFIX * S3_PART_BYTES / nodes)


def fsx_rate(nodes: int, fsx_tib: float, per_unit_mbps: int = 1000, client_gbps: float = FSX_CLIENT_GBPS) -> float:
    """Bytes/s each of `nodes` concurrent readers gets from a file system of `fsx_tib` TiB.

    Raises ValueError naming --fsx-tib or --fsx-mbps-per-tib when out of range.
    """
    if not 0 < fsx_tib < math.inf:
        raise ValueError(f"--fsx-tib must be finite and > 0, got {fsx_tib}")
    if why := fsx_capacity_error(round(fsx_tib * 1000, 6)):
        raise ValueError(f"--fsx-tib {fsx_tib:g}: {why} (1.2 TiB, or a multiple of 2.4 TiB)")
    if per_unit_mbps not in FSX_PER_UNIT_MBPS:
        raise ValueError(f"--fsx-mbps-per-tib must be one of {list(FSX_PER_UNIT_MBPS)} (PERSISTENT_2), got {per_unit_mbps}")
    return min(client_gbps * 1e9 / 8, fsx_tib * per_unit_mbps * 1e6 / nodes)


def startup(config: PretrainedConfig, trainer_nodes: int, rollout_nodes: int, dtype_bytes: int = 2,
            fp8_engines: bool | None = None, fsx_tib: float = 0.0, fsx_mbps_per_tib: int = 1000,
            s3_gbps_per_node: float = S3_GBPS_PER_NODE) -> list[Startup]:
    """The start-up reads of the fleet (module notes above), first fleet-wide, then one node alone.

    fp8_engines: the engines serve the FP8 checkpoint (default: for deepseek_v3).
    fsx_tib: FSx for Lustre capacity, TiB (0: none).
    """
    if trainer_nodes < 1 or rollout_nodes < 1:
        raise ValueError(f"--nodes and --rollout-nodes must be >= 1, got {trainer_nodes}, {rollout_nodes}")
    fp8 = config.model_type == "deepseek_v3" if fp8_engines is None else fp8_engines
    engine_bytes = fp8_version_bytes(config) if fp8 else version_bytes(config, dtype_bytes)
    params = sum(p.numel for p in param_shapes(config))
    rows = [
        ("rollout nodes start (base model)", engine_bytes, rollout_nodes),
        ("rollout node replaced (base model)", engine_bytes, 1),
        ("trainer gang starts (base weights, own shard)", math.ceil(version_bytes(config, dtype_bytes) / trainer_nodes), trainer_nodes),
        ("trainer gang resumes (training state, own shard)", math.ceil(params * STATE_BYTES_PER_PARAM / trainer_nodes), trainer_nodes),
    ]
    out = []
    for role, nbytes, nodes in rows:
        s3 = nbytes / s3_rate(nodes, s3_gbps_per_node)
        fsx = None
        if fsx_tib:
            fsx = nbytes / fsx_rate(nodes, fsx_tib, fsx_mbps_per_tib)
            if role.startswith("rollout nodes start"):  # the first read imports the model once
                fsx += engine_bytes / fsx_rate(1, fsx_tib, fsx_mbps_per_tib)
        out.append(Startup(role, nbytes, nodes, s3, fsx, "FSx" if fsx is not None and fsx < s3 else "S3"))
    return out


# ---- the experience buffer's traffic (`moerl plan --traffic`, second table) ----------------------
#
# A group crosses Redis as a binary payload (app/buffer/encoding.py) plus a small stream entry:
# per group of G samples, prompt P, completions C (the worst case, rollout.max_new_tokens):
#   payload  = 4 P (the prompt once) + 8 G C (int32 ids, float32 logprobs)
#              + G (P + C - 1) n_moe K b   with routing replay (b = 1 byte for E <= 256)
#   entry    = ENTRY_BYTES_PER_PROMPT_TOKEN P (the task's JSON: prompt ids and text) + the header
# Each group is written once (SET, plus its append-only-file record) and read once (by the rank
# that trains it), so a step moves groups_per_step x payload in and out of the buffer pod.
# Redis holds at most capacity_groups untaken groups plus the trainer's: (save_every + 1) steps
# (taken since the last save, and the batch prefetched for the next step); jemalloc rounds each
# payload up to its size class (`jemalloc_size`).
# Main thread: MAIN_THREAD_NS_PER_BYTE per payload byte, all-in (the AOF record, the reply copy,
# freeing the payload, the stream and set commands), from `moerl bench buffer` (bench/results/buffer.md:
# 6.5-9.2 ns/B in both legs, 7.3-9.7 ms per 1.06 MB group and 428-438 ms per 65.7 MB routing-replay
# group, on the 2-core dev VM at a load average of 10-19: an upper bound for a dedicated core).
MAIN_THREAD_NS_PER_BYTE = 6.9
ENTRY_BYTES_PER_PROMPT_TOKEN = 11  # ~7 for the id as JSON, ~4 for the prompt text
HEADER_BYTES = 150
HEADER_BYTES_PER_SAMPLE = 90


def jemalloc_size(n: int) -> int:
    """The jemalloc size class of an allocation of ``n`` > 16 KiB bytes: four classes per
    doubling (2^k x 1.25, 1.5, 1.75, 2; jemalloc's default size classes)."""
    if n <= 16 * 1024:
        return n
    k = (n - 1).bit_length() - 1  # 2^k < n <= 2^(k+1)
    step = (1 << k) // 4
    return -(-n // step) * step


@dataclass(frozen=True)
class BufferTraffic:
    """One step's buffer traffic for one layout (see the comment above).

    Attributes:
        routing_replay: with the routed experts of every MoE layer.
        payload_bytes: one group's payload; routed_bytes: the routed experts' part of it.
        entry_bytes: one group's stream entry (task JSON and header).
        step_bytes: written into and read out of Redis per step (each).
        held_groups: the most groups Redis holds at once.
        memory_bytes: Redis memory for them.
        main_thread_s: Redis main-thread seconds per step.
        link_gbps: the buffer pod's network rate, in plus out, Gbit/s at the step time.
    """

    routing_replay: bool
    payload_bytes: int
    routed_bytes: int
    entry_bytes: int
    step_bytes: int
    held_groups: int
    memory_bytes: int
    main_thread_s: float
    link_gbps: float


def buffer_traffic(config: PretrainedConfig, run, prompt_len: int, step_s: float,
                   routing_replay: bool) -> BufferTraffic:
    """The buffer's bytes, memory and main-thread time per step of ``run`` (a RunConfig) for
    prompts of ``prompt_len`` tokens and the policy ``config``.

    Raises:
        ValueError: prompt_len < 1 or step_s not finite and > 0 (named by the CLI flag).
    """
    if prompt_len < 1:
        raise ValueError(f"--seq-len minus rollout.max_new_tokens must leave a prompt of >= 1 token, got {prompt_len}")
    if not 0 < step_s < math.inf:
        raise ValueError(f"--step-s must be finite and > 0, got {step_s}")
    g, c, gps = run.rollout.group_size, run.rollout.max_new_tokens, run.trainer.groups_per_step
    routed = 0
    if routing_replay:
        e = num_routed_experts(config)
        width = 1 if e <= 1 << 8 else 2 if e <= 1 << 16 else 4
        routed = g * (prompt_len + c - 1) * len(moe_layer_ids(config)) * int(config.num_experts_per_tok) * width
    payload = 4 * prompt_len + 8 * g * c + routed
    entry = ENTRY_BYTES_PER_PROMPT_TOKEN * prompt_len + HEADER_BYTES + HEADER_BYTES_PER_SAMPLE * g
    held = run.buffer.capacity_groups + (run.trainer.save_every + 1) * gps
    step_bytes = gps * (payload + entry)
    return BufferTraffic(
        routing_replay=routing_replay, payload_bytes=payload, routed_bytes=routed, entry_bytes=entry,
        step_bytes=step_bytes, held_groups=held, memory_bytes=held * (jemalloc_size(payload) + entry),
        main_thread_s=gps * payload * MAIN_THREAD_NS_PER_BYTE * 1e-9, link_gbps=2 * step_bytes * 8 / step_s / 1e9,
    )
