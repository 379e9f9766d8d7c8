"""The engine's checkpoint loader refuses weights that do not fit the config, before serving."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from app.config import RouterConfig
from app.model.checkpoint import save_policy
from app.model.config import tiny_config
from app.model.parallel import EPContext
from app.model.policy import build_policy
from app.engine.load import load_checkpoint


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("ck") / "policy"
    model = build_policy(tiny_config("tiny-qwen3-moe"), RouterConfig(), EPContext.local(), seed=0)
    save_policy(model, out, EPContext.local())
    return out


def edited(src: Path, dst: Path, **config) -> Path:
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((src / "config.json").read_text())
    cfg.update(config)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def test_loads_a_good_checkpoint(checkpoint):
    loaded = load_checkpoint(checkpoint)
    assert loaded.vocab_size == tiny_config("tiny-qwen3-moe").vocab_size
    assert all(not torch.isnan(p).any() for p in loaded.model.parameters())


def test_other_architecture_with_these_weights_is_refused(checkpoint, tmp_path):
    # A dense llama config over MoE weights: transformers would fill the MLPs with random weights.
    bad = edited(checkpoint, tmp_path / "arch", model_type="llama", architectures=["LlamaForCausalLM"],
                 intermediate_size=64)
    with pytest.raises(ValueError, match="weights do not match config.json.*missing_keys"):
        load_checkpoint(bad)


def test_invalid_policy_config_is_refused_with_the_field_named(checkpoint, tmp_path):
    bad = edited(checkpoint, tmp_path / "topk", num_experts_per_tok=16)
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        load_checkpoint(bad)


def test_wrong_shape_names_the_tensor(checkpoint, tmp_path):
    bad = edited(checkpoint, tmp_path / "shape", hidden_size=128)
    with pytest.raises(ValueError, match=r"tensor model\.\S+ has shape"):
        load_checkpoint(bad)


@pytest.mark.parametrize("params, field", [
    ({"ignore_eos": "false"}, "ignore_eos"),
    ({"temperature": "hot"}, "temperature"),
    ({"max_new_tokens": True}, "max_new_tokens"),
    ({"n": 10**9}, ".n"),
    ({"stop_token_ids": [2, True]}, "stop_token_ids"),
])
def test_generate_params_are_type_checked_not_coerced(checkpoint, params, field):
    from app.engine.server import BadRequest, parse_generate

    loaded = load_checkpoint(checkpoint)
    with pytest.raises(BadRequest, match=field):
        parse_generate({"input_ids": [1, 20, 30], "sampling_params": params}, loaded)


def test_return_logprob_must_be_a_boolean(checkpoint):
    from app.engine.server import BadRequest, parse_generate

    loaded = load_checkpoint(checkpoint)
    with pytest.raises(BadRequest, match="return_logprob"):
        parse_generate({"input_ids": [1, 20, 30], "return_logprob": "no"}, loaded)
    *_, logprob = parse_generate({"input_ids": [1, 20, 30], "return_logprob": True}, loaded)
    assert logprob is True


def test_a_new_version_of_the_served_model_skips_the_checks_not_the_weights(checkpoint, tmp_path, monkeypatch):
    """A weight update whose config and tensor headers equal the served checkpoint's skips the
    policy checks (they passed already) and reuses the tokenizer; its weights are the new ones.
    A checkpoint that differs in any of those is checked in full."""
    import app.engine.load as load_mod
    from safetensors.torch import load_file, save_file

    from app.model.tokenizer import save_tokenizer

    v1 = edited(checkpoint, tmp_path / "v1")
    save_tokenizer(v1)
    served = load_checkpoint(v1)
    assert served.signature is not None and served.tokenizer is not None
    v2 = edited(v1, tmp_path / "v2")
    for f in v2.glob("*.safetensors"):
        save_file({k: t + 0.5 for k, t in load_file(f).items()}, f, metadata={"format": "pt"})

    def refuse(*a, **k):
        raise AssertionError("check_checkpoint ran for an unchanged structure")

    monkeypatch.setattr(load_mod, "check_checkpoint", refuse)
    new = load_checkpoint(v2, like=served)
    assert new.tokenizer is served.tokenizer and new.signature == served.signature
    embed = "model.embed_tokens.weight"
    assert torch.allclose(new.model.state_dict()[embed], served.model.state_dict()[embed] + 0.5)
    # Different headers (a shape changed): the checks run, and refuse the tensor by name.
    monkeypatch.undo()
    bad = edited(checkpoint, tmp_path / "shape", hidden_size=128)
    with pytest.raises(ValueError, match=r"tensor model\.\S+ has shape"):
        load_checkpoint(bad, like=served)

