"""Agents for the gateway's tests, loaded by file path (`agent.callable=tests/agent/gateway_agents.py:NAME`, or run as a
command: `python tests/agent/gateway_agents.py NAME`). Each talks to the gateway through the real `openai` client."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import openai

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples" / "agents"))
from conveyor.user_code import import_user_code  # noqa: E402

import_user_code(str(Path(__file__).with_name("digit_format.py")), key="tests")  # test_digit_calls
import arithmetic_agent  # noqa: E402


def _client(base_url: str | None = None, api_key: str | None = None) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=120)


def digits(base_url: str, api_key: str, task: dict) -> None:
    """The example agent under the test call format (an untrained model calls the tool often)."""
    arithmetic_agent.session(_client(base_url, api_key), task, call_format="test_digit_calls", max_user_turns=3)


def forgetful(base_url: str, api_key: str, task: dict) -> float:
    """Three turns, each sent with the earlier answers summarised away (a history the model never saw): every call
    after the first starts a new sample of the session. Reports a reward of 0.5 by return value."""
    client = _client(base_url, api_key)
    messages = list(task["prompt"])
    for turn in range(3):
        reply = client.chat.completions.create(model="p", messages=messages, max_tokens=4)
        messages = list(task["prompt"]) + [
            {"role": "user", "content": f"{turn}+{len(reply.choices[0].message.content or '')}="}
        ]
    return 0.5


def second_look(base_url: str, api_key: str, task: dict) -> None:
    """Two turns over a task with images: the second shows the first image again in a user message, so it starts a
    sample of its own (an image belongs to a sample's first prompt). A text-only task gets one turn."""
    client = _client(base_url, api_key)
    messages = list(task["prompt"])
    reply = client.chat.completions.create(model="p", messages=messages, max_tokens=3)
    content = messages[0]["content"]
    if not isinstance(content, list):
        return
    image = next(p for p in content if p["type"] == "image_url")
    messages += [
        {"role": "assistant", "content": reply.choices[0].message.content or ""},
        {"role": "user", "content": [image, {"type": "text", "text": "again="}]},
    ]
    client.chat.completions.create(model="p", messages=messages, max_tokens=3)


def poster(base_url: str, api_key: str, task: dict) -> None:
    """One completion, then its reward posted to the session's /reward."""
    client = _client(base_url, api_key)
    client.chat.completions.create(model="p", messages=task["prompt"], max_tokens=3)
    client.post(base_url.removesuffix("/v1") + "/reward", body={"reward": 0.25}, cast_to=object)


def main() -> int:
    """As a command: `agents.py NAME` runs agent NAME on the task from stdin (some names test failures)."""
    name = sys.argv[1]
    task = json.loads(sys.stdin.readline())
    base, key = os.environ["OPENAI_BASE_URL"], os.environ["OPENAI_API_KEY"]
    if name == "digits":
        digits(base, key, task)
    elif name == "stdout_reward":
        _client().chat.completions.create(model="p", messages=task["prompt"], max_tokens=2)
        print("some text")
        print(json.dumps({"reward": 0.75}))
    elif name == "crash":
        _client().chat.completions.create(model="p", messages=task["prompt"], max_tokens=2)
        return 3
    elif name == "hang":
        _client().chat.completions.create(model="p", messages=task["prompt"], max_tokens=2)
        import signal

        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # ignores SIGTERM: only SIGKILL ends it
        Path(os.environ["AGENT_PID_DIR"], f"{os.getpid()}.pid").write_text("")
        time.sleep(600)
    elif name == "daemon":
        import subprocess

        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        Path(os.environ["AGENT_PID_DIR"], f"{child.pid}.pid").write_text("")
        _client().chat.completions.create(model="p", messages=task["prompt"], max_tokens=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())


def sdk(base_url: str, api_key: str, task: dict) -> None:
    """An agent on the openai-agents SDK: its own tool loop (a calculator function tool), its own message history,
    the policy as an `OpenAIChatCompletionsModel` at the session's base URL."""
    import asyncio

    from agents import Agent, OpenAIChatCompletionsModel, Runner, function_tool, set_tracing_disabled
    from agents.exceptions import MaxTurnsExceeded

    from conveyor.tools.calculator import calculate

    set_tracing_disabled(True)  # the SDK's tracing exports to a remote service

    @function_tool
    def calc(text: str) -> str:
        """Evaluate one arithmetic expression."""
        try:
            return calculate(text)[:8]
        except ValueError:
            return "error"

    client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    agent = Agent(
        name="calculator",
        instructions=None,
        tools=[calc],
        model=OpenAIChatCompletionsModel(model="policy", openai_client=client),
    )

    async def go() -> None:
        try:
            await Runner.run(agent, input=task["prompt"][0]["content"], max_turns=3)
        except (MaxTurnsExceeded, openai.BadRequestError):
            pass  # the model kept calling its tool, or filled its sample: the session ends there, scored by the rule
        finally:
            await client.close()

    asyncio.run(go())
