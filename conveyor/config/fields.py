"""How a setting is declared and the one place declared checks run.

A setting is a dataclass field made with `F`: its default, a one-line help
string and, where they apply, its valid range (`gt`, `ge`, `lt`, `le`), its
valid choices (read lazily from the registry of the code that implements them,
see `registry`) and whether a resumed run may change it (`resume_neutral`). A
nested section is a field made with `S`. `check_tree` runs every declared
check of every section, then each section's own `validate(prefix)` for what is
not a plain range or choice, and raises a one-line `ConfigError` naming the
full dotted key.

This module deliberately knows no section and imports no implementation: a
choice list is imported the first time it is checked or described, so the
schema can be imported by the code it configures without an import cycle.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
import types
import typing
from collections.abc import Callable, Iterable, Iterator
from dataclasses import field
from functools import cache
from typing import Any, Union

__all__ = [
    "ConfigError",
    "F",
    "S",
    "registry",
    "check",
    "check_tree",
    "choices_of",
    "walk",
    "field_paths",
    "resume_neutral_keys",
    "section_hints",
]


class ConfigError(ValueError):
    """A user mistake in the configuration; the message names the key and the fix."""


Choices = Callable[[], Iterable[Any]] | Iterable[Any]


def registry(module: str, name: str) -> Callable[[], Iterable[Any]]:
    """The valid choices of a field: `module.name` (a dict's keys, or a tuple), imported on first use."""

    def read() -> Iterable[Any]:
        return getattr(importlib.import_module(module), name)

    read.__qualname__ = f"registry({module}.{name})"
    return read


def F(  # noqa: N802 - a field declaration reads like a type
    default: Any,
    help: str,  # noqa: A002
    choices: Choices | None = None,
    *,
    gt: float | None = None,
    ge: float | None = None,
    lt: float | None = None,
    le: float | None = None,
    hint: str | None = None,
    resume_neutral: bool = False,
) -> Any:
    """A setting: its default, one-line help, valid range and choices, and whether a resume may change it.

    `choices` is a tuple, or a callable (e.g. `registry(...)`) returning the
    registry of the code that implements the choices, read when a config is
    checked or described, so a function registered at run time (e.g. from
    `trainer.plugins`) is valid at once. `hint` is added to a range error in
    parentheses (e.g. "0 = no limit"). A field whose annotation is Optional
    may also be null.
    """
    meta = {
        "help": help,
        "choices": choices,
        "gt": gt,
        "ge": ge,
        "lt": lt,
        "le": le,
        "hint": hint,
        "resume_neutral": resume_neutral,
    }
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda d=default: type(d)(d), metadata=meta)
    return field(default=default, metadata=meta)


def S(cls: type, help: str, *, resume_neutral: bool = False) -> Any:  # noqa: N802, A002
    """A nested section; `resume_neutral` makes every key under it free to change on resume."""
    return field(default_factory=cls, metadata={"help": help, "resume_neutral": resume_neutral})


def check(cond: bool, key: str, msg: str) -> None:
    """Raise `ConfigError("key: msg")` unless `cond` (for the checks that are not a plain range or choice)."""
    if not cond:
        raise ConfigError(f"{key}: {msg}")


def choices_of(f: dataclasses.Field) -> list[Any] | None:
    """The valid choices of field `f` as a list (read from its registry now), or None when it has none."""
    choices = f.metadata.get("choices")
    if choices is None:
        return None
    return list(choices() if callable(choices) else choices)


@cache
def section_hints(cls: type) -> dict[str, Any]:
    """The resolved annotations of a section class (cached: they never change)."""
    return typing.get_type_hints(cls)


def _optional(t: Any) -> bool:
    return typing.get_origin(t) in (Union, types.UnionType) and type(None) in typing.get_args(t)


def _range_text(meta: typing.Mapping[str, Any]) -> str | None:
    lo = ("(", meta["gt"]) if meta.get("gt") is not None else ("[", meta["ge"]) if meta.get("ge") is not None else None
    hi = (")", meta["lt"]) if meta.get("lt") is not None else ("]", meta["le"]) if meta.get("le") is not None else None
    if lo and hi:
        return f"in {lo[0]}{lo[1]:g}, {hi[1]:g}{hi[0]}"
    if lo:
        return f"{'>' if lo[0] == '(' else '>='} {lo[1]:g}"
    if hi:
        return f"{'<' if hi[0] == ')' else '<='} {hi[1]:g}"
    return None


def _in_range(value: Any, meta: typing.Mapping[str, Any]) -> bool:
    return (
        (meta.get("gt") is None or value > meta["gt"])
        and (meta.get("ge") is None or value >= meta["ge"])
        and (meta.get("lt") is None or value < meta["lt"])
        and (meta.get("le") is None or value <= meta["le"])
    )


def _check_field(section: Any, f: dataclasses.Field, key: str) -> None:
    """The declared range and choices of one field of `section`."""
    value = getattr(section, f.name)
    valid = choices_of(f)
    if valid is not None:
        for v in value if isinstance(value, list) else [value]:
            if v is not None and v not in valid:  # null, where a key allows it, means "the default choice"
                near = difflib.get_close_matches(str(v), [str(c) for c in valid], n=1)
                hint = f" (did you mean {near[0]!r}?)" if near else ""
                raise ConfigError(f"{key}: unknown {v!r}{hint}; valid: {valid}")
    text = _range_text(f.metadata)
    if text is None:
        return
    nullable = _optional(section_hints(type(section))[f.name])
    if value is None and nullable:
        return
    if not isinstance(value, bool) and isinstance(value, (int, float)) and _in_range(value, f.metadata):
        return
    hint = f.metadata.get("hint")
    raise ConfigError(
        f"{key}: must be {text}{' or null' if nullable else ''}{f' ({hint})' if hint else ''}, got {value}"
    )


def check_tree(section: Any, prefix: str = "") -> None:
    """Check `section` and every section under it: nested ones first, then declared fields, then `validate`.

    The one place checks run. A section is checked where it sits in the tree,
    since its keys are named by their full dotted path (the same optimizer
    section sits under the actor and the critic).
    """
    for f in dataclasses.fields(section):
        value = getattr(section, f.name)
        if dataclasses.is_dataclass(value):
            check_tree(value, f"{prefix}{f.name}.")
    for f in dataclasses.fields(section):
        if not dataclasses.is_dataclass(getattr(section, f.name)):
            _check_field(section, f, prefix + f.name)
    validate = getattr(section, "validate", None)
    if validate is not None:
        validate(prefix.rstrip("."))


def walk(cls: type, prefix: str = "") -> Iterator[tuple[str, dataclasses.Field, type | None]]:
    """(dotted path, field, section class or None) for every field of `cls` and its sections, in order."""
    hints = section_hints(cls)
    for f in dataclasses.fields(cls):
        sub = hints[f.name] if dataclasses.is_dataclass(hints[f.name]) else None
        yield prefix + f.name, f, sub
        if sub is not None:
            yield from walk(sub, f"{prefix}{f.name}.")


def field_paths(cls: type) -> list[str]:
    """Every dotted key of `cls`, sections included, in field order."""
    return [path for path, _, _ in walk(cls)]


def resume_neutral_keys(cls: type) -> tuple[str, ...]:
    """The keys declared `resume_neutral` under `cls`; a whole section is its path with a trailing '.'."""
    out: list[str] = []
    skip: tuple[str, ...] = ()
    for path, f, sub in walk(cls):
        if skip and path.startswith(skip):
            continue
        if f.metadata.get("resume_neutral"):
            out.append(path + "." if sub is not None else path)
            if sub is not None:
                skip = skip + (path + ".",)
    return tuple(out)
