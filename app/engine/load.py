"""The built-in engine's checkpoint loader: a Hugging Face checkpoint directory read with stock
``transformers.AutoModelForCausalLM`` (plus its tokenizer), after the trainer's own checks for
the policy families app/model builds; a later version of the same model skips the checks and
reuses the tokenizer (`load_checkpoint`'s ``like``)."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer

from app.model.checkpoint import check_checkpoint


@dataclass
class LoadedModel:
    """A checkpoint in memory: the model, its tokenizer (or None) and special ids."""

    path: str
    model: torch.nn.Module
    tokenizer: Any
    pad_id: int
    eos_ids: list[int]
    vocab_size: int
    max_positions: int
    # What the checks of `load_checkpoint` looked at (`checkpoint_signature`), and a digest of
    # the tokenizer files: a later version with the same ones skips those checks and reuses
    # the tokenizer (see `load_checkpoint`'s ``like``).
    signature: tuple | None = None
    tokenizer_digest: str | None = None


# config.json model_type values of the policies app/model builds (checked like the trainer does).
POLICY_MODEL_TYPES = ("qwen3_moe", "deepseek_v3")


def checkpoint_signature(path: Path) -> tuple | None:
    """config.json (parsed) and every tensor's (name, dtype, shape) from the safetensors
    headers of ``path``: all that `check_checkpoint` decides on. None if a file cannot be read
    (the full checks then run and name the problem)."""
    try:
        config = json.loads((path / "config.json").read_text())
        tensors = []
        for f in sorted(path.glob("*.safetensors")):
            with safe_open(str(f), "pt") as h:
                tensors += [(k, h.get_slice(k).get_dtype(), tuple(h.get_slice(k).get_shape())) for k in h.keys()]
    except Exception:  # noqa: BLE001 - unreadable or torn: the full checks name what is wrong
        return None
    return json.dumps(config, sort_keys=True), tuple(sorted(tensors))


def _tokenizer_digest(path: Path) -> str | None:
    files = [path / n for n in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")]
    if not any(f.is_file() for f in files):
        return None
    h = hashlib.sha256()
    for f in files:
        h.update(f.read_bytes() if f.is_file() else b"-")
    return h.hexdigest()


def load_checkpoint(path: str | Path, device: str = "cpu", dtype: str = "float32",
                    like: LoadedModel | None = None) -> LoadedModel:
    """Load an HF checkpoint directory with stock transformers (and its tokenizer if present).

    Args:
        path: directory with config.json and *.safetensors (a published policy version).
        device: "cpu", "cuda" or "cuda:N".
        dtype: "float32", "bfloat16" or "auto" (the checkpoint's own dtype).
        like: the checkpoint served now. A new version with the same `checkpoint_signature`
            (config and every tensor's name, dtype and shape) passed the policy checks already
            and skips them, and identical tokenizer files reuse its tokenizer: a weight update
            of the same model then costs the weight load alone. transformers still refuses
            missing, unexpected or mis-shaped weights.

    Raises:
        FileNotFoundError: ``path`` is not a directory with a config.json, or a shard is missing.
        ValueError: the config is invalid, or a tensor is missing, unexpected or of the wrong
            shape (named); OSError: transformers cannot read the files.
    """
    path = Path(path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"model_path {str(path)!r}: no config.json (expected an HF checkpoint dir)")
    torch_dtype = "auto" if dtype == "auto" else getattr(torch, dtype)
    model_type = json.loads((path / "config.json").read_text()).get("model_type")
    signature = checkpoint_signature(path)
    same = like is not None and signature is not None and signature == like.signature
    if model_type in POLICY_MODEL_TYPES and not same:
        # Our policy families: the trainer's own checks (config fields, shards, every tensor's
        # name and shape) before anything is loaded, with the offending field or tensor named.

        check_checkpoint(path)
    # use_kernels=False: transformers would otherwise swap layers for kernels fetched from the Hub at
    # load time (it needs the kernels package and, on a GPU, the Hub; the layers
    # would differ from the trainer's). Every from_pretrained of a model in app/ passes it.
    model, info = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch_dtype, output_loading_info=True,
                                                       use_kernels=False)
    problems = {k: v for k, v in info.items() if k in ("missing_keys", "unexpected_keys", "mismatched_keys") and v}
    if problems:
        # transformers would fill missing weights with random ones and serve nonsense.
        detail = "; ".join(f"{k}: {sorted(map(str, v))[:3]}" for k, v in problems.items())
        raise ValueError(f"model_path {str(path)!r}: weights do not match config.json ({detail})")
    model = model.to(device).eval()
    digest = _tokenizer_digest(path)
    if same and digest is not None and digest == like.tokenizer_digest:
        tokenizer = like.tokenizer
    else:
        tokenizer = AutoTokenizer.from_pretrained(str(path)) if (path / "tokenizer.json").is_file() or (
            path / "tokenizer_config.json"
        ).is_file() else None
    cfg = model.config
    eos = getattr(model.generation_config, "eos_token_id", None) if model.generation_config else None
    if eos is None:
        eos = cfg.eos_token_id if cfg.eos_token_id is not None else getattr(tokenizer, "eos_token_id", None)
    eos_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
    pad = cfg.pad_token_id if cfg.pad_token_id is not None else getattr(tokenizer, "pad_token_id", None)
    return LoadedModel(
        path=str(path), model=model, tokenizer=tokenizer,
        pad_id=int(pad) if pad is not None else 0, eos_ids=eos_ids,
        vocab_size=int(cfg.vocab_size), max_positions=int(getattr(cfg, "max_position_embeddings", 1 << 30)),
        signature=signature, tokenizer_digest=digest,
    )
