"""The reward worker: decodes responses and scores them with the reward function of each sample's data_source.

It writes `rm_scores` (B, R): the sequence's score on its last response token,
zero elsewhere (token-level, as the advantage estimators expect). A reward
function that raises or returns a non-finite number stops the run with an
error naming the sample; nothing is silently scored zero.
"""

from __future__ import annotations

import torch

from conveyor.protocol import KVBatchMeta
from conveyor.tasks.rewards import RewardFunctionError, compute_score
from conveyor.workers.perf import memory_metrics

__all__ = ["RewardWorker", "SampleRewardError"]


class SampleRewardError(RewardFunctionError, ValueError):
    """A reward function failed on a named sample (a user-fixable error: exit status 2 at the command line)."""


class RewardWorker:
    """Rule-based rewards from the task registry."""

    def __init__(self, *, tokenizer, data_plane, rank: int = 0, world_size: int = 1):
        self.tokenizer = tokenizer
        self.dp = data_plane
        self.rank, self.world_size = rank, world_size

    def compute_reward(self, meta: KVBatchMeta) -> KVBatchMeta:
        """Writes `rm_scores` (B, R) and `acc` (B,) (the raw score) for the handle's samples."""
        td = self.dp.kv_batch_get(
            keys=meta.keys, partition_id=meta.partition_id,
            select_fields=["responses", "response_mask", "data_source", "ground_truth"],
        )
        responses, mask = td["responses"], td["response_mask"].bool()
        lengths = mask.sum(-1)
        texts = self.tokenizer.batch_decode(
            [r[:n].tolist() for r, n in zip(responses, lengths.tolist())], skip_special_tokens=True
        )
        scores = torch.zeros(len(texts), dtype=torch.float32)
        for i, (text, source, truth) in enumerate(zip(texts, td["data_source"], td["ground_truth"])):
            try:
                scores[i] = compute_score(source, text, truth)
            except RewardFunctionError as err:
                raise SampleRewardError(f"sample {meta.keys[i]!r}: {err}") from err
        rm_scores = torch.zeros(responses.shape, dtype=torch.float32)
        last = (lengths - 1).clamp(min=0)
        has_tokens = lengths > 0
        rm_scores[has_tokens, last[has_tokens]] = scores[has_tokens]
        self.dp.kv_batch_put(keys=meta.keys, partition_id=meta.partition_id,
                             fields={"rm_scores": rm_scores, "acc": scores})
        info = memory_metrics("cpu")
        return KVBatchMeta(meta.keys, meta.partition_id, list(dict.fromkeys(meta.fields + ["rm_scores", "acc"])),
                           meta.tags, info)
