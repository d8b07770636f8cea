"""Tools for multi-turn rollouts: call syntaxes (`formats`), the tool interface and loader (`base`), a calculator.

The agent loop that calls them lives in `conveyor.rollout.agent_loop`.
"""

from conveyor.tools.base import FunctionTool, Tool, ToolResult, load_tools, make_tool, release_all, run_call
from conveyor.tools.calculator import calculate
from conveyor.tools.formats import (
    TOOL_CALL_FORMATS,
    CallFormat,
    ToolCall,
    ToolCallError,
    get_format,
    register_call_format,
)

__all__ = [
    "TOOL_CALL_FORMATS",
    "CallFormat",
    "FunctionTool",
    "Tool",
    "ToolCall",
    "ToolCallError",
    "ToolResult",
    "calculate",
    "get_format",
    "load_tools",
    "make_tool",
    "register_call_format",
    "release_all",
    "run_call",
]
