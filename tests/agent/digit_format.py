"""A call format for tests, imported by the test process and by the agents it starts (`--plugin`): an untrained model
calls `calc` whenever a turn ends at a digit (frequent), so trajectories hold tool turns without a warm start."""

from conveyor.tools import CallFormat, ToolCall, register_call_format

register_call_format(
    CallFormat(
        "test_digit_calls",
        stop_texts=tuple("0123456789"),
        parser=lambda turn: ToolCall("calc", text=turn) if turn[-1:].isdigit() else None,
    ),
    overwrite=True,
)
