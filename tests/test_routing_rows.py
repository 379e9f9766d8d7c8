"""Routing replay at DeepSeek-V3 size (issue 26 item 8): what the worker asks the engine for and
the rows it keeps.

SGLang 0.5.23 reports a row per decoder layer for every token fed, ``[routed_experts_start_len,
prompt + completion - 1)`` (``GenerateReqInput.routed_experts_start_len``, an int in [0, prompt
tokens]), dense layers included (zeros). Against the built-in engine, which reports them the
same way, on a model whose first layer is dense (as DeepSeek-V3's first three are): the worker
asks for the prompt's rows once per group (a one-token request) and for each sample's own rows
only (start = P), and keeps the MoE layers' rows: ``[P + C - 1, moe_layers, K]``, equal to the
engine's full report at those layers. Before, every sample carried the prompt's rows again and
every layer's (61 x 8 int32 per token at DeepSeek-V3 size).
"""

from __future__ import annotations

import asyncio
import base64

import numpy as np
import torch

from app.buffer.records import Task
from app.model.tokenizer import BOS_ID
from app.rollout.engine_client import EngineClient
from app.engine.load import load_checkpoint
from app.engine.scheduler import Engine
from app.engine.server import create_app
from app.rollout.worker import RolloutWorker
from helpers import Recorder
from sglang_oracle import io_struct_fields
from test_worker import make_config

G = 4


def dense_first_checkpoint(out):
    """A tiny Qwen3-MoE of 3 layers whose layer 0 is a dense MLP (mlp_only_layers), 4 experts top-2."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from app.model.tokenizer import EOS_ID, PAD_ID, VOCAB_SIZE, save_tokenizer

    torch.manual_seed(3)
    cfg = Qwen3MoeConfig(
        vocab_size=VOCAB_SIZE, hidden_size=32, intermediate_size=64, moe_intermediate_size=32, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=2,
        max_position_embeddings=128, mlp_only_layers=[0], pad_token_id=PAD_ID, bos_token_id=BOS_ID,
        eos_token_id=EOS_ID)
    Qwen3MoeForCausalLM(cfg).save_pretrained(out)
    save_tokenizer(out)
    return out


def test_the_worker_asks_for_the_prompt_once_and_keeps_the_moe_layers(tmp_path):
    ckpt = dense_first_checkpoint(tmp_path / "m")
    cfg = make_config(tmp_path, "redis://127.0.0.1:1/0", "http://engine", routing_replay=True, max_new_tokens=12)
    cfg.model.path = str(ckpt)
    prompt = [BOS_ID, 21, 30, 22, 31]
    task = Task(task_id="train-0001", prompt_ids=prompt, prompt="p", answer="{}", group_size=G)

    async def go():
        engine = Engine(load_checkpoint(ckpt), weight_version="0", max_batch=8, capture_routing=True)
        recorder = Recorder(create_app(engine, health_timeout_s=0.5))
        await engine.start()
        try:
            async with EngineClient("http://engine", transport=recorder, retries=0) as client:
                worker = RolloutWorker(cfg, None, client, "w-rows", score_fn=lambda t, c: 1.0)
                samples = await worker.rollout(task)
                full = await client.generate(prompt, max_new_tokens=1, temperature=0.0, return_routed_experts=True)
                return samples, recorder.calls, full[0]
        finally:
            await engine.stop()

    samples, calls, full = asyncio.run(go())
    asks = [sent for path, sent, _, _ in calls if path == "/generate"][:2]
    # what SGLang's request type takes, and how the worker uses it
    assert io_struct_fields("GenerateReqInput")["routed_experts_start_len"] == "int"
    head, group = asks
    assert head["sampling_params"]["max_new_tokens"] == 1 and "n" not in head["sampling_params"]
    assert head.get("routed_experts_start_len", 0) == 0 and head["return_routed_experts"] is True
    assert group["sampling_params"]["n"] == G and group["routed_experts_start_len"] == len(prompt)
    # the engine sent each sample's own rows only: C - 1 of 3 layers
    group_answer = next(got for path, sent, _, got in calls if sent is group)
    for item in group_answer:
        rows = np.frombuffer(base64.b64decode(item["meta_info"]["routed_experts"]), dtype=np.int32)
        assert rows.size == (len(item["output_ids"]) - 1) * 3 * 2
    # kept: every token fed, the two MoE layers, equal to the engine's report at those layers
    engine_prompt = full.routed_experts.reshape(len(prompt), 3, 2)
    assert not engine_prompt[:, 0].any()  # the dense layer's row: zeros, not kept
    for s in samples:
        ids = np.asarray(s.routed_experts)  # Sample.routed_experts: the MoE layers' [P + C - 1, n_moe, K] array
        assert ids.shape == (len(prompt) + len(s.completion_ids) - 1, 2, 2)
        np.testing.assert_array_equal(ids[: len(prompt)], engine_prompt[:, 1:])
        assert ids.min() >= 0 and ids.max() < 4
