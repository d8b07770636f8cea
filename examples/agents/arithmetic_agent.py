"""An agent on the `openai` SDK for the arithmetic tool task (`synthetic/arithmetic_tool`), run by the gateway.

conveyor runs it once per session (`actor_rollout_ref.rollout.agent.command`,
examples/agent_gateway.yaml): it reads its task as one JSON line on stdin,
talks to the policy at $OPENAI_BASE_URL with $OPENAI_API_KEY, and runs the
same turns as the built-in tool loop (examples/agent_arithmetic_tool.yaml):
the model's `#calc 123*456;` comes back as an OpenAI tool call, the
calculator's answer goes back as a tool message, at most 3 model turns and
2 tool answers, each answer cut to 16 characters. It prints no reward: the
gateway scores the session's last completion with the task's reward function.

Its tools are the run's own (examples/tools/calculator.yaml, through
conveyor.tools), so a tool answer, error texts included, is the built-in
loop's to the character: which is what lets a test compare the two token for
token. Any other agent needs none of conveyor: only OPENAI_BASE_URL.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import openai

from conveyor.tools.base import load_tools, release_all, run_call, truncate_text
from conveyor.tools.formats import ToolCall, ToolCallError, get_format

TOOL_YAML = Path(__file__).resolve().parent.parent / "tools" / "calculator.yaml"
SCHEMA = [
    {
        "type": "function",
        "function": {
            "name": "calc",
            "description": "evaluates one arithmetic expression",
            "parameters": {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]},
        },
    }
]


def session(
    client: openai.OpenAI,
    task: dict,
    *,
    tools_yaml: str = str(TOOL_YAML),
    call_format: str = "hash",
    max_assistant_turns: int = 3,
    max_user_turns: int = 2,
    max_tool_chars: int = 16,
) -> None:
    """One session: turns until the model answers or a limit is reached (no reward: the task's rule scores it)."""
    tools = load_tools(tools_yaml)
    fmt = get_format(call_format)
    created: set[str] = set()
    messages = list(task["prompt"])
    assistant = user = 0
    try:
        while True:
            try:
                reply = client.chat.completions.create(model="policy", messages=messages, tools=SCHEMA)
            except openai.BadRequestError:
                break  # the sample has no room left for another turn
            message = reply.choices[0].message
            messages.append(message.model_dump(exclude_none=True, include={"role", "content", "tool_calls"}))
            assistant += 1
            if assistant >= max_assistant_turns or user >= max_user_turns:
                break
            if message.tool_calls:
                call = message.tool_calls[0]
                text = json.loads(call.function.arguments).get("text", "")
                answer = run_call(tools, ToolCall(call.function.name, text=text), "session", created).text
                call_id = call.id
            else:
                try:  # a turn whose call does not parse is answered with the parser's error, as the built-in loop does
                    fmt.parse(message.content or "")
                    break  # no call: the model has answered
                except ToolCallError as err:
                    answer, call_id = f"error: {err}", "malformed"
            content = truncate_text(answer, max_tool_chars, "middle")
            messages.append({"role": "tool", "tool_call_id": call_id, "content": content})
            user += 1
    finally:
        release_all(tools, "session", created)


_CLIENT: list[openai.OpenAI] = []


def run(base_url: str, api_key: str, task: dict) -> float | None:
    """The same agent in-process (actor_rollout_ref.rollout.agent.callable=examples/agents/arithmetic_agent.py:run)."""
    # One HTTP client for all sessions, each with its own base URL and key: making a client costs tens of ms (its
    # SSL context), more than a session's requests.
    if not _CLIENT:
        _CLIENT.append(openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=600))
    session(_CLIENT[0].with_options(base_url=base_url, api_key=api_key), task)
    return None


def main() -> int:
    """The agent as a command: its task from stdin, the gateway from the environment."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tools", default=str(TOOL_YAML), help="the tool YAML (multi_turn.tool_config_path's format)")
    ap.add_argument("--format", default="hash", help="the run's call format (multi_turn.format)")
    ap.add_argument("--plugin", default=None, help="a Python file to import first (a call format it registers)")
    ap.add_argument("--max-assistant-turns", type=int, default=3)
    ap.add_argument("--max-user-turns", type=int, default=2)
    ap.add_argument("--max-tool-chars", type=int, default=16)
    args = ap.parse_args()
    if args.plugin:
        from conveyor.user_code import import_user_code

        import_user_code(args.plugin, key="--plugin")
    task = json.loads(sys.stdin.readline())
    session(
        openai.OpenAI(max_retries=0, timeout=600),
        task,
        tools_yaml=args.tools,
        call_format=args.format,
        max_assistant_turns=args.max_assistant_turns,
        max_user_turns=args.max_user_turns,
        max_tool_chars=args.max_tool_chars,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
