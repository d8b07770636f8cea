"""What the gateway tests on the hf engine and on vLLM share: the prompts, and the agent command that answers them."""

from __future__ import annotations

import sys

PROMPTS = ["1+2=", "12+345=", "7*8=", "100-1="]
# The example agent on the openai client, with the test's digit call format (registered by its --plugin file).
AGENT = (
    f"{sys.executable} examples/agents/arithmetic_agent.py --format test_digit_calls "
    "--plugin tests/agent/digit_format.py"
)
