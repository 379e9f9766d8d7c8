"""The deepep dispatcher against the `sgl-deep-ep==0.1.2.post1` wheel's own definitions (issue 20).

On CPU, in every `make test`:
  - tests/deep_ep_standin.py is a STAND-IN for the wheel's `deep_ep` (it moves rows over gloo and
    enforces the wheel's argument checks for the calls moerl makes). Its signatures, the lines of
    the wheel it cites, and the assertion texts it enforces are compared with the wheel itself,
    downloaded from PyPI;
  - through the stand-in, on 2 gloo ranks: the equivalence cases of tests/test_ep_equivalence.py
    at hidden 256 in bf16 (outputs, input and parameter gradients against EP=1), with the V2
    `ElasticBuffer` (built with 32-bit top-k ids, so a missing cast to `deep_ep.topk_idx_t` fails)
    and with the V1 `Buffer`; the buffer growing while a graph still uses the old one (kept until
    that graph is gone, then destroyed behind a barrier, never by the garbage collector); `auto`
    falling back when the buffer cannot be built (NCCL GIN missing); the first-run checklist's
    GPU checks (scripts/deepep_checklist.py);
  - a hidden size DeepEP rejects is refused when the layer is built, naming config.hidden_size;
  - `auto`'s reason when `import deep_ep` fails is that exception; the wheel's pins are checked
    with its real metadata;
  - the checklist's CPU-side part (`PREFLIGHT=1 bash scripts/gpu_ep_bench.sh`) runs here.
GPU only (skipped here; scripts/gpu_ep_bench.sh runs it): the same equivalence cases with the real
`deep_ep` on 2, 4 and 8 GPUs.
"""

from __future__ import annotations

import ast
import importlib.util
import inspect
import os
import re
import subprocess
import sys
import types
import zipfile
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from packaging.utils import canonicalize_name

sys.path.insert(0, str(Path(__file__).resolve().parent))
import deep_ep_standin as standin  # noqa: E402 - the tests directory's helpers
import pypi  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
WHEEL = "sgl-deep-ep==0.1.2.post1"
HIDDEN = 256  # the smallest width DeepEP's combine accepts
BF16_REL = 2e-2  # bf16 keeps 8 mantissa bits; expert GEMMs see the rows in another grouping


def rel_error(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| in fp32 (||a|| when b is all zeros)."""
    a, b = a.float(), b.float()
    denom = float(b.norm())
    return float((a - b).norm()) / denom if denom > 0 else float(a.norm())


def _equivalence():
    import test_ep_equivalence  # noqa: PLC0415 - this directory is on sys.path

    return test_ep_equivalence


def _checklist():
    spec = importlib.util.spec_from_file_location("deepep_checklist", ROOT / "scripts" / "deepep_checklist.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ---------------------------------------------------------------------------------------------
# Multi-rank workers (gloo with the stand-in on CPU, NCCL with the real deep_ep on GPUs).


def _use_standin(variant: str) -> None:
    """Make `import deep_ep` give the stand-in: V2 (ElasticBuffer and Buffer) or V1 only."""
    import app.model.dispatch.deepep as deepep_module

    if variant == "v2":
        standin.topk_idx_t = torch.int32  # a build with EP_NUM_TOPK_IDX_BITS=32: the cast matters
        module = standin
    else:
        standin.topk_idx_t = torch.int64
        module = types.ModuleType("deep_ep")
        for name in ("Buffer", "Config", "EventOverlap", "topk_idx_t"):
            setattr(module, name, getattr(standin, name))
    sys.modules["deep_ep"] = module
    # The stand-in runs on CPU: the availability check (CUDA, NCCL, sm90) is the real module's.
    deepep_module.deepep_unavailable_reason = lambda group=None, hidden_size=None: None


def _equivalence_cases(rank: int, size: int, device: torch.device) -> None:
    """The cases of tests/test_ep_equivalence.py at hidden 256, bf16, deepep vs EP=1."""
    from app.config import ParallelConfig
    from app.model.parallel import EPContext, init_ep

    eq = _equivalence()
    ep = init_ep(ParallelConfig(ep=size, ep_backend="deepep"))
    assert ep.backend == "deepep"
    for name, (make_config, tokens, mode) in eq.CASES.items():
        config = make_config(hidden=HIDDEN)
        tokens = (tokens * 2)[:size]
        if mode == "bias-skewed":
            tokens = tokens[:-1] + [0]
        x, replay, proj = eq.batch(sum(tokens), config.num_experts_per_tok, mode, hidden=HIDDEN)
        x, proj = x.to(torch.bfloat16), proj.to(torch.bfloat16)
        start, stop = sum(tokens[:rank]), sum(tokens[: rank + 1])

        def bf16_block(ep_ctx, config=config, mode=mode):
            block = eq.build(config, ep_ctx, mode).to(device)
            block.experts.to(torch.bfloat16)  # the router stays fp32, as build_policy keeps it
            if block.shared_experts is not None:
                block.shared_experts.to(torch.bfloat16)
            return block

        ref_out, ref_dx, ref_grads = eq.run_case(bf16_block(EPContext.local()), x, replay, proj)
        block = bf16_block(ep)
        local = slice(start, stop)
        out, dx, grads = eq.run_case(block, x[local], None if replay is None else replay[local], proj[local])
        where = f"deepep case {name}, EP={size}, rank {rank}"
        assert rel_error(out, ref_out[local]) < BF16_REL, f"{where}: output"
        assert rel_error(dx, ref_dx[local]) < BF16_REL, f"{where}: input grad"
        shard = slice(block.local_expert_offset, block.local_expert_offset + block.num_local_experts)
        for pname, grad in grads.items():
            if pname.startswith("experts."):
                expected = ref_grads[pname][shard]
            else:
                grad = grad.to(device)
                dist.all_reduce(grad)
                grad, expected = grad.cpu(), ref_grads[pname]
            assert rel_error(grad, expected) < BF16_REL, f"{where}: grad of {pname}"


def _regrowth_under_a_live_graph(size: int, device: torch.device) -> None:
    """A larger batch while the previous batch's graph still holds the buffer: the old buffer is
    kept for that graph's backward, then destroyed at the next dispatch once no rank holds it."""
    from app.model.dispatch import deepep
    from app.model.parallel import EPContext

    eq = _equivalence()
    ep = EPContext(group=dist.group.WORLD, rank=dist.get_rank(), size=size, backend="deepep")
    block = eq.build(eq.qwen_config(hidden=HIDDEN), ep, "natural").to(device)
    block.experts.to(torch.bfloat16)

    def forward(tokens: int):
        x = torch.randn(tokens, HIDDEN, generator=torch.Generator().manual_seed(tokens)).to(device, torch.bfloat16)
        return block(x.requires_grad_(True).unsqueeze(0)).float().sum()

    small = forward(3)
    before = deepep._current
    big = forward(4 * before.num_tokens)  # grows the buffer while `small`'s graph lives
    assert deepep._current is not before and len(deepep._retired) == 1 and deepep._retired[0] is before
    (small + big).backward()  # small's backward runs on the replaced buffer
    del small, big
    forward(3).backward()  # no graph holds the old buffer on any rank now: destroyed here
    assert deepep._retired == []


def _auto_falls_back_without_gin(size: int) -> None:
    from app.config import ParallelConfig
    from app.model.parallel import init_ep

    standin.ElasticBuffer.gin_available = False
    try:
        assert init_ep(ParallelConfig(ep=size, ep_backend="auto"), hidden_size=HIDDEN).backend == "alltoall"
    finally:
        standin.ElasticBuffer.gin_available = True
    assert init_ep(ParallelConfig(ep=size, ep_backend="auto"), hidden_size=HIDDEN).backend == "deepep"


def _worker(rank: int, size: int, port: int, variant: str) -> None:
    """variant: "v2" or "v1" (the stand-in, gloo on CPU) or "real" (deep_ep, NCCL on GPUs)."""
    from app.model.dispatch import deepep

    torch.set_num_threads(1)
    backend = "nccl" if variant == "real" else "gloo"
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size)
    try:
        if variant != "real":
            _use_standin(variant)
        _equivalence_cases(rank, size, device)
        if variant != "v1":
            _regrowth_under_a_live_graph(size, device)
        if variant == "v2":
            _auto_falls_back_without_gin(size)
            results = _checklist().check_group(dist.group.WORLD, device)
            assert results and all(r["ok"] for r in results), [r for r in results if not r["ok"]]
        deepep.release_buffers()
        if variant != "real":
            events = [e[0] for e in standin.EVENTS if e[1] == rank]
            assert events.count("create") == events.count("destroy") > 0, events
            assert "gc-destroy" not in events and "leak" not in events, events
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("variant", ["v2", "v1"])
def test_dispatcher_through_the_standin_on_two_gloo_ranks(variant: str) -> None:
    mp.spawn(_worker, args=(2, _equivalence().free_port(), variant), nprocs=2, join=True)


@pytest.mark.parametrize("size", [2, 4, 8])
def test_deepep_matches_ep1_on_gpus(size: int) -> None:
    """The equivalence cases with the real deep_ep in bf16 (relative L2 error < 2e-2)."""
    from app.model.dispatch.deepep import deepep_unavailable_reason

    reason = deepep_unavailable_reason(hidden_size=HIDDEN)
    if reason or torch.cuda.device_count() < size:
        pytest.skip(f"needs deep_ep and {size} GPUs: {reason or f'found {torch.cuda.device_count()}'}")
    mp.spawn(_worker, args=(size, _equivalence().free_port(), "real"), nprocs=size, join=True)


# ---------------------------------------------------------------------------------------------
# In-process checks.


def test_a_hidden_size_deepep_rejects_is_refused_when_the_layer_is_built() -> None:
    from app.config import RouterConfig
    from app.model.moe import MoEBlock
    from app.model.parallel import EPContext

    eq = _equivalence()
    ep = EPContext(group=None, rank=0, size=2, backend="deepep")
    for config in (eq.qwen_config(hidden=64), eq.deepseek_config(hidden=7000)):
        with pytest.raises(ValueError, match=rf"config\.hidden_size={config.hidden_size} is not a multiple of 256"):
            MoEBlock(config, RouterConfig(), ep)
    # A width it accepts gets past that check (and stops at the next: no deep_ep here).
    with pytest.raises(ValueError, match=r"ep\.backend='deepep' cannot run here"):
        MoEBlock(eq.qwen_config(hidden=HIDDEN), RouterConfig(), ep)


def test_auto_gives_the_import_error_as_its_reason(tmp_path, monkeypatch) -> None:
    from app.model.dispatch.deepep import deepep_unavailable_reason

    package = tmp_path / "deep_ep"
    package.mkdir()
    (package / "__init__.py").write_text(
        "raise ImportError('libnccl.so.2: undefined symbol: ncclCommQueryProperties')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "deep_ep", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    reason = deepep_unavailable_reason()
    assert reason == "import deep_ep failed: ImportError: libnccl.so.2: undefined symbol: ncclCommQueryProperties"
    assert deepep_unavailable_reason(hidden_size=64).startswith("config.hidden_size=64 is not a multiple of 256")
    # One that imports, with no sgl-deep-ep metadata (a source build): nothing left to object to.
    (package / "__init__.py").write_text("")
    monkeypatch.delitem(sys.modules, "deep_ep", raising=False)
    assert deepep_unavailable_reason(hidden_size=HIDDEN) is None


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel, unpacked."""
    d = tmp_path_factory.mktemp("sgl-deep-ep")
    path = pypi.download_wheel(WHEEL, d / "dl")
    with zipfile.ZipFile(path) as z:
        z.extractall(d / "w")
    return d / "w"


def _methods(source: str, cls: str) -> dict[str, ast.FunctionDef]:
    tree = ast.parse(source)
    node = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls)
    return {f.name: f for f in node.body if isinstance(f, ast.FunctionDef)}


def _ast_signature(f: ast.FunctionDef) -> list[tuple[str, object]]:
    args = [a.arg for a in f.args.args]
    defaults = [None] * (len(args) - len(f.args.defaults)) + [ast.literal_eval(d) for d in f.args.defaults]
    return [(a, d) for a, d in zip(args, defaults, strict=True) if a != "self"]


def _py_signature(f) -> list[tuple[str, object]]:
    params = inspect.signature(f).parameters.values()
    return [(p.name, None if p.default is inspect.Parameter.empty else p.default) for p in params if p.name != "self"]


@pytest.mark.parametrize(("path", "cls", "methods"), [
    ("deep_ep/buffers/elastic.py", "ElasticBuffer",
     ["__init__", "destroy", "get_buffer_size_hint", "get_theoretical_num_sms", "dispatch", "combine"]),
    ("deep_ep/buffers/legacy.py", "Buffer",
     ["__init__", "destroy", "get_dispatch_config", "get_combine_config", "get_dispatch_layout", "dispatch",
      "combine"]),
])
def test_standin_signatures_are_the_wheels(wheel, path, cls, methods) -> None:
    real = _methods((wheel / path).read_text(), cls)
    for m in methods:
        assert _py_signature(getattr(getattr(standin, cls), m)) == _ast_signature(real[m]), f"{cls}.{m}"


# (file in the wheel, line, text that line holds): the places the stand-in and deepep.py rely on.
CITED = [
    ("deep_ep/buffers/elastic.py", 771, "assert num_experts % num_groups == 0"),
    ("deep_ep/buffers/elastic.py", 928,
     "num_sms = self.get_theoretical_num_sms(num_experts, num_topk) if num_sms == 0"),
    ("deep_ep/buffers/elastic.py", 938, "assert topk_idx is None"),
    ("deep_ep/buffers/elastic.py", 1086, "num_sms = handle.num_sms if num_sms == 0 else num_sms"),
    ("deep_ep/buffers/elastic.py", 373, "assert self.explicitly_destroy"),
    ("deep_ep/buffers/legacy.py", 387, "assert topk_idx is None and topk_weights is None"),
    ("deep_ep/buffers/legacy.py", 259, "assert num_ranks in config_map"),
    ("deep_ep/buffers/legacy.py", 144, "assert self.explicitly_destroy"),
    ("deep_ep/__init__.py", 103, "from deep_ep._C import Config, topk_idx_t"),
    ("deep_ep/utils/comm.py", 62, "EP_REUSE_NCCL_COMM"),
    ("deep_ep/include/deep_ep/impls/combine.cuh", 109, "kHidden % (32 * sizeof(int4) / sizeof(nv_bfloat16)) == 0"),
    ("deep_ep/include/deep_ep/common/layout.cuh", 198, "num_hidden_bytes % ptx::kNumTMAAlignBytes == 0"),
    ("deep_ep/include/deep_ep/common/ptx.cuh", 16, "kNumTMAAlignBytes = 32"),
    ("deep_ep/include/deep_ep/common/compiled.cuh", 55, "#define EP_NUM_TOPK_IDX_BITS 64"),
    ("deep_ep/include/deep_ep/impls/dispatch_copy_epilogue.cuh", 107, "ptx::deduplicate(dst_expert_idx, lane_idx)"),
]


def test_the_wheel_lines_cited_hold_what_is_cited(wheel) -> None:
    for path, line, text in CITED:
        assert text in (wheel / path).read_text().splitlines()[line - 1], f"{path}:{line}"
    # Every other citation of a wheel file in the stand-in points at a line that exists.
    for path, line in re.findall(r"((?:deep_ep/)?[\w/]+\.(?:py|cuh)):(\d+)", Path(standin.__file__).read_text()):
        found = [wheel / path] if path.startswith("deep_ep/") else list(wheel.rglob(path))
        assert len(found) == 1 and found[0].exists(), f"{path}: not one file of the wheel"
        assert len(found[0].read_text().splitlines()) >= int(line), f"{path}:{line}"


# The C++ checks the stand-in enforces for moerl's calls, as the wheel's compiled module spells them
# (upstream DeepEP dd758ca csrc/elastic/buffer.hpp, csrc/kernels/backend/nccl.cu).
CPP_ASSERTS = [
    "num_sms > 0", "x.is_cuda() and x.is_contiguous()", "(x.size(1) * x.element_size()) % sizeof(int4) == 0",
    "num_tokens <= num_max_tokens_per_rank", "topk_idx.scalar_type() == c10::CppTypeToScalarType<topk_idx_t>::value",
    "topk_idx.is_cuda() and topk_idx.is_contiguous()", "num_experts % nccl_context->num_ranks == 0",
    "topk_weights->is_cuda() and topk_weights->is_contiguous()", "x.scalar_type() == torch::kBFloat16",
    "num_tokens == num_tokens__ and num_topk == num_topk__", "topk_weights->scalar_type() == torch::kFloat",
    "num_max_tokens_per_rank > 0 and hidden > 0", "not destroyed", "NCCL GIN is unavailable",
    "Prior to NCCL 2.31, NCCL compile-time and runtime versions must be the same",
]


def test_the_wheels_compiled_module_carries_the_checks_the_standin_enforces(wheel) -> None:
    (so,) = (wheel / "deep_ep").glob("_C*.so")
    data = so.read_bytes()
    missing = [a for a in CPP_ASSERTS if a.encode() not in data]
    assert not missing, missing


def test_the_wheels_pins_are_checked_with_its_real_metadata() -> None:
    from app.model.dispatch.deepep import deepep_pin_mismatch

    md = {canonicalize_name(m["name"]): m for m in pypi.resolve([WHEEL, "torch==2.14.1"], no_deps=True)}
    old = pypi.resolve(["torch==2.11.0"], no_deps=True)[0]  # the lent GPU machine's torch
    deepep, torch_md = md["sgl-deep-ep"], md["torch"]
    args = (deepep["version"], deepep["requires_dist"])
    assert deepep_pin_mismatch(*args, "2.14.1", torch_md["requires_dist"], (2, 30, 7)) is None
    assert deepep_pin_mismatch(*args, "2.14.1+cu130", torch_md["requires_dist"], (2, 30, 7)) is None
    assert "needs NCCL 2.30.7 exactly" in deepep_pin_mismatch(*args, "2.14.1", torch_md["requires_dist"], (2, 28, 9))
    assert "built for torch==2.14.1" in deepep_pin_mismatch(*args, "2.11.0", old["requires_dist"], (2, 28, 9))


def test_checklist_preflight_runs_here(tmp_path) -> None:
    """The checklist's CPU-side part, as scripts/gpu_ep_bench.sh runs it (PREFLIGHT=1: no GPU needed)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHON": sys.executable, "PREFLIGHT": "1", "OUT": str(tmp_path)}
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_ep_bench.sh")], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    facts = dict(line.split(": ", 1) for line in proc.stdout.splitlines() if ": " in line)
    assert facts["torch"] == torch.__version__
    assert {"nvcc", "loaded_nccl", "sgl_deep_ep", "deepep_unavailable_reason", "problems"} <= facts.keys()
    if importlib.util.find_spec("deep_ep") is None:
        assert facts["sgl_deep_ep"] == "None" and "sgl-deep-ep is not installed" in facts["problems"]
    assert "torch: " in (tmp_path / "gpu_ep_bench.log").read_text()
