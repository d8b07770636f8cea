"""The reward worker: decodes responses and scores them with the reward function of each sample's data_source.

It writes `rm_scores` (B, R): the sequence's score on its last response token,
zero elsewhere (token-level, as the advantage estimators expect), and `acc`
(B,), the reward function's own score. With DAPO's overlong shaping on
(`reward_model.overlong_buffer`), `rm_scores` also carries the length
penalty; `acc` never does, so accuracy stays exact match. A reward
function that raises or returns a non-finite number stops the run with an
error naming the sample; nothing is silently scored zero.

With `reward.custom_reward_function.path` set, every sample is scored by the
user's function from that file instead (verl's signature:
`fn(data_source, solution_str, ground_truth, extra_info=None) -> float`;
`extra_info` is passed as None), under the same checks.

A function that calls `sys.exit` is an error like one that raises, and one
call that takes longer than `reward.timeout_s` stops the run with an error
naming the function and the sample. Python cannot stop a thread, so the hung
call is abandoned (in a daemon thread), not stopped: the run ends instead.

A reward that runs the response as a program (marked `runs_code`, such as
`synthetic/code`) is given a sandbox (`reward.sandbox`): its samples run
`max_concurrent` at once, each killed past its own wall clock, and every
execution is counted by how it ended (`reward/sandbox/<outcome>`); a hostile
program scores 0 and the run goes on.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from conveyor.algos.trajectory import span_lengths
from conveyor.deadline import DeadlineExceeded, map_with_deadline
from conveyor.protocol import KVBatchMeta
from conveyor.tasks.rewards import (
    RewardFunctionError,
    compute_score,
    describe_failure,
    finite_score,
    get_reward_fn,
    reward_fn_name,
)
from conveyor.tasks.sandbox import SandboxPool, sandbox_metrics, sandbox_pool
from conveyor.user_code import is_file_source, user_attribute
from conveyor.workers.ranks.perf import result_handle

__all__ = ["RewardWorker", "SampleRewardError", "load_custom_reward_fn", "overlong_penalty"]


class SampleRewardError(RewardFunctionError, ValueError):
    """A reward function failed on a named sample (a user-fixable error: exit status 2 at the command line)."""


_PATH_KEY = "reward.custom_reward_function.path"
_NAME_KEY = "reward.custom_reward_function.name"
_F32_MAX = float(torch.finfo(torch.float32).max)


def load_custom_reward_fn(path: str, name: str = "compute_score") -> Callable[..., Any]:
    """The function `name` defined in the Python file `path`; a missing file or name is a ValueError naming the key.

    Loaded as all of the user's code is (`conveyor.user_code`): once per process, so a file that is also a
    plugin runs once.
    """
    if not is_file_source(str(path)):
        path = f"./{path}"  # always a file here, even without a `.py` suffix or a folder
    return user_attribute(str(path), name, key=_PATH_KEY, name_key=_NAME_KEY, kind="function", must_be_callable=True)


class RewardWorker:
    """Rule-based rewards from the task registry (or from the user's function, when one is configured)."""

    def __init__(
        self,
        *,
        tokenizer,
        data_plane,
        rank: int = 0,
        world_size: int = 1,
        custom_reward_path: str | None = None,
        custom_reward_name: str = "compute_score",
        timeout_s: float = 30.0,
        overlong_buffer: tuple[int, int, float, bool] | None = None,
        sandbox: dict[str, Any] | None = None,
    ):
        if not timeout_s >= 0:
            raise ValueError(f"reward.timeout_s must be >= 0 (0 = no limit), got {timeout_s}")
        self.tokenizer = tokenizer
        self.data_plane = data_plane
        self.rank, self.world_size = rank, world_size
        self.timeout_s = float(timeout_s)
        self.custom_fn = load_custom_reward_fn(custom_reward_path, custom_reward_name) if custom_reward_path else None
        self.custom_label = f"custom reward function {custom_reward_name} from {custom_reward_path}"
        # (max_response_length, buffer length, penalty factor, log): DAPO's soft overlong punishment.
        self.overlong_buffer = overlong_buffer
        # The reward.sandbox keys; the pool is built when a sample's reward first runs code.
        self.sandbox_settings = sandbox
        self.sandbox: SandboxPool | None = None

    def _score(self, source: str, text: str, truth: str) -> float:
        """One sample's score, finite as a float32; RewardFunctionError when the function raises or returns junk."""
        if self.custom_fn is None:
            value = compute_score(source, text, truth, sandbox=self.sandbox.sandbox if self.sandbox else None)
        else:
            value = self._custom_score(source, text, truth)
        # Scores are stored as float32: a finite double beyond its range would become inf there.
        if abs(value) > _F32_MAX:
            raise RewardFunctionError(
                f"the score {value!r} for data_source {source!r} overflows a float32 "
                "'rm_scores' value; keep rewards within +-3.4e38"
            )
        return value

    def _custom_score(self, source: str, text: str, truth: str) -> float:
        """The user's function on one sample, checked like the registry's (raises or non-finite: an error)."""
        try:
            if getattr(self.custom_fn, "runs_code", False):
                result = self.custom_fn(source, text, truth, None, sandbox=self._pool().sandbox)
            else:
                result = self.custom_fn(source, text, truth, None)
        except (Exception, SystemExit) as err:  # sys.exit in a reward function must not end the run quietly
            raise RewardFunctionError(f"{self.custom_label} {describe_failure(err)}") from err
        return finite_score(result, self.custom_label)

    def _function_label(self, source: str) -> str:
        """The function that scores `source`, as error messages name it."""
        if self.custom_fn is not None:
            return self.custom_label
        try:
            return f"reward function {reward_fn_name(get_reward_fn(source))} for data_source {source!r}"
        except ValueError:
            return f"the reward function for data_source {source!r}"

    def _runs_code(self, source: str) -> bool:
        """Whether the reward of `source` runs the response as a program (marked `runs_code`)."""
        if self.custom_fn is not None:
            return bool(getattr(self.custom_fn, "runs_code", False))
        try:
            return bool(getattr(get_reward_fn(source), "runs_code", False))
        except ValueError:
            return False  # an unknown data source is reported, with the registered ones, when it is scored

    def _pool(self) -> SandboxPool:
        """The sandbox pool (reward.sandbox), built on first use."""
        if self.sandbox is None:
            if self.sandbox_settings is None:
                raise ValueError("this reward worker has no reward.sandbox settings, so it cannot run code")
            self.sandbox = sandbox_pool(self.sandbox_settings)
        return self.sandbox

    def _score_all(
        self, keys: list[str], samples: list[tuple[str, str, str]], cpu: list[float] | None = None
    ) -> list[float]:
        """Every sample's score; a failed or hung call stops the run with a SampleRewardError naming the sample.

        Rewards that run code go to the sandbox pool, `max_concurrent` at once: each execution has its own wall
        clock and is killed past it, so none can hang. The other calls run in a daemon thread so that one that
        hangs past `timeout_s` can be given up on (`conveyor.deadline`): a thread cannot be killed, so the call is
        left running while the run stops with an error naming the function.
        """
        code = [i for i, sample in enumerate(samples) if self._runs_code(sample[0])]
        if not code:
            return self._score_calls(keys, samples, cpu)
        pool = self._pool()
        scores: list[float] = [0.0] * len(samples)
        for i, value in zip(code, pool.map(lambda i: self._score_one(keys[i], *samples[i]), code)):
            scores[i] = value
        in_sandbox = set(code)
        rest = [i for i in range(len(samples)) if i not in in_sandbox]
        for i, value in zip(rest, self._score_calls([keys[i] for i in rest], [samples[i] for i in rest], cpu)):
            scores[i] = value
        return scores

    def _score_calls(
        self, keys: list[str], samples: list[tuple[str, str, str]], cpu: list[float] | None = None
    ) -> list[float]:
        """Scores of rewards that run no code, each call under `timeout_s`."""
        try:
            return map_with_deadline(
                lambda i: self._score_one(keys[i], *samples[i]),
                range(len(samples)),
                timeout_s=self.timeout_s,
                key="reward.timeout_s",
                what=lambda i: self._function_label(samples[i][0]),
                thread_name=f"reward-rank{self.rank}",
                cpu=cpu,
            )
        except DeadlineExceeded as err:
            raise SampleRewardError(
                f"sample {keys[err.index]!r}: {err}; the run stops. "
                "Fix the function, or raise reward.timeout_s if it is just slow"
            ) from err

    def _score_one(self, key: str, source: str, text: str, truth: str) -> float:
        """`_score` of one sample, its failure a SampleRewardError naming `key`."""
        try:
            return self._score(source, text, truth)
        except RewardFunctionError as err:
            raise SampleRewardError(f"sample {key!r}: {err}") from err

    def compute_reward(self, meta: KVBatchMeta) -> KVBatchMeta:
        """Writes `rm_scores` (B, R) and `acc` (B,) (the raw score) for the handle's samples."""
        cpu0 = time.thread_time()
        td = self.data_plane.kv_batch_get(
            keys=meta.keys,
            partition_id=meta.partition_id,
            select_fields=["responses", "response_mask", "data_source", "ground_truth"],
        )
        responses, mask = td["responses"], td["response_mask"].bool()
        # Through the last model token: a multi-turn response's tool tokens are read too (the span).
        lengths = span_lengths(mask)
        scoring_cpu: list[float] = []  # the calls run on a thread of their own: its CPU counts too
        if "agent_reward" in meta.fields:
            # Agent sessions (the gateway): the session's reward where its agent reported one; else the task's reward
            # function on the session's last completion, the same for each of its samples.
            agent = self.data_plane.kv_batch_get(
                keys=meta.keys, partition_id=meta.partition_id, select_fields=["agent_reward", "agent_completion"]
            )
            texts = list(agent["agent_completion"])
            reported = agent["agent_reward"].float()
            rule = [i for i, known in enumerate(torch.isfinite(reported).tolist()) if not known]
            sources, truths = td["data_source"], td["ground_truth"]
            scored = self._score_all(
                [meta.keys[i] for i in rule], [(sources[i], texts[i], truths[i]) for i in rule], scoring_cpu
            )
            values = reported.tolist()
            for i, v in zip(rule, scored):
                values[i] = v
        else:
            # One tolist of the whole batch, then list slicing: far cheaper than a tensor slice per row.
            texts = self.tokenizer.batch_decode(
                [row[:n] for row, n in zip(responses.tolist(), lengths.tolist())], skip_special_tokens=True
            )
            values = self._score_all(
                list(meta.keys), list(zip(td["data_source"], texts, td["ground_truth"])), scoring_cpu
            )
        acc = torch.tensor(values, dtype=torch.float32)
        metrics: dict[str, float] = {}
        scores = acc
        if self.overlong_buffer is not None:
            max_len, buffer_len, factor, log = self.overlong_buffer
            penalty = overlong_penalty(lengths, max_len, buffer_len, factor)
            scores = acc + penalty
            n = float(len(lengths))
            if log:
                metrics = {
                    "reward/overlong_reward_mean@sum": float(penalty.sum()),
                    "reward/overlong_reward_mean@count": n,
                    "reward/overlong_frac@sum": float((penalty < 0).sum()),
                    "reward/overlong_frac@count": n,
                }
        if "tool_rewards" in meta.fields:  # rewards returned by a multi-turn rollout's tools count in rm_scores
            scores = (
                scores
                + self.data_plane.kv_batch_get(
                    keys=meta.keys, partition_id=meta.partition_id, select_fields=["tool_rewards"]
                )["tool_rewards"].float()
            )
        rm_scores = torch.zeros(responses.shape, dtype=torch.float32)
        last = (lengths - 1).clamp(min=0)
        has_tokens = lengths > 0
        rm_scores[has_tokens, last[has_tokens]] = scores[has_tokens]
        self.data_plane.kv_batch_put(
            keys=meta.keys, partition_id=meta.partition_id, fields={"rm_scores": rm_scores, "acc": acc}
        )
        if self.sandbox is not None:  # each program run, by how it ended: hostile ones are counted, not hidden
            metrics.update(sandbox_metrics(*self.sandbox.sandbox.pop_counts()))
        # Where a step's CPU goes (benchmarks/async.py): this thread's and the scoring thread's.
        metrics["reward/perf/cpu_s"] = time.thread_time() - cpu0 + sum(scoring_cpu)
        return result_handle(meta, ["rm_scores", "acc"], metrics)


def overlong_penalty(
    lengths: torch.Tensor, max_response_length: int, buffer_len: int, penalty_factor: float
) -> torch.Tensor:
    """DAPO's soft overlong punishment (B,): 0 up to max - buffer tokens, then linear down to -penalty_factor at max."""
    over = lengths.to(torch.float32) - (max_response_length - buffer_len)
    return torch.clamp(-over / buffer_len * penalty_factor, max=0.0)
