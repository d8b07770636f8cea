"""No import cycles among conveyor's modules, found from the source alone (an AST pass, nothing is imported).

The graph has one node per module under conveyor/ (a package's __init__ is
the package's node) and an edge for each import of another conveyor module:
`import a.b`, `from a import b` (to `a.b` when `b` is a submodule, else to
`a`), relative imports resolved against the importing module. The implicit
import of a module's parent packages is not an edge (every submodule of a
package whose __init__ re-exports it would otherwise be in a cycle).

The test graph holds the module-level imports: top-level statements,
including those in top-level `try`, `if`, `with` blocks and class bodies
(they run at import), but not in `if TYPE_CHECKING:` blocks (they never
run). Any strongly connected component of two or more modules, or a module
importing itself, fails the test, named by one cycle through it.

`python tests/test_imports.py` prints the cycles of that graph and of the one
that also counts imports inside functions.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

PACKAGE = "conveyor"
ROOT = Path(__file__).resolve().parent.parent / PACKAGE

# Edges carry where the import is, for the failure message: (target, line).
Graph = dict[str, dict[str, int]]


def module_files(root: Path, package: str) -> dict[str, Path]:
    """Module name -> file, for every .py under `root` (the package `package`)."""
    out = {}
    for file in sorted(root.rglob("*.py")):
        parts = [package, *file.relative_to(root).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = file
    return out


def _is_type_checking(test: ast.expr) -> bool:
    """`TYPE_CHECKING` or `typing.TYPE_CHECKING` (or any `x.TYPE_CHECKING`)."""
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _import_nodes(body: list[ast.stmt], in_functions: bool) -> list[ast.Import | ast.ImportFrom]:
    """The import statements that run when `body` runs (with `in_functions`, also those in function bodies)."""
    found: list[ast.Import | ast.ImportFrom] = []
    for node in body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
        elif isinstance(node, ast.If):
            if not _is_type_checking(node.test):
                found += _import_nodes(node.body, in_functions)
            found += _import_nodes(node.orelse, in_functions)
        elif isinstance(node, (ast.Try, getattr(ast, "TryStar", ast.Try))):
            for block in (node.body, node.orelse, node.finalbody, *(h.body for h in node.handlers)):
                found += _import_nodes(block, in_functions)
        elif isinstance(node, (ast.With, ast.AsyncWith, ast.For, ast.AsyncFor, ast.While, ast.ClassDef)):
            found += _import_nodes(node.body, in_functions)
            found += _import_nodes(getattr(node, "orelse", []), in_functions)
        elif in_functions and isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            found += _import_nodes(node.body, in_functions)
    return found


def _targets(node: ast.Import | ast.ImportFrom, module: str, is_package: bool, modules: set[str]) -> list[str]:
    """The conveyor modules one import statement of `module` imports."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names if alias.name in modules]
    if node.level:
        parts = module.split(".") if is_package else module.split(".")[:-1]
        parts = parts[: len(parts) - (node.level - 1)]
        base = ".".join(parts + ([node.module] if node.module else []))
    else:
        base = node.module or ""
    out = []
    for alias in node.names:
        sub = f"{base}.{alias.name}"
        if sub in modules:
            out.append(sub)
        elif base in modules:
            out.append(base)
    return out


def import_graph(root: Path = ROOT, package: str = PACKAGE, in_functions: bool = False) -> Graph:
    """Module -> {imported module: line of the first such import}, over the modules under `root`."""
    files = module_files(root, package)
    names = set(files)
    graph: Graph = {}
    for module, file in files.items():
        tree = ast.parse(file.read_text(), filename=str(file))
        edges: dict[str, int] = {}
        for node in _import_nodes(tree.body, in_functions):
            for target in _targets(node, module, file.name == "__init__.py", names):
                edges.setdefault(target, node.lineno)
        graph[module] = edges
    return graph


def strongly_connected(graph: Graph) -> list[list[str]]:
    """Tarjan's strongly connected components (iterative), each sorted; only those that are cycles."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    comps: list[list[str]] = []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            for child in children:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, {})))))
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    comp = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        comp.append(member)
                        if member == node:
                            break
                    if len(comp) > 1 or node in graph.get(node, {}):
                        comps.append(sorted(comp))
    return sorted(comps)


def one_cycle(graph: Graph, comp: list[str]) -> list[str]:
    """A shortest cycle through the first module of `comp`, within `comp`: [a, b, ..., a]."""
    start, members = comp[0], set(comp)
    previous: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for node in frontier:
            for child in sorted(graph[node]):
                if child not in members:
                    continue
                if child == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(previous[path[-1]])
                    return [start, *reversed(path[:-1]), start] if node != start else [start, start]
                if child not in previous:
                    previous[child] = node
                    nxt.append(child)
        frontier = nxt
    raise AssertionError(f"{comp} is not a cycle")


def describe(graph: Graph, comp: list[str]) -> str:
    """`a -> b (line 12 of a) -> a (line 3 of b)`, plus the component's size when it holds more."""
    cycle = one_cycle(graph, comp)
    steps = [cycle[0]] + [f"{b} (line {graph[a][b]} of {a})" for a, b in zip(cycle, cycle[1:])]
    more = f" [one cycle of {len(comp)} modules: {', '.join(comp)}]" if len(comp) > len(cycle) - 1 else ""
    return " -> ".join(steps) + more


@pytest.mark.parametrize("in_functions", [False, True], ids=["module-level", "functions-included"])
def test_no_import_cycles(in_functions: bool) -> None:
    """No module imports a module that imports it back, at module level or inside a function.

    A lazy import inside a function breaks no import order, but a circle through
    one still means two modules that each need the other: a layering to untangle.
    """
    graph = import_graph(in_functions=in_functions)
    assert len(graph) > 20 and "conveyor.protocol" in graph  # the pass did find the package
    cycles = [describe(graph, comp) for comp in strongly_connected(graph)]
    assert not cycles, "import cycles:\n  " + "\n  ".join(cycles)


def test_the_pass_resolves_imports_and_finds_cycles(tmp_path: Path) -> None:
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    files = {
        "__init__.py": "from pkg.a import thing\n",
        "a.py": "from . import b\nthing = 1\n",
        "b.py": "import typing\nif typing.TYPE_CHECKING:\n    from pkg import c\nelse:\n    import pkg.sub.d\n"
        "try:\n    from .sub import e\nexcept ImportError:\n    pass\n",
        "c.py": "from pkg import a\n",
        "sub/__init__.py": "",
        "sub/d.py": "def f():\n    from ..c import x\n",
        "sub/e.py": "from .. import thing\nclass K:\n    from pkg.sub import d\n",
    }
    for name, text in files.items():
        (pkg / name).write_text(text)
    graph = import_graph(pkg, "pkg")
    assert graph == {
        "pkg": {"pkg.a": 1},
        "pkg.a": {"pkg.b": 1},
        "pkg.b": {"pkg.sub.d": 5, "pkg.sub.e": 7},
        "pkg.c": {"pkg.a": 1},
        "pkg.sub": {},
        "pkg.sub.d": {},
        "pkg.sub.e": {"pkg": 1, "pkg.sub.d": 3},
    }
    assert strongly_connected(graph) == [["pkg", "pkg.a", "pkg.b", "pkg.sub.e"]]
    assert describe(graph, ["pkg", "pkg.a", "pkg.b", "pkg.sub.e"]) == (
        "pkg -> pkg.a (line 1 of pkg) -> pkg.b (line 1 of pkg.a) -> pkg.sub.e (line 7 of pkg.b) "
        "-> pkg (line 1 of pkg.sub.e)"
    )
    full = import_graph(pkg, "pkg", in_functions=True)
    assert full["pkg.sub.d"] == {"pkg.c": 2}
    assert strongly_connected(full) == [["pkg", "pkg.a", "pkg.b", "pkg.c", "pkg.sub.d", "pkg.sub.e"]]


if __name__ == "__main__":
    for label, flag in (("module-level imports", False), ("imports anywhere, functions included", True)):
        g = import_graph(in_functions=flag)
        found = strongly_connected(g)
        print(f"{label}: {len(found)} cycle(s)")
        for c in found:
            print("  " + describe(g, c))
    sys.exit(0)
