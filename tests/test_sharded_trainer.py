"""The sharded trainer (issue 13): FSDP2 x EP layouts over gloo give the single-process step,
for GRPO and PPO, with micro-batches and activation checkpointing; chunked logprobs equal the
full ones; bf16 compute with fp32 master weights keeps a 1e-6 update; every rank publishes what it
owns into the store without a shared disk, and stock transformers loads the version."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from app.config import RunConfig
from helpers import assert_params_match, fake_groups, full_params, join_world, sharded_trainer, single_rank_env, spawn

BASE = dict(model={"preset": "tiny-qwen3-moe"},
            trainer={"grad_clip": 1e9, "tis_cap": 2.0, "log_entropy": True, "lr_warmup_steps": 0})
# name -> (run-config overrides, optimizer). SGD with lr 1 makes a step's update minus the
# gradient, so the comparison is of gradients; "adamw" compares the optimizer's sharded state too.
VARIANTS = {
    "grpo": ({}, "sgd"),
    "grpo-seq-mean": ({"trainer": {"loss_agg": "seq-mean"}}, "sgd"),
    "grpo-3-micro-batches": ({"trainer": {"micro_batch_tokens": 24}}, "sgd"),
    "grpo-ac-full": ({"trainer": {"activation_checkpointing": "full"}}, "sgd"),
    "grpo-ac-selective": ({"trainer": {"activation_checkpointing": "selective", "micro_batch_tokens": 24}}, "sgd"),
    "grpo-deepseek-v3": ({"model": {"preset": "tiny-deepseek-v3"}}, "sgd"),
    "grpo-deepseek-v3-ac-selective": ({"model": {"preset": "tiny-deepseek-v3"},
                                       "trainer": {"activation_checkpointing": "selective"}}, "sgd"),
    "ppo": ({"trainer": {"algorithm": "ppo", "gae_lambda": 0.9, "gamma": 0.99}}, "sgd"),
    # The aux loss over micro-batches and ranks, and DeepSeek-V3's aux-loss-free bias update.
    "grpo-aux-3-micro-batches": ({"router": {"aux_loss_coef": 0.05}, "trainer": {"micro_batch_tokens": 24}}, "sgd"),
    "grpo-deepseek-v3-bias": ({"model": {"preset": "tiny-deepseek-v3"}, "router": {"bias_update_rate": 0.01}}, "sgd"),
    # GSPO's sequence ratio, Dr. GRPO's constant normaliser (global sequence count), token-masked IS,
    # dual-clip and the entropy bonus (global token count), over micro-batches.
    "gspo-dr-grpo-objectives": ({"trainer": {"ratio_level": "sequence", "loss_agg": "seq-mean-token-sum-norm",
                                             "scale_by_std": False, "rollout_is": "token_mask", "rollout_is_min": 0.5,
                                             "dual_clip": 3.0, "entropy_coef": 0.01, "micro_batch_tokens": 24}}, "sgd"),
    "adamw": ({}, "adamw"),
}
N_GROUPS = 5  # over 4 ranks: one rank gets two groups, the others one (uneven shares)


def _cfg(name: str, parallel: dict) -> RunConfig:
    over, _ = VARIANTS[name]
    merged = copy.deepcopy(BASE)
    for section, fields in over.items():
        merged.setdefault(section, {}).update(fields)
    merged["trainer"]["parallel"] = parallel
    return RunConfig.model_validate(merged)


def _optimizer(kind: str, params):
    if kind == "sgd":
        return torch.optim.SGD(params, lr=1.0)
    return torch.optim.AdamW(params, lr=1e-3, eps=1e-4)  # eps above fp32 gradient noise: no sign flips


def _value_head(critic) -> None:
    """A non-zero value head, the same at every layout, so the critic's trunk gets gradient too."""
    from app.model.checkpoint import local_block

    w = critic.module.value_head.weight
    full = torch.randn(tuple(w.shape), generator=torch.Generator().manual_seed(1))
    local, offset, block = local_block(w.data)
    with torch.no_grad():
        local.copy_(full[tuple(slice(o, o + b) for o, b in zip(offset, block))])


def _step(cfg, kind, model, critic, groups, rank: int, world: int) -> dict:
    """One train_step on this rank's share; returns stats and the full weights before/after."""
    from app.trainer.batch import collate_groups, split_groups
    from app.trainer.step import train_step

    if critic is not None:
        _value_head(critic)
    before = full_params(model) | ({f"critic.{k}": v for k, v in full_params(critic.module).items()} if critic else {})
    opt = _optimizer(kind, model.parameters())
    if critic is not None:
        critic.optimizer = _optimizer(kind, critic.module.parameters())
    batch = collate_groups(split_groups(groups, world)[rank], scale_by_std=cfg.trainer.scale_by_std)
    applied, stats = train_step(cfg, model, opt, batch, pad_id=0, critic=critic)
    after = full_params(model) | ({f"critic.{k}": v for k, v in full_params(critic.module).items()} if critic else {})
    bias = {k: v.detach().clone() for k, v in model.named_buffers() if k.endswith("e_score_correction_bias")}
    return {"applied": applied, "stats": stats, "before": before, "after": after, "bias": bias}


def _sharded_worker(rank: int, world: int, port: int, names: list[str], out: str) -> None:
    join_world(rank, world, port)
    from app.trainer.models import build_critic_parts

    results = {}
    for name in names:
        cfg = _cfg(name, {"ep": 2})
        model, mesh, ep = sharded_trainer(cfg)
        critic = build_critic_parts(cfg, None, ep, mesh, torch.device("cpu")) if cfg.trainer.algorithm == "ppo" else None
        results[name] = _step(cfg, VARIANTS[name][1], model, critic, _groups(name), rank, world)
    if rank == 0:
        torch.save(results, out)
    dist.barrier()
    dist.destroy_process_group()


def _reference(name: str) -> dict:
    """The same step on one process with the plain (unsharded, unwrapped) transformers model."""
    from app.model.config import tiny_config
    from app.model.parallel import EPContext
    from app.model.policy import build_policy
    from app.trainer.critic import Critic, CriticParts

    cfg = _cfg(name, {"ep": 1})
    config = tiny_config(cfg.model.preset)
    model = build_policy(config, cfg.router, EPContext.local(), seed=cfg.task.seed)
    critic = None
    if cfg.trainer.algorithm == "ppo":
        trunk = build_policy(config, cfg.router, EPContext.local(), seed=cfg.task.seed).model
        critic = CriticParts(Critic(trunk, config.hidden_size), optimizer=None)
    return _step(cfg, VARIANTS[name][1], model, critic, _groups(name), 0, 1)


def _groups(name: str):
    return fake_groups(N_GROUPS, binary_reward=not name.startswith("ppo"))


@pytest.fixture(scope="module")
def sharded_results(tmp_path_factory):
    """Every variant's step on 4 gloo ranks as dp_shard 4 x EP 2 (FSDP over all four; each EP
    rank holds half the experts, sharded over 2 expert-data-parallel ranks), in one spawn."""
    out = tmp_path_factory.mktemp("sharded") / "results.pt"
    spawn(_sharded_worker, 4, list(VARIANTS), str(out))
    return torch.load(out)


@pytest.mark.parametrize("name", list(VARIANTS))
def test_dp2_x_ep2_step_equals_the_single_process_step(sharded_results, name):
    got, ref = sharded_results[name], _reference(name)
    assert got["applied"] and ref["applied"]
    assert_params_match(got["before"], ref["before"], atol=0, rtol=0)  # same init at every layout
    for key in ("loss", "grad_norm", "tokens", "entropy", "clip_frac", "tis"):
        assert got["stats"][key] == pytest.approx(ref["stats"][key], rel=1e-4, abs=1e-6), key
    delta = {k: got["before"][k] - got["after"][k] for k in got["after"]}
    ref_delta = {k: ref["before"][k] - ref["after"][k] for k in ref["after"]}
    assert max(float(d.abs().max()) for d in ref_delta.values()) > 0
    # fp32, reduction order differs (rank split, reduce-scatter): tolerance above 1e-7 noise.
    assert_params_match(delta, ref_delta, atol=2e-6, rtol=1e-4)
    if name == "grpo-3-micro-batches":
        assert got["stats"]["micro_batches"] >= 3 and ref["stats"]["micro_batches"] >= 3
    if name == "grpo-deepseek-v3-bias":  # the bias moved, on every rank as on one (loads of every rank)
        assert ref["bias"] and any(float(b.abs().max()) > 0 for b in ref["bias"].values())
        for k in ref["bias"]:
            torch.testing.assert_close(got["bias"][k], ref["bias"][k], atol=0, rtol=0)
    if name == "gspo-dr-grpo-objectives":
        assert 0 < ref["stats"]["is_masked_frac"] < 1
        assert got["stats"]["is_masked_frac"] == pytest.approx(ref["stats"]["is_masked_frac"], rel=1e-6)
    if name == "ppo":
        for key in ("vf_loss", "value", "return", "critic_grad_norm"):
            assert got["stats"][key] == pytest.approx(ref["stats"][key], rel=1e-4, abs=1e-6), key
        assert float(ref_delta["critic.trunk.embed_tokens.weight"].abs().max()) > 0  # the trunk learns too


def test_micro_batches_split_the_rows_and_equal_one_shot():
    """One process: 1 micro-batch vs 3 give the same update (global token normalisation)."""
    one, three = _reference("grpo"), _reference("grpo-3-micro-batches")
    assert one["stats"]["micro_batches"] == 1 and three["stats"]["micro_batches"] >= 3
    d1 = {k: one["before"][k] - one["after"][k] for k in one["after"]}
    d3 = {k: three["before"][k] - three["after"][k] for k in three["after"]}
    assert_params_match(d3, d1, atol=2e-6, rtol=1e-4)


def test_the_aux_loss_gives_the_same_update_for_any_micro_batch_split():
    """One process: the aux loss per sequence over real tokens makes 1 and 3 micro-batches (with
    their padding) the same step, the router included."""
    VARIANTS["_aux-one"] = ({"router": {"aux_loss_coef": 0.05}}, "sgd")
    try:
        one, three = _reference("_aux-one"), _reference("grpo-aux-3-micro-batches")
    finally:
        del VARIANTS["_aux-one"]
    assert one["stats"]["micro_batches"] == 1 and three["stats"]["micro_batches"] >= 3
    d1 = {k: one["before"][k] - one["after"][k] for k in one["after"]}
    d3 = {k: three["before"][k] - three["after"][k] for k in three["after"]}
    plain = _reference("grpo")  # without the aux loss the router's update differs: the term is there
    d0 = {k: plain["before"][k] - plain["after"][k] for k in plain["after"]}
    router = [k for k in d1 if k.endswith("mlp.gate.weight")]
    assert router and max(float((d1[k] - d0[k]).abs().max()) for k in router) > 1e-4
    assert_params_match(d3, d1, atol=2e-6, rtol=1e-4)


def test_plan_micro_batches_respects_the_token_budget():
    from app.trainer.batch import collate_groups, plan_micro_batches

    batch = collate_groups(fake_groups(N_GROUPS))
    lengths = batch.attention_mask.sum(-1)
    plan = plan_micro_batches(batch, 24)
    rows = torch.cat([r for r, _ in plan])
    assert sorted(rows.tolist()) == list(range(batch.input_ids.shape[0]))  # every row exactly once
    for r, length in plan:
        assert length == int(lengths[r].max()) and (len(r) * length <= 24 or len(r) == 1)
    assert plan_micro_batches(batch, None)[0][0].tolist() == list(range(batch.input_ids.shape[0]))


# ------------------------------------------------------------------------------------------
# Chunked logprobs and entropy


def test_chunked_logprobs_equal_the_full_log_softmax_in_value_and_gradient():
    from app.model.logprobs import chunked_logprobs

    torch.manual_seed(0)
    n, h, v = 37, 16, 50
    hidden = torch.randn(n, h, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(v, h, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, v, (n,))
    for temperature in (1.0, 0.7):
        logp, ent = chunked_logprobs(hidden, weight, targets, temperature, chunk=5, with_entropy=True)
        z = hidden @ weight.T / temperature
        ref = torch.log_softmax(z, -1).gather(1, targets[:, None]).squeeze(1)
        ref_ent = -(torch.softmax(z, -1) * torch.log_softmax(z, -1)).sum(-1)
        torch.testing.assert_close(logp, ref, atol=1e-12, rtol=0)
        torch.testing.assert_close(ent, ref_ent, atol=1e-12, rtol=0)
        g = torch.randn(n, dtype=torch.float64)
        got = torch.autograd.grad((logp * g).sum(), (hidden, weight))
        want = torch.autograd.grad((ref * g).sum(), (hidden, weight))
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, atol=1e-12, rtol=0)
    assert torch.autograd.gradcheck(lambda x, w: chunked_logprobs(x, w, targets, 0.9, chunk=8)[0], (hidden, weight))
    empty, _ = chunked_logprobs(hidden[:0], weight, targets[:0], 1.0, chunk=4)
    assert empty.shape == (0,)


def test_sequence_logprobs_equal_token_logprobs_of_the_full_logits():
    from app.model.config import tiny_config
    from app.model.parallel import EPContext
    from app.model.policy import build_policy
    from app.trainer.batch import collate_groups
    from app.trainer.grpo import token_entropy, token_logprobs

    cfg = RunConfig()
    model = build_policy(tiny_config("tiny-deepseek-v3"), cfg.router, EPContext.local(), seed=1)
    b = collate_groups(fake_groups(3))
    logp, ent, _ = model.sequence_logprobs(b.input_ids, b.attention_mask, b.completion_mask, 0.8,
                                           chunk=7, with_entropy=True)
    logits = model(input_ids=b.input_ids, attention_mask=b.attention_mask).logits
    m = b.completion_mask
    torch.testing.assert_close(logp, token_logprobs(logits, b.input_ids, 0.8) * m, atol=1e-5, rtol=0)
    torch.testing.assert_close(ent, token_entropy(logits, 0.8) * m, atol=1e-5, rtol=0)
    g = torch.autograd.grad((logp * m).sum(), model.lm_head.weight)[0]
    g_ref = torch.autograd.grad((token_logprobs(logits, b.input_ids, 0.8) * m).sum(), model.lm_head.weight)[0]
    torch.testing.assert_close(g, g_ref, atol=1e-5, rtol=1e-4)


# ------------------------------------------------------------------------------------------
# Activation checkpointing really recomputes, and selective keeps the all-to-alls


def _count_worker(rank: int, world: int, port: int, out: str) -> None:
    join_world(rank, world, port)
    import app.model.dispatch.alltoall as a2a
    from app.model.moe import MoEBlock
    from app.trainer.batch import collate_groups, split_groups
    from app.trainer.step import train_step

    counts = {}
    real_a2a, real_forward = a2a.fc.all_to_all_single_autograd, MoEBlock.forward
    for mode in ("none", "full", "selective"):
        calls = {"a2a": 0, "moe": 0}

        def counted_a2a(*a, **k):  # a real exchange of rows (dispatch x and weights, combine)
            calls["a2a"] += 1
            return real_a2a(*a, **k)

        def counted_forward(self, *a, **k):  # (module hooks do not run in a checkpoint's recompute)
            calls["moe"] += 1
            return real_forward(self, *a, **k)

        a2a.fc.all_to_all_single_autograd, MoEBlock.forward = counted_a2a, counted_forward
        cfg = RunConfig.model_validate({**BASE, "trainer": {**BASE["trainer"], "parallel": {"ep": 2},
                                                            "activation_checkpointing": mode}})
        model, _, _ = sharded_trainer(cfg)
        batch = collate_groups(split_groups(fake_groups(2), world)[rank])
        train_step(cfg, model, torch.optim.SGD(model.parameters(), lr=0.0), batch, pad_id=0)
        counts[mode] = dict(calls)
    a2a.fc.all_to_all_single_autograd, MoEBlock.forward = real_a2a, real_forward
    if rank == 0:
        torch.save(counts, out)
    dist.barrier()
    dist.destroy_process_group()


def test_activation_checkpointing_recomputes_layers_and_selective_keeps_the_all_to_alls(tmp_path):
    spawn(_count_worker, 2, str(tmp_path / "c.pt"))
    c = torch.load(tmp_path / "c.pt")
    layers = c["none"]["moe"]  # one forward of each MoE layer
    assert layers > 0 and c["full"]["moe"] == 2 * layers and c["selective"]["moe"] == 2 * layers
    # full AC redoes the dispatch exchanges in backward (the recompute stops early, after the last
    # tensor backward needs, so not necessarily the combine's); selective replays every kept one.
    assert c["full"]["a2a"] >= c["none"]["a2a"] + layers
    assert c["selective"]["a2a"] == c["none"]["a2a"] > 0


# ------------------------------------------------------------------------------------------
# Precision: fp32 master weights keep an update that bf16 storage loses


def test_bf16_compute_step_at_lr_1e6_moves_weights_as_the_fp32_step(monkeypatch):
    """The issue's measurement as an assertion: bf16 compute (FSDP2 param_dtype bf16) with fp32
    master weights changes every element of a 1e-6 AdamW step like fp32 compute does; the same
    update stored in bf16 (the old trainer) would keep almost none of it."""
    from app.trainer.batch import collate_groups
    from app.trainer.step import train_step
    from app.trainer.parallel import init_distributed

    single_rank_env(monkeypatch)
    init_distributed(timeout_s=60)
    try:
        deltas = {}
        for dtype in ("float32", "bfloat16"):
            cfg = RunConfig.model_validate({**BASE, "model": {"preset": "tiny-qwen3-moe", "dtype": dtype}})
            model, _, _ = sharded_trainer(cfg)
            before = full_params(model)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-6)
            applied, _ = train_step(cfg, model, opt, collate_groups(fake_groups(4)), pad_id=0)
            assert applied
            after = full_params(model)
            assert all(v.dtype == torch.float32 for v in after.values())  # master weights
            deltas[dtype] = {k: after[k] - before[k] for k in before}
            if dtype == "bfloat16":
                stored_bf16 = {k: (before[k].bfloat16() + deltas[dtype][k].bfloat16()) != before[k].bfloat16()
                               for k in before}
        # Elements the fp32 step moves (embedding rows of tokens absent from the batch get no gradient).
        live = {k: d != 0 for k, d in deltas["float32"].items()}
        n_live = sum(int(m.sum()) for m in live.values())
        assert n_live > 0.9 * sum(m.numel() for m in live.values())
        frac = lambda f: sum(int((f(k) & live[k]).sum()) for k in live) / n_live  # noqa: E731
        assert frac(lambda k: deltas["bfloat16"][k] != 0) > 0.99  # bf16 compute moves them too
        assert frac(lambda k: torch.sign(deltas["bfloat16"][k]) == torch.sign(deltas["float32"][k])) > 0.9
        assert frac(lambda k: stored_bf16[k]) < 0.1  # what bf16 parameters would have kept of the same step

        # PPO in bf16 with activation checkpointing: the critic's head and the recomputed layers
        # see the dtypes of the forward (a recompute runs without FSDP's forward hooks).
        from app.trainer.models import build_critic_parts

        for ac in ("full", "selective"):
            cfg = RunConfig.model_validate({**BASE, "model": {"preset": "tiny-deepseek-v3", "dtype": "bfloat16"},
                                            "trainer": {**BASE["trainer"], "algorithm": "ppo", "activation_checkpointing": ac}})
            model, mesh, ep = sharded_trainer(cfg)
            critic = build_critic_parts(cfg, None, ep, mesh, torch.device("cpu"))
            applied, stats = train_step(cfg, model, torch.optim.AdamW(model.parameters(), lr=1e-4),
                                        collate_groups(fake_groups(3)), pad_id=0, critic=critic)
            assert applied and stats["critic_grad_norm"] > 0, ac
    finally:
        dist.destroy_process_group()


# ------------------------------------------------------------------------------------------
# Publishing without a shared disk


def _publish_worker(rank: int, world: int, port: int, root: str) -> None:
    join_world(rank, world, port)
    from app.storage import open_store
    from app.trainer.publish import plan_version, publish_version

    cfg = RunConfig.model_validate({**BASE, "model": {"preset": "tiny-deepseek-v3"},
                                    "trainer": {**BASE["trainer"], "parallel": {"ep": 2}}})
    model, mesh, _ = sharded_trainer(cfg)
    plan = plan_version(model, mesh, torch.float32, max_shard_bytes=200_000)
    assert set(plan.owners) == set(range(world))  # both ranks write files
    store = open_store(f"file://{root}/store")
    # Each rank's own scratch directory: nothing is shared between the "pods" but the store.
    uri, _ = publish_version(model, mesh, 0, store=store, run_id="pub", work_dir=Path(root) / f"pod{rank}",
                             keep=2, dtype=torch.float32, max_shard_bytes=200_000)
    assert not list((Path(root) / f"pod{rank}").rglob("*.safetensors"))  # uploaded, then removed
    dist.barrier()
    dist.destroy_process_group()


def test_a_bf16_version_keeps_the_fp32_routing_bias_and_no_quantization_config(tmp_path):
    """What is published is what is trained: DeepSeek-V3's routing bias goes out in fp32 (the
    engines add it to the router's scores), every parameter in the publish dtype, and a
    quantization_config inherited from an FP8 source is not copied over bf16 weights."""
    import json

    from safetensors import safe_open

    from app.model.config import tiny_config
    from app.model.parallel import EPContext
    from app.model.policy import build_policy
    from app.storage import open_store
    from app.storage.policy import download_policy
    from app.trainer.publish import publish_version

    model = build_policy(tiny_config("tiny-deepseek-v3"), RunConfig().router, EPContext.local(), seed=0)
    with torch.no_grad():
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.linspace(-1e-3, 1e-3, b.numel()) + 1.0)  # not representable in bf16
    model.config.quantization_config = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}
    store = open_store(f"file://{tmp_path}/store")
    publish_version(model, None, 0, store=store, run_id="bf16", work_dir=tmp_path / "w", keep=1, dtype=torch.bfloat16)
    local = download_policy(store, "bf16", 0, tmp_path / "v0")
    assert "quantization_config" not in json.loads((local / "config.json").read_text())
    dtypes = {}
    for f in local.glob("*.safetensors"):
        with safe_open(f, "pt") as st:
            dtypes.update({k: st.get_slice(k).get_dtype() for k in st.keys()})
    biases = {k: v for k, v in dtypes.items() if k.endswith("e_score_correction_bias")}
    assert biases and set(biases.values()) == {"F32"}
    assert {v for k, v in dtypes.items() if k not in biases} == {"BF16"}
    from transformers import AutoModelForCausalLM

    stock = AutoModelForCausalLM.from_pretrained(local)  # refused with an FP8 quantization_config
    want = dict(model.named_buffers())
    for k in biases:
        assert torch.equal(stock.state_dict()[k], want[k]), k


def test_two_ranks_publish_a_version_stock_transformers_loads(tmp_path):
    from transformers import AutoModelForCausalLM

    from app.model.config import tiny_config
    from app.model.parallel import EPContext
    from app.model.policy import build_policy
    from app.storage import open_store
    from app.storage.policy import download_policy, latest_policy_version

    spawn(_publish_worker, 2, str(tmp_path))
    store = open_store(f"file://{tmp_path}/store")
    assert latest_policy_version(store, "pub") == 0
    local = download_policy(store, "pub", 0, tmp_path / "v0")
    assert len(list(local.glob("model-*.safetensors"))) > 2
    stock = AutoModelForCausalLM.from_pretrained(local, dtype=torch.float32).eval()
    ours = build_policy(tiny_config("tiny-deepseek-v3"), RunConfig().router, EPContext.local(), seed=0).eval()
    ids = torch.tensor([[1, 5, 9, 13, 7, 3]])
    with torch.no_grad():
        torch.testing.assert_close(stock(input_ids=ids).logits, ours(input_ids=ids).logits, atol=1e-5, rtol=1e-4)
