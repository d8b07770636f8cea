"""Tool-call syntaxes: how a tool call is found in a model turn, and how a tool's answer is worded.

A format is chosen by `actor_rollout_ref.rollout.multi_turn.format`:

- ``hermes`` (verl's default, what Qwen models are trained on): a call is
  ``<tool_call>{"name": "calc", "arguments": {"expression": "2+3"}}</tool_call>``
  anywhere in the turn; the arguments are passed as keyword arguments. The
  turn ends at EOS, as the model's chat template ends it. The tool's text is
  the content of a ``tool`` message (the chat template wraps it).
- ``hash``: a call is ``#name text;`` at the end of the turn: ``#``, the
  tool's name (lower-case letters, digits, ``_``), one space, any text, and
  ``;``, which ends the turn. The text is the function's one positional
  argument. The tool's answer is appended as ``=text;``. Every character of
  it exists in the tiny character tokenizer (`conveyor.models.tokenizer`),
  so a tiny model can learn to write it. A ``;`` always ends a turn; a turn
  that ends with ``;`` but holds no well-formed call ends the sample.

Another syntax is one `CallFormat` passed to `register_call_format`.

This module only reads and writes text: it does not tokenize, run tools or
know about models.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from conveyor.registry import lookup, registrar

__all__ = ["TOOL_CALL_FORMATS", "ToolCall", "ToolCallError", "CallFormat", "get_format", "register_call_format"]


@dataclass(frozen=True)
class ToolCall:
    """One parsed call: the tool's `name` and either keyword `arguments` (hermes) or one free `text` (hash)."""

    name: str
    arguments: dict[str, Any] | None = None
    text: str | None = None


class ToolCallError(ValueError):
    """The turn holds a call that cannot be parsed; the message is shown to the model as the tool's answer."""


@dataclass(frozen=True)
class CallFormat:
    """A tool-call syntax: the texts that end a turn, how a call is parsed, how an answer is worded.

    `parser(turn_text)` returns the turn's `ToolCall`, None when it makes no call, or raises
    `ToolCallError`; `response_template` holds `{text}` where the tool's text goes.
    """

    name: str
    stop_texts: tuple[str, ...]
    parser: Callable[[str], ToolCall | None]
    response_template: str = "{text}"

    def parse(self, turn: str) -> ToolCall | None:
        """The call in one model turn's text, None when the turn makes no call; ToolCallError when malformed."""
        return self.parser(turn)

    def response_content(self, text: str) -> str:
        """The content of the tool message that carries `text` back to the model."""
        return self.response_template.replace("{text}", text)


_HASH_CALL = re.compile(r"#([a-z_][a-z0-9_]*)(?: (.*))?;\s*$", re.DOTALL)
_HERMES_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


def _parse_hash(turn: str) -> ToolCall | None:
    stripped = turn.rstrip()
    if not stripped.endswith(";"):
        return None
    start = stripped.rfind("#")
    if start < 0:
        return None  # a ";" without a call: the turn just ends
    m = _HASH_CALL.match(stripped[start:])
    if m is None:
        raise ToolCallError(f"malformed call {stripped[start:]!r}; write #name text;")
    return ToolCall(name=m.group(1), text=(m.group(2) or "").strip())


MAX_JSON_DEPTH = 64
"""Deepest nesting of brackets a tool call's JSON may have: deeper is refused before parsing (the parser recurses)."""


def _json_depth(text: str) -> int:
    """The deepest bracket nesting of `text`, counting brackets outside JSON strings (an upper bound when malformed)."""
    depth = deepest = 0
    in_string = escaped = False
    for ch in text:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif ch in "]}":
            depth -= 1
    return deepest


def _load_json(text: str, what: str) -> Any:
    """`text` parsed as JSON; ToolCallError (shown to the model) when it is not JSON or nested too deeply."""
    if _json_depth(text) > MAX_JSON_DEPTH:
        raise ToolCallError(f"{what} nests brackets deeper than {MAX_JSON_DEPTH} levels")
    try:
        return json.loads(text)
    except ValueError as err:
        raise ToolCallError(f"{what} is not valid JSON ({err})") from err


def _parse_hermes(turn: str) -> ToolCall | None:
    found = _HERMES_CALL.findall(turn)
    if not found:
        if "<tool_call>" in turn:
            raise ToolCallError("a <tool_call> is not closed with </tool_call>")
        return None
    body = found[-1].strip()  # one call per turn: the last one wins
    obj = _load_json(body, "the tool call")
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        raise ToolCallError('a tool call must be {"name": ..., "arguments": {...}}')
    args = obj.get("arguments", {})
    if isinstance(args, str):  # some models write the arguments as a JSON string
        args = _load_json(args, "the tool call's arguments")
    if not isinstance(args, dict):
        raise ToolCallError("a tool call's arguments must be a JSON object")
    return ToolCall(name=obj["name"], arguments=args)


#: Format name -> its syntax; the valid values of multi_turn.format.
_FORMATS: dict[str, CallFormat] = {}
TOOL_CALL_FORMATS = _FORMATS.keys()
"""The names of the registered formats (a live view: a format registered later is listed)."""


def register_call_format(call_format: CallFormat, *, overwrite: bool = False) -> CallFormat:
    """Make `call_format` selectable as multi_turn.format=<its name> (e.g. from a `trainer.plugins` file)."""
    if not isinstance(call_format, CallFormat):
        raise ValueError(f"register_call_format takes a CallFormat, got {type(call_format).__name__}")
    return registrar(_FORMATS, call_format.name, "tool-call format", overwrite=overwrite)(call_format)


def get_format(name: str) -> CallFormat:
    """The syntax called `name`; ValueError naming the valid ones otherwise."""
    return lookup(_FORMATS, name, "actor_rollout_ref.rollout.multi_turn.format")


register_call_format(CallFormat("hermes", stop_texts=(), parser=_parse_hermes))
register_call_format(CallFormat("hash", stop_texts=(";",), parser=_parse_hash, response_template="={text};"))
