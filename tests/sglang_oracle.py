"""SGLang's own definitions, read from the installed sglang wheel (pinned in the Makefile, installed
without its dependencies) without importing the package: ``import sglang`` pulls in torch,
orjson, zmq, ... (its ``__init__``), so

- `api_types()`: ``sglang/api/v1/api_types.py`` (imports only typing and msgspec) loaded by path:
  the JSON contract of /generate, /model_info, ... (``X.from_json_value`` raises
  ``JsonContractError`` on a violation, as the server answers 400);
- `io_struct_fields` / `io_struct_required`: the request dataclasses of ``srt/managers/io_struct.py``,
  read with ``ast``;
- `http_routes`: every route of ``srt/entrypoints/http_server.py`` with its methods and the
  ``io_struct`` type of its JSON body (``obj: Annotated[X, Body()]``); `route_auth_levels`: each
  route's ``@auth_level``;
- `function_strings`: the string constants of one function or method (the messages SGLang answers);
- `function_calls`: the names one function or method calls;
- `wheel_function` / `wheel_module`: one function's source, or one dependency-free module, from
  the wheel, compiled here (SGLang's own ``init_custom_process_group`` and
  ``FlattenedTensorBucket`` run in the weight-sync tests);
- `server_argument_parser`: an ``argparse`` parser of ``python -m sglang.launch_server`` built from
  the field declarations ``ServerArgs`` collects (``srt/server_args.py`` ``_INPUT_NAMESPACES``,
  ``srt/arg_groups/fields/*.py``) with the rules of ``add_cli_args_from_dataclass``
  (``srt/arg_groups/arg_utils.py``: ``--field-name`` or ``cli_name``, aliases, bool ->
  store_true, Literal/choices, ``no_cli`` skipped) plus the flags ``ServerArgs.add_cli_args``
  registers by hand.
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import sys
from functools import cache
from pathlib import Path
from types import ModuleType


@cache
def sglang_dir() -> Path:
    """The installed sglang package directory (found, not imported)."""
    spec = importlib.util.find_spec("sglang")
    if spec is None or spec.origin is None:
        raise RuntimeError("the sglang wheel is not installed: run `make test` (its install step adds it)")
    return Path(spec.origin).parent


@cache
def api_types() -> ModuleType:
    """``sglang.api.v1.api_types`` loaded from its file."""
    path = sglang_dir() / "api" / "v1" / "api_types.py"
    spec = importlib.util.spec_from_file_location("sglang_api_v1_api_types", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there while the class is built
    spec.loader.exec_module(module)
    return module


def _classes(path: Path) -> dict[str, ast.ClassDef]:
    return {n.name: n for n in ast.parse(path.read_text()).body if isinstance(n, ast.ClassDef)}


def _annotated(cls: ast.ClassDef) -> list[ast.AnnAssign]:
    return [n for n in cls.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)]


@cache
def io_struct_fields(name: str) -> dict[str, str]:
    """Field -> annotation source of dataclass ``name`` in ``srt/managers/io_struct.py``, base
    classes of the same file included (``BaseReq``'s bookkeeping fields too)."""
    classes = _classes(sglang_dir() / "srt" / "managers" / "io_struct.py")
    if name not in classes:
        raise KeyError(f"io_struct.py has no class {name}")
    out: dict[str, str] = {}
    for base in classes[name].bases:
        if isinstance(base, ast.Name) and base.id in classes:
            out.update(io_struct_fields(base.id))
    out.update({n.target.id: ast.unparse(n.annotation) for n in _annotated(classes[name])})
    return out


@cache
def io_struct_required(name: str) -> set[str]:
    """Fields of ``io_struct.py`` class ``name`` (bases included) that have no default."""
    classes = _classes(sglang_dir() / "srt" / "managers" / "io_struct.py")
    out: set[str] = set()
    for base in classes[name].bases:
        if isinstance(base, ast.Name) and base.id in classes:
            out |= io_struct_required(base.id)
    for n in _annotated(classes[name]):
        if n.value is None:
            out.add(n.target.id)
        else:
            out.discard(n.target.id)
    return out


@cache
def http_routes() -> dict[str, dict]:
    """Path -> ``{"methods": [...], "body": io_struct class name or None}`` of every route
    ``http_server.py`` declares with ``@app.get/post/put/api_route``."""
    tree = ast.parse((sglang_dir() / "srt" / "entrypoints" / "http_server.py").read_text())
    routes: dict[str, dict] = {}
    for fn in tree.body:
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        body = None
        for arg in fn.args.args:
            ann = arg.annotation
            if isinstance(ann, ast.Subscript) and ast.unparse(ann.value) == "Annotated":
                first = ann.slice.elts[0] if isinstance(ann.slice, ast.Tuple) else ann.slice
                if "Body" in ast.unparse(ann.slice):
                    body = ast.unparse(first)
        for dec in fn.decorator_list:
            if not (isinstance(dec, ast.Call) and isinstance(dec.func, ast.Attribute)
                    and ast.unparse(dec.func.value) == "app" and dec.args):
                continue
            kind = dec.func.attr
            if kind == "api_route":
                kw = {k.arg: k.value for k in dec.keywords}
                methods = ast.literal_eval(kw["methods"]) if "methods" in kw else ["GET"]
            elif kind in ("get", "post", "put", "delete"):
                methods = [kind.upper()]
            else:
                continue
            if not isinstance(dec.args[0], ast.Constant):
                continue  # a computed path (none of the weight-update routes)
            path = dec.args[0].value
            entry = routes.setdefault(path, {"methods": [], "body": body})
            entry["methods"] = sorted(set(entry["methods"]) | set(methods))
    return routes


@cache
def route_auth_levels() -> dict[str, str]:
    """Path -> the auth level (``NORMAL``, ``ADMIN_OPTIONAL``, ``ADMIN_FORCE``) of every route
    ``http_server.py`` declares, from its ``@auth_level(...)`` (none: ``NORMAL``)."""
    levels = {}
    for node in ast.parse((sglang_dir() / "srt" / "entrypoints" / "http_server.py").read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            level = next((d.args[0].attr for d in node.decorator_list if isinstance(d, ast.Call)
                          and getattr(d.func, "id", "") == "auth_level"), "NORMAL")
            for d in node.decorator_list:
                if isinstance(d, ast.Call) and isinstance(d.func, ast.Attribute) and d.args \
                        and isinstance(d.args[0], ast.Constant) and isinstance(d.args[0].value, str):
                    levels[d.args[0].value] = level
    return levels


def _function_node(relpath: str, qualname: str) -> ast.AST:
    tree = ast.parse((sglang_dir() / relpath).read_text())
    node: ast.AST = tree
    for part in qualname.split("."):
        node = next(n for n in node.body if isinstance(n, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                    and n.name == part)
    return node


def function_strings(relpath: str, qualname: str) -> set[str]:
    """Every string constant in function ``qualname`` (``Class.method`` for a method) of
    ``sglang/<relpath>``; adjacent literals are one constant, as Python joins them."""
    node = _function_node(relpath, qualname)
    return {n.value for n in ast.walk(node) if isinstance(n, ast.Constant) and isinstance(n.value, str)}


def function_calls(relpath: str, qualname: str) -> set[str]:
    """The names every call in function ``qualname`` of ``sglang/<relpath>`` calls (``f(...)``
    and ``x.f(...)`` both give ``f``)."""
    node = _function_node(relpath, qualname)
    return {n.func.attr if isinstance(n.func, ast.Attribute) else getattr(n.func, "id", "")
            for n in ast.walk(node) if isinstance(n, ast.Call)}


def wheel_function(relpath: str, qualname: str, namespace: dict):
    """Function ``qualname`` of ``sglang/<relpath>`` compiled into ``namespace`` (which must hold
    the module globals it uses) and returned; a method becomes a plain function of ``self``."""
    node = _function_node(relpath, qualname)
    node.decorator_list = []
    code = compile(ast.Module(body=[node], type_ignores=[]), str(sglang_dir() / relpath), "exec")
    exec(code, namespace)  # noqa: S102 - SGLang's own source, from the pinned wheel
    return namespace[node.name]


@cache
def wheel_module(relpath: str) -> ModuleType:
    """A module of the wheel that imports nothing of SGLang's, loaded from its file."""
    path = sglang_dir() / relpath
    spec = importlib.util.spec_from_file_location("sglang_" + relpath.replace("/", "_")[:-3], path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there while the class is built
    spec.loader.exec_module(module)
    return module


def literal_values(annotation: str) -> list:
    """The values of a ``Literal[...]`` annotation (source text)."""
    node = ast.parse(annotation, mode="eval").body
    assert isinstance(node, ast.Subscript) and ast.unparse(node.value) == "Literal", annotation
    elts = node.slice.elts if isinstance(node.slice, ast.Tuple) else [node.slice]
    return [ast.literal_eval(e) for e in elts]


class ArgumentRejected(ValueError):
    """SGLang's argument parser would refuse this command line."""


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # argparse exits; a test wants the reason
        raise ArgumentRejected(message)


def _constants(path: Path) -> dict[str, object]:
    """Module-level NAME = <literal> assignments of a file (choice lists)."""
    out = {}
    for n in ast.parse(path.read_text()).body:
        if isinstance(n, ast.Assign) and len(n.targets) == 1 and isinstance(n.targets[0], ast.Name):
            try:
                out[n.targets[0].id] = ast.literal_eval(n.value)
            except ValueError:
                pass
    return out


def _type_of(annotation: ast.expr) -> tuple[str, list | None]:
    """("bool" | "int" | "float" | "str" | "list", Literal choices or None) of a field's type."""
    node = annotation
    if isinstance(node, ast.Subscript) and ast.unparse(node.value) in ("Optional",):
        node = node.slice
    if isinstance(node, ast.BinOp):  # X | None
        node = node.left if ast.unparse(node.right) == "None" else node.right
    if isinstance(node, ast.Subscript) and ast.unparse(node.value) == "Literal":
        values = [v for v in literal_values(ast.unparse(node)) if v is not None]
        return ("int" if values and isinstance(values[0], int) else "str"), values
    if isinstance(node, ast.Subscript) and ast.unparse(node.value) in ("List", "list"):
        return "list", None
    name = ast.unparse(node)
    return (name if name in ("bool", "int", "float", "str") else "str"), None


@cache
def server_argument_parser() -> argparse.ArgumentParser:
    """A parser of ``sglang.launch_server``'s flags as SGLang 0.5.23 declares them (module doc)."""
    srt = sglang_dir() / "srt"
    server_args = ast.parse((srt / "server_args.py").read_text())
    namespaces: list[str] = []
    modules: dict[str, Path] = {}
    for node in server_args.body:
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("sglang.srt.arg_groups.fields."):
            for alias in node.names:
                modules[alias.asname or alias.name] = srt / "arg_groups" / "fields" / f"{node.module.rsplit('.', 1)[1]}.py"
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "_INPUT_NAMESPACES" for t in node.targets):
            namespaces = [e.id for e in node.value.elts]
    if not namespaces:
        raise RuntimeError("server_args.py: no _INPUT_NAMESPACES list (SGLang changed how ServerArgs is built)")
    choices = _constants(srt / "arg_groups" / "choices.py")
    parser = _Parser(prog="sglang.launch_server", add_help=False, allow_abbrev=False)

    def fields_of(cls_name: str, path: Path) -> list[ast.AnnAssign]:
        classes = _classes(path)
        cls = classes[cls_name]
        out = []
        for base in cls.bases:
            if isinstance(base, ast.Name) and base.id in classes:
                out += fields_of(base.id, path)
        return out + _annotated(cls)

    for ns in namespaces:
        for field in fields_of(ns, modules[ns]):
            ann = field.annotation
            if not (isinstance(ann, ast.Subscript) and ast.unparse(ann.value) == "A" and isinstance(ann.slice, ast.Tuple)):
                continue
            type_node, *meta = ann.slice.elts
            arg = next((m for m in meta if isinstance(m, ast.Call) and ast.unparse(m.func) == "Arg"), None)
            if arg is None and not any(isinstance(m, ast.Constant) and isinstance(m.value, str) for m in meta):
                continue  # no CLI metadata: not registered
            kw = {k.arg: k.value for k in (arg.keywords if arg else [])}
            if "no_cli" in kw and ast.literal_eval(kw["no_cli"]):
                continue
            name = field.target.id
            flag = ast.literal_eval(kw["cli_name"]) if "cli_name" in kw else "--" + name.replace("_", "-")
            names = [flag] + (ast.literal_eval(kw["aliases"]) if "aliases" in kw else [])
            kind, literal = _type_of(type_node)
            opts: dict = {"dest": name}
            if field.value is not None:
                try:
                    opts["default"] = ast.literal_eval(field.value)
                except ValueError:
                    pass  # a computed default: left unset
            if "action" in kw:
                if ast.unparse(kw["action"]).endswith("BooleanOptionalAction"):
                    opts["action"] = argparse.BooleanOptionalAction
                else:
                    opts["nargs"] = "*"  # a custom action: its arguments are not checked here
            elif kind == "bool":
                opts["action"] = "store_true"
            else:
                if kind == "list" and "type_parser" not in kw:
                    opts["nargs"] = ast.literal_eval(kw["nargs"]) if "nargs" in kw else "+"
                elif "nargs" in kw:
                    opts["nargs"] = ast.literal_eval(kw["nargs"])
                if "type_parser" not in kw and kind in ("int", "float"):
                    opts["type"] = {"int": int, "float": float}[kind]
                listed = kw.get("choices")
                if listed is not None:
                    try:
                        opts["choices"] = ast.literal_eval(listed)
                    except ValueError:
                        opts["choices"] = choices.get(ast.unparse(listed))
                elif literal:
                    opts["choices"] = literal
                if opts.get("choices") is None:
                    opts.pop("choices", None)
            parser.add_argument(*names, **opts)

    # The flags ServerArgs.add_cli_args registers by hand.
    cls = next(n for n in server_args.body if isinstance(n, ast.ClassDef) and n.name == "ServerArgs")
    add_cli = next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "add_cli_args")
    for call in ast.walk(add_cli):
        if not (isinstance(call, ast.Call) and ast.unparse(call.func) == "parser.add_argument"):
            continue
        names = [a.value for a in call.args if isinstance(a, ast.Constant) and str(a.value).startswith("--")]
        kw = {k.arg: k.value for k in call.keywords}
        action = ast.unparse(kw["action"]) if "action" in kw else ""
        if "StoreTrue" in action or action == "'store_true'":
            parser.add_argument(*names, action="store_true")
        elif "nargs" in kw and ast.unparse(kw["nargs"]) == "None" and "Const" in action:
            parser.add_argument(*names, nargs="?")
        else:
            parser.add_argument(*names)
    return parser


@cache
def deprecated_flags() -> set[str]:
    """Flags ``ServerArgs.add_cli_args`` keeps only as deprecated spellings (Deprecated* actions)."""
    srt = sglang_dir() / "srt"
    tree = ast.parse((srt / "server_args.py").read_text())
    out = set()
    for call in ast.walk(tree):
        if isinstance(call, ast.Call) and ast.unparse(call.func) == "parser.add_argument":
            kw = {k.arg: ast.unparse(k.value) for k in call.keywords}
            if "Deprecated" in kw.get("action", ""):
                out |= {a.value for a in call.args if isinstance(a, ast.Constant)}
    return out


def parse_launch_server(argv: list[str], env: dict[str, str] | None = None,
                        files: dict[str, Path] | None = None) -> argparse.Namespace:
    """Parse ``python3 -m sglang.launch_server ...`` as SGLang would, after the kubelet's
    ``$(VAR)`` expansion with ``env``; a ``--config FILE`` is merged as SGLang's own
    ``ConfigArgumentMerger`` (``srt/utils/server_args_config_parser.py``, from the wheel) merges
    it, reading ``files[FILE]`` for a path inside the pod.

    Raises:
        ArgumentRejected: an unknown flag, a missing or bad value, a value not among the choices,
            a config file that is not there.
    """
    prefix = ["python3", "-m", "sglang.launch_server"]
    if argv[:3] != prefix:
        raise ArgumentRejected(f"not an sglang.launch_server command: {argv[:3]}")
    args = []
    for a in argv[3:]:
        for k, v in (env or {}).items():
            a = a.replace(f"$({k})", v)
        if "$(" in a:
            raise ArgumentRejected(f"unexpanded variable in {a!r}")
        args.append(str((files or {}).get(a, a)))
    if "--config" in args:
        merger = wheel_module("srt/utils/server_args_config_parser.py").ConfigArgumentMerger(server_argument_parser())
        try:
            args = merger.merge_config_with_args(args)
        except ValueError as e:
            raise ArgumentRejected(str(e)) from None
    ns, extra = server_argument_parser().parse_known_args(args)
    if extra:
        raise ArgumentRejected(f"unrecognized arguments: {extra}")
    return ns
