"""The packages of conveyor form layers, and imports only run down them.

Every import is counted: at module level, inside functions, and under `TYPE_CHECKING` (a type-only import
still ties the two modules together for a reader and for the next refactor). A package may import its own
modules and any package in a lower layer; an import that runs up a layer is a failure that names the file,
the line and both packages. Two more rules keep modules' insides their own:

- no module imports another module's underscore name (`from conveyor.x import _helper`);
- no code reaches an underscore attribute of a conveyor object defined in another file
  (`group._channel`, `trainer._seed`): the attribute names are read from the assignments and definitions in
  conveyor's own classes, so third-party internals (`torch._foreach_copy_`) are not counted unless named
  in THIRD_PARTY.

Nothing is excepted: a new edge that runs up means the shared piece belongs lower, not a new exception.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "conveyor"

# Lowest first. Packages in one tuple are one layer: they may import each other's modules.
LAYERS: list[tuple[str, ...]] = [
    ("files", "deadline", "user_code", "registry"),
    ("plugins", "protocol"),
    ("data_plane", "algos", "tools", "tasks"),
    ("config",),
    ("models",),
    ("metrics",),
    ("weights",),
    ("rollout",),
    ("workers.training",),
    ("workers.ranks",),
    ("workers.placement",),
    ("ray_utils",),
    ("trainer",),
    ("cli",),
]
LAYER = {pkg: i for i, layer in enumerate(LAYERS) for pkg in layer}

# Underscore attributes of third-party objects that conveyor reaches on purpose, by name, should one of them
# also be the name of an attribute in a conveyor class.
THIRD_PARTY: frozenset[str] = frozenset()


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


MODULES = _modules()


def _package(module: str) -> str:
    parts = module.split(".")
    if len(parts) > 2 and parts[1] == "workers":  # the workers' sub-packages are layers of their own
        return ".".join(parts[1:3])
    return parts[1] if len(parts) > 1 else parts[0]


def _imports(module: str, path: Path) -> list[tuple[int, str, list[str]]]:
    """(line, imported module, names imported from it) of every import in `path`, relative ones resolved."""
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name, []) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            found.append((node.lineno, target, [alias.name for alias in node.names]))
    return [f for f in found if f[1] == "conveyor" or f[1].startswith("conveyor.")]


def test_every_package_has_a_layer() -> None:
    missing = sorted({_package(m) for m in MODULES} - set(LAYER) - {"conveyor", "workers"})
    assert not missing, f"packages with no layer in LAYERS: {missing}"


def test_imports_run_down_the_layers() -> None:
    up = []
    for module, path in MODULES.items():
        source = _package(module)
        for line, target, _ in _imports(module, path):
            dest = _package(target)
            if dest in LAYER and source in LAYER and LAYER[dest] > LAYER[source]:
                up.append(f"{path.relative_to(ROOT.parent)}:{line}: {source} imports {target} ({dest} is above)")
    assert not up, "imports that run up a layer:\n" + "\n".join(up)


def test_no_module_imports_another_modules_private_name() -> None:
    private = []
    for module, path in MODULES.items():
        for line, target, names in _imports(module, path):
            for name in names:
                if name.startswith("_") and not name.startswith("__") and target != module:
                    private.append(f"{path.relative_to(ROOT.parent)}:{line}: {name} from {target}")
    assert not private, "underscore names imported from other modules:\n" + "\n".join(private)


def _defined_attributes() -> dict[str, set[Path]]:
    """Underscore attribute names that conveyor classes define (methods, `self._x = ...`), by defining file."""
    defined: dict[str, set[Path]] = defaultdict(set)
    for path in MODULES.values():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ClassDef):
                for item in ast.walk(node):
                    if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and item in node.body:
                        defined[item.name].add(path)
                    elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name) and item in node.body:
                        defined[item.target.id].add(path)
                    elif (
                        isinstance(item, ast.Attribute)
                        and isinstance(item.ctx, ast.Store)
                        and isinstance(item.value, ast.Name)
                        and item.value.id in ("self", "cls")
                    ):
                        defined[item.attr].add(path)
    return {
        name: files
        for name, files in defined.items()
        if name.startswith("_") and not name.startswith("__") and name not in THIRD_PARTY
    }


def test_no_code_reaches_a_private_attribute_defined_in_another_file() -> None:
    defined = _defined_attributes()
    reached = []
    for path in MODULES.values():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.Attribute) or node.attr not in defined:
                continue
            if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                continue
            if path not in defined[node.attr]:
                reached.append(
                    f"{path.relative_to(ROOT.parent)}:{node.lineno}: .{node.attr} (defined in "
                    f"{', '.join(sorted(str(p.relative_to(ROOT.parent)) for p in defined[node.attr]))})"
                )
    assert not reached, "private attributes reached from another file:\n" + "\n".join(reached)
