"""HF checkpoint I/O of the policy: round trips with stock transformers, both expert layouts,
and save/load under expert parallelism with real processes (gloo).

Tolerance: logits compared in fp32 with atol 1e-5 (logits are O(1)). Our MoE block sums the
same products as transformers' eager experts loop, but in a different order (grouped by expert
and dispatched), so results may differ by float32 rounding (~1e-7 relative per op, a few layers
deep); 1e-5 is far below any real mismatch (a wrong expert or weight moves logits by >1e-3).
"""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from safetensors import safe_open
from transformers import AutoModelForCausalLM

from app.config import RouterConfig
from app.model.checkpoint import INDEX_NAME, load_policy, save_policy
from app.model.config import moe_layer_ids, tiny_config
from app.model.parallel import EPContext
from app.model.policy import build_policy, moe_blocks, stock_architecture

PRESETS = ["tiny-qwen3-moe", "tiny-deepseek-v3"]
ATOL = 1e-5


def _ids(seed: int = 0) -> torch.Tensor:
    return torch.randint(4, 100, (2, 9), generator=torch.Generator().manual_seed(seed))


def _logits(model, ids) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits.float()


def _keys(directory: Path) -> dict[str, tuple[int, ...]]:
    out = {}
    for f in directory.glob("*.safetensors"):
        with safe_open(f, framework="pt") as h:
            out.update({k: tuple(h.get_slice(k).get_shape()) for k in h.keys()})
    return out


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)  # the CI machine is shared


@pytest.mark.parametrize("preset", PRESETS)
def test_saved_checkpoint_loads_in_stock_transformers_with_same_logits(tmp_path, preset):
    config = tiny_config(preset)
    ours = build_policy(config, RouterConfig(), EPContext.local(), seed=3).eval()
    out = save_policy(ours, tmp_path / "ckpt", EPContext.local(), max_shard_bytes=40_000)

    files = sorted(p.name for p in out.iterdir())
    assert "config.json" in files and INDEX_NAME in files
    shards = [f for f in files if f.endswith(".safetensors")]
    assert len(shards) > 1 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    index = json.loads((out / INDEX_NAME).read_text())
    assert set(index["weight_map"].values()) == set(shards)
    keys = _keys(out)
    assert set(index["weight_map"]) == set(keys)
    assert index["metadata"]["total_size"] == sum(p.numel() * p.element_size() for p in ours.state_dict().values())
    layer = moe_layer_ids(config)[0]
    inter, hidden = config.moe_intermediate_size, config.hidden_size
    for e in range(8):  # Hub per-expert names, one tensor per projection and expert
        assert keys[f"model.layers.{layer}.mlp.experts.{e}.gate_proj.weight"] == (inter, hidden)
        assert keys[f"model.layers.{layer}.mlp.experts.{e}.up_proj.weight"] == (inter, hidden)
        assert keys[f"model.layers.{layer}.mlp.experts.{e}.down_proj.weight"] == (hidden, inter)
    assert not any(k.endswith("gate_up_proj") for k in keys)
    assert not list(tmp_path.glob(".*"))  # no partial directory left behind

    stock, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert type(stock).__name__ == stock_architecture(ours)  # our policy subclasses the stock class
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    ids = _ids()
    ref = _logits(ours, ids)
    torch.testing.assert_close(_logits(stock.eval(), ids), ref, atol=ATOL, rtol=0)
    torch.testing.assert_close(_logits(load_policy(out, RouterConfig(), EPContext.local()), ids), ref, atol=ATOL, rtol=0)


@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("fused", [False, True], ids=["per-expert", "fused"])
def test_stock_checkpoint_loads_into_our_policy_with_same_logits(tmp_path, preset, fused):
    torch.manual_seed(11)
    stock = AutoModelForCausalLM.from_config(tiny_config(preset)).eval()
    stock.save_pretrained(tmp_path / "stock", save_original_format=not fused)
    keys = _keys(tmp_path / "stock")
    # transformers 5 writes Hub per-expert names by default and its fused layout on request.
    assert any(k.endswith("mlp.experts.gate_up_proj") for k in keys) == fused
    assert any(k.endswith("mlp.experts.0.gate_proj.weight") for k in keys) != fused

    ours = load_policy(tmp_path / "stock", RouterConfig(), EPContext.local())
    assert not ours.training
    ids = _ids(1)
    torch.testing.assert_close(_logits(ours, ids), _logits(stock, ids), atol=ATOL, rtol=0)


def test_save_bf16_keeps_router_fp32_and_reloads(tmp_path):
    config = tiny_config("tiny-qwen3-moe")
    model = build_policy(config, RouterConfig(), EPContext.local(), dtype=torch.bfloat16)
    save_policy(model, tmp_path / "c", EPContext.local())
    saved = json.loads((tmp_path / "c" / "config.json").read_text())
    assert saved["dtype"] == "bfloat16" and saved["architectures"] == ["Qwen3MoeForCausalLM"]
    assert saved["rope_theta"] == saved["rope_parameters"]["rope_theta"]  # for transformers 4.x readers
    back = load_policy(tmp_path / "c", RouterConfig(), EPContext.local(), dtype=torch.bfloat16)
    for (name, a), (_, b) in zip(model.state_dict().items(), back.state_dict().items()):
        assert a.dtype == b.dtype and torch.equal(a, b), name
    _, block = moe_blocks(back)[0]
    assert block.gate.weight.dtype == torch.float32
    assert block.experts.gate_up_proj.dtype == torch.bfloat16


def test_overwrite_replaces_existing_checkpoint(tmp_path):
    ep = EPContext.local()
    config = tiny_config("tiny-qwen3-moe")
    save_policy(build_policy(config, RouterConfig(), ep, seed=1), tmp_path / "c", ep)
    second = build_policy(config, RouterConfig(), ep, seed=2)
    save_policy(second, tmp_path / "c", ep, overwrite=True)
    back = load_policy(tmp_path / "c", RouterConfig(), ep)
    torch.testing.assert_close(back.lm_head.weight, second.lm_head.weight, atol=0, rtol=0)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c"]


# ---------------------------------------------------------------- expert parallelism, 2 ranks


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _ReadLog:
    """Wraps safetensors.safe_open and records which tensors are read (not just listed)."""

    def __init__(self, real):
        self.real, self.read = real, []

    def __call__(self, *args, **kwargs):
        log, handle_cm = self.read, self.real(*args, **kwargs)

        class Handle:
            def __enter__(self):
                self.h = handle_cm.__enter__()
                return self

            def __exit__(self, *exc):
                return handle_cm.__exit__(*exc)

            def keys(self):
                return self.h.keys()

            def get_tensor(self, key):
                log.append(key)
                return self.h.get_tensor(key)

            def get_slice(self, key):
                s = self.h.get_slice(key)

                class Slice:
                    def get_shape(self):
                        return s.get_shape()

                    def get_dtype(self):
                        return s.get_dtype()

                    def __getitem__(self, item):
                        log.append(key)
                        return s[item]

                return Slice()

        return Handle()


def _ep_worker(rank: int, world: int, port: int, root: str) -> None:
    import app.model.reader as ckpt  # load_policy reads through app.model.reader's safe_open

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        ep = EPContext(group=dist.group.WORLD, rank=rank, size=world, backend="alltoall")
        for preset in PRESETS:
            config = tiny_config(preset)
            ref = build_policy(config, RouterConfig(), EPContext.local(), seed=5)
            model = build_policy(config, RouterConfig(), ep, seed=5)
            n_local = 8 // world
            stats = {"numel": sum(p.numel() for p in model.parameters()),
                     "ref_numel": sum(p.numel() for p in ref.parameters())}
            for (_, ours), (_, full) in zip(moe_blocks(model), moe_blocks(ref)):
                assert ours.num_local_experts == n_local and ours.local_expert_offset == rank * n_local
                assert ours.experts.gate_up_proj.shape[0] == n_local and ours.experts.down_proj.shape[0] == n_local
                rows = slice(rank * n_local, (rank + 1) * n_local)
                # Initialisation does not depend on the EP layout.
                assert torch.equal(ours.experts.gate_up_proj, full.experts.gate_up_proj[rows])
                assert torch.equal(ours.experts.down_proj, full.experts.down_proj[rows])
            ids = _ids(2)
            torch.save({"logits": _logits(model.eval(), ids), **stats}, Path(root) / f"{preset}-rank{rank}.pt")
            save_policy(model, Path(root) / preset / "ep2", ep, max_shard_bytes=20_000)

            # Load under EP=2 a checkpoint written at EP=1: this rank reads only its experts.
            if rank == 0:
                save_policy(ref, Path(root) / preset / "ep1", EPContext.local(), max_shard_bytes=20_000)
            dist.barrier()
            log = _ReadLog(ckpt.safe_open)
            ckpt.safe_open = log
            try:
                loaded = load_policy(Path(root) / preset / "ep1", RouterConfig(), ep)
            finally:
                ckpt.safe_open = log.real
            local = {str(e) for e in range(rank * n_local, (rank + 1) * n_local)}
            expert_reads = [k.split(".")[5] for k in log.read if ".mlp.experts." in k]
            assert expert_reads and set(expert_reads) == local, (rank, sorted(set(expert_reads)))
            for (name, a), (_, b) in zip(loaded.state_dict().items(), model.state_dict().items()):
                assert torch.equal(a, b), name
    finally:
        dist.destroy_process_group()


def test_ep2_ranks_hold_local_experts_and_save_loads_at_ep1(tmp_path):
    world = 2
    mp.spawn(_ep_worker, args=(world, _free_port(), str(tmp_path)), nprocs=world, join=True)
    for preset in PRESETS:
        config = tiny_config(preset)
        ref = build_policy(config, RouterConfig(), EPContext.local(), seed=5)
        out = tmp_path / preset / "ep2"
        index = json.loads((out / INDEX_NAME).read_text())
        # Each shard holds one owner's tensors: rank 1 wrote shards with only experts 4..7.
        expert_shards = {}
        for key, shard in index["weight_map"].items():
            if ".mlp.experts." in key:
                expert_shards.setdefault(shard, set()).add(int(key.split(".")[5]) // 4)
        assert all(len(owners) == 1 for owners in expert_shards.values())
        assert {o for owners in expert_shards.values() for o in owners} == {0, 1}

        back = load_policy(out, RouterConfig(), EPContext.local())
        for (name, a), (_, b) in zip(back.state_dict().items(), ref.state_dict().items()):
            assert torch.equal(a, b), name
        ids = _ids(2)
        ref_logits = _logits(ref.eval(), ids)
        torch.testing.assert_close(_logits(back, ids), ref_logits, atol=ATOL, rtol=0)

        expert_numel = sum(b.experts.gate_up_proj.numel() + b.experts.down_proj.numel() for _, b in moe_blocks(ref))
        for rank in range(world):
            got = torch.load(tmp_path / f"{preset}-rank{rank}.pt")
            # Each rank materialises half the experts and everything else once.
            assert got["ref_numel"] == sum(p.numel() for p in ref.parameters())
            assert got["numel"] == got["ref_numel"] - expert_numel // world
            # The EP=2 forward (dispatch over gloo) gives the EP=1 logits.
            torch.testing.assert_close(got["logits"], ref_logits, atol=ATOL, rtol=0)
    assert not list(tmp_path.glob("**/.*.partial"))


def test_tied_embeddings_round_trip(tmp_path):
    ep = EPContext.local()
    model = build_policy(tiny_config("tiny-qwen3-moe", tie_word_embeddings=True), RouterConfig(), ep).eval()
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    out = save_policy(model, tmp_path / "c", ep)
    assert "lm_head.weight" not in _keys(out)  # the Hub omits tied weights
    stock, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    ours = load_policy(out, RouterConfig(), ep)
    assert ours.lm_head.weight.data_ptr() == ours.model.embed_tokens.weight.data_ptr()
    ids = _ids()
    torch.testing.assert_close(_logits(stock.eval(), ids), _logits(model, ids), atol=ATOL, rtol=0)
    torch.testing.assert_close(_logits(ours, ids), _logits(model, ids), atol=ATOL, rtol=0)
