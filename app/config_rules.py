"""The rules the three config documents share: the run config (app/config.py), the deployment
config (infra/config.py) and the workloads document (charts8s/workloads.py).

* `load_yaml`: how each is read (PyYAML's safe loader, refusing a key given twice);
* `strict_scalar`: which scalars a field takes (no bool for a number, only true or false for a bool);
* `error_line`, `yaml_error_line`: how a bad one is reported (one line, the field or line named).
"""

from __future__ import annotations

import types
import typing
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError


def _args(annotation: Any) -> tuple:
    union = typing.get_origin(annotation) in (typing.Union, types.UnionType)
    return typing.get_args(annotation) if union else (annotation,)


def strict_scalar(cls: type[BaseModel], v: Any, info) -> Any:
    """A field validator (mode "before") of every config model: a bool is refused where a
    number is wanted (pydantic would read ``publish_every: true`` as 1), and anything but true
    or false where a bool is (pydantic would read ``"yes"``, ``"off"`` or ``1`` as one). The
    deployment config, the run config (app/config.py) and the workloads file use it.

    Raises:
        ValueError: naming the value; pydantic adds the field path.
    """
    args = _args(cls.model_fields[info.field_name].annotation)
    if isinstance(v, bool) and {int, float} & set(args) and bool not in args:
        raise ValueError(f"{str(v).lower()} is a bool, not a number")
    if v is not None and not isinstance(v, bool) and bool in args and set(args) <= {bool, type(None)}:
        raise ValueError(f"{v!r} is not a bool: write true or false")
    return v


def error_line(e: ValidationError, whole: str | None = None) -> str:
    """A pydantic error as one line, ``<field path>: <why>; ...`` (pydantic's "Value error, "
    prefix dropped): the one format of the deployment config's, the run config's (app/config.py)
    and the workloads file's (charts8s/workloads.py) errors; the CLIs print it on one line and
    exit 2. A rule of the whole document (no field path) reads ``<whole>: <why>``, or ``<why>``
    when ``whole`` is None."""
    parts = []
    for err in e.errors():
        loc = ".".join(map(str, err["loc"])) or whole
        msg = err["msg"].removeprefix("Value error, ")
        parts.append(f"{loc}: {msg}" if loc else msg)
    return "; ".join(parts)


def yaml_error_line(e: yaml.YAMLError) -> str:
    """A PyYAML error as one line, ``line L, column C: <problem> (<context>)``: PyYAML's own
    text spans five lines (the context, a quoted source line, a caret) and the CLIs print one.
    Used for the deployment config, the run config and the workloads file."""
    mark = getattr(e, "problem_mark", None)
    problem = getattr(e, "problem", None) or str(e).splitlines()[0]
    where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
    context = getattr(e, "context", None)
    return f"{where}{problem}" + (f" ({context})" if context else "")


class _UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML's safe loader, refusing a key given twice in one mapping: plain PyYAML keeps the
    last value silently (``steps: 3`` then ``steps: 400`` ran 400 steps)."""

    def construct_mapping(self, node, deep=False):
        seen: dict = {}  # key -> the line it was first given on
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # ``<<: *base``: its keys may be overridden
                continue
            key = self.construct_object(key_node, deep=True)
            try:
                if key in seen:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"duplicate key {key!r} (first given on line {seen[key]})", key_node.start_mark)
                seen[key] = key_node.start_mark.line + 1
            except TypeError:  # an unhashable key: PyYAML's own error follows
                continue
        return super().construct_mapping(node, deep)


def load_yaml(text: str) -> Any:
    """``yaml.safe_load`` that refuses a key given twice in one mapping (a ``yaml.YAMLError``
    whose `yaml_error_line` names both lines). The deployment config, the run config and the
    workloads file are read with it.

    Raises:
        yaml.YAMLError: not valid YAML, or a duplicate key.
    """
    return yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 - a SafeLoader subclass
