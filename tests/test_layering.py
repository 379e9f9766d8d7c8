"""The import graph of app/, charts8s/ and infra/ has floors and no circle (issue 32 item 5, issue 43
item 4).

A module imports only modules of its own floor or of the floors below (FLOORS, bottom first), and
no two modules need each other. A circle or an upward arrow closed only by a function-level
import works at run time, but it means the lower module needs the upper one: neither can be read,
tested or moved alone. The graph is built from the source (ast), so an import that only runs on a
GPU, behind a flag or inside a function counts as well.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("app", "charts8s", "infra")

# Bottom first. A module's floor is that of the longest name here that is the module or one of
# its packages; every module must have one.
FLOORS: list[tuple[str, tuple[str, ...]]] = [
    ("names, versions and facts", ("app", "app.names", "app.versions", "app.logs", "app.layout",
                                   "app.config_rules", "infra.instances", "infra.charts", "infra.addons")),
    ("the config documents", ("app.config", "infra.config")),
    ("stores, buffer, model", ("app.storage", "app.metrics", "app.ledger", "app.buffer", "app.model",
                               "app.weight_group")),
    ("the roles: engine, environments, rollout, trainer, feed", (
        "app.engine", "app.envs", "app.rollout", "app.trainer", "app.feed", "app.torchx_component",
        "app.healthcheck", "app.nodehealth")),
    ("one machine: the local run, benchmarks, plans", ("app.local", "app.bench", "app.plan")),
    ("manifests and stacks", ("charts8s", "infra")),
    ("the replica of the cluster and the command line", ("app.replica", "app.cli")),
]


def modules(root: Path = ROOT, packages: tuple[str, ...] = PACKAGES) -> dict[str, Path]:
    """Dotted name -> file of every module and package under ``packages``."""
    mods = {}
    for package in packages:
        for path in (root / package).rglob("*.py"):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            mods[".".join(parts)] = path
    return mods


def import_graph(mods: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the project modules it imports anywhere in its file (top level, functions, classes).

    ``from a.b import c`` is an edge to ``a.b.c`` when that is a module, else to ``a.b``. An
    import of one's own package (an ancestor) is left out: Python runs a package's __init__
    before any module in it in any case, so that edge adds no dependency.
    """

    def known(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {m: set() for m in mods}
    for mod, path in mods.items():
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets: list[str | None] = []
            if isinstance(node, ast.Import):
                targets = [known(a.name) for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package
                    for _ in range(node.level - 1):
                        up = up.rpartition(".")[0]
                    base = f"{up}.{base}" if base else up
                targets = [known(f"{base}.{a.name}") if f"{base}.{a.name}" in mods else known(base)
                           for a in node.names]
            for target in targets:
                if target and target != mod and not mod.startswith(target + "."):
                    graph[mod].add(target)
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def floor_of(module: str, floors=FLOORS) -> int | None:
    """The floor (index into ``floors``) of the longest name that is ``module`` or a package of it."""
    best, floor = -1, None
    for i, (_, names) in enumerate(floors):
        for name in names:
            if (module == name or module.startswith(name + ".")) and len(name) > best:
                best, floor = len(name), i
    return floor


def upward(graph: dict[str, set[str]], floors=FLOORS) -> list[str]:
    """Every import of a module on a higher floor, as ``a (floor) -> b (floor)``."""
    out = []
    for mod in sorted(graph):
        for target in sorted(graph[mod]):
            low, high = floor_of(mod, floors), floor_of(target, floors)
            if high > low:
                out.append(f"{mod} ({floors[low][0]}) -> {target} ({floors[high][0]})")
    return out


def test_the_graph_sees_imports_inside_functions(tmp_path):
    pkg = tmp_path / "app"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from app.b import f\n")
    (pkg / "b.py").write_text("def f():\n    from app import a\n")
    (pkg / "c.py").write_text("import app.a\n")
    graph = import_graph(modules(tmp_path, ("app",)))
    assert graph["app.b"] == {"app.a"} and graph["app.c"] == {"app.a"}
    assert circles(graph) == [["app.a", "app.b"]]


def test_the_floors_see_an_upward_import_inside_a_function(tmp_path):
    for package in ("low", "high"):
        (tmp_path / package).mkdir()
        (tmp_path / package / "__init__.py").write_text("")
    (tmp_path / "low" / "rules.py").write_text("def f():\n    from high.use import g\n")
    (tmp_path / "high" / "use.py").write_text("from low.rules import f\n")
    (tmp_path / "high" / "other.py").write_text("import low.rules\n")
    floors = [("bottom", ("low",)), ("top", ("high", "high.other"))]
    graph = import_graph(modules(tmp_path, ("low", "high")))
    assert upward(graph, floors) == ["low.rules (bottom) -> high.use (top)"]
    assert floor_of("high.other.x", floors) == 1 and floor_of("elsewhere", floors) is None


def test_every_module_has_a_floor():
    missing = sorted(m for m in modules() if floor_of(m) is None)
    assert missing == [], "modules on no floor (place them in FLOORS): " + ", ".join(missing)


def test_no_module_imports_from_a_floor_above():
    found = upward(import_graph(modules()))
    assert found == [], "imports that run up the floors:\n" + "\n".join(found)


def test_no_import_circle():
    found = circles(import_graph(modules()))
    assert found == [], "import circles (each needs the others): " + "; ".join(" <-> ".join(c) for c in found)


# The rules the three config documents share (how they are read, which scalars they take, how an
# error reads), and their one home below all three.
SHARED_RULES = ("strict_scalar", "error_line", "yaml_error_line", "load_yaml")
RULES_HOME = "app.config_rules"


def test_the_config_documents_take_their_shared_rules_from_one_module():
    """The run config (app/config.py), the deployment config (infra/config.py) and the workloads
    document (charts8s/workloads.py) take the rules they share from app/config_rules.py: the run
    config does not reach into infra/ for them, and no module defines or passes them on besides
    (issue 43 item 4d)."""
    mods = modules()
    elsewhere = []
    for mod, path in mods.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node.name in SHARED_RULES and mod != RULES_HOME:
                elsewhere.append(f"{mod} defines {node.name}")
            if isinstance(node, ast.ImportFrom) and node.module != RULES_HOME:
                elsewhere += [f"{mod} imports {a.name} from {node.module}" for a in node.names if a.name in SHARED_RULES]
    assert elsewhere == [], f"the shared config rules live in {RULES_HOME} only:\n" + "\n".join(elsewhere)
    graph = import_graph(mods)
    for document in ("app.config", "infra.config", "charts8s.workloads"):
        assert RULES_HOME in graph[document], f"{document} does not take its rules from {RULES_HOME}"
    assert not [m for m in graph["app.config"] if m.startswith("infra")], "the run config imports from infra/"


IMPORTS = ("import ", "from ")


def unexplained_imports(mods: dict[str, Path]) -> list[str]:
    """Every import inside a function with no comment on its line or above its run of imports
    (``file:line``): an import stays in a function only for a reason it names (an optional
    dependency, a fast ``--help``, a package a process runs without, a circle)."""
    out = []
    for path in sorted(mods.values()):
        lines = path.read_text().splitlines()

        def visit(node: ast.AST, in_function: bool) -> None:
            for child in ast.iter_child_nodes(node):
                if in_function and isinstance(child, (ast.Import, ast.ImportFrom)):
                    above = child.lineno - 2
                    while above >= 0 and (not lines[above].strip() or lines[above].lstrip().startswith(IMPORTS)):
                        above -= 1
                    own = "#" in lines[child.lineno - 1]
                    if not own and not (above >= 0 and lines[above].lstrip().startswith("#")):
                        out.append(f"{path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}:{child.lineno}")
                visit(child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)))

        visit(ast.parse("\n".join(lines), str(path)), False)
    return out


def test_an_import_in_a_function_without_a_reason_is_found(tmp_path):
    (tmp_path / "app").mkdir()
    (tmp_path / "app" / "m.py").write_text(
        "import os\n\n\ndef f():\n    import json\n\n    # optional: yaml\n    import yaml\n    import sys\n"
        "    import re  # fast --help\n")
    assert [s.rpartition(":")[2] for s in unexplained_imports(modules(tmp_path, ("app",)))] == ["5"]


def test_every_import_inside_a_function_says_why():
    found = unexplained_imports(modules())
    assert found == [], ("imports inside functions with no reason (lift them to the top, or say why in a "
                         "comment):\n" + "\n".join(found))
