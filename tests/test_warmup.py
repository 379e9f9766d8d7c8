"""`moerl warmup`: a few supervised steps lower the loss and write a checkpoint stock transformers loads."""

from __future__ import annotations

import json

import pytest
import torch

from app.config import RunConfig, TaskConfig
from app.envs.evaluate import evaluate, evaluate_checkpoint, generate
from app.envs.tasks import make_splits
from app.model.tokenizer import EOS_ID, build_tokenizer
from app.envs.warmup import lr_at, run_warmup, sft_batch


def small_config(**task) -> RunConfig:
    fields = dict(train_size=64, eval_size=8, warmup_steps=40, warmup_batch_size=16) | task
    return RunConfig(task=TaskConfig(**fields))


def test_sft_batch_masks_answer_and_eos_only():
    tok = build_tokenizer()
    train, _ = make_splits(small_config().task)
    ids, attn, mask = sft_batch(train[:3], tok)
    for i, p in enumerate(train[:3]):
        n_prompt = len(p.text) + 1  # <bos> + characters
        n_answer = len(p.answer) + 1  # characters + <eos>
        assert int(attn[i].sum()) == n_prompt + n_answer
        assert mask[i, :n_prompt].sum() == 0 and mask[i, n_prompt : n_prompt + n_answer].sum() == n_answer
        assert ids[i, n_prompt + n_answer - 1] == EOS_ID
        assert tok.decode(ids[i, n_prompt : n_prompt + n_answer - 1].tolist()) == p.answer


def test_lr_schedule_warms_up_then_decays():
    lrs = [lr_at(s, 100, 1e-3) for s in range(100)]
    assert lrs[0] < lrs[19] and max(lrs) <= 1e-3
    assert lrs[-1] < lrs[20] and lrs[-1] >= 1e-4 * 0.99


def test_warmup_lowers_loss_and_writes_a_stock_loadable_checkpoint(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cfg = small_config()
    out = tmp_path / "base"
    summary = run_warmup(cfg, out, threads=1, log=lambda msg: None)
    assert summary["last_loss"] < 0.7 * summary["first_loss"]
    assert json.loads((out / "warmup.json").read_text())["steps"] == 40
    assert 0.0 <= summary["heldout"]["sampled"] <= 1.0

    model = AutoModelForCausalLM.from_pretrained(str(out))
    tok = AutoTokenizer.from_pretrained(str(out))
    assert type(model).__name__ == "Qwen3MoeForCausalLM"
    assert tok.eos_token_id == EOS_ID
    train, held = make_splits(cfg.task)
    # the stock model gives the same held-out evaluation as the warm-up's in-memory model did
    res = evaluate_checkpoint(out, held, temperature=cfg.rollout.temperature, max_new_tokens=cfg.rollout.max_new_tokens)
    assert res.sampled == pytest.approx(summary["heldout"]["sampled"], abs=1e-6)
    assert res.greedy == pytest.approx(summary["heldout"]["greedy"], abs=1e-6)
    # and its loss on training examples is below that of an untrained model of the same config
    ids, attn, mask = sft_batch(train[:16], tok)
    fresh = AutoModelForCausalLM.from_config(model.config)
    from app.envs.warmup import sft_loss

    with torch.no_grad():
        assert sft_loss(model, ids, attn, mask) < sft_loss(fresh, ids, attn, mask)

    # a warm-up can continue from a checkpoint (model.path): it starts where the first one ended
    more = small_config(warmup_steps=5)
    more.model.path = str(out)
    again = run_warmup(more, tmp_path / "again", threads=1, log=lambda msg: None)
    assert again["first_loss"] < 0.7 * summary["first_loss"]
    assert (tmp_path / "again" / "tokenizer.json").is_file()


def test_evaluate_restores_mode_and_greedy_is_deterministic():
    from app.envs.warmup import build_base_policy

    cfg = small_config()
    _, held = make_splits(cfg.task)
    model = build_base_policy(cfg)
    model.train()
    tok = build_tokenizer()
    a = evaluate(model, tok, held, temperature=1.0, max_new_tokens=4)
    b = evaluate(model, tok, held, temperature=1.0, max_new_tokens=4)
    assert model.training
    assert a == b  # seeded sampling
    assert generate(model, tok, ["ab="], 0.0, 4) == generate(model, tok, ["ab="], 0.0, 4)
    with pytest.raises(ValueError, match="eval_size"):
        evaluate(model, tok, [], 1.0, 4)
    with pytest.raises(ValueError, match="samples"):
        evaluate(model, tok, held, 1.0, 4, samples=0)


def test_warmup_rejects_a_file_as_out(tmp_path):
    target = tmp_path / "file"
    target.write_text("x")
    with pytest.raises(ValueError, match="--out"):
        run_warmup(small_config(), target, log=lambda msg: None)
    assert target.read_text() == "x"


def test_warmup_refuses_a_non_empty_directory_that_is_not_a_checkpoint(tmp_path):
    from app.config import RunConfig
    from app.envs.warmup import run_warmup

    out = tmp_path / "precious"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    with pytest.raises(ValueError, match="not empty"):
        run_warmup(RunConfig(), out)
    assert (out / "notes.txt").read_text() == "keep me"


class _Wider:  # the same config, other problems: the secret now in 1..30
    def reset(self, *args, **kwargs):
        obs = super().reset(*args, **kwargs)
        obs.message = "1-30?"
        return obs


class _TenTimes:  # the same problems and reset observations, 10x the reward
    def step(self, *args, **kwargs):
        obs = super().step(*args, **kwargs)
        obs.reward = 10 * (obs.reward or 0.0)
        return obs


@pytest.mark.parametrize("change", [_Wider, _TenTimes], ids=["problems", "rewards"])
def test_the_warm_up_cache_follows_what_the_environment_serves(tmp_path, change):
    """Keyed on the config alone, a changed environment (the secret's range) was served the old
    warm-up ("warm-up: reusing ..."; a user's RL then started from 0.049 instead of 0.424); a
    server that paid 10x was served the old warm-up and its "before RL" figure, and the reward
    range it broke was found only after start. The key holds what the warm-up sees: the problems,
    the server's reset observations and (env.demos_from_env) its answers to the first demonstrations."""
    from openenv.core.env_server import create_fastapi_app

    from app.local.run import warmup_dir
    from examples.guess_number.env import GuessAction, GuessNumberEnv, GuessObservation
    from helpers import EnvServer

    changed = type("Changed", (change, GuessNumberEnv), {})
    servers = [EnvServer(app=create_fastapi_app(cls, GuessAction, GuessObservation, max_concurrent_envs=8))
               for cls in (GuessNumberEnv, changed)]
    try:
        cfg = RunConfig.model_validate({"task": {"source": "env", "train_size": 20, "eval_size": 4},
                                        "env": {"name": "guess-number", "url": servers[0].url, "demos_from_env": True}})
        first, again, other = (warmup_dir(cfg, tmp_path, s.url) for s in (servers[0], servers[0], servers[1]))
        assert first == again != other
        cfg.task.seed = 1  # other problems of the same environment
        assert warmup_dir(cfg, tmp_path, servers[0].url) not in (first, other)
    finally:
        for s in servers:
            s.stop()
