"""DeepEP's low-latency token cap on the engines (issue 26 item 3), against SGLang 0.5.23's own code.

With ``--deepep-mode auto`` the decode runs DeepEP's low-latency kernels, whose buffers hold
``SGLANG_DEEPEP_NUM_MAX_DISPATCH_TOKENS_PER_RANK`` tokens per rank (default 128 in
``srt/environ.py``); SGLang 0.5.23 checks the decode batch against its cap only for deepep_v2.
For every ep-deepep profile the charts render (the examples, the bench pair, the DeepSeek-V3
recipe) this test resolves the rendered command with SGLang's own code, compiled from the
wheel: ``handle_gpu_memory_settings`` (the decode CUDA-graph batch by GPU memory, capped by
--max-running-requests) and ``_decode_graph_dispatch_tokens_per_rank`` (the tokens one rank
dispatches in its largest decode graph), and checks them against the rendered cap; and
``_set_nvshmem_qp_depth`` leaves the rendered NVSHMEM queue depth as it is. A profile whose
decode batch exceeds its cap is refused before synth.
"""

from __future__ import annotations

import ast
import builtins
import copy
import logging
import os
from pathlib import Path
from types import ModuleType, SimpleNamespace

import pytest

from charts8s.rollout import engine_container
from charts8s.workloads import WorkloadError, load_workloads
from infra.config import load_config
from sglang_oracle import parse_launch_server, sglang_dir, wheel_function

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "charts8s" / "examples"
LWS_ENV = {"LWS_WORKER_INDEX": "1", "LWS_LEADER_ADDRESS": "moerl-rollout-0.moerl-rollout.moerl", "LWS_GROUP_SIZE": "2"}
CAP = "SGLANG_DEEPEP_NUM_MAX_DISPATCH_TOKENS_PER_RANK"
BACKEND = SimpleNamespace(FULL="full", BREAKABLE="breakable", DISABLED="disabled")


def sglang_default(name: str) -> int:
    """An ``EnvInt`` default of ``srt/environ.py``."""
    for node in ast.walk(ast.parse((sglang_dir() / "srt/environ.py").read_text())):
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) == name:
            return ast.literal_eval(node.value.args[0])
    raise KeyError(name)


def _importer(stubs: dict[str, ModuleType]):
    real = builtins.__import__

    def imp(name, globals=None, locals=None, fromlist=(), level=0):
        return stubs[name] if name in stubs else real(name, globals, locals, fromlist, level)

    return {**builtins.__dict__, "__import__": imp}


def sglang_resolve(ns, gpu_memory_gib: float) -> SimpleNamespace:
    """The server arguments after SGLang's ``handle_gpu_memory_settings`` (compiled from the
    wheel) on parsed command ``ns`` on a GPU of ``gpu_memory_gib``. Its batch-size list helpers
    are stand-ins (they do not change max_bs); parse_cuda_graph_config's fold of
    --cuda-graph-max-bs-decode into the decode phase is applied as it is written there."""
    sa = SimpleNamespace(**vars(ns))
    sa.device = "cuda"
    sa.cuda_graph_config = SimpleNamespace(
        decode=SimpleNamespace(max_bs=ns.cuda_graph_max_bs_decode, bs=None, backend=BACKEND.FULL),
        prefill=SimpleNamespace(max_bs=None, bs=None, backend=BACKEND.BREAKABLE))
    sa._cuda_graph_config_locked = set()
    sa.mem_fraction_static = sa.mem_fraction_static or 0.85  # the static-memory block is not under test
    sa.enable_symm_mem = False
    graphs = ModuleType("cuda_graph_hook")
    graphs.generate_decode_cuda_graph_batch_sizes = lambda server_args, max_bs: [max_bs]
    graphs.generate_prefill_cuda_graph_batch_sizes = lambda max_bs: [max_bs]
    graphs.generate_cpu_graph_batch_sizes = lambda server_args: [1]
    vl = ModuleType("qwen3_vl")
    vl.expand_multimodal_decode_graph_to_running_limit = lambda server_args, decode, gpu_mem: None
    namespace = {
        "__builtins__": _importer({"sglang.srt.arg_groups.cuda_graph_hook": graphs,
                                   "sglang.srt.arg_groups.model_overrides.qwen3_vl": vl}),
        "copy": copy, "logger": logging.getLogger("sglang-memory"), "resolving_view": lambda s: s,
        "declare_resolution": lambda s, source, **kw: [setattr(s, k, v) for k, v in kw.items()],
        "get_device_memory_capacity": lambda device: gpu_memory_gib * 1024, "Backend": BACKEND,
        "Phase": SimpleNamespace(DECODE="decode", PREFILL="prefill"), "use_mla_backend": lambda s: True,
        "_DEFAULT_PP_PREFILL_CUDA_GRAPH_MAX_TOKENS": 2048,
    }
    wheel_function("srt/arg_groups/memory_hook.py", "handle_gpu_memory_settings", namespace)(sa)
    return sa


def sglang_decode_tokens_per_rank(sa) -> int:
    """SGLang's ``_decode_graph_dispatch_tokens_per_rank`` (its deepep_v2 budget check) on
    resolved arguments: requests x tokens per request of the largest decode graph of one rank."""
    fn = wheel_function("srt/arg_groups/moe_hook.py", "_decode_graph_dispatch_tokens_per_rank", {
        "resolved_view": lambda s: s, "Backend": BACKEND, "max_speculative_num_draft_tokens": lambda s: None})
    sa.disaggregation_mode = "null"
    bs, per_request = fn(sa)
    return bs * per_request


def sglang_qp_depth(env: dict) -> str:
    """NVSHMEM_QP_DEPTH after SGLang's ``_set_nvshmem_qp_depth`` with the rendered environment."""
    environ = dict(env)
    fn = wheel_function("srt/layers/moe/token_dispatcher/deepep.py", "_set_nvshmem_qp_depth",
                        {"os": SimpleNamespace(environ=environ), "_NVSHMEM_QP_DEPTH_DEFAULT": 1024})
    fn(int(env.get(CAP, sglang_default(CAP))))
    return environ["NVSHMEM_QP_DEPTH"]


def deepep_engines() -> list[tuple[str, object, object]]:
    """(where, plan, layout) of every ep-deepep layout the examples and the recipe render."""
    os.chdir(ROOT)
    out = []
    sources = [(load_config("prod", EXAMPLES / "p5en-rollout.deploy.yaml"), EXAMPLES / f"{n}.workloads.yaml")
               for n in ("qwen3-30b-a3b-1node-deepep", "dsv3-2node-deepep", "dsv3-ab")]
    sources.append((load_config("prod", ROOT / "recipes" / "deepseek-v3-grpo.deploy.yaml"),
                    ROOT / "recipes" / "deepseek-v3-grpo.workloads.yaml"))
    for cfg, path in sources:
        plan = load_workloads(cfg, path)
        for name, layout in {"rollout": plan.engine, **plan.bench_layouts()}.items():
            if layout.profile.kind == "ep-deepep":
                out.append((f"{path.name}:{name}", plan, layout))
    return out


ENGINES = deepep_engines()


@pytest.mark.parametrize("where,plan,layout", ENGINES, ids=[w for w, _, _ in ENGINES])
def test_the_rendered_decode_batch_fits_the_rendered_dispatch_cap(where, plan, layout):
    c = engine_container(plan, layout, leader=True)
    env = {e["name"]: e["value"] for e in c["env"]}
    gpu = min(s.gpu_memory_gib for s in plan.pool("rollout-gpu").specs)
    resolved = sglang_resolve(parse_launch_server(c["command"], LWS_ENV), gpu)
    tokens = sglang_decode_tokens_per_rank(resolved)
    cap = int(env.get(CAP, sglang_default(CAP)))
    assert layout.profile.deepep_mode in ("auto", "low_latency")
    assert 0 < tokens <= cap <= 1024, (where, tokens, cap)
    assert tokens == layout.decode_tokens_per_rank(gpu)  # the synth-time rule is SGLang's resolution
    assert sglang_qp_depth(env) == env["NVSHMEM_QP_DEPTH"]  # what SGLang would set, written out


def test_sglangs_own_default_overflows_the_default_cap_on_h200():
    """What the profiles rendered before: no batch flags, the default cap: SGLang captures
    decode graphs of 512 requests per rank on a 141 GiB GPU with tp >= 4."""
    ns = parse_launch_server(["python3", "-m", "sglang.launch_server", "--model-path", "m", "--tp-size", "8",
                              "--ep-size", "8", "--moe-a2a-backend", "deepep", "--attn-dp-size", "8"])
    assert sglang_decode_tokens_per_rank(sglang_resolve(ns, 141)) == 512 > sglang_default(CAP) == 128


@pytest.mark.parametrize("engine,message", [
    ("deepep_max_dispatch_tokens: 128, max_running_requests: 2048",
     r"rollout\.engine\.deepep_max_dispatch_tokens=128: a decode step sends up to 256 tokens per rank"),
    ("max_running_requests: 16384", r"rollout\.engine: 2048 dispatch tokens per rank exceed DeepEP's low-latency bound"),
])
def test_a_decode_batch_over_the_cap_is_refused_before_synth(tmp_path, engine, message):
    (tmp_path / "run.yaml").write_text(f"rollout: {{engine: {{kind: ep-deepep, attn_dp_size: 8, {engine}}}}}\n"
                                       "model: {path: Qwen/Qwen3-30B-A3B}\n")
    (tmp_path / "w.yaml").write_text(f"run_config: {tmp_path / 'run.yaml'}\n")
    with pytest.raises(WorkloadError, match=message):
        load_workloads(load_config("prod", EXAMPLES / "p5en-rollout.deploy.yaml"), tmp_path / "w.yaml")
