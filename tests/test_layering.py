"""app/ has no import circle, counting the imports inside functions too (issue 32, item 5).

A circle closed only by a function-level import works at run time, but it means two modules each
need the other: neither can be read, tested or moved alone. The graph is built from the source
(ast), so an import that only runs on a GPU or behind a flag counts as well.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def app_modules(root: Path = ROOT) -> dict[str, Path]:
    """Dotted name -> file of every module and package under app/."""
    mods = {}
    for path in (root / "app").rglob("*.py"):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        mods[".".join(parts)] = path
    return mods


def import_graph(mods: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the app modules it imports anywhere in its file (top level, functions, classes).

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


def test_the_graph_sees_imports_inside_functions(tmp_path):
    pkg = tmp_path / "app"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from app.b import f\n")
    (pkg / "b.py").write_text("def f():\n    from app import a\n")
    (pkg / "c.py").write_text("import app.a\n")
    graph = import_graph(app_modules(tmp_path))
    assert graph["app.b"] == {"app.a"} and graph["app.c"] == {"app.a"}
    assert circles(graph) == [["app.a", "app.b"]]


def test_app_has_no_import_circle():
    found = circles(import_graph(app_modules()))
    assert found == [], "import circles in app/ (each needs the others): " + "; ".join(
        " <-> ".join(c) for c in found)
