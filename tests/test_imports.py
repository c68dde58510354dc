"""Imports flow one way (train.py -> launchers -> trainer -> model/strategies/kernels -> metrics/errors): no module
of the product imports, at any depth or inside a function, a module that imports it back."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PRODUCT = ("core", "launchers", "experiments")


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(root: Path, packages: tuple[str, ...], scripts: tuple[str, ...] = ()) -> dict[str, set[str]]:
    """module -> the project modules it imports (top-level and function-level imports alike; a package's implicit
    import by its submodules is not an edge: Python runs it first, it cannot close a cycle by itself)."""
    files = [p for pkg in packages for p in sorted((root / pkg).rglob("*.py"))] + [root / s for s in scripts]
    modules = {_module_name(p, root): p for p in files if p.is_file()}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        is_package = path.name == "__init__.py"
        edges = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: resolved against this module's package
                    package = name.split(".") if is_package else name.split(".")[:-1]
                    package = package[:len(package) - (node.level - 1)]
                    base = ".".join(package + ([base] if base else []))
                # `from pkg import sub` imports the submodule pkg.sub where there is one
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            else:
                continue
            for t in targets:
                while t and t not in modules:  # `import core.kernels.flash_triton.X`-style: the longest module
                    t = t.rpartition(".")[0]
                if t and t != name:
                    edges.add(t)
        graph[name] = edges
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
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
        for w in graph.get(v, ()):
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


def test_the_finder_sees_a_cycle_through_a_function_level_import(tmp_path: Path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from pkg import b\n")
    (pkg / "b.py").write_text("def f():\n    from . import c\n")
    (pkg / "c.py").write_text("import pkg.a\n")
    (pkg / "d.py").write_text("from pkg.a import thing\n")
    graph = import_graph(tmp_path, ("pkg",))
    assert graph["pkg.d"] == {"pkg.a"}
    assert cycles(graph) == [["pkg.a", "pkg.b", "pkg.c"]]


def test_the_product_has_no_import_cycle():
    graph = import_graph(ROOT, PRODUCT, ("train.py",))
    assert {"core.trainer", "core.kernels.flash_triton.dispatch", "launchers.local", "train"} <= graph.keys()
    assert "core.kernels.flash_triton.launch" in graph["core.kernels.flash_triton.dispatch"]
    assert cycles(graph) == []
