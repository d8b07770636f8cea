"""Plugins: the user's Python files or modules that register names in the registries (`conveyor.registry`).

Estimators, policy losses, KL controllers, reward functions, trackers, tool-call
formats, rollout engines, data-plane backends and roles (a scoring role's worker,
handle and placement: `conveyor.workers.placement.role_table.register_role`) can
all be registered there.

`trainer.plugins` names them; they are imported before the config's choices are
checked (so a registered name is valid) and again in every worker process (so
a Ray rank computes with the same registries). Each is imported once per
process (registering the same name twice would otherwise clash), the way all
of the user's code is loaded: see `conveyor.user_code`.
"""

from __future__ import annotations

from types import ModuleType

from conveyor.user_code import import_user_code

__all__ = ["load_plugins"]

_KEY = "trainer.plugins"


def load_plugins(plugins: list[str]) -> list[ModuleType]:
    """Import each plugin (a `.py` path or a module name) once in this process; a failure names the plugin."""
    modules = []
    for entry in plugins:
        if not isinstance(entry, str) or not entry.strip():
            raise ValueError(f"{_KEY}: entries must be file paths or module names, got {entry!r}")
        modules.append(import_user_code(entry, key=_KEY))
    return modules
