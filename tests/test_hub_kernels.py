"""No Hub kernels in moerl's models: transformers (5.x) swaps layers for kernels of the `kernels`
package by default on ``from_pretrained``; where that package is absent it refuses to load (a GPU
machine's `moerl run` ended in its warm-up with "Kernels are not available"), and where it is
present the layers would come from the Hub, unlike the trainer's. Every load in app/ opts out."""

from __future__ import annotations

import ast
from pathlib import Path

import transformers.modeling_utils

from app.engine.load import load_checkpoint
from helpers import tiny_moe_checkpoint

ROOT = Path(__file__).resolve().parents[1]


def test_a_checkpoint_loads_where_the_kernels_package_is_missing(tmp_path, monkeypatch):
    path = tiny_moe_checkpoint(tmp_path / "ckpt", seed=0, max_position_embeddings=64)
    monkeypatch.setattr(transformers.modeling_utils, "is_kernels_available", lambda: False)
    loaded = load_checkpoint(path)
    assert not loaded.model.use_kernels


def model_loads_without_opt_out() -> list[str]:
    """Every ``<Auto...Model...>.from_pretrained(...)`` call in app/ lacking ``use_kernels=False``."""
    found = []
    for f in sorted((ROOT / "app").rglob("*.py")):
        for node in ast.walk(ast.parse(f.read_text())):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr == "from_pretrained" and isinstance(node.func.value, ast.Name)):
                continue
            name = node.func.value.id
            if "Model" not in name:  # tokenizers and configs load no layers
                continue
            opt_out = [k for k in node.keywords if k.arg == "use_kernels"]
            if not (opt_out and isinstance(opt_out[0].value, ast.Constant) and opt_out[0].value.value is False):
                found.append(f"{f.relative_to(ROOT)}:{node.lineno} {name}.from_pretrained")
    return found


def test_every_model_load_in_app_opts_out_of_hub_kernels():
    found = model_loads_without_opt_out()
    assert found == [], found
    assert len([f for f in (ROOT / "app").rglob("*.py") if "from_pretrained(" in f.read_text()]) >= 5  # the walk sees them
