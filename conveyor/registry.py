"""Registries: name -> function tables that algorithms, trackers and the config's choices share.

One rule for all of them: a name is registered once; registering another
function under a taken name is a `ValueError` (a silent replacement would
change a run without a word), while registering the same function again is a
no-op (a module imported twice).
"""

from __future__ import annotations

from typing import Callable, TypeVar

__all__ = ["registrar"]

T = TypeVar("T")


def registrar(registry: dict[str, T], name: str, what: str) -> Callable[[T], T]:
    """A decorator putting its function into `registry` under `name`; `what` names the kind in the error."""

    def decorator(fn: T) -> T:
        if name in registry and registry[name] is not fn:
            raise ValueError(f"{what} {name!r} is already registered")
        registry[name] = fn
        return fn

    return decorator
