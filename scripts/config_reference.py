"""Write docs/config.md, the reference of every field of the YAML documents a run reads, from the
pydantic models' own field descriptions: the run config (app.config.RunConfig), the workloads file
(charts8s.workloads.Workloads), the deployment config (infra.config.DeploymentConfig) and the
pipeline file (infra.config.PipelineConfig). tests/test_config_reference.py fails when the
committed file differs from what this writes.

    .venv/bin/python scripts/config_reference.py           # rewrite docs/config.md
    .venv/bin/python scripts/config_reference.py --check   # exit 1 when it is stale
"""

from __future__ import annotations

import inspect
import json
import sys
import types
import typing
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Run as a file (`python scripts/config_reference.py`): the repository root is not on sys.path then.
sys.path.insert(0, str(ROOT))

from pydantic import BaseModel  # noqa: E402
from pydantic_core import PydanticUndefined  # noqa: E402

from app.config import EngineProfile, RunConfig  # noqa: E402
from charts8s.workloads import Workloads  # noqa: E402
from infra.config import DeploymentConfig, PipelineConfig  # noqa: E402

OUT = ROOT / "docs" / "config.md"
COMMAND = ".venv/bin/python scripts/config_reference.py"
# The example documents of each kind, by where they live and how their names end.
EXAMPLE_DIRS = ("recipes", "charts8s/examples", "examples/guess_number", "bench")


def example_files() -> dict[str, list[str]]:
    """Repository paths of the example YAML documents, by kind: run, workloads, deploy."""
    kinds: dict[str, list[str]] = {"run": [], "workloads": [], "deploy": []}
    for folder in EXAMPLE_DIRS:
        for path in sorted((ROOT / folder).glob("*.yaml")):
            name = path.name
            kind = "workloads" if name.endswith(".workloads.yaml") else "deploy" if name.endswith(".deploy.yaml") else "run"
            kinds[kind].append(path.relative_to(ROOT).as_posix())
    return kinds


def _model_of(annotation) -> type[BaseModel] | None:
    """The pydantic model inside an annotation (X, X | None, list[X], dict[str, X]), if any."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in typing.get_args(annotation):
        if (found := _model_of(arg)) is not None:
            return found
    return None


def type_text(annotation) -> str:
    """An annotation as a reader writes it in YAML."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Literal:
        return " \\| ".join(f"`{a}`" for a in args)
    if origin in (typing.Union, types.UnionType):
        parts = [type_text(a) for a in args if a is not type(None)]
        return " \\| ".join(parts) + (" \\| null" if type(None) in args else "")
    if origin is list:
        return f"list of {type_text(args[0])}"
    if origin is tuple:
        return "[" + ", ".join(type_text(a) for a in args) + "]"
    if origin is dict:
        return f"map of {type_text(args[0])} to {type_text(args[1])}"
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return "section"
    return {str: "string", int: "integer", float: "number", bool: "boolean"}.get(annotation, "any")


def default_text(field) -> str:
    if field.default_factory is not None:
        value = field.default_factory()
    elif field.default is PydanticUndefined:
        return "required"
    else:
        value = field.default
    if isinstance(value, BaseModel):
        return "(section)"
    text = json.dumps(value, default=str)
    # A default built from this checkout's location (a recipe's path) is shown relative to it,
    # so the file is the same in every checkout.
    text = text.replace(str(ROOT) + "/", "")
    return "`" + text.replace("|", "\\|") + "`"


def cell(text: str | None) -> str:
    return " ".join((text or "").split()).replace("|", "\\|")


def summary(model: type[BaseModel]) -> str:
    """A model's docstring, as written."""
    return inspect.cleandoc(model.__doc__ or "")


def section(model: type[BaseModel], path: str, level: int, seen: dict[type, str]) -> list[str]:
    """A table of `model`'s fields under heading `path`, then one section per nested model; a model
    in `seen` (model -> where its table is) is referred to, not repeated."""
    title = f"`{path}`" if path else "top level"
    lines = [f"{'#' * level} {title}", "", summary(model), "",
             "| field | type | default | description |", "| --- | --- | --- | --- |"]
    nested = []
    for name, field in model.model_fields.items():
        sub = _model_of(field.annotation)
        where = f"{path}.{name}" if path else name
        kind = type_text(field.annotation)
        if sub is not None:
            origin = typing.get_origin(field.annotation)
            child = where + (".<name>" if origin is dict else "[]" if origin is list else "")
            if sub in seen:
                kind = kind.replace("section", f"section (as {seen[sub]})")
            else:
                kind = kind.replace("section", "section (below)")
                nested.append((sub, child))
                seen[sub] = f"`{child}`"
        lines.append(f"| `{name}` | {kind} | {default_text(field)} | {cell(field.description)} |")
    lines.append("")
    for sub, child in nested:
        lines += section(sub, child, level + 1, seen)
    return lines


def links(paths: list[str]) -> str:
    return ", ".join(f"[{p}](../{p})" for p in paths)


def render() -> str:
    ex = example_files()
    out = [
        "# Configuration reference",
        "",
        f"Generated from the models' field descriptions by `{COMMAND}`; edit the descriptions in the",
        "models, not this file (`tests/test_config_reference.py` fails when it is stale).",
        "",
        "A run on one machine reads a run config; a cluster run reads three YAML documents",
        "([cluster.md](cluster.md), \"The three YAML documents of a cluster run\"). Each document refuses",
        "unknown keys and takes only `true` or `false` for a boolean and a number for a number; a",
        "broken rule is one line naming the file and the field, before anything starts.",
        "",
        "- [Run config](#run-config-appconfigrunconfig): " + links(ex["run"]),
        "- [Workloads](#workloads-charts8sworkloadsworkloads): " + links(ex["workloads"]),
        "- [Deployment config](#deployment-config-infraconfigdeploymentconfig): " + links(ex["deploy"]),
        "- [Pipeline file](#pipeline-file-infraconfigpipelineconfig)",
        "",
        "## Run config (`app.config.RunConfig`)",
        "",
        "app/config.py. Read by every role (`moerl run --config`, `moerl train`, `moerl rollout`, ...,",
        "mounted from a ConfigMap in the cluster) and by `moerl plan --config`. Examples: " + links(ex["run"]) + ".",
        "",
    ]
    out += section(RunConfig, "", 3, {})
    out += [
        "## Workloads (`charts8s.workloads.Workloads`)",
        "",
        "charts8s/workloads.py. Read by `python -m charts8s.main --workloads FILE`. Examples: "
        + links(ex["workloads"]) + ".",
        "",
    ]
    # The engine profiles of a rollout bench are the run config's rollout.engine: one table of them.
    out += section(Workloads, "", 3, {EngineProfile: "`rollout.engine` of the run config"})
    out += [
        "## Deployment config (`infra.config.DeploymentConfig`)",
        "",
        "infra/config.py. A file of overrides merged over the built-in defaults of one environment",
        "(`infra.config.default_config`), read by `cdk -c config=FILE`, `python -m charts8s.main --config",
        "FILE` and the `infra.*` commands' `--config FILE`. The defaults below are the model's; an",
        "environment's built-in values (pools, buckets, account) are printed by:",
        "",
        "```bash",
        ".venv/bin/python -c \"import yaml; from infra.config import default_config; "
        "print(yaml.safe_dump(default_config('prod'), sort_keys=False))\"",
        "```",
        "",
        "Examples: " + links(ex["deploy"]) + ".",
        "",
    ]
    out += section(DeploymentConfig, "", 3, {})
    out += [
        "## Pipeline file (`infra.config.PipelineConfig`)",
        "",
        "Read by `cdk -c env=pipeline -c config=FILE` ([deploy-aws.md](deploy-aws.md), \"Promotion",
        "pipeline\"): a `pipeline` section, below, and `environments`, a map of dev, staging and prod",
        "to deployment-config overrides as above.",
        "",
    ]
    out += section(PipelineConfig, "pipeline", 3, {})
    return "\n".join(out).rstrip("\n") + "\n"


def stale_message(committed: str) -> str | None:
    """None when `committed` is what render() writes; else what to run."""
    if committed == render():
        return None
    return f"docs/config.md is stale: run `{COMMAND}` and commit the result"


def main(argv: list[str]) -> int:
    if argv == ["--check"]:
        why = stale_message(OUT.read_text() if OUT.is_file() else "")
        if why:
            print(why, file=sys.stderr)
            return 1
        return 0
    if argv:
        print(f"usage: {COMMAND} [--check]", file=sys.stderr)
        return 2
    OUT.write_text(render())
    print(f"wrote {OUT.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
