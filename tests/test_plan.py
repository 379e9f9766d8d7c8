"""`moerl plan`: parameter counts, FSDP2 shards, activation terms, DeepEP and traffic arithmetic,
the CLI's exit codes and JSON, and the two reference layouts.

Reality checks: parameter names and shapes against a meta-device `build_policy` model; per-rank
bytes of master weights, gradients and AdamW moments against a real 2-rank FSDP2 (gloo) step;
saved activations against the tensors autograd really saves on CPU (and on CUDA where there is
one, at real widths).
"""

from __future__ import annotations

import gc
import json
import math
import os
import weakref

import pytest
import torch
from typer.testing import CliRunner

from app.config import RouterConfig
from app.layout import Layout
from app.model.config import (
    DEEPSEEK_V3,
    deepseek_v3_config,
    is_moe_layer,
    load_hf_config,
    qwen3_30b_a3b_config,
    tiny_config,
)
from app.model.parallel import EPContext
from app.model.policy import build_policy
from app.plan import activations as act
from app.plan import deepep, traffic
from app.plan.cli import cli
from app.plan.memory import FRAGMENTATION, FRAGMENTATION_EXPANDABLE, GIB, PlanInput, fragmentation_for, plan_memory
from app.plan.params import ParamShape, count_params, param_shapes, rank_numel, shard_dim, units
from app.plan.term import total

runner = CliRunner()


def _plan(*args: str):
    return runner.invoke(cli, list(args))


# --- parameter counts --------------------------------------------------------------------------

@pytest.fixture(scope="module")
def real_configs():
    return {"qwen3-30b-a3b": qwen3_30b_a3b_config(), "deepseek-v3": deepseek_v3_config()}


@pytest.mark.parametrize("name", ["qwen3-30b-a3b", "deepseek-v3", "tiny-qwen3-moe", "tiny-deepseek-v3"])
def test_param_shapes_equal_a_meta_device_policy(name, real_configs):
    config = real_configs.get(name) or tiny_config(name)
    model = build_policy(config, RouterConfig(), EPContext.local(), device="meta", init=False)
    built = {n: tuple(p.shape) for n, p in model.named_parameters()}
    assert {p.name: p.shape for p in param_shapes(config)} == built
    assert count_params(config).total == sum(p.numel() for p in model.parameters())


def test_published_parameter_counts(real_configs):
    q, d = count_params(real_configs["qwen3-30b-a3b"]), count_params(real_configs["deepseek-v3"])
    # The model cards: 30.5 B (Qwen3-30B-A3B), 671 B without the MTP module (DeepSeek-V3).
    assert round(q.total / 1e9, 2) == 30.53
    assert round(d.total / 1e9, 1) == 671.0
    # By hand from the config fields (H, V, layers, heads, experts).
    h, v, e, i = 2048, 151936, 128, 768
    attn = h * 32 * 128 + 2 * h * 4 * 128 + 32 * 128 * h + 2 * 128
    layer = attn + 2 * h + e * h + e * 3 * h * i
    assert q.total == 48 * layer + 2 * v * h + h
    assert q.experts == 48 * e * 3 * h * i
    h, v = 7168, 129280
    mla = h * 1536 + 1536 + 1536 * 128 * 192 + h * (512 + 64) + 512 + 512 * 128 * 256 + 128 * 128 * h
    dense = mla + 2 * h + 3 * h * 18432
    moe = mla + 2 * h + 256 * h + 256 * 3 * h * 2048 + 3 * h * 2048
    assert d.total == 3 * dense + 58 * moe + 2 * v * h + h
    # issue 13's non-expert figures (1.53 B, 17.0 B) leave the routers out.
    assert round((q.non_expert - q.routers) / 1e9, 2) == 1.53
    assert round((d.non_expert - d.routers) / 1e9, 1) == 17.0


def test_real_configs_are_the_published_ones(real_configs, tmp_path):
    d = real_configs["deepseek-v3"]
    assert (d.n_routed_experts, d.first_k_dense_replace, d.kv_lora_rank, d.q_lora_rank) == (256, 3, 512, 1536)
    assert getattr(d, "quantization_config", None) is None  # a published bf16 version must not claim FP8
    assert qwen3_30b_a3b_config(4).num_hidden_layers == 4
    with pytest.raises(ValueError, match="first_k_dense_replace"):
        deepseek_v3_config(2)
    assert deepseek_v3_config(2, first_k_dense_replace=1).num_hidden_layers == 2
    # A config.json on disk reads back as the same model (directory or file).
    qwen3_30b_a3b_config().save_pretrained(tmp_path)
    assert count_params(load_hf_config(tmp_path)).total == count_params(real_configs["qwen3-30b-a3b"]).total
    assert load_hf_config(tmp_path / "config.json").num_experts == 128
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_hf_config(tmp_path / "missing")
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ValueError, match="model_type"):
        load_hf_config(tmp_path / "bad")
    assert DEEPSEEK_V3["num_nextn_predict_layers"] == 0


# --- FSDP2 shards --------------------------------------------------------------------------------

def test_rank_numel_pads_dim0_and_moves_experts_to_dim1():
    lay = Layout(world=4, dp_replicate=1, dp_shard=4, ep=2, efsdp=2)
    assert rank_numel(ParamShape("w", (5, 3), "attention", 0), lay) == 2 * 3  # ceil(5/4) rows
    ex = ParamShape("e", (8, 6, 4), "experts", 0)  # 4 local experts over efsdp 2: dim 0
    assert (shard_dim(ex, lay), rank_numel(ex, lay)) == (0, 2 * 6 * 4)
    odd = ParamShape("e", (6, 6, 4), "experts", 0)  # 3 local experts: dim 1, 6 / 2 = 3
    assert (shard_dim(odd, lay), rank_numel(odd, lay)) == (1, 3 * 3 * 4)
    with pytest.raises(ValueError, match="efsdp=2"):
        shard_dim(ParamShape("e", (6, 5, 4), "experts", 0), lay)


def _fsdp_worker(rank: int, port: int, queue) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (2,))

    def nbytes(tensors) -> int:  # storages, each once (a gradient is a view of the reduce-scatter output)
        return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values())

    out = {}
    # 3 experts over 2 ranks: the expert tensors go to dim 1, everything else to dim 0.
    for name, overrides in {"dim0": {}, "dim1": dict(num_experts=3, num_experts_per_tok=2)}.items():
        model = build_policy(tiny_config("tiny-qwen3-moe", **overrides), RouterConfig(), EPContext.local())
        for layer in model.model.layers:
            fully_shard(layer.mlp.experts, mesh=mesh,
                        shard_placement_fn=lambda p: Shard(1) if p.shape[0] % 2 else Shard(0))
            fully_shard(layer.mlp.gate, mesh=mesh)
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        params = nbytes(p.to_local() for p in model.parameters())
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        model(input_ids=torch.randint(0, 40, (2, 12))).logits.float().pow(2).mean().backward()
        grads = nbytes(p.grad.to_local() for p in model.parameters())
        optimizer.step()
        moments = nbytes(s[k].to_local() for s in optimizer.state.values() for k in ("exp_avg", "exp_avg_sq"))
        out[name] = (params, grads, moments)
    queue.put((rank, out))
    dist.barrier()
    dist.destroy_process_group()


def test_per_rank_bytes_equal_a_two_rank_fsdp2_step():
    """Master weights, gradients and AdamW moments per rank, measured on a real FSDP2 (gloo) step."""
    import torch.multiprocessing as mp

    from app.buffer.redis_server import free_port

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_fsdp_worker, args=(r, port, queue)) for r in range(2)]
    for p in procs:
        p.start()
    got = dict(queue.get(timeout=300) for _ in procs)
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    lay = Layout(world=2, dp_replicate=1, dp_shard=2, ep=1, efsdp=2)
    for name, overrides in {"dim0": {}, "dim1": dict(num_experts=3, num_experts_per_tok=2)}.items():
        local = sum(rank_numel(p, lay) for p in param_shapes(tiny_config("tiny-qwen3-moe", **overrides)))
        # Rank 0 holds the largest (padded) chunk of every tensor: the plan's figure, exactly.
        assert got[0][name] == (4 * local, 4 * local, 8 * local), name
        # FSDP2 pads every rank's weights and gradients; the moments are unpadded, so rank 1 <= rank 0.
        assert got[1][name][:2] == (4 * local, 4 * local) and got[1][name][2] <= 8 * local
    # The dim-1 case really is another placement: the routers' 3 rows leave rank 1 short.
    assert got[1]["dim1"][2] < got[0]["dim1"][2]


# --- activations -------------------------------------------------------------------------------

def _tagged_sdpa():
    """An attention implementation that is SDPA but marks the tensors it saves (see below)."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    state = {"in_sdpa": False}

    def forward(*args, **kwargs):
        state["in_sdpa"] = True
        try:
            return sdpa_attention_forward(*args, **kwargs)
        finally:
            state["in_sdpa"] = False

    AttentionInterface.register("sdpa_tagged", forward)
    AttentionMaskInterface.register("sdpa_tagged", ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])  # the same mask as sdpa
    return state


def saved_by_layer(model, input_ids, attention_mask) -> dict:
    """Bytes autograd keeps after the trunk's forward, per decoder layer, split into what SDPA
    saved and the rest: storages counted once, parameters excluded, and only tensors still alive
    after the forward (a dead branch, e.g. DeepSeek-V3's group scores, is freed with its graph).
    A storage saved by several layers (rotary cos/sin) counts as ``("shared", ...)``."""
    state = _tagged_sdpa()
    model.set_attn_implementation("sdpa_tagged")
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    where = ["root"]
    seen: dict[int, tuple] = {}
    hooks = []
    for i, layer in enumerate(model.model.layers):
        hooks.append(layer.register_forward_pre_hook(lambda m, a, i=i: where.__setitem__(0, i)))
        hooks.append(layer.register_forward_hook(lambda m, a, o: where.__setitem__(0, "root")))

    def pack(t):
        s = t.untyped_storage()
        key = (where[0], "sdpa" if state["in_sdpa"] else "rest")
        old = seen.get(s.data_ptr())
        if old is not None and old[2]() is None:  # that tensor was freed (a dead branch): a new storage here
            old = None
        if old is not None and old[0][0] != where[0]:
            seen[s.data_ptr()] = (("shared", key[1]),) + old[1:]
        elif old is None and s.data_ptr() not in params:
            seen[s.data_ptr()] = (key, s.nbytes(), weakref.ref(t))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model.model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
    gc.collect()
    result: dict = {}
    for key, nbytes, ref in seen.values():
        if ref() is not None:
            result[key] = result.get(key, 0) + nbytes
    for h in hooks:
        h.remove()
    del out
    return result


SMALL = {
    "qwen3": ("tiny-qwen3-moe", dict(hidden_size=256, num_attention_heads=8, num_key_value_heads=2, head_dim=32,
                                     num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64,
                                     intermediate_size=384, mlp_only_layers=[0], vocab_size=512)),
    "deepseek-v3": ("tiny-deepseek-v3", dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=4,
                                             q_lora_rank=64, kv_lora_rank=32, qk_nope_head_dim=32,
                                             qk_rope_head_dim=16, v_head_dim=32, n_routed_experts=8, n_group=4,
                                             topk_group=2, num_experts_per_tok=2, moe_intermediate_size=64,
                                             intermediate_size=384, first_k_dense_replace=1, num_hidden_layers=2,
                                             vocab_size=512)),
}


def _sdpa_terms(terms):
    return sum(t.bytes for t in terms if t.name.startswith(("SDPA q", "SDPA k", "SDPA v", "SDPA o", "SDPA s",
                                                             "attention mask")))


@pytest.mark.parametrize("family", sorted(SMALL))
def test_layer_terms_equal_what_autograd_saves_on_cpu(family):
    """Each layer's saved bytes on CPU (bf16, 2 x 64 tokens, a padding mask) equal the plan's terms
    plus the CPU-only differences named below, exactly; SDPA's own tensors are compared separately
    (exact for Qwen3, whose CPU kernel saves what cuDNN saves; DeepSeek-V3's q/k and v head dims
    differ, which sends CPU SDPA to the math kernel, so only the H200 figures check that part)."""
    preset, fields = SMALL[family]
    config = tiny_config(preset, **fields)
    model = build_policy(config, RouterConfig(), EPContext.local(), dtype=torch.bfloat16)
    batch, seq = 2, 64
    ids = torch.randint(0, config.vocab_size, (batch, seq))
    mask = torch.ones(batch, seq, dtype=torch.int64)
    mask[1, 50:] = 0
    got = saved_by_layer(model, ids, mask)
    t = batch * seq
    mb = act.MicroBatch(seqs=batch, seq_len=seq, expert_rows=t * config.num_experts_per_tok)
    n = mb.expert_rows
    rot = config.head_dim if family == "qwen3" else config.qk_rope_head_dim
    assert got[("shared", "rest")] == 2 * 2 * seq * rot  # rotary cos, sin: a root term of the plan
    for layer in range(config.num_hidden_layers):
        terms = act.layer_terms(config, layer, mb)
        want = total(terms) - _sdpa_terms(terms)
        if "dispatched" in " ".join(x.name for x in terms):
            want -= 8 * (2 * n + t + 1)  # the row maps live on the autograd context: hooks do not see them
            want += 2 * 2 * n * config.moe_intermediate_size  # CPU: unfused SwiGLU keeps silu(gate), silu*up
            want -= 2 * n  # CPU: the unfused multiply keeps the gate weights as bf16, not fp32
        assert got[(layer, "rest")] == want, (family, layer)
        if family == "qwen3":
            assert got[(layer, "sdpa")] == _sdpa_terms(terms), layer


@pytest.mark.skipif(not torch.cuda.is_available(), reason="real widths need a GPU")
@pytest.mark.parametrize("family", ["qwen3", "deepseek-v3"])
def test_layer_terms_at_real_widths_on_cuda(family):
    """Measured on an H200 (torch 2.11, transformers 5.17) with the same hooks: Qwen3 1444.7 MB per
    layer against 1442.6 MB; DeepSeek-V3 4233.2 and 5152.2 MB against 4232.2 and 5148.3 MB. The
    tolerance (0.5 %) covers small tensors that cuDNN and the grouped GEMM keep beyond the CPU's."""
    config = qwen3_30b_a3b_config(2) if family == "qwen3" else deepseek_v3_config(2, first_k_dense_replace=1)
    model = build_policy(config, RouterConfig(), EPContext.local(), device="cuda", dtype=torch.bfloat16, init=False)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02)
    ids = torch.randint(0, config.vocab_size, (2, 4096), device="cuda")
    mask = torch.ones(2, 4096, dtype=torch.int64, device="cuda")
    mask[1, 3000:] = 0
    got = saved_by_layer(model, ids, mask)
    mb = act.MicroBatch(seqs=2, seq_len=4096, expert_rows=8192 * config.num_experts_per_tok)
    for layer in range(2):
        measured = got[(layer, "rest")] + got.get((layer, "sdpa"), 0)
        want = act.layer_saved(config, layer, mb) - 8 * (2 * mb.expert_rows + 8193) * is_moe_layer(config, layer)
        assert abs(measured - want) <= 0.005 * want, (family, layer, measured, want)


def test_layer_terms_by_hand():
    """The Qwen3-30B-A3B MoE layer at 2 x 8192 tokens, tensor by tensor."""
    config = qwen3_30b_a3b_config(1)
    t, h, n = 16384, 2048, 16384 * 8
    mb = act.MicroBatch(seqs=2, seq_len=8192, expert_rows=n)
    by_hand = (
        (4 + 2) * t * h + 4 * t + 2 * t * h  # input norm + its output
        + (4 + 2) * t * 32 * 128 + 4 * t * 32 + (4 + 2) * t * 4 * 128 + 4 * t * 4  # q_norm, k_norm
        + 2 * t * 32 * 128 * 4 + 4 * t * 32  # q, k and v repeated to 32 heads, out; stats
        + 2 * 2 * 8192 * 8192  # the per-layer mask copy
        + (4 + 2) * t * h + 4 * t  # post-attention norm
        + 4 * t * h + 4 * t * 128 + 12 * t * 8 + 4 * t  # router
        + 2 * n * h + 4 * n + 8 * n + n + 8 * (2 * n + t + 1) + 2 * n * 1536 + 2 * n * 768  # dispatch, experts
    )
    assert act.layer_saved(config, 0, mb) == by_hand
    # Selective keeps the exchanges' outputs only on the alltoall dispatcher (the received rows and
    # gate weights, the rows received back [S = T*K, H]; test_alltoall_transients_... measures it);
    # the local dispatcher exchanges nothing, so selective is full there.
    assert act.checkpoint_kept(config, 0, mb, "selective") == 2 * t * h
    a2a = act.MicroBatch(seqs=2, seq_len=8192, expert_rows=n, backend="alltoall", top_k=8)
    assert act.checkpoint_kept(config, 0, a2a, "selective") == 2 * t * h + 2 * n * h + 4 * n + 2 * t * 8 * h
    # The recompute regroups the replayed rows into a new [N, H] that the experts save: the full set.
    assert act.recompute_bytes(config, 0, a2a, "selective") == by_hand
    assert act.backward_transient(config, 0, mb) == 2 * n * (h - 768)


# --- DeepEP ------------------------------------------------------------------------------------

def test_deepep_buffer_by_hand():
    # DeepSeek-V3, bf16: a dispatch token is 14336 B of hidden + 8*8 + 9*4 = 100 -> 128 B metadata.
    assert deepep.token_bytes(7168 * 2, 8, with_metadata=True) == 14336 + 128
    assert deepep.token_bytes(7168 * 2, 8, with_metadata=False) == 14336 + 64
    # EP 8 in one node: direct mode, receive buffer of 8 ranks x 16384 tokens (already 2 MiB-aligned).
    assert deepep.elastic_buffer_bytes(8, 8, 16384, 7168, 8) == 8 * 16384 * 14464
    # EP 16 over 2 nodes: hybrid, the dispatch layout (scale-up + scale-out send + scale-out receive).
    d = 8 * 2 * 16384 * 14464 + 16384 * 14464 + 2 * (16384 + 1280) * 14464
    c = 8 * 2 * 16384 * 14400 + 2 * 16384 * 14400 + 2 * (16384 + 1280) * 14400
    assert deepep.elastic_buffer_bytes(16, 8, 16384, 7168, 8) == math.ceil(max(d, c) / 2**21) * 2**21
    assert deepep.workspace_bytes() == 7 * 2**21  # 12.8 MB of control words, aligned up
    assert deepep.max_tokens_per_rank(12288) == 16384 and deepep.max_tokens_per_rank(16384) == 16384
    with pytest.raises(ValueError, match="NVLink"):
        deepep.elastic_buffer_bytes(12, 8, 1024, 7168, 8)


# --- the memory plan ---------------------------------------------------------------------------

def _input(config, world, ep, **kw):
    lay = Layout(world=world, dp_replicate=1, dp_shard=world, ep=ep, efsdp=world // ep)
    base = dict(gpus_per_node=8, rollouts_per_gpu=8, seq_len=8192, micro_batch_tokens=16384,
                activation_checkpointing="full", ep_backend="deepep")
    return PlanInput(config=config, layout=lay, **(base | kw))


def test_memory_terms_and_phases(real_configs):
    q = real_configs["qwen3-30b-a3b"]
    p = plan_memory(_input(q, 8, 8))
    local = sum(rank_numel(x, p.inp.layout) for x in param_shapes(q))
    assert (p.terms["master"].bytes, p.terms["adam"].bytes) == (4 * local, 8 * local)
    # 16 bytes per parameter over dp_shard, up to FSDP2's padding.
    static = sum(p.terms[k].bytes for k in ("master", "grads", "adam"))
    assert 16 * count_params(q).total / 8 <= static <= 16 * count_params(q).total / 8 * 1.001
    assert p.micro_batches == 4 and p.micro_batch.tokens == 16384
    _, layers = units(q, p.inp.layout)
    assert p.terms["root"].bytes == 2 * 2 * 151936 * 2048 + 2 * 2048
    assert p.terms["unit1"].bytes == 2 * layers[0].compute + 4 * layers[0].fp32
    assert p.terms["acts_moe"].bytes == 48 * 2 * 16384 * 2048  # full checkpointing keeps each layer's input
    assert p.tensors_peak == max(p.phase_bytes(x) for x in p.phases)
    assert p.reserved == int(p.tensors_peak * FRAGMENTATION)
    assert p.predicted == p.reserved + p.overhead
    # PPO adds a critic (no LM head), local backends no DeepEP buffer, "none" the saved tensors.
    ppo = plan_memory(_input(q, 8, 8, algorithm="ppo"))
    assert ppo.terms["c_master"].bytes == p.terms["master"].bytes - 4 * -(-151936 // 8) * 2048 + 4 * (2048 + 1)
    assert "deepep" not in plan_memory(_input(q, 8, 8, ep_backend="alltoall")).terms
    none = plan_memory(_input(q, 8, 8, activation_checkpointing="none"))
    assert none.terms["acts_moe"].bytes == 48 * act.layer_saved(q, 1, none.micro_batch)


@pytest.mark.parametrize("config,measured", [
    (lambda: qwen3_30b_a3b_config(4), {"loss forward": 50.60e9, "optimizer step": 63.63e9}),
    (lambda: deepseek_v3_config(2, first_k_dense_replace=1, n_routed_experts=32),
     {"loss forward": 66.44e9, "layer backward": 83.24e9, "optimizer step": 85.34e9}),
], ids=["qwen3-4-layers", "deepseek-v3-2-layers-32-experts"])
def test_one_micro_batch_step_against_the_h200_measurement(config, measured):
    """Two FSDP2 steps recorded on the H200 here (torch 2.11; world 1, fp32 master weights and
    foreach AdamW, bf16 compute, full checkpointing with checkpoint_wrapper, the router its own
    fp32 unit, chunked logprobs with entropy; 2 x 8192 tokens with a padding mask):
    max_memory_allocated of the second step's forward + loss, backward and optimizer step, in
    bytes. The backward peak of the Qwen3 case (56.63 GB) is the root reduce-scatter's, which the
    plan puts 3 % lower; it is not the step's peak."""
    # What that script ran: foreach AdamW over one group, the torch ops of the LM head (before the
    # Triton passes), fully_shard's default resharding after forward.
    p = plan_memory(PlanInput(config=config(), layout=Layout(1, 1, 1, 1, 1), gpus_per_node=8,
                              rollouts_per_gpu=2, seq_len=8192, micro_batch_tokens=16384,
                              activation_checkpointing="full", ep_backend="local", adamw="foreach",
                              fused_logits=False, reshard_after_forward=True))
    assert p.micro_batches == 1
    assert "grads" not in p.phases["loss forward"] and "grads" in p.phases["optimizer step"]
    for phase, value in measured.items():
        assert abs(p.phase_bytes(phase) - value) <= 0.02 * value, phase
    assert abs(p.tensors_peak - max(measured.values())) <= 0.02 * max(measured.values())
    # With several micro-batches the gradients made by the first one stay for the others.
    assert "grads" in plan_memory(_input(qwen3_30b_a3b_config(4), 8, 8)).phases["loss forward"]


def test_memory_input_errors_name_the_flag(real_configs):
    q = real_configs["qwen3-30b-a3b"]
    for kw, flag in ((dict(micro_batch_tokens=4096), "--micro-batch-tokens"),
                     (dict(activation_checkpointing="some"), "--activation-checkpointing"),
                     (dict(rollouts_per_gpu=0), "--rollouts-per-gpu"),
                     (dict(gpu_memory_gib=0), "--gpu-memory-gib")):
        with pytest.raises(ValueError, match=flag):
            plan_memory(_input(q, 8, 8, **kw))


# --- traffic -----------------------------------------------------------------------------------

def test_traffic_by_hand(real_configs):
    d = real_configs["deepseek-v3"]
    v = traffic.version_bytes(d)
    assert v == 2 * count_params(d).total + 4 * 256 * 58
    assert 0.67e12 < traffic.fp8_version_bytes(d) < 0.68e12  # ~1 byte/param + block scales, bf16 embeddings
    t = traffic.TrafficInput(trainer_nodes=16, rollout_nodes=32, step_s=60, generation_s=60)
    tree, direct, s3 = traffic.paths(v, t)
    link = 3200e9 / 8
    assert tree.seconds == pytest.approx((v + 6 * 2**30) / link)  # depth ceil(log2 33) = 6
    assert direct.seconds == pytest.approx(v * 32 / 16 / link)
    assert s3.seconds == pytest.approx(v / 16 / 12.5e9 + v / 12.5e9)
    assert s3.s3_bytes == 33 * v and tree.s3_bytes == v
    # An instant fleet publishing every step is one version stale, as an async loop must be.
    instant = traffic.TrafficInput(trainer_nodes=1, rollout_nodes=1, step_s=10, generation_s=0)
    assert traffic.staleness(0.0, instant) == 1
    assert traffic.staleness(tree.latency_s, t) == math.ceil((tree.latency_s + 120) / 60)
    assert traffic.min_publish_every(tree.latency_s, t) == math.ceil((tree.latency_s + 120) / 60)
    assert traffic.staleness(tree.latency_s, t, traffic.min_publish_every(tree.latency_s, t)) <= 1
    assert traffic.min_publish_every(0.0, traffic.TrafficInput(1, 1, max_staleness=0)) is None


def test_buffer_traffic_by_hand(real_configs):
    """The seed's step through the buffer: 64 groups of 16 x (512 + 8192) tokens; with routing
    replay one byte per id for DeepSeek-V3's 58 MoE layers x top-8 of 256 experts."""
    from app.config import RunConfig

    d = real_configs["deepseek-v3"]
    run = RunConfig()
    run.rollout.group_size, run.rollout.max_new_tokens, run.trainer.groups_per_step = 16, 8192, 64
    run.buffer.capacity_groups, run.trainer.save_every = 384, 5
    plain = traffic.buffer_traffic(d, run, 512, 60.0, routing_replay=False)
    assert plain.payload_bytes == 4 * 512 + 16 * 8192 * 8 and plain.routed_bytes == 0
    assert plain.step_bytes == 64 * (plain.payload_bytes + plain.entry_bytes)
    assert plain.held_groups == 384 + 6 * 64
    replay = traffic.buffer_traffic(d, run, 512, 60.0, routing_replay=True)
    assert replay.routed_bytes == 16 * (512 + 8192 - 1) * 58 * 8 == 64_611_072
    assert replay.memory_bytes == replay.held_groups * (traffic.jemalloc_size(replay.payload_bytes) + replay.entry_bytes)
    assert replay.main_thread_s == pytest.approx(64 * replay.payload_bytes * traffic.MAIN_THREAD_NS_PER_BYTE * 1e-9)
    assert replay.link_gbps == pytest.approx(2 * replay.step_bytes * 8 / 60 / 1e9)
    # jemalloc: four size classes per doubling
    assert [traffic.jemalloc_size(n) for n in (2**20, 2**20 + 1, 1_060_000, 65_660_000)] == [
        2**20, 1_310_720, 1_310_720, 2**26]
    with pytest.raises(ValueError, match="--seq-len"):
        traffic.buffer_traffic(d, run, 0, 60.0, routing_replay=False)


def test_cli_traffic_prints_the_buffer_table():
    r = _plan("--model", "deepseek-v3", "--nodes", "16", "--traffic", "--seq-len", "8704", "--json")
    assert r.exit_code in (0, 1), r.output
    rows = json.loads(r.output)["buffer"]
    assert [x["routing_replay"] for x in rows] == [False, True] and rows[0]["this_config"]
    assert rows[1]["payload_bytes"] > 60 * rows[0]["payload_bytes"]
    table = _plan("--model", "deepseek-v3", "--nodes", "16", "--traffic", "--seq-len", "8704")
    assert "Experience buffer per step" in table.output
    short = _plan("--model", "deepseek-v3", "--nodes", "16", "--traffic", "--seq-len", "16")
    assert "leaves no prompt" in short.output


# --- the command line --------------------------------------------------------------------------

# DeepSeek-V3 on 16 x 8 fits with the allocator's expandable segments (the plan's default reserve, as the
# GPU trainer pods run), not with the default allocator's 1.33; Qwen3-30B-A3B with full checkpointing (on
# the alltoall dispatcher that auto resolves to, selective keeps every MoE layer's exchange outputs: 182.6 GiB).
DSV3_FIT = ("--model", "deepseek-v3", "--nodes", "16", "--gpus-per-node", "8", "--ep", "32",
            "--ep-backend", "alltoall", "--micro-batch-tokens", "8192", "--activation-checkpointing", "full")
QWEN_FIT = ("--model", "qwen3-30b-a3b", "--nodes", "1", "--ep", "8", "--micro-batch-tokens", "16384",
            "--activation-checkpointing", "full")


@pytest.mark.parametrize("args", [DSV3_FIT, QWEN_FIT], ids=["deepseek-v3-16x8", "qwen3-30b-a3b-1x8"])
def test_cli_reference_layouts_fit(args):
    r = _plan(*args, "--json")
    assert r.exit_code == 0, r.output
    out = json.loads(r.output)
    assert out["fits"] and out["batch"]["rollouts_per_gpu"] == 8 and out["batch"]["seq_len"] == 8192
    assert sum(t["bytes"] for t in out["terms"] if t["in_peak"]) == out["tensors_peak"]
    assert out["predicted"] + out["headroom"] == out["capacity"] == 141 * GIB
    table = _plan(*args)
    assert table.exit_code == 0 and "FITS" in table.output and "policy master weights fp32" in table.output


def test_cli_fragmentation_flag_decides_a_close_layout():
    """DeepEP at EP 8 fits with the allocator's expandable segments (the default: the reserve
    the GPU trainer pods' allocator measured) but not with the default allocator's worst
    measured reserve (1.33)."""
    args = ("--model", "deepseek-v3", "--nodes", "16", "--ep", "8", "--ep-backend", "deepep",
            "--micro-batch-tokens", "8192", "--activation-checkpointing", "full", "--json")
    tight, roomy = _plan(*args, "--fragmentation", "1.33"), _plan(*args)
    assert (tight.exit_code, roomy.exit_code) == (1, 0)
    a, b = json.loads(tight.output), json.loads(roomy.output)
    assert a["tensors_peak"] == b["tensors_peak"] and b["constants"]["FRAGMENTATION"] == FRAGMENTATION_EXPANDABLE
    assert b["reserved"] == int(b["tensors_peak"] * FRAGMENTATION_EXPANDABLE)
    assert _plan(*args, "--fragmentation", "0.9").exit_code == 2


def test_fragmentation_follows_the_allocator_configuration():
    from app.torchx_component import GPU_ALLOC_ENV

    assert fragmentation_for(GPU_ALLOC_ENV["PYTORCH_CUDA_ALLOC_CONF"]) == FRAGMENTATION_EXPANDABLE
    assert fragmentation_for("max_split_size_mb:128,expandable_segments:True") == FRAGMENTATION_EXPANDABLE
    assert fragmentation_for(None) == fragmentation_for("expandable_segments:False") == FRAGMENTATION


def test_cli_does_not_fit_exits_1():
    r = _plan("--model", "deepseek-v3", "--nodes", "16", "--ep", "8", "--activation-checkpointing", "none",
              "--micro-batch-tokens", "8192", "--json")
    assert r.exit_code == 1 and not json.loads(r.output)["fits"]
    assert "DOES NOT FIT" in _plan("--model", "deepseek-v3", "--nodes", "16", "--ep", "8").output


@pytest.mark.parametrize("args,message", [
    (("--model", "qwen3-30b-a3b", "--micro-batch-tokens", "4096"), "--micro-batch-tokens"),
    (("--model", "qwen3-30b-a3b", "--ep", "3"), "trainer.parallel.ep=3"),
    (("--model", "qwen3-30b-a3b", "--nodes", "2", "--dp-replicate", "3"), "trainer.parallel.dp_replicate=3"),
    (("--model", "qwen3-30b-a3b", "--activation-checkpointing", "some"), "--activation-checkpointing"),
    (("--model", "no-such-model"), "--model"),
    (("--model", "qwen3-30b-a3b", "--set", "no_such_field=1"), "--set"),
    (("--model", "qwen3-30b-a3b", "--ep-backend", "nccl"), "ep_backend"),
    (("--model", "qwen3-30b-a3b", "--dtype", "float16"), "--dtype"),
    (("--model", "deepseek-v3", "--num-layers", "2"), "first_k_dense_replace"),
    ((), "--model"),
    (("--model", "qwen3-30b-a3b", "--traffic", "--step-s", "0"), "--step-s"),
    # Infinity passes a plain "> 0" check and then overflows math.ceil or prints 0 s transfers.
    (("--model", "qwen3-30b-a3b", "--traffic", "--step-s", "inf"), "--step-s"),
    (("--model", "qwen3-30b-a3b", "--traffic", "--generation-s", "inf"), "--generation-s"),
    (("--model", "qwen3-30b-a3b", "--traffic", "--load-s", "inf"), "--load-s"),
    (("--model", "qwen3-30b-a3b", "--traffic", "--link-gbps", "inf"), "--link-gbps"),
    (("--model", "qwen3-30b-a3b", "--traffic", "--s3-gbps-per-node", "inf"), "--s3-gbps-per-node"),
    (("--model", "qwen3-30b-a3b", "--traffic", "--generation-s", "nan"), "--generation-s"),
    (("--model", "qwen3-30b-a3b", "--gpu-memory-gib", "inf"), "--gpu-memory-gib"),
    (("--model", "qwen3-30b-a3b", "--fragmentation", "inf"), "--fragmentation"),
    (("--model", "qwen3-30b-a3b", "--rollouts-per-gpu", "0"), "rollouts-per-gpu"),
    (("--model", "qwen3-30b-a3b", "--set", "num_hidden_layers=abc"), "--set 'num_hidden_layers=abc'"),
    (("--model", "qwen3-30b-a3b", "--set", "num_experts_per_tok=2.5"), "--set 'num_experts_per_tok=2.5'"),
    (("--model", "qwen3-30b-a3b", "--set", "hidden_size=0"), "config.hidden_size"),
    (("--model", "qwen3-30b-a3b", "--set", "vocab_size=-1"), "config.vocab_size"),
    (("--model", "qwen3-30b-a3b", "--num-layers", "1", "--set", "num_hidden_layers=0"), "config.num_hidden_layers"),
    # --num-layers cuts a model; a deeper one is --set num_hidden_layers.
    (("--model", "qwen3-30b-a3b", "--num-layers", "49"), "--num-layers 49: qwen3-30b-a3b has 48 decoder layers"),
])
def test_cli_bad_input_exits_2_naming_the_flag(args, message):
    r = _plan(*args)
    assert r.exit_code == 2, r.output
    assert message in r.output


def test_cli_reads_a_run_config(tmp_path):
    model_dir = tmp_path / "model"
    qwen3_30b_a3b_config(4).save_pretrained(model_dir)
    run = tmp_path / "run.yaml"
    run.write_text(f"model:\n  path: {model_dir}\n  dtype: bfloat16\ntrainer:\n  micro_batch_tokens: 16384\n"
                   f"  activation_checkpointing: selective\n  parallel:\n    ep: 8\n")
    out = json.loads(_plan("--config", str(run), "--json").output)
    assert out["model"]["num_hidden_layers"] == 4 and out["layout"]["ep"] == 8
    assert out["batch"]["activation_checkpointing"] == "selective" and out["batch"]["micro_batch_tokens"] == 16384
    # A flag overrides the file; a path that is not local is refused by name.
    assert json.loads(_plan("--config", str(run), "--ep", "4", "--json").output)["layout"]["ep"] == 4
    run.write_text("model:\n  path: s3://bucket/model\n")
    r = _plan("--config", str(run))
    assert r.exit_code == 2 and "model.path" in r.output
    run.write_text("trainer:\n  micro_batch_tokens: 0\n")
    r = _plan("--config", str(run))
    assert r.exit_code == 2 and "trainer.micro_batch_tokens" in r.output


def test_cli_traffic_json_and_exit_code():
    args = ("--model", "deepseek-v3", "--nodes", "16", "--traffic", "--rollout-nodes", "32", "--step-s", "60",
            "--json")
    r = _plan(*args)
    out = json.loads(r.output)
    assert out["version_bytes"] == traffic.version_bytes(deepseek_v3_config())
    assert [p["path"] for p in out["paths"]] == ["broadcast tree", "direct push", "S3"]
    tree = out["paths"][0]
    # Publishing every step with 60 s rollouts is 3 versions stale in the worst case: exit 1.
    assert tree["staleness"] == 3 and r.exit_code == 1
    ok = _plan(*args, "--publish-every", str(tree["min_publish_every"]))
    assert ok.exit_code == 0, ok.output
    assert _plan(*args, "--max-staleness", "3").exit_code == 0


def test_cli_traffic_for_qwen3_30b_a3b_on_one_trainer_and_one_rollout_node():
    """The small layout of issue 21 (1 + 1 p5en): one receiver, so every path moves one version over
    the busiest link; the network push is one version at the EFA rate, S3 an upload then a download
    at the per-node S3 rate, and S3 carries twice the version per version."""
    r = _plan("--model", "qwen3-30b-a3b", "--nodes", "1", "--traffic", "--rollout-nodes", "1", "--step-s", "30",
              "--json")
    out = json.loads(r.output)
    size = traffic.version_bytes(qwen3_30b_a3b_config())
    assert out["version_bytes"] == size and 55e9 < size < 65e9  # 30.5 B parameters in bf16
    by = {p["path"]: p for p in out["paths"]}
    assert all(p["link_bytes"] == size for p in by.values())
    assert by["direct push"]["seconds"] == pytest.approx(size * 8 / 3200e9, rel=0.01)
    assert by["S3"]["seconds"] == pytest.approx(2 * size * 8 / 100e9, rel=0.01)
    assert by["S3"]["s3_bytes_per_version"] == 2 * size and by["direct push"]["s3_bytes_per_version"] == size
    # 30 s rollouts on 30 s steps: a version every step is 3 versions stale at worst, over max_staleness 1.
    assert by["direct push"]["staleness"] == 3 and r.exit_code == 1


# --- what the trainer holds (issue 25): fused AdamW, the Triton LM head, the reference policy,
# the dispatch transients, expert imbalance, NCCL buffers, --ep-backend auto, --search ----------

def _new_bytes(fn, *known):
    """(peak bytes of tensors allocated while ``fn`` runs, beyond ``known``'s storages; fn's result),
    by torch's own tracker (torch.distributed._tools.mem_tracker.MemTracker: every op's outputs,
    storages deduplicated, freed ones dropped)."""
    from torch.distributed._tools.mem_tracker import MemTracker

    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in known}
    tracker = MemTracker()
    tracker.track_external(*known)
    with tracker:
        out = fn()
    return tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"] - sum(storages.values()), out


def test_fused_adamw_makes_no_temporary_and_the_plan_counts_none():
    """The trainer's optimizer (app/trainer/step.py build_optimizer; fused on CUDA, and fused AdamW
    runs on CPU too) allocates nothing in a step once its moments exist; torch's foreach AdamW
    makes one fp32 temporary per parameter (the sqrt of exp_avg_sq). The plan's default is the
    trainer's: no temporary (before: 4 bytes per parameter, 19.5 GiB at DeepSeek-V3 16 x 8)."""
    from app.trainer.step import build_optimizer

    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(n)) for n in (4096, 1000, 33)]
    numel = sum(p.numel() for p in params)
    got = {}
    for name, make in {"fused": lambda ps: build_optimizer(ps, 1e-3, (0.9, 0.95), 0.1, torch.device("cuda")),
                       "foreach": lambda ps: torch.optim.AdamW(ps, lr=1e-3, foreach=True)}.items():
        ps = [torch.nn.Parameter(p.detach().clone()) for p in params]
        opt = make(ps)
        assert opt.defaults.get("fused") is (True if name == "fused" else None)
        for p in ps:
            p.grad = torch.randn_like(p)
        opt.step()  # the first step makes the moments
        state = [s[k] for s in opt.state.values() for k in ("exp_avg", "exp_avg_sq", "step")]
        got[name], _ = _new_bytes(opt.step, *ps, *(p.grad for p in ps), *state)
    assert got["foreach"] == 4 * numel
    assert got["fused"] == 0
    q = qwen3_30b_a3b_config(2)
    assert plan_memory(_input(q, 8, 8)).terms["optim_temp"].bytes == 0
    foreach = plan_memory(_input(q, 8, 8, adamw="foreach"))
    assert foreach.terms["optim_temp"].bytes == foreach.terms["master"].bytes


@pytest.fixture
def interpreted_logit_kernels(monkeypatch):
    """The Triton softmax passes, run by Triton's interpreter on CPU, with the interpreter's own
    garbage (reference cycles holding its argument views; a compiled CUDA launch holds nothing)
    collected after each launch, so that what stays alive is what the kernels' callers hold."""
    import app.model.logprobs as lp
    from app.model import kernels

    if not (kernels.AVAILABLE and kernels.INTERPRETED):
        pytest.skip("needs triton's interpreter (CPU)")
    for name in ("logit_stats", "logit_grad"):
        real = getattr(lp, name)

        def collected(*a, _real=real, **kw):
            out = _real(*a, **kw)
            gc.collect()
            return out

        monkeypatch.setattr(lp, name, collected)


@pytest.mark.parametrize("rows,chunk,entropy", [(60, 32, True), (24, 32, False)])
def test_lm_head_triton_path_bytes_equal_what_the_kernels_callers_allocate(rows, chunk, entropy,
                                                                           interpreted_logit_kernels):
    """`chunked_logprobs` with the Triton passes (the trainer's path on CUDA), bf16, forward and
    backward: the bytes alive beyond its inputs equal the plan's LM-head terms exactly. No fp32
    [chunk, V] block exists (the torch path's 10-16 bytes per element, which the plan charged
    before, measure here as such: the last assertion)."""
    from app.model.logprobs import chunked_logprobs

    h_dim, v = 64, 512
    config = tiny_config("tiny-qwen3-moe", vocab_size=v, hidden_size=h_dim)
    torch.manual_seed(0)
    h = torch.randn(rows, h_dim, dtype=torch.bfloat16, requires_grad=True)
    w = (0.1 * torch.randn(v, h_dim, dtype=torch.bfloat16)).requires_grad_()
    t = torch.randint(0, v, (rows,))
    fwd, (logp, ent) = _new_bytes(lambda: chunked_logprobs(h, w, t, 1.0, chunk, entropy, fused=True), h, w, t)
    assert fwd == act.logprob_forward(config, chunk, entropy, rows, 2, fused=True).bytes
    g = torch.randn(rows)
    lse = logp.grad_fn.saved_tensors[3]
    bwd, _ = _new_bytes(lambda: torch.autograd.grad(logp, (h, w), g), h, w, t, g, logp, lse,
                        *([ent] if ent is not None else []))
    assert bwd == act.logprob_backward(config, chunk, rows, 2, fused=True).bytes
    torch_fwd, _ = _new_bytes(lambda: chunked_logprobs(h, w, t, 1.0, chunk, entropy, fused=False), h, w, t)
    assert torch_fwd - fwd >= 0.9 * 4 * min(chunk, rows) * v  # the torch path does make an fp32 block


@pytest.mark.parametrize("rows", [0, 1, 31, 32, 33, 64, 95, 96, 100, 1000])
@pytest.mark.parametrize("entropy", [False, True])
def test_lm_head_peaks_from_three_chunks_equal_every_chunk(rows, entropy, monkeypatch):
    """The LM-head peaks read the first two chunks and the last; listing every chunk (as a
    10**15-token micro-batch would) gives the same bytes."""
    config = tiny_config("tiny-qwen3-moe", vocab_size=512, hidden_size=64)
    short = (act.logprob_forward(config, 32, entropy, rows, 2).bytes, act.logprob_backward(config, 32, rows, 2).bytes)
    monkeypatch.setattr(act, "_chunks", lambda n, c: [min(c, n - s) for s in range(0, n, c)] or [0])
    assert short == (act.logprob_forward(config, 32, entropy, rows, 2).bytes,
                     act.logprob_backward(config, 32, rows, 2).bytes)


@pytest.mark.timeout(60)
def test_cli_plans_a_huge_batch_without_hanging():
    """10**15 tokens per micro-batch (the LM-head chunks were listed one by one: 2.4 x 10**11 of
    them) is planned, and does not fit."""
    r = _plan("--model", "qwen3-30b-a3b", "--seq-len", "1000000000", "--rollouts-per-gpu", "1000000", "--json")
    assert r.exit_code == 1, r.output
    out = json.loads(r.output)
    assert out["batch"]["micro_batch_tokens"] == 10**15 and not out["fits"]


@pytest.mark.timeout(60)
def test_units_of_a_deep_model():
    """20000 layers (--set num_hidden_layers): the units are found in one pass over the tensors,
    not one per layer (quadratic: hours)."""
    config = tiny_config("tiny-qwen3-moe", num_hidden_layers=20000)
    root, layers = units(config, Layout(world=1, dp_replicate=1, dp_shard=1, ep=1, efsdp=1))
    assert len(layers) == 20000 and layers[-1].name == "layer 19999"
    assert (layers[-1].compute, layers[-1].fp32) == (layers[0].compute, layers[0].fp32) and layers[0].fp32 > 0
    assert root.compute == sum(p.numel for p in param_shapes(config) if p.layer is None)


def test_nccl_buffers_per_group_from_nccl_defaults():
    """NCCL 2.30.7's defaults (src/init.cc computeBuffSizes; src/include/device.h): LL 512 KiB,
    LL128 4.69 MiB, Simple 4 MiB per connection, rounded to cuMem's 2 MiB: the 10485760- and
    2097152-byte allocations NCCL logs per channel and peer for an all-to-all on 8 x H100
    (NVIDIA/nccl issue 1685, 32 channels per pair). The plan used to put 1 GiB on all of NCCL."""
    from app.plan import nccl

    assert nccl.LL_BYTES + nccl.LL128_BYTES + nccl.SIMPLE_BYTES == 524288 + 4915200 + 4194304
    assert nccl.connection_bytes() == 10485760 + 2097152
    lay = Layout(world=8, dp_replicate=1, dp_shard=8, ep=8, efsdp=1)
    groups = {g.name.split(" (")[0]: g for g in nccl.trainer_groups(lay, 8, "alltoall")}
    assert groups["NCCL ep group"].bytes == 7 * 32 * (10485760 + 2097152)  # 2.82 GB; issue 1685 saw +3.28 GB
    # DeepEP moves tokens in its own buffer: the EP group only all-reduces (a ring).
    ring = {g.name.split(" (")[0]: g for g in nccl.trainer_groups(lay, 8, "deepep")}["NCCL ep group"].bytes
    assert ring == 32 * 12 * 2**20 + 16 * 2 * 2**20 * 8
    # Across nodes: 16 ring channels, 4 channels per network peer (p5en: 2 x 200 Gbit/s EFA per GPU).
    assert nccl.p2p_channels_per_peer(32, 4) == 4 and nccl.p2p_channels_per_peer(128, 16) == 2
    q = qwen3_30b_a3b_config(2)
    p = plan_memory(_input(q, 8, 8, ep_backend="alltoall"))
    assert p.overhead == int(1.78 * GIB) + sum(g.bytes for g in nccl.trainer_groups(lay, 8, "alltoall"))
    assert p.overhead > int(1.78 * GIB) + 3 * GIB
    # Ranks over gloo (several on one GPU) and a world of one make no NCCL buffers.
    assert plan_memory(_input(q, 8, 8, ep_backend="alltoall", collectives="gloo")).overhead == int(1.78 * GIB)
    one = PlanInput(config=q, layout=Layout(1, 1, 1, 1, 1), gpus_per_node=8, rollouts_per_gpu=2, seq_len=8192,
                    micro_batch_tokens=16384, ep_backend="local")
    assert plan_memory(one).overhead == int(1.78 * GIB)


def test_ep_backend_auto_plans_what_the_trainer_runs():
    """`auto` resolves as app/model/parallel.py init_ep would on the trainer pods (alltoall, the
    reason said); `deepep` is planned when asked, with its buffer; a width DeepEP rejects falls
    back under auto and is refused when deepep is asked (exit 2)."""
    args = ("--model", "qwen3-30b-a3b", "--nodes", "1", "--ep", "8", "--micro-batch-tokens", "16384",
            "--activation-checkpointing", "full", "--json")
    auto = json.loads(_plan(*args).output)
    assert auto["layout"]["ep_backend"] == "alltoall" and auto["layout"]["ep_backend_requested"] == "auto"
    assert "EP_DISABLE_GIN" in auto["layout"]["ep_backend_reason"]
    assert "deepep" not in {t["key"] for t in auto["terms"]}
    deep = json.loads(_plan(*args, "--ep-backend", "deepep").output)
    assert deep["layout"]["ep_backend"] == "deepep" and "deepep" in {t["key"] for t in deep["terms"]}
    gloo = json.loads(_plan(*args, "--collectives", "gloo").output)
    assert "gloo" in gloo["layout"]["ep_backend_reason"] and gloo["overhead_terms"][1:] == []
    odd = ("--model", "tiny-qwen3-moe", "--nodes", "1", "--gpus-per-node", "2", "--ep", "2", "--seq-len", "64")
    assert json.loads(_plan(*odd, "--json").output)["layout"]["ep_backend"] == "alltoall"
    r = _plan(*odd, "--ep-backend", "deepep")
    assert r.exit_code == 2 and "hidden_size" in r.output
    one = json.loads(_plan("--model", "qwen3-30b-a3b", "--nodes", "1", "--ep", "1", "--json").output)
    assert one["layout"]["ep_backend"] == "local"


def _tiny_router_imbalance(TaskConfig, make_splits, build_tokenizer, build_base_policy, sft_batch, warm_up, MoEBlock):
    """{preset: worst max/mean rows of 2 EP ranks} (see the test below)."""
    from app.config import RunConfig

    measured = {}
    for preset in ("tiny-qwen3-moe", "tiny-deepseek-v3"):
        run = RunConfig(task=TaskConfig(train_size=256, eval_size=64, warmup_steps=40, warmup_batch_size=16))
        run.model.preset = preset
        train, held = make_splits(run.task)
        tok = build_tokenizer()
        torch.manual_seed(0)
        model = build_base_policy(run)
        warm_up(model, tok, train, run.task.warmup_steps, run.task.warmup_lr, run.task.warmup_batch_size)
        ids, attn, _ = sft_batch(held, tok)
        worst = 1.0
        with torch.no_grad():
            for s in range(0, len(held), 16):
                model(input_ids=ids[s:s + 16], attention_mask=attn[s:s + 16])
                for block in (m for m in model.modules() if isinstance(m, MoEBlock)):
                    idx = block.last_topk_idx.reshape(-1)
                    per_rank = torch.bincount(idx[idx >= 0], minlength=block.num_experts).view(2, -1).sum(1).float()
                    worst = max(worst, float(per_rank.max() / per_rank.mean()))
        measured[preset] = worst
    return measured


def test_expert_imbalance_scales_the_expert_side_and_its_default_is_the_measured_tiny_router():
    """The default of --expert-imbalance is what this measures: the embedded tiny presets after a
    40-step supervised warm-up on the embedded task, their held-out prompts in micro-batches of
    16, the busiest of 2 EP ranks' rows over the mean, worst micro-batch and MoE layer."""
    from app.config import TaskConfig
    from app.envs.tasks import make_splits
    from app.model.tokenizer import build_tokenizer
    from app.envs.warmup import build_base_policy, sft_batch, warm_up
    from app.model.moe import MoEBlock
    from app.plan.memory import EXPERT_IMBALANCE

    measured = {}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a few seconds on one thread; minutes when two threads fight a busy machine
    try:
        measured = _tiny_router_imbalance(TaskConfig, make_splits, build_tokenizer, build_base_policy, sft_batch,
                                          warm_up, MoEBlock)
    finally:
        torch.set_num_threads(threads)
    assert max(measured.values()) <= EXPERT_IMBALANCE <= max(measured.values()) + 0.05, measured    # The flag scales the rows the busiest rank's experts take, and what is made of them.
    q = qwen3_30b_a3b_config(2)
    flat, skew = (plan_memory(_input(q, 8, 8, ep_backend="alltoall", expert_imbalance=x)) for x in (1.0, 2.0))
    assert (flat.micro_batch.expert_rows, skew.micro_batch.expert_rows) == (16384 * 8, 2 * 16384 * 8)
    for key in ("recompute", "comm_fwd", "comm_bwd", "bwd_transient"):
        assert skew.terms[key].bytes > flat.terms[key].bytes, key
    assert flat.terms["master"] == skew.terms["master"]
    r = _plan("--model", "qwen3-30b-a3b", "--ep", "8", "--expert-imbalance", "0.5")
    assert r.exit_code == 2 and "--expert-imbalance" in r.output


@pytest.mark.parametrize("model,layers,experts,ac,measured_gb", [
    ("qwen3-30b-a3b", 4, None, "none", 72.4), ("qwen3-30b-a3b", 4, None, "full", 65.1),
    ("deepseek-v3", 2, 32, "full", 98.7), ("deepseek-v3", 2, 32, "selective", 98.7)])
def test_trainer_step_on_one_h200_against_bench_train_step(model, layers, experts, ac, measured_gb):
    """`moerl bench train-step` on the H200 (bench/results/train-step.md, 2026-12-01 12:02-12:05 UTC: the trainer's
    own step at world 1, fused AdamW, the Triton logit passes, 8 x 8192 tokens in 16K micro-batches):
    max_memory_allocated against the plan of that shape, within 2 %. At world 1 the trainer keeps
    every layer unit gathered from forward to backward, selective is full checkpointing on the
    local dispatcher (the two DeepSeek-V3 rows measured the same), and fused AdamW makes no
    temporary: the plan before put these peaks at the foreach temporary of the optimizer step."""
    from app.bench.train_step import model_config

    p = plan_memory(PlanInput(config=model_config(model, layers, experts), layout=Layout(1, 1, 1, 1, 1),
                              gpus_per_node=1, rollouts_per_gpu=8, seq_len=8192, micro_batch_tokens=16384,
                              activation_checkpointing=ac, ep_backend="local"))
    assert abs(p.tensors_peak / 1e9 - measured_gb) <= 0.02 * measured_gb, (p.peak_phase, p.tensors_peak / 1e9)
    assert p.peak_phase != "optimizer step"


def test_search_lists_every_layout_that_fits_best_first():
    """--search plans every (ep, dp_shard, dp_replicate) app/layout.py accepts for the world, every
    micro-batch size and checkpointing mode; what it lists fits, is ordered by its ranking, and
    equals the plan of that layout run on its own."""
    from app.plan import search

    # A capacity between the tiny model's smallest and largest plans (1.783-1.793 GiB, mostly the CUDA
    # context), so that some candidates fit and some do not.
    base = ("--model", "tiny-qwen3-moe", "--nodes", "1", "--gpus-per-node", "4", "--rollouts-per-gpu", "4",
            "--seq-len", "256", "--collectives", "gloo", "--gpu-memory-gib", "1.786")
    r = _plan(*base, "--search", "--json")
    assert r.exit_code == 0, r.output
    out = json.loads(r.output)
    assert {(lay.ep, lay.dp_shard, lay.dp_replicate) for lay in search.layouts(4, 8)} == {
        (1, 4, 1), (2, 4, 1), (4, 4, 1), (1, 2, 2), (2, 2, 2), (1, 1, 4)}
    assert out["candidates"] == 6 * 3 * 3  # layouts x micro-batches of 1, 2, 4 sequences x AC modes
    fits = out["fits"]
    assert fits and all(f["fits"] for f in fits) and len(fits) < out["candidates"]
    assert [search.rank_key(f) for f in fits] == sorted(search.rank_key(f) for f in fits)
    for f in fits[:3]:
        one = json.loads(_plan(*base, "--ep", str(f["ep"]), "--dp-shard", str(f["dp_shard"]), "--dp-replicate",
                               str(f["dp_replicate"]), "--micro-batch-tokens", str(f["micro_batch_tokens"]),
                               "--activation-checkpointing", f["activation_checkpointing"], "--json").output)
        assert (one["tensors_peak"], one["predicted"]) == (f["tensors_peak"], f["predicted"])
    table = _plan(*base, "--search")
    assert table.exit_code == 0 and "Layouts that fit" in table.output and "Best first" in table.output
    assert _plan(*base[:-1], "1.0", "--search").exit_code == 1


def _reference_worker(rank: int, world: int, port: int, queue) -> None:
    torch.set_num_threads(1)
    import torch.distributed as dist
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    from app.config import RunConfig
    from app.layout import resolve_layout
    from app.model.config import num_routed_experts
    from app.trainer.models import build_reference, policy_config
    from app.trainer.parallel import build_mesh

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    cfg = RunConfig()
    cfg.model.dtype = "bfloat16"
    cfg.trainer.kl_coef = 0.1
    config = policy_config(cfg, None)
    mesh = build_mesh(resolve_layout(cfg.trainer.parallel, world, num_routed_experts(config)), "cpu")
    ref = build_reference(cfg, None, mesh.ep_context("local"), mesh, torch.device("cpu"))

    def nbytes(tensors) -> int:
        return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values())

    def local(t):
        return t.to_local() if isinstance(t, DTensor) else t

    groups = [g for m in ref.modules() if isinstance(m, FSDPModule) for g in m._get_fsdp_state()._fsdp_param_groups]
    sharded = nbytes(fp.sharded_param.to_local() for g in groups for fp in g.fsdp_params)
    ids = torch.randint(4, config.vocab_size, (2, 32))
    with torch.no_grad():  # as app/trainer/step.py _micro_step runs it
        ref.sequence_logprobs(ids, torch.ones_like(ids), torch.ones(2, 32))
    # What stays gathered after the forward (an unsharded group's copies; experts are EP DTensors).
    resident = nbytes(local(fp._unsharded_param) for g in groups if g.is_unsharded for fp in g.fsdp_params)
    queue.put(((world, rank), (sharded, resident, all(not p.requires_grad for p in ref.parameters()))))
    dist.barrier()
    dist.destroy_process_group()


def _spawn(target, worlds: tuple[int, ...], *args) -> dict:
    import torch.multiprocessing as mp

    from app.buffer.redis_server import free_port

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = []
    for world in worlds:
        port = free_port()
        procs += [ctx.Process(target=target, args=(r, world, port, queue, *args)) for r in range(world)]
    for p in procs:
        p.start()
    got = dict(queue.get(timeout=300) for _ in procs)
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    return got


def test_reference_policy_bytes_per_rank_equal_the_trainers_frozen_reference():
    """app/trainer/models.py build_reference on 1 and 2 gloo ranks (bf16 compute, FSDP2 as the
    trainer shards it): its fp32 shards per rank are the plan's ref_master; after its no-grad
    forward nothing stays gathered at world 2, and at world 1 (no reshard after forward, no
    backward to reshard it) its whole compute-dtype copy stays: the plan's ref_resident."""
    got = _spawn(_reference_worker, (1, 2))
    for world in (1, 2):
        lay = Layout(world=world, dp_replicate=1, dp_shard=world, ep=1, efsdp=world)
        config = tiny_config("tiny-qwen3-moe")
        p = plan_memory(PlanInput(config=config, layout=lay, gpus_per_node=8, rollouts_per_gpu=2, seq_len=32,
                                  micro_batch_tokens=None, ep_backend="local", reference=True))
        sharded, resident, frozen = got[(world, 0)]
        assert frozen and sharded == p.terms["ref_master"].bytes, world
        assert resident == (p.terms["ref_resident"].bytes if world == 1 else 0), world
        assert ("ref_resident" in p.terms) == (world == 1)
        assert "ref_master" in p.phases[p.peak_phase] and "reference forward" in p.phases
    q = qwen3_30b_a3b_config(2)
    without, with_ref = plan_memory(_input(q, 8, 8)), plan_memory(_input(q, 8, 8, reference=True))
    assert with_ref.phase_bytes("optimizer step") - without.phase_bytes("optimizer step") == \
        with_ref.terms["master"].bytes
    r = json.loads(_plan("--model", "qwen3-30b-a3b", "--nodes", "1", "--ep", "8", "--kl-coef", "0.05",
                         "--json").output)
    assert r["batch"]["reference"] and "ref_master" in {t["key"] for t in r["terms"]}


def _alltoall_worker(rank: int, world: int, port: int, queue) -> None:
    torch.set_num_threads(1)
    import torch.distributed as dist

    from app.model.dispatch import exchange_cache
    from app.model.dispatch.alltoall import AllToAllDispatcher

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    t, h, e, k = 96, 256, 8, 2
    gen = torch.Generator().manual_seed(rank)
    # Rank 0's tokens prefer rank 1's experts (4-7): rank 1 receives more rows than the mean.
    prefer = torch.tensor([1.0] * 4 + [3.0] * 4) if rank == 0 else torch.ones(e)
    idx = torch.multinomial(prefer.expand(t, e), k, generator=gen)
    w = torch.softmax(torch.randn(t, k, generator=gen), -1)
    x = torch.randn(t, h, generator=gen, requires_grad=True)
    disp = AllToAllDispatcher(EPContext(group=dist.group.WORLD, rank=rank, size=world, backend="alltoall"), e)
    d = disp.dispatch(x, idx, w)
    y = (d.x * 2).detach().requires_grad_()  # the experts' output [N, H]
    known = [x, idx, w, d.x, d.weights, y, d.handle.rmap.token_of_row, d.handle.rmap.rows_by_token,
             d.handle.rmap.bag_offsets]
    g = torch.randn(t, h, generator=gen)
    # gloo frees an exchange's buffers when its work ends, on its own thread: in about one run in
    # five the tracker saw one more [N, H] buffer alive in the backward. The least of three
    # passes is the dispatcher's own (a buffer it makes on every pass is in all three).
    fwd = bwd = None
    for _ in range(3):
        f, out = _new_bytes(lambda: disp.combine(y, d.handle), *known)
        b, _ = _new_bytes(lambda: torch.autograd.grad(out, y, g), *known, out, g)
        fwd, bwd = min(f, fwd or f), min(b, bwd or b)
    # Selective checkpointing: what the dispatcher keeps for the recompute (its exchanges' outputs).
    cache = exchange_cache._Cache()
    with exchange_cache._use(cache, "record"):
        d2 = disp.dispatch(x, idx, w)
        disp.combine((d2.x * 2), d2.handle)
    kept = sum(v.untyped_storage().nbytes() for key, v in cache.items if key == "rows")
    queue.put(((world, rank), (d.x.shape[0], fwd, bwd, kept)))
    dist.barrier()
    dist.destroy_process_group()


def test_alltoall_transients_selective_keep_and_imbalance_equal_the_dispatchers():
    """app/model/dispatch/alltoall.py on 2 gloo ranks (fp32, skewed routing: rank 1 receives more):
    the bytes its combine makes in forward and in backward, and what selective checkpointing
    keeps, equal the plan's terms at each rank's received rows N; the plan's rows of the busiest
    rank at --expert-imbalance = its measured max/mean are that rank's N."""
    got = _spawn(_alltoall_worker, (2,))
    t, h, k = 96, 256, 2
    config = tiny_config("tiny-qwen3-moe", hidden_size=h)
    rows = {}
    for rank in (0, 1):
        n, fwd, bwd, kept = got[(2, rank)]
        rows[rank] = n
        mb = act.MicroBatch(seqs=1, seq_len=t, expert_rows=n, compute_bytes=4, backend="alltoall", top_k=k)
        # The experts' output y [N, H] exists before the combine; the plan's term includes it.
        want_fwd = act.dispatch_forward(config, 0, mb).bytes - 4 * n * h
        assert want_fwd <= fwd <= 1.02 * want_fwd, (rank, fwd, want_fwd)  # + the per-token sum's int64 offsets
        want_bwd = act.dispatch_backward(config, 0, mb).bytes
        assert want_bwd <= bwd <= 1.02 * want_bwd, (rank, bwd, want_bwd)
        assert kept == act.checkpoint_kept(config, 0, mb, "selective") - 4 * t * h, (rank, kept)
    assert rows[0] + rows[1] == 2 * t * k and rows[1] > t * k
    imbalance = max(rows.values()) / (t * k)
    lay = Layout(world=2, dp_replicate=1, dp_shard=2, ep=2, efsdp=1)
    p = plan_memory(PlanInput(config=config, layout=lay, gpus_per_node=2, rollouts_per_gpu=1, seq_len=t,
                              micro_batch_tokens=None, ep_backend="alltoall", expert_imbalance=imbalance,
                              compute_dtype="float32"))
    assert p.micro_batch.expert_rows == rows[1]
