"""The reward worker: decodes responses and scores them with the reward function of each sample's data_source.

It writes `rm_scores` (B, R): the sequence's score on its last response token,
zero elsewhere (token-level, as the advantage estimators expect). A reward
function that raises or returns a non-finite number stops the run with an
error naming the sample; nothing is silently scored zero.

With `reward.custom_reward_function.path` set, every sample is scored by the
user's function from that file instead (verl's signature:
`fn(data_source, solution_str, ground_truth, extra_info=None) -> float`;
`extra_info` is passed as None), under the same checks.
"""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path
from typing import Any, Callable

import torch

from conveyor.protocol import KVBatchMeta
from conveyor.tasks.rewards import RewardFunctionError, compute_score
from conveyor.workers.perf import result_handle

__all__ = ["RewardWorker", "SampleRewardError", "load_custom_reward_fn"]


class SampleRewardError(RewardFunctionError, ValueError):
    """A reward function failed on a named sample (a user-fixable error: exit status 2 at the command line)."""


_PATH_KEY = "reward.custom_reward_function.path"
_F32_MAX = float(torch.finfo(torch.float32).max)


def load_custom_reward_fn(path: str, name: str = "compute_score") -> Callable[..., Any]:
    """The function `name` defined in the Python file `path`; a missing file or name is a ValueError naming the key."""
    file = Path(path).expanduser()
    if not file.is_file():
        raise ValueError(f"{_PATH_KEY}: no such file {str(path)!r}")
    # Not added to sys.modules: each worker gets a fresh module, and a user's file
    # cannot shadow an importable module of the same name.
    spec = importlib.util.spec_from_file_location(f"conveyor_custom_reward_{file.stem}", file)
    if spec is None or spec.loader is None:
        raise ValueError(f"{_PATH_KEY}: {str(path)!r} is not a Python file")
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as err:
        raise ValueError(f"{_PATH_KEY}: importing {str(path)!r} failed: {type(err).__name__}: {err}") from err
    fn = getattr(module, name, None)
    if not callable(fn):
        raise ValueError(f"reward.custom_reward_function.name: {str(path)!r} defines no function {name!r}")
    return fn


class RewardWorker:
    """Rule-based rewards from the task registry (or from the user's function, when one is configured)."""

    def __init__(self, *, tokenizer, data_plane, rank: int = 0, world_size: int = 1,
                 custom_reward_path: str | None = None, custom_reward_name: str = "compute_score"):
        self.tokenizer = tokenizer
        self.dp = data_plane
        self.rank, self.world_size = rank, world_size
        self.custom_fn = load_custom_reward_fn(custom_reward_path, custom_reward_name) if custom_reward_path else None
        self.custom_label = f"custom reward function {custom_reward_name} from {custom_reward_path}"

    def _score(self, source: str, text: str, truth: str) -> float:
        """One sample's score, finite as a float32; RewardFunctionError when the function raises or returns junk."""
        if self.custom_fn is None:
            value = compute_score(source, text, truth)
        else:
            value = self._custom_score(source, text, truth)
        # Scores are stored as float32: a finite double beyond its range would become inf there.
        if abs(value) > _F32_MAX:
            raise RewardFunctionError(f"the score {value!r} for data_source {source!r} overflows a float32 "
                                      "'rm_scores' value; keep rewards within +-3.4e38")
        return value

    def _custom_score(self, source: str, text: str, truth: str) -> float:
        """The user's function on one sample, checked like the registry's (raises or non-finite: an error)."""
        try:
            result = self.custom_fn(source, text, truth, None)
        except Exception as err:
            raise RewardFunctionError(f"{self.custom_label} raised {type(err).__name__}: {err}") from err
        try:
            value = float(result) if not isinstance(result, (str, bytes)) else math.nan
        except (TypeError, ValueError):
            value = math.nan
        if not math.isfinite(value):
            raise RewardFunctionError(f"{self.custom_label} returned {result!r}, not a finite number")
        return value

    def compute_reward(self, meta: KVBatchMeta) -> KVBatchMeta:
        """Writes `rm_scores` (B, R) and `acc` (B,) (the raw score) for the handle's samples."""
        td = self.dp.kv_batch_get(
            keys=meta.keys, partition_id=meta.partition_id,
            select_fields=["responses", "response_mask", "data_source", "ground_truth"],
        )
        responses, mask = td["responses"], td["response_mask"].bool()
        lengths = mask.sum(-1)
        # One tolist of the whole batch, then list slicing: far cheaper than a tensor slice per row.
        texts = self.tokenizer.batch_decode(
            [row[:n] for row, n in zip(responses.tolist(), lengths.tolist())], skip_special_tokens=True
        )
        values = []
        for i, (text, source, truth) in enumerate(zip(texts, td["data_source"], td["ground_truth"])):
            try:
                values.append(self._score(source, text, truth))
            except RewardFunctionError as err:
                raise SampleRewardError(f"sample {meta.keys[i]!r}: {err}") from err
        scores = torch.tensor(values, dtype=torch.float32)
        rm_scores = torch.zeros(responses.shape, dtype=torch.float32)
        last = (lengths - 1).clamp(min=0)
        has_tokens = lengths > 0
        rm_scores[has_tokens, last[has_tokens]] = scores[has_tokens]
        self.dp.kv_batch_put(keys=meta.keys, partition_id=meta.partition_id,
                             fields={"rm_scores": rm_scores, "acc": scores})
        return result_handle(meta, ["rm_scores", "acc"], {})
