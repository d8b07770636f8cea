"""Registries: the name -> implementation tables behind every choice a config makes by name.

Every table (advantage estimators, policy losses, KL controllers, training
strategies, trackers, reward functions, tool-call formats, rollout engines,
data-plane backends, the roles of a run) is a plain dict, filled with `registrar` and read with
`lookup`, so one rule holds for all of them:

- a name is registered once: registering another implementation under a taken
  name is a `ValueError` (a silent replacement would change a run without a
  word) unless `overwrite=True` says the replacement is meant; registering the
  same object again is a no-op (a module imported twice);
- an unknown name is a `ValueError` on one line naming the config key, the
  name, the nearest valid name and all the valid ones.

The config reads its valid choices from these same dicts (when a config is
checked, not when it is imported), so whatever a `trainer.plugins` file
registers is selectable from the command line at once. This module holds no
table itself and imports nothing of conveyor: each table lives beside the code
that implements its entries.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Mapping
from typing import TypeVar

__all__ = ["lookup", "registrar", "unknown_name"]

T = TypeVar("T")


def registrar(table: dict[str, T], name: str, what: str, *, overwrite: bool = False) -> Callable[[T], T]:
    """A decorator putting its argument into `table` under `name`; `what` names the kind in the error."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"a {what} is registered under a non-empty string, got {name!r}")

    def decorator(obj: T) -> T:
        existing = table.get(name)
        if existing is not None and existing is not obj and not overwrite:
            raise ValueError(
                f"{what} {name!r} is already registered ({_describe(existing)}); pass overwrite=True to replace it"
            )
        table[name] = obj
        return obj

    return decorator


def unknown_name(table: Mapping[str, object], name: object, key: str) -> str:
    """The one-line message for `name` missing from `table`: the config key, the nearest and all valid names."""
    valid = sorted(table)
    near = difflib.get_close_matches(str(name), valid, n=1)
    hint = f" (did you mean {near[0]!r}?)" if near else ""
    return f"{key}: unknown {name!r}{hint}; valid names are {', '.join(valid)}"


def lookup(table: Mapping[str, T], name: str, key: str) -> T:
    """`table[name]`; a ValueError naming the config `key` and the valid names when `name` is not registered."""
    try:
        return table[name]
    except (KeyError, TypeError):  # TypeError: an unhashable name (a list from YAML) is unknown too
        raise ValueError(unknown_name(table, name, key)) from None


def _describe(obj: object) -> str:
    """How an error names a registered object: its qualified name where it has one."""
    qualname = getattr(obj, "__qualname__", None)
    module = getattr(obj, "__module__", None)
    return f"{module}.{qualname}" if qualname and module else repr(obj)
