"""Tools a model may call during a rollout: what a tool is, how one is loaded from YAML and how a call runs.

A tool is either

- a plain function that takes the parsed call (keyword arguments under the
  hermes format, one text argument under the hash format) and returns its
  answer as text, or ``(text, reward)``; it may be ``async``; or
- a small class for tools with per-sample state: ``execute(instance_id,
  call) -> text | (text, reward)``, and optionally ``create(instance_id)``
  (before a sample's first call of it) and ``release(instance_id)`` (when
  the sample is done, also after an error). Constructed once with the
  YAML's ``config`` as keyword arguments. Methods may be ``async``.

The tool YAML (``actor_rollout_ref.rollout.multi_turn.tool_config_path``)::

    tools:
      - name: calc                                  # what the model writes
        path: conveyor.tools.calculator:calculate   # module:attribute, module.attribute or file.py:attribute
        config: {}                                  # optional: a class's constructor arguments

`run_call` never raises: an exception becomes an error text for the model
(and `ToolResult.error`), so one bad call does not stop a run. Timeouts are
the caller's business (`conveyor.rollout.agent_loop`), because a thread
cannot be stopped from inside. The one exception is a tool that returns an
image (a PIL image, or OpenAI-style content parts with an image): tool
outputs reach the policy as text only so far, and such a tool would fail on
every call, so the run stops naming it (`ToolOutputRefused`).
"""

from __future__ import annotations

import asyncio
import inspect
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from conveyor.files import read_text
from conveyor.tools.formats import ToolCall
from conveyor.user_code import describe_error, user_attribute

__all__ = [
    "Tool",
    "ToolOutputRefused",
    "ToolResult",
    "FunctionTool",
    "load_tools",
    "make_tool",
    "run_call",
    "release_all",
    "truncate_text",
]

_KEY = "actor_rollout_ref.rollout.multi_turn.tool_config_path"


@dataclass
class ToolResult:
    """What one call gave: the text shown to the model, a reward (0 if none), an error message or None, seconds."""

    text: str
    reward: float = 0.0
    error: str | None = None
    latency_s: float = 0.0


def _resolve(value: Any) -> Any:
    """`value`, awaited to completion when it is a coroutine (async tools run in the calling thread's own loop)."""
    if inspect.isawaitable(value):

        async def wait() -> Any:
            return await value

        return asyncio.run(wait())
    return value


class Tool:
    """The interface of a stateful tool (subclassing it is optional: any object with `execute` will do)."""

    def create(self, instance_id: str) -> None:
        """Set up the state of one sample (called before its first call of this tool)."""

    def execute(self, instance_id: str, call: ToolCall) -> Any:
        """Answer `call` for the sample `instance_id`: text, or (text, reward)."""
        raise NotImplementedError

    def release(self, instance_id: str) -> None:
        """Drop the state of one sample (called once the sample is done)."""


class FunctionTool(Tool):
    """A plain function as a tool: keyword arguments from a hermes call, the text of a hash call as one argument."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn

    def execute(self, instance_id: str, call: ToolCall) -> Any:
        """Call the function with the call's arguments."""
        if call.arguments is not None:
            return self.fn(**call.arguments)
        return self.fn(call.text if call.text is not None else "")


def _import(path: str, where: str) -> Any:
    """The object at `module:attr`, `module.attr` or `file.py:attr`, loaded as all user code is
    (`conveyor.user_code`)."""
    module, sep, attr = path.partition(":")
    if not sep:
        module, _, attr = path.rpartition(".")
    if not module or not attr:
        raise ValueError(
            f"{where}: {path!r} is not a Python path; write module.attribute, module:attribute or file.py:attribute"
        )
    return user_attribute(module, attr, key=where)


def make_tool(obj: Any, config: dict | None = None) -> Tool:
    """A `Tool` from a function, a class (constructed with `config`) or an object with `execute`."""
    config = dict(config or {})
    if inspect.isclass(obj):
        obj = obj(**config)
    elif callable(obj) and not hasattr(obj, "execute"):
        if config:
            raise ValueError("`config` is for tool classes; a function tool takes none (bind values in the function)")
        return FunctionTool(obj)
    if not callable(getattr(obj, "execute", None)):
        raise ValueError(
            f"{type(obj).__name__} is not a tool: give a function, or a class with execute(instance_id, call)"
        )
    return obj


def load_tools(path: str | Path) -> dict[str, Tool]:
    """Name -> tool, from the tool YAML at `path` (format in this module's docstring)."""
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"{_KEY}: no file at {str(p)!r}; give the path of a tool YAML (see docs/agent.md)")
    try:
        spec = yaml.safe_load(read_text(p, f"{_KEY}: the tool YAML"))
    except RecursionError as err:
        raise ValueError(f"{_KEY}: {str(p)!r} is nested too deeply to be a tool YAML") from err
    except yaml.YAMLError as err:
        raise ValueError(f"{_KEY}: {str(p)!r} is not valid YAML ({err})") from err
    entries = spec.get("tools") if isinstance(spec, dict) else None
    if not isinstance(entries, list) or not entries:
        raise ValueError(f"{_KEY}: {str(p)!r} must hold a non-empty list under `tools:` (entries with name and path)")
    tools: dict[str, Tool] = {}
    for i, entry in enumerate(entries):
        where = f"{_KEY}: {str(p)!r}, tools[{i}]"
        if (
            not isinstance(entry, dict)
            or not isinstance(entry.get("name"), str)
            or not isinstance(entry.get("path"), str)
        ):
            raise ValueError(f"{where}: give `name` (what the model writes) and `path` (module:attribute)")
        unknown = set(entry) - {"name", "path", "config", "description"}
        if unknown:
            raise ValueError(f"{where}: unknown keys {sorted(unknown)}; valid: name, path, config, description")
        if entry["name"] in tools:
            raise ValueError(f"{where}: the name {entry['name']!r} is used twice; give each tool its own")
        obj = _import(entry["path"], where)
        try:
            tools[entry["name"]] = make_tool(obj, entry.get("config"))
        except ValueError as err:
            raise ValueError(f"{where}: {err}") from err
        except (Exception, SystemExit) as err:  # a constructor that fails (sys.exit in it must not end the run quietly)
            raise ValueError(f"{where}: building {entry['path']!r} failed: {describe_error(err)}") from err
    return tools


class ToolOutputRefused(ValueError):
    """A tool returned an image, which the loop cannot pass to the policy: the run stops rather than every call fail."""


_IMAGE_PARTS = ("image", "image_url", "input_image")


def _is_image(value: Any) -> bool:
    """Whether a tool's answer is an image: a PIL image, or content parts (a dict or a list of them) holding one."""
    if type(value).__module__.startswith("PIL.") and hasattr(value, "getbands"):
        return True
    parts = value if isinstance(value, list) else [value]
    return any(isinstance(p, dict) and (p.get("type") in _IMAGE_PARTS or "image_url" in p) for p in parts)


def _normalise(value: Any) -> tuple[str, float]:
    """(text, reward) from what a tool returned; ValueError when it is neither text nor (text, number)."""
    reward = 0.0
    if isinstance(value, tuple) and len(value) == 2:
        value, reward = value
        if isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(float(reward)):
            raise ValueError(f"the reward it returned is {reward!r}, not a finite number")
    if _is_image(value):
        raise ToolOutputRefused(
            f"it returned an image ({type(value).__name__}); tool outputs reach the policy as text only so far "
            "(images a tool returns are not passed to a vision-language policy yet, docs/vlm.md): return text, "
            "or (text, reward)"
        )
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        value = str(value)
    if not isinstance(value, str):
        raise ValueError(f"it returned {type(value).__name__}; return text, or (text, reward)")
    # Lone surrogates (half a UTF-16 pair) cannot be tokenized, dumped or printed: they become U+FFFD's "?".
    return value.encode("utf-8", "replace").decode("utf-8"), float(reward)


def run_call(tools: dict[str, Tool], call: ToolCall, instance_id: str, created: set[str]) -> ToolResult:
    """Run one call; errors (unknown tool, an exception, a bad return value) become a `ToolResult` with `error`."""
    start = time.perf_counter()
    tool = tools.get(call.name)
    try:
        if tool is None:
            raise LookupError(f"unknown tool {call.name!r}; tools: {', '.join(sorted(tools))}")
        if call.name not in created:
            created.add(call.name)  # released even if create fails half-way
            if hasattr(tool, "create"):
                _resolve(tool.create(instance_id))
        text, reward = _normalise(_resolve(tool.execute(instance_id, call)))
        return ToolResult(text, reward, None, time.perf_counter() - start)
    except ToolOutputRefused as err:
        raise ToolOutputRefused(f"tool {call.name!r}: {err}") from None
    # sys.exit in a tool, or a coroutine tool cancelled from inside, is a failed call, not the end of the run.
    except (Exception, SystemExit, asyncio.CancelledError) as err:
        message = describe_error(err) if tool is not None else str(err).strip("'\"")
        return ToolResult(f"error: {message}", 0.0, message, time.perf_counter() - start)


def release_all(tools: dict[str, Tool], instance_id: str, created: set[str]) -> list[str]:
    """Call `release` of every tool this sample created; the messages of those that raised."""
    failures = []
    for name in sorted(created):
        tool = tools.get(name)
        if tool is None or not hasattr(tool, "release"):
            continue
        try:
            _resolve(tool.release(instance_id))
        except (Exception, SystemExit, asyncio.CancelledError) as err:
            failures.append(f"tool {name!r} release raised {describe_error(err)}")
    return failures


def truncate_text(text: str, limit: int, side: str) -> str:
    """`text` cut to `limit` characters on `side` (left, middle or right), the cut marked with "..."."""
    if len(text) <= limit:
        return text
    if side == "left":
        return "..." + text[len(text) - limit :]
    if side == "right":
        return text[:limit] + "..."
    half = limit // 2
    return text[:half] + "..." + text[len(text) - (limit - half) :]
