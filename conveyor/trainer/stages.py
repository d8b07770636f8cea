"""The stages that make a step's samples (prompts, generation, rewards) and the seeds they sample with.

`Stages` holds what those stages need: the run's config (its sampling
parameters), the plan, the prompt encoder and the prompt order, the data
plane, the worker groups, and the step being trained (every seed depends on
it). `PPOTrainer`, every sample source (`trainer/sources.py`) and validation
(`trainer/validation.py`) are handed one `Stages` and call its public
methods; none of them is handed the trainer, so none reaches into it.

Each stage passes a handle (`KVBatchMeta`) to a worker group, or writes the
few fields it makes itself, and returns the handle with its fields written
(and its metrics, where it has any).

What it deliberately does not do: choose where a batch is generated (the
caller passes `generate`: a source's rollout), train, or decide when anything
runs (the loop and the sources do).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from conveyor.metrics.reduce import reduce_rank_metrics
from conveyor.protocol import KVBatchMeta
from conveyor.tasks.dataset import PromptDataset
from conveyor.tasks.prompts import RENDER_PROMPTS, PromptEncoder, sample_keys
from conveyor.workers.ranks.calls import GenerateCall
from conveyor.workers.training.balance import SEQ_LEN_TAG

if TYPE_CHECKING:
    from conveyor.config import Config
    from conveyor.data_plane.base import DataPlane
    from conveyor.trainer.plan import RunPlan
    from conveyor.workers.placement.roles import WorkerGroups

__all__ = ["Generate", "Stages"]

# Where stage 2 runs: a handle of prompts (with the generation call on it) in, the handle of the samples out.
Generate = Callable[[KVBatchMeta], KVBatchMeta]


class Stages:
    """Stages 1-3 of a step over the data plane, the prompt order they draw from, and the step whose seeds they use."""

    def __init__(
        self,
        cfg: Config,
        *,
        plan: RunPlan,
        data_plane: DataPlane,
        workers: WorkerGroups,
        prompts: PromptEncoder,
        train_records: list[dict],
        run_dir: Path,
    ):
        self.cfg = cfg
        self.plan = plan
        self.data_plane = data_plane
        self.workers = workers
        self.prompts = prompts
        self.train_data = PromptDataset(train_records, seed=cfg.data.seed, shuffle=cfg.data.shuffle)
        self.run_dir = Path(run_dir)
        # The step being trained (updates so far, inside a step): set by the loop and a resume, read by every seed.
        self.global_step = 0
        self._train_records = train_records
        self._train_width: int | None = None

    def seed(self, salt: str, step: int | None = None) -> int:
        """A seed that depends only on (trainer.seed, step, purpose): resumed runs sample the same.

        `step` defaults to the current one (an asynchronous source draws step b's batch earlier).
        """
        step = self.global_step if step is None else step
        code = sum(ord(c) * 31**i for i, c in enumerate(salt)) % 1_000_003
        return (self.cfg.trainer.seed * 1_000_003 + step * 7_919 + code) % (2**62)

    def train_prompt_width(self) -> int:
        """The longest training prompt in tokens (computed once): a common width for every generation batch."""
        if self._train_width is None:
            self._train_width = self.prompts.longest(self._train_records)
        return self._train_width

    def put_prompts(
        self, records: list[dict], partition_id: str, n: int, key_prefix: str | None = None, width: int | None = None
    ) -> KVBatchMeta:
        """Stage 1: tokenize prompts, repeat each `n` times (a group per prompt), write them left-padded to `width`."""
        uids = _uids(records, partition_id, key_prefix)
        fields, lengths = self.prompts.fields(records, uids, [i for i in range(len(records)) for _ in range(n)], width)
        return self.data_plane.kv_batch_put(
            keys=sample_keys(uids, n),
            partition_id=partition_id,
            fields=fields,
            tags=[{SEQ_LEN_TAG: length} for length in lengths],
        )

    def prompts_to_render(
        self,
        records: list[dict],
        partition_id: str,
        n: int,
        key_prefix: str | None = None,
        width: int | None = None,
        *,
        replicas: int = 1,
    ) -> KVBatchMeta:
        """Stage 1 left to the `replicas` that generate the batch (`RENDER_PROMPTS`): the handle of the batch's samples,
        their prompts not yet written; the call carries their records (and the width to pad them to)."""
        uids = _uids(records, partition_id, key_prefix)
        tags: list[dict] = []  # one replica: no split to balance, and it pads to its own longest prompt
        if replicas > 1:
            # Several replicas write one partition: they pad to one width, and the split over them balances prompt
            # tokens, as it does for prompts put here. Both need the lengths: rendered here too, once per prompt.
            _, token_lists = self.prompts.encode(records)
            width = max([len(ids) for ids in token_lists] + [width or 0])
            tags = [{SEQ_LEN_TAG: len(ids)} for ids in token_lists for _ in range(n)]
        return KVBatchMeta(
            keys=sample_keys(uids, n),
            partition_id=partition_id,
            tags=tags,
            extra_info={RENDER_PROMPTS: {"records": dict(zip(uids, records)), "width": width}},
        )

    def generate(
        self,
        meta: KVBatchMeta,
        *,
        seed: int,
        generate: Generate,
        validate: bool = False,
        greedy: bool = False,
        pad: bool = False,
    ) -> tuple[KVBatchMeta, dict[str, float]]:
        """Stage 2: the rollout writes responses, response_mask, rollout_log_probs (and routed_experts).

        `generate` runs it (a source's: `SampleSource.generate` outside training, with the trainer's current weights).
        """
        r = self.cfg.actor_rollout_ref.rollout
        kw = r.val_kwargs if validate else r
        greedy = greedy or (validate and (not r.val_kwargs.do_sample or r.val_kwargs.temperature == 0))
        call = GenerateCall(
            max_new_tokens=self.cfg.data.max_response_length,
            temperature=1.0 if greedy else kw.temperature,
            top_p=kw.top_p,
            top_k=kw.top_k,
            min_p=kw.min_p,
            do_sample=False if greedy else kw.do_sample,
            seed=seed,
            capture_routing=self.plan.rollout_captures_routing and not validate and not greedy,
            pad_to_max_new_tokens=pad,
            # The margins feed rollout/moe/near_tie/*, which the load-balance metrics' interval turns on.
            capture_router_margins=r.moe_load_balance_metrics_interval > 0,
        )
        out = generate(meta.with_extra_info(**call.to_extra_info()))
        metrics = reduce_rank_metrics(out.extra_info, prefix="")
        gen = {k: v for k, v in metrics.items() if k.startswith(("rollout/", "fault/"))}
        gen.update({f"actor/{k}": v for k, v in metrics.items() if k.startswith("perf/")})
        return out, gen

    def compute_reward(self, meta: KVBatchMeta, scored: bool = False) -> tuple[KVBatchMeta, dict[str, float]]:
        """Stage 3: rule-based scores by data_source into rm_scores (and acc), then every scoring role's score (the
        reward model's, the judge's, a plugin's: `WorkerGroups.scorers`, in the role table's order); returns the
        reward metrics too.

        `scored`: the generation call already scored the batch (the reward worker in the rollout's processes);
        `meta` is its handle, with the reward's metrics.
        """
        out = meta if scored else self.workers.reward.compute_reward(meta)
        metrics = {k: v for k, v in reduce_rank_metrics(out.extra_info).items() if k.startswith("reward/")}
        for scorer in self.workers.scorers():  # each sums its score into rm_scores with the earlier ones
            out = scorer.score(out)
            metrics.update({k: v for k, v in reduce_rank_metrics(out.extra_info).items() if k.startswith("reward/")})
        return out, metrics


def _uids(records: list[dict], partition_id: str, key_prefix: str | None) -> list[str]:
    """One group id per prompt record: `<key_prefix or partition>/p<i>`."""
    return [f"{key_prefix or partition_id}/p{i}" for i in range(len(records))]
