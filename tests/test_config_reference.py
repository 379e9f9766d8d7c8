"""docs/config.md is scripts/config_reference.py's rendering of the models' field descriptions: the
committed file is current, every field of the run config, the workloads file, the deployment config
and the pipeline file has a description, and every example document is linked from it."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import typing
from pathlib import Path

from pydantic import BaseModel

from app.config import RunConfig
from charts8s.workloads import Workloads
from infra.config import DeploymentConfig, PipelineConfig

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "config_reference.py"
_spec = importlib.util.spec_from_file_location("config_reference", SCRIPT)
ref = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ref)


def test_committed_reference_is_current():
    why = ref.stale_message((ROOT / "docs" / "config.md").read_text())
    assert why is None, why


def test_the_reference_is_the_same_from_any_checkout():
    """A default that is a file of the repository (the workloads file's run_config) is shown
    relative to it, so the committed reference is current in a clone anywhere."""
    text = ref.render()
    assert str(ROOT) not in text and "`\"recipes/dev-tiny-grpo.yaml\"`" in text


def test_a_stale_reference_is_caught_with_the_command_to_fix_it(tmp_path):
    current = ref.render()
    assert ref.stale_message(current) is None
    stale = current.replace("Most tokens of a completion", "Most tokens")
    assert stale != current
    assert "scripts/config_reference.py" in ref.stale_message(stale)
    # The documented command runs as a file, from any directory, without PYTHONPATH.
    check = subprocess.run([sys.executable, str(SCRIPT), "--check"], capture_output=True, text=True,
                           env={"PATH": "/usr/bin:/bin"}, cwd=tmp_path, timeout=120)
    assert check.returncode == 0, check.stderr


def _fields(model: type[BaseModel], seen: set) -> list[tuple[str, object]]:
    out = []
    for name, field in model.model_fields.items():
        out.append((f"{model.__name__}.{name}", field))
        sub = ref._model_of(field.annotation)
        if sub is not None and sub not in seen:
            seen.add(sub)
            out += _fields(sub, seen)
    return out


def test_every_field_has_a_description():
    missing = [name for model in (RunConfig, Workloads, DeploymentConfig, PipelineConfig)
               for name, field in _fields(model, set()) if not (field.description or "").strip()]
    assert not missing, f"fields without description=: {missing}"


def test_every_example_document_is_linked():
    text = (ROOT / "docs" / "config.md").read_text()
    examples = [p for folder in ("recipes", "charts8s/examples") for p in sorted((ROOT / folder).glob("*.yaml"))]
    assert len(examples) >= 14
    for path in examples:
        rel = path.relative_to(ROOT).as_posix()
        assert f"](../{rel})" in text, rel


def test_types_read_as_yaml():
    assert ref.type_text(typing.Literal["a", "b"]) == "`a` \\| `b`"
    assert ref.type_text(int | None) == "integer \\| null"
    assert ref.type_text(dict[str, list[float]]) == "map of string to list of number"
    assert ref.type_text(tuple[float, float]) == "[number, number]"
