"""The reward-model worker: one rank of a trained scorer, which adds its score to the step's rule reward.

It runs after the rule reward (`conveyor.workers.ranks.reward`), on the same handle: it reads `rm_scores`
(the rule reward on each response's last token), scores every sequence with the reward model
(`reward_model.model.path`, `conveyor.models.reward_model`) and writes back

- `rm_scores` (B, R): `model_weight x model score + rule_weight x rule reward` on the last response token;
- `rm_model_score` (B,) and `rm_rule_score` (B,): the two parts, as they were summed.

The reward model reads its own tokens. When its tokenizer is the policy's (same vocabulary and chat template)
the sequence is the prompt's ids followed by the response's; otherwise the response is decoded to text and the
conversation (the prompt's chat messages and the response as the assistant's turn) is rendered with the reward
model's chat template and tokenized by its tokenizer. A sequence longer than `reward_model.max_length` keeps
its last tokens (where the score is read). Rows are scored in micro-batches of `micro_batch_size_per_gpu`
sequences or up to `forward_max_token_len_per_gpu` tokens, left-padded so the last column is every row's last
token. Under `fsdp2` the forward gathers one layer at a time and every rank runs as many forwards as the
busiest; `fsdp_config.param_offload` keeps the shards in host memory between calls (on a GPU).

What it deliberately does not do: update the reward model, compute the rule reward, or decide where it runs
(`reward_model.placement`, `conveyor.workers.placement.roles`).
"""

from __future__ import annotations

import copy
import dataclasses
import time
from typing import TYPE_CHECKING, Any

import torch

from conveyor.algos.trajectory import span_lengths
from conveyor.data_plane.base import DataPlane
from conveyor.metrics.reduce import weighted
from conveyor.models.loading import load_tokenizer
from conveyor.models.reward_model import import_external_lib, load_keyed, load_reward_model, sequence_scores
from conveyor.protocol import KVBatchMeta
from conveyor.tasks.prompts import PROMPT_MESSAGES
from conveyor.workers.ranks.perf import begin_phase, phase_memory_metrics, result_handle, set_allocator_defaults
from conveyor.workers.ranks.settings import role_strategy
from conveyor.workers.training.batching import TokenBudget, micro_batches, token_micro_batches
from conveyor.workers.training.loading import loads_from_rank0
from conveyor.workers.training.trained_model import TrainedModel

if TYPE_CHECKING:
    from conveyor.config import Config
    from conveyor.config.plan import RunPlan

__all__ = [
    "RewardModelSettings",
    "RewardModelWorker",
    "reward_model_settings",
    "combine_rewards",
    "same_tokenizer",
    "check_token_ids_fit",
    "check_scorer_vocabularies",
]


@dataclasses.dataclass(frozen=True)
class RewardModelSettings:
    """The reward model's worker (`RewardModelWorker`): its section of the config and its token budget."""

    reward_model: Any  # reward_model (model, micro-batches, max_length, strategy, fsdp_config, the weights)
    budget: TokenBudget | None = None  # use_dynamic_bsz / forward_max_token_len_per_gpu


def reward_model_settings(cfg: Config, plan: RunPlan | None = None) -> RewardModelSettings:
    """The reward model's settings of a run of `cfg` (the plan says whether it runs)."""
    rm = cfg.reward_model
    budget = (
        TokenBudget(rm.forward_max_token_len_per_gpu, "reward_model.forward_max_token_len_per_gpu")
        if rm.use_dynamic_bsz
        else None
    )
    return RewardModelSettings(reward_model=copy.deepcopy(rm), budget=budget)


def combine_rewards(
    rule: torch.Tensor, model: torch.Tensor, *, rule_weight: float, model_weight: float
) -> torch.Tensor:
    """The reward (B,): `rule_weight * rule + model_weight * model`, both (B,) float32."""
    return rule_weight * rule + model_weight * model


def same_tokenizer(a: Any, b: Any) -> bool:
    """Whether two tokenizers give the same ids to the same conversation (vocabulary and chat template)."""
    if a is b:
        return True
    return (
        getattr(a, "chat_template", None) == getattr(b, "chat_template", None)
        and a.get_vocab() == b.get_vocab()
        and a.all_special_tokens == b.all_special_tokens
    )


def check_token_ids_fit(key: str, tokenizer: Any, model: Any) -> None:
    """Refuse a `tokenizer` with token ids that `model` has no embedding row for; `key` names the setting to change.

    Such a pair loads and starts, then fails at the first forward (an index past the embedding table): checked
    when the role is built, before any step.
    """
    embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    weight = getattr(embeddings, "weight", None)
    rows = int(weight.shape[0]) if weight is not None else getattr(getattr(model, "config", None), "vocab_size", None)
    if rows is None:
        return
    _check_ids_below(key, tokenizer, rows, f"its model has {rows} embedding rows")


def _check_ids_below(key: str, tokenizer: Any, rows: int, what: str) -> None:
    """Refuse a `tokenizer` with ids >= `rows` (what the model has, said by `what`), naming `key`."""
    vocab = tokenizer.get_vocab()
    top = max(vocab.values(), default=-1)
    if top >= rows:
        over = sum(1 for i in vocab.values() if i >= rows)
        raise ValueError(
            f"{key}: its tokenizer has token ids up to {top} ({over} of them past the end), but {what}: the "
            f"tokenizer is not the model's; point {key} at the tokenizer saved with that model"
        )


def check_scorer_vocabularies(cfg: Any, *, reward_model: bool, judge: bool) -> None:
    """At start, from config.json and the tokenizer alone (no weights): refuse a reward model or judge whose
    tokenizer has ids past its model's vocabulary, naming the key, before the actor is loaded."""
    from conveyor.models.loading import load_model_config

    scorers = []
    if reward_model:
        m = cfg.reward_model.model
        key = "reward_model.model.tokenizer_path" if m.tokenizer_path else "reward_model.model.path"
        scorers.append((key, "reward_model.model.path", m.path, m.tokenizer_path or m.path, m.trust_remote_code))
    if judge:
        m = cfg.reward_model.judge.model
        key = "reward_model.judge.model.path"
        scorers.append((key, key, m.path, m.path, m.trust_remote_code))
    for key, model_key, path, tok_path, trust in scorers:
        if path is None:
            continue  # the settings' own check names the missing path
        config = load_keyed(model_key, path, load_model_config, path, trust_remote_code=trust)
        rows = getattr(config, "vocab_size", None)
        if rows is None:
            continue
        tokenizer = load_keyed(key, tok_path, load_tokenizer, tok_path, trust_remote_code=trust)
        _check_ids_below(key, tokenizer, rows, f"{model_key}'s config.json says vocab_size {rows}")


def _messages(prompt: Any) -> list[dict[str, Any]]:
    """A record's prompt (chat messages, as the datasets require) as a new list."""
    return [dict(m) for m in prompt]


class RewardModelWorker:
    """One rank of the frozen reward model."""

    def __init__(
        self,
        settings: RewardModelSettings,
        *,
        policy_tokenizer: Any,
        data_plane: DataPlane,
        rank: int = 0,
        world_size: int = 1,
        device: str = "cpu",
    ):
        set_allocator_defaults()  # before the first CUDA allocation of this process
        self.settings = settings
        rm = settings.reward_model
        self.rank, self.world_size = rank, world_size
        self.device = torch.device(device)
        self.data_plane = data_plane
        import_external_lib(rm.model.external_lib)
        strategy = role_strategy(rm.strategy, rm.fsdp_config, world_size, self.device)
        from_rank0 = loads_from_rank0(strategy.name, world_size)
        # Under fsdp2 over several ranks only rank 0 reads the checkpoint; TrainedModel fills the others' shards.
        model = load_reward_model(
            rm.model.path,
            head=rm.model.head,
            dtype=rm.model.dtype,
            device="cpu" if from_rank0 else self.device,
            meta=from_rank0 and rank != 0,
            trust_remote_code=rm.model.trust_remote_code,
        )
        self.trained = TrainedModel(model, strategy, trainable=False)
        self.model = model
        self.policy_tokenizer = policy_tokenizer
        tok_path = rm.model.tokenizer_path or rm.model.path
        key = "reward_model.model.tokenizer_path" if rm.model.tokenizer_path else "reward_model.model.path"
        self.tokenizer = load_keyed(
            key, tok_path, load_tokenizer, tok_path, trust_remote_code=rm.model.trust_remote_code
        )
        check_token_ids_fit(key, self.tokenizer, model)
        # Same tokens: the policy's ids are the reward model's, and nothing is decoded (verl's input_tokenizer=null).
        self.retokenize = not same_tokenizer(policy_tokenizer, self.tokenizer)

    @property
    def optim_steps(self) -> int:
        """Always 0: the reward model is never updated."""
        return 0

    # ------------------------------------------------------------------ inputs
    def _sequences(self, td: Any, lengths: torch.Tensor) -> list[list[int]]:
        """Each row's reward-model token ids (before truncation)."""
        resp = [row[:n] for row, n in zip(td["responses"].tolist(), lengths.tolist())]
        if not self.retokenize:
            prompts = [
                [t for t, m in zip(row, mask) if m]
                for row, mask in zip(td["prompts"].tolist(), td["prompt_mask"].bool().tolist())
            ]
            return [p + r for p, r in zip(prompts, resp)]
        texts = self.policy_tokenizer.batch_decode(resp, skip_special_tokens=True)
        tok = self.tokenizer
        if getattr(tok, "chat_template", None):
            rendered = [
                tok.apply_chat_template(_messages(prompt) + [{"role": "assistant", "content": text}], tokenize=False)
                for prompt, text in zip(td[PROMPT_MESSAGES], texts)
            ]
            # The template writes its own special tokens (a BOS among them): none are added again.
            return tok(rendered, add_special_tokens=False)["input_ids"]
        # No template: the prompt as the policy saw it, then the response, with the tokenizer's own special tokens.
        return tok([p + t for p, t in zip(td["raw_prompt"], texts)], add_special_tokens=True)["input_ids"]

    def _batches(self, lengths: list[int]) -> list[list[int]]:
        """Row indices of each forward: a fixed number of rows, or as many as fit the token budget."""
        n = len(lengths)
        if self.settings.budget is None:
            # Longest first: rows of like lengths share a forward, so little of it is padding (scores are per row).
            order = sorted(range(n), key=lambda i: (-lengths[i], i))
            return [order[s] for s in micro_batches(n, self.settings.reward_model.micro_batch_size_per_gpu)]
        # A row of L tokens costs L: one "prompt" of L - 1 and one "response" token in the planner's terms.
        return token_micro_batches(
            [max(L - 1, 0) for L in lengths],
            [1] * n,
            self.settings.budget,
            agree=self.trained.strategy.agree_count,
        )

    def _pad(self, rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """Left-padded ids and mask (b, longest row) on this rank's device."""
        width = max(len(r) for r in rows)
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows], dtype=torch.long)
        mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows], dtype=torch.long)
        return ids.to(self.device), mask.to(self.device)

    def score_sequences(self, sequences: list[list[int]]) -> torch.Tensor:
        """The reward model's scores (B,) float32 of token-id rows (already the reward model's tokens)."""
        out = torch.zeros(len(sequences), dtype=torch.float32)
        batches = self._batches([len(s) for s in sequences])
        self.model.eval()
        with torch.no_grad(), self.trained.strategy.sharded_no_grad():
            # Every rank runs as many forwards as the busiest (each gathers layer by layer); extra ones are dropped.
            for rows, real in self.trained.passes(batches):
                ids, mask = self._pad([sequences[i] for i in rows])
                scores = sequence_scores(self.trained.forward_module, ids, mask)
                if real:
                    out[torch.tensor(rows, dtype=torch.long)] = scores.cpu()
        return out

    # ------------------------------------------------------------------ the endpoint
    def compute_rm_score(self, meta: KVBatchMeta) -> KVBatchMeta:
        """Writes `rm_scores` (B, R) (the weighted sum), `rm_model_score` (B,) and `rm_rule_score` (B,)."""
        begin_phase(self.device)
        cpu0 = time.thread_time()
        rm = self.settings.reward_model
        fields = ["prompts", "prompt_mask", "responses", "response_mask", "rm_scores"]
        if self.retokenize:
            fields += [PROMPT_MESSAGES, "raw_prompt"]
        td = self.data_plane.kv_batch_get(keys=meta.keys, partition_id=meta.partition_id, select_fields=fields)
        lengths = span_lengths(td["response_mask"].bool())
        sequences = self._sequences(td, lengths)
        truncated = 0
        if rm.max_length is not None:
            truncated = sum(len(s) > rm.max_length for s in sequences)
            # The score is read at the last token: a long sequence keeps its end (the response), not its start.
            sequences = [s[-rm.max_length :] for s in sequences]
        empty = [i for i, s in enumerate(sequences) if not s]
        if empty:
            raise ValueError(
                f"sample {meta.keys[empty[0]]!r}: nothing to score (an empty prompt and response); "
                "the reward model needs at least one token"
            )
        model_score = self.score_sequences(sequences)
        rule_score = td["rm_scores"].float().sum(-1)
        reward = combine_rewards(rule_score, model_score, rule_weight=rm.rule_weight, model_weight=rm.model_weight)
        rm_scores = torch.zeros(td["responses"].shape, dtype=torch.float32)
        has_tokens = lengths > 0
        last = (lengths - 1).clamp(min=0)
        rm_scores[has_tokens, last[has_tokens]] = reward[has_tokens]
        self.data_plane.kv_batch_put(
            keys=meta.keys,
            partition_id=meta.partition_id,
            fields={"rm_scores": rm_scores, "rm_model_score": model_score, "rm_rule_score": rule_score},
        )
        n = float(len(sequences))
        metrics = {
            **weighted("reward/model_score", float(model_score.sum()), n),
            **weighted("reward/rule_score", float(rule_score.sum()), n),
            **weighted("reward/model_truncated_frac", float(truncated), n),
            "reward/model_score_max": float(model_score.max()),
            "reward/model_score_min": float(model_score.min()),
            "reward/perf/model_cpu_s": time.thread_time() - cpu0,
            # The phase's peak as a reward metric (max over ranks): the stage reports reward/* keys.
            "reward/perf/model_max_memory_gb": phase_memory_metrics("reward_model", self.device)[
                "perf/reward_model/max_memory_gb"
            ],
        }
        return result_handle(meta, ["rm_scores", "rm_model_score", "rm_rule_score"], metrics, self.device)
