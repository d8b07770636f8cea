"""Plugins: the user's Python files or modules that register estimators, policy losses or reward functions.

`trainer.plugins` names them; they are imported before the config's choices are
checked (so a registered name is valid) and again in every worker process (so
a Ray rank computes with the same registries). Each is imported once per
process: registering the same name twice would otherwise clash.

It deliberately does not sandbox anything: a plugin is the user's own code,
run with the user's rights, like `reward.custom_reward_function.path`.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

__all__ = ["load_plugins"]

_LOADED: dict[str, ModuleType] = {}


def _import_file(file: Path) -> ModuleType:
    name = f"conveyor_plugin_{file.stem}_{hashlib.sha1(str(file).encode()).hexdigest()[:8]}"
    spec = importlib.util.spec_from_file_location(name, file)
    if spec is None or spec.loader is None:
        raise ValueError(f"trainer.plugins: {str(file)!r} is not a Python file")
    module = importlib.util.module_from_spec(spec)
    # In sys.modules before it runs, so pickling a class or function it defines works (Ray ships them by name).
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as err:
        del sys.modules[name]
        raise ValueError(f"trainer.plugins: importing {str(file)!r} failed: {type(err).__name__}: {err}") from err
    return module


def load_plugins(plugins: list[str]) -> list[ModuleType]:
    """Import each plugin (a `.py` path or a module name) once in this process; a failure names the plugin."""
    modules = []
    for entry in plugins:
        if not isinstance(entry, str) or not entry.strip():
            raise ValueError(f"trainer.plugins: entries must be file paths or module names, got {entry!r}")
        is_file = entry.endswith(".py") or "/" in entry
        key = str(Path(entry).expanduser().resolve()) if is_file else entry
        if key not in _LOADED:
            if is_file:
                file = Path(key)
                if not file.is_file():
                    raise ValueError(f"trainer.plugins: no such file {entry!r}")
                _LOADED[key] = _import_file(file)
            else:
                try:
                    _LOADED[key] = importlib.import_module(entry)
                except Exception as err:
                    raise ValueError(f"trainer.plugins: importing module {entry!r} failed: "
                                     f"{type(err).__name__}: {err}") from err
        modules.append(_LOADED[key])
    return modules
