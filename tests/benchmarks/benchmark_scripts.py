"""Import a script of benchmarks/ as a module, for the smoke tests next to this file."""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import sys
from collections.abc import Iterator
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


@contextlib.contextmanager
def spawning_script(name: str, monkeypatch) -> Iterator[ModuleType]:
    """benchmarks/<name>.py imported under its own name, for a script whose spawned ranks unpickle its functions.

    The ranks import the script by module name and inherit this process's path, so it is imported from
    benchmarks/ (put first on the path) as `name`, in this process (its imports are paid already), and removed
    from `sys.modules` afterwards.
    """
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert name not in sys.modules
    try:
        module = importlib.import_module(name)
        assert module.__file__ == str(script_path(name))
        yield module
    finally:
        sys.modules.pop(name, None)
