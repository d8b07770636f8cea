"""Prompt sources and reward functions: synthetic task, parquet files, reward registry, prompt dataset.

A prompt record is a plain dict in verl's format: ``data_source`` (str),
``prompt`` (list of ``{"role", "content"}`` messages), ``ability`` (str),
``reward_model`` (``{"style": "rule", "ground_truth": str}``) and
``extra_info`` (dict). Nothing here touches tensors, models or the data plane.
"""

from conveyor.tasks.arithmetic_tool import ARITHMETIC_TOOL_DATA_SOURCE, make_arithmetic_tool_records
from conveyor.tasks.code import CODE_DATA_SOURCE, code_tests_score, make_code_records
from conveyor.tasks.dataset import TRUNCATION_MODES, PromptDataset, check_prompt_length, render_prompt
from conveyor.tasks.parquet import load_parquet_records, write_parquet_records
from conveyor.tasks.rewards import (
    REWARD_FNS,
    RewardFunctionError,
    compute_score,
    extract_gsm8k_answer,
    get_reward_fn,
    gsm8k_score,
    register_reward_fn,
)
from conveyor.tasks.synthetic import (
    ARITHMETIC_ALPHABET,
    ARITHMETIC_DATA_SOURCE,
    arithmetic_split,
    make_arithmetic_records,
)
from conveyor.tasks.visual import VISUAL_DATA_SOURCE, make_visual_count_records, make_visual_sum_records

#: data.synthetic.task -> the function making its records: fn(n, *, seed, max_operand, ops, split) -> list[dict].
SYNTHETIC_TASKS = {
    "arithmetic": make_arithmetic_records,
    "arithmetic_tool": make_arithmetic_tool_records,
    "code": make_code_records,
    "visual_sum": make_visual_sum_records,
    "visual_count": make_visual_count_records,
}

__all__ = [
    "ARITHMETIC_ALPHABET",
    "ARITHMETIC_DATA_SOURCE",
    "ARITHMETIC_TOOL_DATA_SOURCE",
    "CODE_DATA_SOURCE",
    "REWARD_FNS",
    "SYNTHETIC_TASKS",
    "TRUNCATION_MODES",
    "VISUAL_DATA_SOURCE",
    "PromptDataset",
    "RewardFunctionError",
    "arithmetic_split",
    "check_prompt_length",
    "code_tests_score",
    "compute_score",
    "extract_gsm8k_answer",
    "get_reward_fn",
    "gsm8k_score",
    "load_parquet_records",
    "make_arithmetic_records",
    "make_arithmetic_tool_records",
    "make_code_records",
    "make_visual_count_records",
    "make_visual_sum_records",
    "register_reward_fn",
    "render_prompt",
    "write_parquet_records",
]
