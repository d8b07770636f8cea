"""Loading the user's Python code: plugins, a custom reward function, the tools of a multi-turn rollout.

Three config entries name code of the user's: `trainer.plugins` (files or
modules that register estimators, losses or reward functions),
`reward.custom_reward_function.path` with `.name`, and the `path` of each tool
in the tool YAML. They are loaded here, one way:

- a source is a `.py` file (anything ending in `.py` or holding a `/`,
  relative to the current directory) or the name of an importable module;
- each is imported once per process, keyed by its resolved path (or module
  name), so a file named by two entries runs once and whatever it registers
  is registered once;
- a file's module is put in `sys.modules` (under a name derived from its
  path, which no importable module has) before it runs, so pickling a class
  or function it defines works: Ray ships them by name;
- every failure is one `ValueError` on one line naming the config key (or
  the tool file), the source and what went wrong. An exception raised while
  importing, `SystemExit` included (a module that calls `sys.exit` would
  otherwise end the run with status 0, having trained nothing), is such a
  failure; `KeyboardInterrupt` goes through.

It deliberately does not sandbox anything: this is the user's own code, run
with the user's rights.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

__all__ = ["describe_error", "import_user_code", "is_file_source", "user_attribute"]

_LOADED: dict[str, ModuleType] = {}


def describe_error(err: BaseException) -> str:
    """`Type: message` on one line; a `SystemExit` says that sys.exit was called."""
    if isinstance(err, SystemExit):
        return f"it called sys.exit({err.code!r})"
    try:
        text = " ".join(str(err).split())
    except Exception:  # an exception whose __str__ itself fails still has a type to report
        text = "(its message cannot be shown)"
    text = text.encode("utf-8", "replace").decode("utf-8")  # lone surrogates cannot be printed or logged
    return f"{type(err).__name__}: {text}" if text else type(err).__name__


def is_file_source(source: str) -> bool:
    """Whether `source` names a Python file (rather than an importable module)."""
    return source.endswith(".py") or "/" in source


def _module_name(file: Path) -> str:
    """The `sys.modules` name of a user file: its stem plus a hash of its path, so no real module is shadowed."""
    digest = hashlib.sha1(str(file).encode()).hexdigest()[:8]
    stem = "".join(c if c.isalnum() or c == "_" else "_" for c in file.stem)
    return f"conveyor_user_{stem}_{digest}"


def _import_file(file: Path, source: str, key: str) -> ModuleType:
    name = _module_name(file)
    spec = importlib.util.spec_from_file_location(name, file)
    if spec is None or spec.loader is None:
        raise ValueError(f"{key}: {source!r} is not a Python file")
    module = importlib.util.module_from_spec(spec)
    # In sys.modules before it runs, so pickling a class or function it defines works (Ray ships them by name).
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException as err:
        sys.modules.pop(name, None)  # a half-run module is not left behind; the next load runs it again
        if not isinstance(err, (Exception, SystemExit)):
            raise  # KeyboardInterrupt
        raise ValueError(f"{key}: importing {source!r} failed: {describe_error(err)}") from err
    return module


def import_user_code(source: str, *, key: str) -> ModuleType:
    """The module of `source` (a `.py` path or a module name), imported once in this process.

    `key` names where `source` came from (a config key, or a tool file and
    entry) and starts every error message.
    """
    if not isinstance(source, str) or not source.strip():
        raise ValueError(f"{key}: give a Python file path or a module name, got {source!r}")
    if is_file_source(source):
        file = Path(source).expanduser().resolve()
        cache_key = str(file)
        if cache_key not in _LOADED:
            if not file.is_file():
                raise ValueError(f"{key}: no such file {source!r}")
            _LOADED[cache_key] = _import_file(file, source, key)
        return _LOADED[cache_key]
    if source not in _LOADED:
        try:
            _LOADED[source] = importlib.import_module(source)
        except (Exception, SystemExit) as err:
            raise ValueError(f"{key}: importing module {source!r} failed: {describe_error(err)}") from err
    return _LOADED[source]


def user_attribute(
    source: str,
    name: str,
    *,
    key: str,
    name_key: str | None = None,
    kind: str = "attribute",
    must_be_callable: bool = False,
) -> Any:
    """The object `name` (dots reach into it: `Class.method`) of the module of `source`, imported as above.

    A missing name (or, with `must_be_callable`, one that cannot be called)
    is a ValueError naming `name_key` (default `key`), the source and the
    name, as "defines no <kind>".
    """
    module = import_user_code(source, key=key)
    obj: Any = module
    for part in name.split("."):
        obj = getattr(obj, part, _MISSING) if part else _MISSING
        if obj is _MISSING:
            break
    if obj is _MISSING or (must_be_callable and not callable(obj)):
        raise ValueError(f"{name_key or key}: {source!r} defines no {kind} {name!r}")
    return obj


_MISSING = object()
