"""The rollout engine's command line, from the run config's engine profile.

One definition for every place that starts an engine: charts8s (SGLang in rollout pods, on
LeaderWorkerSet groups, and for `moerl bench rollout`), the TorchX component and the embedded
loop (the built-in `moerl engine`). Flags are SGLang 0.5.23's server arguments
(``sglang/srt/arg_groups/fields/*.py``); tests/test_sglang_protocol.py parses every command
charts8s emits with those definitions, so a misspelt or removed flag fails a test.
"""

from __future__ import annotations

from dataclasses import dataclass

from app.config import EngineProfile

# The torch.distributed rendezvous port of a multi-node engine on its leader
# (kubernetes-sigs/lws docs/examples/sglang/lws.yaml uses 20000).
DIST_INIT_PORT = 20000
# LeaderWorkerSet sets these in every pod of a group (kubernetes-sigs/lws, "Environment variables"):
# the leader's DNS name and the pod's index in its group (0 on the leader).
LWS_LEADER_ADDRESS = "$(LWS_LEADER_ADDRESS)"
LWS_WORKER_INDEX = "$(LWS_WORKER_INDEX)"
LWS_GROUP_SIZE = "$(LWS_GROUP_SIZE)"


# SGLang 0.5.23 ``srt/environ.py``: SGLANG_DEEPEP_NUM_MAX_DISPATCH_TOKENS_PER_RANK's default,
# and DeepEP's low-latency bound on it (``token_dispatcher/deepep.py`` asserts <= 1024).
DEEPEP_DEFAULT_DISPATCH_TOKENS = 128
DEEPEP_MAX_DISPATCH_TOKENS = 1024
NVSHMEM_QP_DEPTH_DEFAULT = 1024  # ``token_dispatcher/deepep.py`` _NVSHMEM_QP_DEPTH_DEFAULT


def default_decode_graph_bs(gpu_memory_gib: float, tp_size: int) -> int:
    """SGLang 0.5.23's default decode CUDA-graph batch per rank by GPU memory
    (``arg_groups/memory_hook.py`` ``handle_gpu_memory_settings``), before it is capped by
    ``--max-running-requests``."""
    mib = gpu_memory_gib * 1024
    if mib < 20 * 1024:
        return 8
    if mib < 35 * 1024:
        return 48 if tp_size < 4 else 160
    if mib < 60 * 1024:
        return 32 if tp_size < 4 else 160
    if mib < 160 * 1024:
        return 256 if tp_size < 4 else 512
    return 512


@dataclass(frozen=True)
class EngineLayout:
    """An `EngineProfile` resolved against the GPUs of one node.

    Attributes: profile, gpus_per_node; derived: nodes, gpus (whole engine), tp_size, ep_size
    (1 for ``tp``), a2a_backend (None for ``tp``, else SGLang's ``--moe-a2a-backend``).
    """

    profile: EngineProfile
    gpus_per_node: int

    @property
    def nodes(self) -> int:
        return self.profile.nodes_per_engine

    @property
    def gpus(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def tp_size(self) -> int:
        return self.profile.tp_size or self.gpus

    @property
    def ep_size(self) -> int:
        if self.profile.kind == "tp":
            return 1
        return self.profile.ep_size or self.tp_size

    @property
    def a2a_backend(self) -> str | None:
        return {"tp": None, "ep": "none", "ep-deepep": "deepep"}[self.profile.kind]

    @property
    def low_latency(self) -> bool:
        """DeepEP's low-latency kernels run the decode (``--deepep-mode`` auto or low_latency)."""
        return self.profile.kind == "ep-deepep" and self.profile.deepep_mode in ("auto", "low_latency")

    @property
    def max_running_requests(self) -> int | None:
        """``--max-running-requests``: the profile's, or for DeepEP low latency its in-flight
        default (SGLang splits it over the attention-DP ranks)."""
        if self.profile.max_running_requests or not self.low_latency:
            return self.profile.max_running_requests
        return self.profile.default_inflight_sequences()

    @property
    def decode_graph_bs(self) -> int | None:
        """``--cuda-graph-max-bs-decode``: the profile's, or for DeepEP low latency the
        requests one attention-DP rank runs at most."""
        if self.profile.cuda_graph_max_bs or not self.low_latency:
            return self.profile.cuda_graph_max_bs
        return max(1, self.max_running_requests // self.profile.attn_dp_size)

    @property
    def dispatch_tokens(self) -> int:
        """SGLANG_DEEPEP_NUM_MAX_DISPATCH_TOKENS_PER_RANK (ep-deepep): the profile's, else the
        decode graph batch per rank, at least SGLang's default."""
        return self.profile.deepep_max_dispatch_tokens or max(DEEPEP_DEFAULT_DISPATCH_TOKENS, self.decode_graph_bs or 0)

    def decode_tokens_per_rank(self, gpu_memory_gib: float) -> int:
        """Tokens one rank dispatches in its largest decode step as SGLang 0.5.23 resolves the
        command (one token per request, no speculative decoding): the decode CUDA-graph batch
        (``--cuda-graph-max-bs-decode``, else the GPU-memory default capped by
        ``--max-running-requests``), no more than that rank's share of the running requests."""
        bs = self.decode_graph_bs
        mrr = self.max_running_requests
        if bs is None:
            bs = default_decode_graph_bs(gpu_memory_gib, self.tp_size)
            if mrr is not None:
                bs = min(bs, mrr)
        if mrr is not None:
            bs = min(bs, max(1, mrr // self.profile.attn_dp_size))
        return bs

    def engine_env(self) -> dict[str, str]:
        """Environment of the engine's SGLang processes for this layout: for DeepEP low latency
        the dispatch cap and NVSHMEM's queue-pair depth (SGLang raises it to
        ``max(1024, 2 * (cap + 1))`` itself; written out so the pod spec says what runs)."""
        if not self.low_latency:
            return {}
        cap = self.dispatch_tokens
        return {"SGLANG_DEEPEP_NUM_MAX_DISPATCH_TOKENS_PER_RANK": str(cap),
                "NVSHMEM_QP_DEPTH": str(max(NVSHMEM_QP_DEPTH_DEFAULT, 2 * (cap + 1)))}

    def check_dispatch(self, gpu_memory_gib: float, where: str = "rollout.engine") -> None:
        """Raise ValueError naming the field when a DeepEP low-latency decode can send more
        tokens per rank than the dispatch cap (SGLang 0.5.23 checks this for deepep_v2 only:
        ``arg_groups/moe_hook.py`` ``validate_deepep_v2_dispatch_token_budget``; for deepep
        nothing clamps it) or the cap exceeds DeepEP's bound."""
        if not self.low_latency:
            return
        tokens, cap = self.decode_tokens_per_rank(gpu_memory_gib), self.dispatch_tokens
        if cap > DEEPEP_MAX_DISPATCH_TOKENS:
            raise ValueError(f"{where}: {cap} dispatch tokens per rank exceed DeepEP's low-latency bound of "
                             f"{DEEPEP_MAX_DISPATCH_TOKENS}; lower max_running_requests or cuda_graph_max_bs")
        if tokens > cap:
            raise ValueError(f"{where}.deepep_max_dispatch_tokens={cap}: a decode step sends up to {tokens} tokens per "
                             "rank (cuda_graph_max_bs, and max_running_requests over attn_dp_size); raise it "
                             "(SGLANG_DEEPEP_NUM_MAX_DISPATCH_TOKENS_PER_RANK) or lower those")

    def check(self, where: str = "rollout.engine") -> None:
        """Raise ValueError naming the field when the profile cannot run on these GPUs.

        Rules: a multi-node engine uses every GPU of its nodes (SGLang splits ``--tp-size``
        evenly over ``--nnodes``); a one-node engine at most the node's GPUs; attention DP and
        EP divide the TP size (SGLang ``arg_groups/parallel_hook.py``); DeepEP runs with
        ep_size == tp_size (``arg_groups/overrides.py``, ``_a2a_ep_size``).
        """
        p = self.profile
        if self.gpus_per_node < 1:
            raise ValueError(f"{where}: the engine's nodes have no GPU")
        if self.nodes > 1 and self.tp_size != self.gpus:
            raise ValueError(f"{where}.tp_size={self.tp_size}: an engine over {self.nodes} nodes uses all their "
                             f"{self.gpus} GPUs ({self.gpus_per_node} per node)")
        if self.tp_size > self.gpus:
            raise ValueError(f"{where}.tp_size={self.tp_size} exceeds the engine's {self.gpus} GPUs")
        if self.tp_size % p.attn_dp_size:
            raise ValueError(f"{where}.attn_dp_size={p.attn_dp_size} must divide tp_size={self.tp_size}")
        if self.tp_size % self.ep_size:
            raise ValueError(f"{where}.ep_size={self.ep_size} must divide tp_size={self.tp_size}")
        if p.kind == "ep-deepep" and self.ep_size != self.tp_size:
            raise ValueError(f"{where}.ep_size={self.ep_size}: SGLang's DeepEP backend runs with ep_size == "
                             f"tp_size={self.tp_size}")


def sglang_command(
    layout: EngineLayout, model_path: str, *, port: int, host: str = "127.0.0.1", weight_version: str = "0",
    routing_replay: bool = False, dist_init_port: int = DIST_INIT_PORT,
) -> list[str]:
    """``python3 -m sglang.launch_server ...`` for one node of an engine.

    The same command runs on every node of a multi-node engine: LeaderWorkerSet fills in the
    node rank and the leader's address per pod (``$(VAR)`` is expanded by the kubelet); only
    node rank 0 serves HTTP (SGLang ``entrypoints/http_server.py``).

    Args:
        weight_version: ``--weight-version`` of the weights loaded at start ("0": the base
            policy is policy version 0; SGLang's default is "default", which no worker can compare).
        routing_replay: ``--enable-return-routed-experts`` (requests may then ask for them).

    Raises:
        ValueError: see `EngineLayout.check`, or no model_path.
    """
    if not model_path:
        raise ValueError("the SGLang engine needs model_path (an HF id or a local checkpoint directory)")
    layout.check()
    p = layout.profile
    cmd = ["python3", "-m", "sglang.launch_server", "--model-path", model_path, "--host", host, "--port", str(port),
           "--tp-size", str(layout.tp_size), "--weight-version", str(weight_version)]
    if layout.a2a_backend is not None:
        cmd += ["--ep-size", str(layout.ep_size), "--moe-a2a-backend", layout.a2a_backend]
    if p.kind == "ep-deepep":
        cmd += ["--deepep-mode", p.deepep_mode]
    if p.attn_dp_size > 1:
        cmd += ["--attn-dp-size", str(p.attn_dp_size)]
    if p.enable_dp_lm_head:
        cmd.append("--enable-dp-lm-head")
    for flag, value in (("--moe-dense-tp-size", p.moe_dense_tp_size), ("--moe-runner-backend", p.moe_runner_backend),
                        ("--max-running-requests", layout.max_running_requests),
                        ("--cuda-graph-max-bs-decode", layout.decode_graph_bs),
                        ("--chunked-prefill-size", p.chunked_prefill_size),
                        ("--mem-fraction-static", p.mem_fraction_static)):
        if value is not None:
            cmd += [flag, str(value)]
    if routing_replay:
        cmd.append("--enable-return-routed-experts")
    if layout.nodes > 1:
        cmd += ["--nnodes", str(layout.nodes), "--node-rank", LWS_WORKER_INDEX,
                "--dist-init-addr", f"{LWS_LEADER_ADDRESS}:{dist_init_port}"]
    return cmd + list(p.extra_args)


def builtin_command(profile: EngineProfile, model_path: str, *, port: int, host: str = "127.0.0.1",
                    weight_version: str = "0", routing_replay: bool = False) -> list[str]:
    """``moerl engine ...``: the built-in engine (one process, no parallelism) for a profile.

    Raises:
        ValueError: the profile asks for more than one node, or no model_path.
    """
    if not model_path:
        raise ValueError("the built-in engine needs model_path (a local HF checkpoint directory)")
    if profile.nodes_per_engine != 1:
        raise ValueError(f"rollout.engine.nodes_per_engine={profile.nodes_per_engine}: the built-in engine runs on one node")
    cmd = ["moerl", "engine", "--model-path", model_path, "--host", host, "--port", str(port),
           "--weight-version", str(weight_version)]
    if profile.max_running_requests:
        cmd += ["--max-running-requests", str(profile.max_running_requests)]
    if routing_replay:
        cmd.append("--enable-return-routed-experts")
    return cmd
