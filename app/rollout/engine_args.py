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
                        ("--max-running-requests", p.max_running_requests),
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
