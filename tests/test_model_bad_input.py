"""Bad model input fails at once with one clear error naming the field, file or tensor, and
nothing already written is lost."""

from __future__ import annotations

import copy
import json
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

import app.model.checkpoint as ckpt
from app.config import RouterConfig
from app.model.checkpoint import INDEX_NAME, load_policy, save_policy
from app.model.config import tiny_config, validate_config
from app.model.parallel import EPContext
from app.model.policy import build_policy, moe_blocks, routing_replay

LOCAL = EPContext.local()


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)


def _with(preset: str, **fields):
    config = tiny_config(preset)
    for k, v in fields.items():
        setattr(config, k, v)
    return config


@pytest.mark.parametrize(
    "preset, fields, ep_size, message",
    [
        ("tiny-qwen3-moe", {}, 3, r"config\.num_experts \(8\) is not divisible by trainer\.parallel\.ep \(3\)"),
        ("tiny-deepseek-v3", {}, 3, r"config\.n_routed_experts \(8\) is not divisible by trainer\.parallel\.ep \(3\)"),
        ("tiny-qwen3-moe", {"num_experts_per_tok": 9}, 1, r"config\.num_experts_per_tok \(9\)"),
        ("tiny-deepseek-v3", {"num_experts_per_tok": 9}, 1, r"config\.num_experts_per_tok \(9\)"),
        ("tiny-deepseek-v3", {"n_group": 3}, 1, r"config\.n_group \(3\) does not divide"),
        ("tiny-deepseek-v3", {"n_group": 8, "topk_group": 4}, 1, r"config\.n_group \(8\) leaves 1 expert"),
        ("tiny-deepseek-v3", {"topk_group": 5}, 1, r"config\.topk_group \(5\)"),
        ("tiny-deepseek-v3", {"topk_group": 1, "num_experts_per_tok": 3}, 1, r"config\.num_experts_per_tok \(3\) exceeds"),
        ("tiny-deepseek-v3", {"first_k_dense_replace": 4}, 1, r"config\.first_k_dense_replace \(4\)"),
        ("tiny-qwen3-moe", {"num_key_value_heads": 3}, 1, r"config\.num_key_value_heads \(3\)"),
        ("tiny-qwen3-moe", {}, 0, r"trainer\.parallel\.ep"),
        # Router settings the router does not implement (DeepSeek-V2's softmax / greedy routing).
        ("tiny-deepseek-v3", {"scoring_func": "softmax"}, 1,
         r"config\.scoring_func: 'softmax' is not implemented by the deepseek_v3 router .* 'sigmoid'"),
        ("tiny-deepseek-v3", {"topk_method": "group_limited_greedy"}, 1,
         r"config\.topk_method: 'group_limited_greedy' is not implemented .* 'noaux_tc'"),
        ("tiny-deepseek-v3", {"topk_method": "greedy"}, 1, r"config\.topk_method: 'greedy'"),
        ("tiny-qwen3-moe", {"scoring_func": "sigmoid"}, 1,
         r"config\.scoring_func: 'sigmoid' is not implemented by the qwen3_moe router"),
        ("tiny-qwen3-moe", {"topk_method": "noaux_tc"}, 1, r"config\.topk_method: 'noaux_tc'"),
        ("tiny-qwen3-moe", {"n_group": 4}, 1, r"config\.n_group: 4 is not implemented by the qwen3_moe router"),
        ("tiny-qwen3-moe", {"topk_group": 2}, 1, r"config\.topk_group: 2"),
        ("tiny-qwen3-moe", {"routed_scaling_factor": 2.5}, 1, r"config\.routed_scaling_factor: 2\.5"),
        # Sizes: zero or negative widths would build empty tensors or divide by zero later.
        ("tiny-qwen3-moe", {"hidden_size": 0}, 1, r"config\.hidden_size: must be a positive integer, got 0"),
        ("tiny-qwen3-moe", {"vocab_size": -3}, 1, r"config\.vocab_size: must be a positive integer, got -3"),
        ("tiny-qwen3-moe", {"num_hidden_layers": 0}, 1, r"config\.num_hidden_layers: must be a positive"),
        ("tiny-qwen3-moe", {"num_attention_heads": 0}, 1, r"config\.num_attention_heads: must be a positive"),
        ("tiny-qwen3-moe", {"head_dim": 0}, 1, r"config\.head_dim: must be a positive"),
        ("tiny-qwen3-moe", {"moe_intermediate_size": 0}, 1, r"config\.moe_intermediate_size: must be a positive"),
        ("tiny-deepseek-v3", {"intermediate_size": -1}, 1, r"config\.intermediate_size: must be a positive"),
        ("tiny-deepseek-v3", {"kv_lora_rank": 0}, 1, r"config\.kv_lora_rank: must be a positive"),
        ("tiny-deepseek-v3", {"qk_rope_head_dim": 0}, 1, r"config\.qk_rope_head_dim: must be a positive"),
    ],
)
def test_validate_config_names_the_field(preset, fields, ep_size, message):
    config = _with(preset, **fields)
    with pytest.raises(ValueError, match=message):
        validate_config(config, ep_size)


def test_router_settings_the_router_implements_pass():
    validate_config(_with("tiny-deepseek-v3", scoring_func="sigmoid", topk_method="noaux_tc"), 1)  # DeepSeek-V3's own
    validate_config(_with("tiny-qwen3-moe", scoring_func="softmax", n_group=1, routed_scaling_factor=1.0), 1)


@pytest.mark.parametrize("preset, field, value", [("tiny-deepseek-v3", "scoring_func", "softmax"),
                                                  ("tiny-qwen3-moe", "n_group", 8)])
def test_router_setting_in_config_json_is_refused(tmp_path, preset, field, value):
    """transformers' config classes do not declare these fields but keep them from config.json."""
    model = build_policy(tiny_config(preset), RouterConfig(), LOCAL)
    out = save_policy(model, tmp_path / "c", LOCAL)
    config = json.loads((out / "config.json").read_text())
    config[field] = value
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=rf"config\.json: config\.{field}: {value!r} is not implemented"):
        ckpt.check_checkpoint(out)
    with pytest.raises(ValueError, match=rf"config\.{field}"):
        load_policy(out, RouterConfig(), LOCAL)


def test_config_json_field_of_the_wrong_type_names_file_and_field(tmp_path):
    """transformers 5 checks field types when it reads config.json (huggingface_hub's strict
    dataclasses); that error is not a ValueError and must not escape as a traceback."""
    from app.model.config import load_hf_config

    config = tiny_config("tiny-qwen3-moe").to_dict()
    config["num_hidden_layers"] = "two"
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"config\.json: not a readable Hugging Face config: .*num_hidden_layers"):
        load_hf_config(tmp_path)


def test_unknown_preset_and_model_type():
    with pytest.raises(ValueError, match="model.preset"):
        tiny_config("tiny-llama")
    config = copy.deepcopy(tiny_config("tiny-qwen3-moe"))
    config.model_type = "llama"
    with pytest.raises(ValueError, match="config.model_type"):
        validate_config(config, 1)


def test_build_policy_rejects_bad_ep_before_building():
    ep3 = EPContext(group=None, rank=0, size=3, backend="alltoall")  # never reaches torch.distributed
    with pytest.raises(ValueError, match=r"num_experts \(8\) is not divisible by trainer\.parallel\.ep \(3\)"):
        build_policy(tiny_config("tiny-qwen3-moe"), RouterConfig(), ep3)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A small sharded checkpoint; tests copy it before breaking it."""
    root = tmp_path_factory.mktemp("ckpt")
    model = build_policy(tiny_config("tiny-qwen3-moe"), RouterConfig(), LOCAL)
    return save_policy(model, root / "good", LOCAL, max_shard_bytes=40_000)


@pytest.fixture
def ckpt_copy(saved, tmp_path):
    return shutil.copytree(saved, tmp_path / "c")


def _rewrite_shard(directory, key, edit):
    """Rewrite the shard holding ``key`` with ``edit(tensors)`` applied; returns the shard name."""
    name = json.loads((directory / INDEX_NAME).read_text())["weight_map"][key]
    with safe_open(directory / name, framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    edit(tensors)
    save_file(tensors, directory / name, metadata={"format": "pt"})
    return name


def test_missing_config_json(ckpt_copy):
    (ckpt_copy / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match=r"config\.json"):
        load_policy(ckpt_copy, RouterConfig(), LOCAL)


def test_missing_shard(ckpt_copy):
    shard = sorted(ckpt_copy.glob("model-*.safetensors"))[-1]
    shard.unlink()
    with pytest.raises(FileNotFoundError, match=shard.name):
        load_policy(ckpt_copy, RouterConfig(), LOCAL)


def test_no_weights_at_all(ckpt_copy):
    for f in ckpt_copy.glob("model*"):
        f.unlink()
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        load_policy(ckpt_copy, RouterConfig(), LOCAL)


def test_wrong_tensor_shape_names_tensor_and_file(ckpt_copy):
    key = "model.layers.1.mlp.experts.5.down_proj.weight"
    name = _rewrite_shard(ckpt_copy, key, lambda t: t.__setitem__(key, torch.zeros(64, 31)))
    with pytest.raises(ValueError, match=rf"{name}: tensor {key} has shape \[64, 31\], config expects \[64, 32\]"):
        load_policy(ckpt_copy, RouterConfig(), LOCAL)


def test_config_disagreeing_with_weights(ckpt_copy):
    config = json.loads((ckpt_copy / "config.json").read_text())
    config["moe_intermediate_size"] = 48
    (ckpt_copy / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"tensor model\.layers\.0\.mlp\.experts\.0\.gate_proj\.weight has shape"):
        load_policy(ckpt_copy, RouterConfig(), LOCAL)


def test_missing_and_unexpected_tensor_names(ckpt_copy):
    key = "model.layers.0.mlp.experts.7.up_proj.weight"
    bad = "model.layers.0.mlp.experts.7.upp_proj.weight"

    def rename(t):
        t[bad] = t.pop(key)

    _rewrite_shard(ckpt_copy, key, rename)
    with pytest.raises(ValueError, match=rf"tensor {key} is listed in {INDEX_NAME} but not in this shard"):
        load_policy(ckpt_copy, RouterConfig(), LOCAL)
    index = json.loads((ckpt_copy / INDEX_NAME).read_text())
    index["weight_map"][bad] = index["weight_map"].pop(key)
    (ckpt_copy / INDEX_NAME).write_text(json.dumps(index))
    with pytest.raises(ValueError, match=rf"tensor {key} is missing from the checkpoint"):
        load_policy(ckpt_copy, RouterConfig(), LOCAL)


def test_unknown_quantization_method_is_refused(ckpt_copy):
    config = json.loads((ckpt_copy / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4}
    (ckpt_copy / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"config\.json: quantization_config\.quant_method 'gptq' is not supported"):
        load_policy(ckpt_copy, RouterConfig(), LOCAL)


def test_extra_tensor_is_rejected(ckpt_copy):
    key = "model.norm.weight"
    name = _rewrite_shard(ckpt_copy, key, lambda t: t.__setitem__("model.layers.0.mlp.bogus", torch.ones(2)))
    index = json.loads((ckpt_copy / INDEX_NAME).read_text())
    index["weight_map"]["model.layers.0.mlp.bogus"] = name
    (ckpt_copy / INDEX_NAME).write_text(json.dumps(index))
    with pytest.raises(ValueError, match=r"tensor model\.layers\.0\.mlp\.bogus does not belong"):
        load_policy(ckpt_copy, RouterConfig(), LOCAL)


def test_checkpoint_experts_not_divisible_by_ep(saved):
    ep3 = EPContext(group=None, rank=0, size=3, backend="alltoall")
    with pytest.raises(ValueError, match=r"config\.json: config\.num_experts \(8\) is not divisible by trainer\.parallel\.ep \(3\)"):
        load_policy(saved, RouterConfig(), ep3)


def test_save_refuses_to_clobber_and_failed_save_leaves_nothing(saved, tmp_path, monkeypatch):
    model = build_policy(tiny_config("tiny-qwen3-moe"), RouterConfig(), LOCAL, seed=9)
    before = {p.name: p.read_bytes() for p in saved.iterdir()}
    with pytest.raises(FileExistsError, match="already exists"):
        save_policy(model, saved, LOCAL)
    assert {p.name: p.read_bytes() for p in saved.iterdir()} == before

    calls = []

    def failing_save_file(tensors, path, metadata=None):
        calls.append(path)
        if len(calls) == 2:
            raise OSError("disk full")
        return save_file(tensors, path, metadata=metadata)

    monkeypatch.setattr(ckpt, "save_file", failing_save_file)
    with pytest.raises(OSError, match="disk full"):
        save_policy(model, tmp_path / "new", LOCAL, max_shard_bytes=40_000)
    assert list(tmp_path.iterdir()) == []  # neither the target nor the partial directory remain
    with pytest.raises(OSError, match="disk full"):
        calls.clear()
        save_policy(model, saved, LOCAL, max_shard_bytes=40_000, overwrite=True)
    assert {p.name: p.read_bytes() for p in saved.iterdir()} == before  # old checkpoint intact


def test_routing_replay_rejects_bad_indices():
    model = build_policy(tiny_config("tiny-qwen3-moe"), RouterConfig(), LOCAL)
    good = torch.zeros(2, 6, 2, dtype=torch.long)
    cases = [
        ([good], r"got 1 layers, the model has 2 MoE layers"),
        ({0: good, 5: good}, r"keys \[0, 5\] must be the MoE layer indices \[0, 1\]"),
        ([good, torch.zeros(2, 6, 3, dtype=torch.long)], r"topk_per_layer\[1\]: shape \(2, 6, 3\)"),
        ([good, good.float()], r"topk_per_layer\[1\]: must be an integer tensor"),
        ([good, good + 8], r"topk_per_layer\[1\]: expert ids must lie in \[-1, 8\)"),
    ]
    for arg, message in cases:
        with pytest.raises(ValueError, match=message):
            with routing_replay(model, arg):
                pass
        assert all(block.replay_topk_idx is None for _, block in moe_blocks(model))
