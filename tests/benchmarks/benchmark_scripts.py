"""Import a script of benchmarks/ as a module, for the smoke tests next to this file."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def script_path(name: str) -> Path:
    """benchmarks/<name>.py."""
    return BENCHMARKS / f"{name}.py"


def load_script(name: str) -> ModuleType:
    """A fresh import of benchmarks/<name>.py (loaded by path: benchmarks/ is a folder of scripts, not a package)."""
    spec = importlib.util.spec_from_file_location(f"{name}_benchmark", script_path(name))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
