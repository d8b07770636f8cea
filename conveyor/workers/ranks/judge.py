"""The generative judge's worker: a judge model served by a rollout engine, which scores each response from text.

It runs last in stage 3, on the same handle. For every sample it fills the prompt template
(`reward_model.judge.prompt_template`: `{question}`, the prompt's last user message; `{response}`, the
decoded response; `{ground_truth}`), renders it with the judge tokenizer's chat template as one user turn,
and generates judgements for the step's samples in batches of `micro_batch_size` through the engine
`reward_model.judge.engine` (any registered rollout engine, `conveyor.rollout.base`). A score is parsed
from each judgement (`parser`: the number in `<score_tag>...</score_tag>`, or yes = 1 / no = 0);
the unparsable ones are generated again, up to `max_retries` times, with a new seed (at temperature 1 when
the judgement is greedy, which would repeat itself). What stays unparsable stops the run with an error
naming the sample and the output (`on_unparsable=error`), or scores `unparsable_score` and is counted in
`reward/judge_unparsable_frac`.

It writes `rm_judge_score` (B,) and `rm_scores` (B, R): `rule_weight x rule + model_weight x the reward
model's score (when one ran) + weight x the judge's score` on the last response token.

The judge's weights are its checkpoint's, read once when it is built: an engine that samples from the
module it is given gets the loaded model; any other (vLLM) gets the checkpoint's tensors through its
`update_weights` once. The judge is never given the actor's weights: no weight shipper knows it.

What it deliberately does not do: train the judge, or decide where it runs (`conveyor.workers.placement`).
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from conveyor.algos.trajectory import span_lengths
from conveyor.data_plane.base import DataPlane
from conveyor.metrics.reduce import weighted
from conveyor.models.loading import build_causal_lm_on_meta, load_causal_lm, load_tokenizer
from conveyor.models.reward_model import load_keyed
from conveyor.protocol import KVBatchMeta
from conveyor.rollout.base import EngineContext, SamplingParams, engine_spec
from conveyor.tasks.prompts import PROMPT_MESSAGES
from conveyor.workers.ranks.perf import result_handle
from conveyor.workers.ranks.reward_model import check_token_ids_fit

if TYPE_CHECKING:
    from conveyor.config import Config
    from conveyor.config.plan import RunPlan


logger = logging.getLogger(__name__)
__all__ = [
    "DEFAULT_JUDGE_TEMPLATE",
    "JudgeSettings",
    "JudgeWorker",
    "UnparsableJudgementError",
    "judge_settings",
    "parse_judgement",
]

#: The template used when `reward_model.judge.prompt_template` is null.
DEFAULT_JUDGE_TEMPLATE = (
    "Rate the response to the question from 0 (wrong or useless) to 10 (correct and helpful).\n"
    "Question: {question}\n"
    "Response: {response}\n"
    "Reference answer: {ground_truth}\n"
    "Answer with the rating only, as <score>N</score>."
)

_NUMBER = r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?"
_YES_NO = re.compile(r"\b(yes|no)\b", re.IGNORECASE)


class UnparsableJudgementError(ValueError):
    """A judgement stayed unparsable after its retries (reward_model.judge.on_unparsable=error)."""


@dataclasses.dataclass(frozen=True)
class JudgeSettings:
    """The judge's worker (`JudgeWorker`): its section, the weights of the sum, and the engine's settings."""

    judge: Any  # reward_model.judge
    rule_weight: float  # reward_model.rule_weight
    model_weight: float  # reward_model.model_weight (applies when a reward model ran before)
    rollout: Any  # actor_rollout_ref.rollout with the judge's engine and a placement of its own
    seed: int  # trainer.seed
    sample_tokens: int = 0  # the policy's longest prompt and response (data.max_prompt_length + max_response_length)


def judge_settings(cfg: Config, plan: RunPlan | None = None) -> JudgeSettings:
    """The judge's settings of a run of `cfg`."""
    rollout = copy.deepcopy(cfg.actor_rollout_ref.rollout)
    rollout.name = cfg.reward_model.judge.engine
    rollout.placement = "separate"  # an engine of its own: it never sleeps for a trainer, nor takes its weights
    return JudgeSettings(
        judge=copy.deepcopy(cfg.reward_model.judge),
        rule_weight=cfg.reward_model.rule_weight,
        model_weight=cfg.reward_model.model_weight,
        rollout=rollout,
        seed=cfg.trainer.seed,
        sample_tokens=cfg.data.max_prompt_length + cfg.data.max_response_length,
    )


def parse_judgement(text: str, parser: str, tag: str = "score") -> float | None:
    """The score in a judgement's `text`, or None when it holds none (`parser`: tag or yes_no)."""
    if parser == "tag":
        found = re.search(rf"<{re.escape(tag)}>\s*({_NUMBER})\s*</{re.escape(tag)}>", text)
        if found is None:
            return None
        value = float(found.group(1))
        return value if abs(value) < float("inf") else None
    if parser == "yes_no":
        found = _YES_NO.search(text)
        return None if found is None else float(found.group(1).lower() == "yes")
    raise ValueError(f"reward_model.judge.parser: unknown parser {parser!r}; use tag or yes_no")


def _checkpoint_tensors(path: str) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors by Hugging Face name, one at a time."""
    from safetensors import safe_open

    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise ValueError(f"reward_model.judge.model.path={path!r}: no *.safetensors files to load the engine from")
    for file in files:
        with safe_open(str(file), framework="pt") as fh:
            for name in fh.keys():
                yield name, fh.get_tensor(name)


def _question(prompt: Any) -> str:
    """The question of a prompt: its last user message (all messages joined when none is the user's)."""
    users = [m["content"] for m in prompt if m.get("role") == "user"]
    return str(users[-1]) if users else "\n".join(str(m["content"]) for m in prompt)


class JudgeWorker:
    """The generative judge on one engine."""

    def __init__(
        self,
        settings: JudgeSettings,
        *,
        policy_tokenizer: Any,
        data_plane: DataPlane,
        rank: int = 0,
        world_size: int = 1,
        device: str = "cpu",
    ):
        self.settings = settings
        j = settings.judge
        self.rank, self.world_size = rank, world_size
        self.device = torch.device(device)
        self.data_plane = data_plane
        self.policy_tokenizer = policy_tokenizer
        self.template = DEFAULT_JUDGE_TEMPLATE
        if j.prompt_template is not None:
            try:
                self.template = Path(j.prompt_template).read_text()
            except OSError as err:
                raise ValueError(
                    f"reward_model.judge.prompt_template={j.prompt_template!r}: cannot read it ({err}); "
                    "point it at a text file, or set it to null for the built-in template"
                ) from err
        try:  # a field the template names that does not exist is the user's to fix: said now, not mid-run
            self.template.format(question="", response="", ground_truth="")
        except (KeyError, IndexError, ValueError) as err:
            raise ValueError(
                f"reward_model.judge.prompt_template: {type(err).__name__}: {err}; its fields are {{question}}, "
                "{response} and {ground_truth} (write {{ and }} for a literal brace)"
            ) from err
        if self.template.format(question="", response="\x00", ground_truth="") == self.template.format(
            question="", response="", ground_truth=""
        ):  # a judge that never sees the response scores every sample of a prompt alike: nothing to learn from
            raise ValueError(
                "reward_model.judge.prompt_template never shows the judge the response: put {response} in it"
            )
        key = "reward_model.judge.model.path"
        self.tokenizer = load_keyed(
            key,
            j.model.path,
            load_tokenizer,
            j.model.path,
            padding_side="left",
            trust_remote_code=j.model.trust_remote_code,
        )
        spec = engine_spec(settings.rollout.name)
        own_modules = spec.capabilities(self.device.type).shares_trainer_modules
        # An engine that samples from the module it is given gets the loaded judge; one with its own copy
        # gets a weightless skeleton (for its config) and the checkpoint's tensors below.
        if own_modules:
            model = load_keyed(
                key,
                j.model.path,
                load_causal_lm,
                j.model.path,
                dtype=j.model.dtype,
                device=self.device,
                trust_remote_code=j.model.trust_remote_code,
            ).eval()
        else:
            model = load_keyed(
                key,
                j.model.path,
                build_causal_lm_on_meta,
                j.model.path,
                dtype=j.model.dtype,
                trust_remote_code=j.model.trust_remote_code,
            )
        check_token_ids_fit(key, self.tokenizer, model)
        context = settings.rollout.max_model_len or int(model.config.max_position_embeddings)
        self._check_context(context)
        self.engine = spec.build(
            EngineContext(
                model_path=j.model.path,
                model=model,
                tokenizer=self.tokenizer,
                rollout=settings.rollout,
                model_dtype=j.model.dtype,
                trust_remote_code=j.model.trust_remote_code,
                max_model_len=context,
                seed=settings.seed,
                rank=rank,
                world_size=world_size,
                device=self.device,
            )
        )
        if not own_modules:
            self.engine.update_weights(_checkpoint_tensors(j.model.path), version=0)

    def _check_context(self, context: int) -> None:
        """Refuse a judge whose context cannot hold its template and judgement; warn where long samples may not fit
        (their judgement would be unparsable every time)."""
        j = self.settings.judge
        bare = len(self.prompt_ids([""], [""], [""])[0])
        if bare + j.max_new_tokens > context:
            raise ValueError(
                f"reward_model.judge.prompt_template: the judge's context is {context} tokens, and its template alone "
                f"renders to {bare} tokens before any question or response, plus max_new_tokens={j.max_new_tokens}: "
                "shorten the template, lower reward_model.judge.max_new_tokens, or use a judge model with a longer "
                "context (reward_model.judge.model.path)"
            )
        worst = bare + self.settings.sample_tokens + j.max_new_tokens
        if self.settings.sample_tokens and worst > context:
            logger.warning(
                "reward_model.judge: its context is %d tokens; the template (%d) with the longest prompt and response "
                "(data.max_prompt_length + max_response_length = %d policy tokens) and max_new_tokens=%d may need "
                "%d: such samples cannot be judged and count under reward/judge_unparsable_frac",
                context,
                bare,
                self.settings.sample_tokens,
                j.max_new_tokens,
                worst,
            )

    @property
    def optim_steps(self) -> int:
        """Always 0: the judge is never updated."""
        return 0

    def close(self) -> None:
        """Release the engine."""
        self.engine.close()

    def prompt_ids(self, questions: list[str], responses: list[str], truths: list[str]) -> list[list[int]]:
        """The judge's prompt ids for each sample: the filled template as one user turn of its chat template."""
        filled = [
            self.template.format(question=q, response=r, ground_truth=t)
            for q, r, t in zip(questions, responses, truths)
        ]
        tok = self.tokenizer
        if getattr(tok, "chat_template", None):
            texts = [
                tok.apply_chat_template([{"role": "user", "content": f}], add_generation_prompt=True, tokenize=False)
                for f in filled
            ]
            return tok(texts, add_special_tokens=False)["input_ids"]
        return tok(filled, add_special_tokens=True)["input_ids"]

    def judge(self, prompt_ids: list[list[int]], attempt: int) -> list[str]:
        """Judgements of the prompts (in micro-batches through the engine), decoded; `attempt` > 0 resamples."""
        j = self.settings.judge
        greedy = j.temperature == 0 and attempt == 0
        params = SamplingParams(
            max_new_tokens=j.max_new_tokens,
            temperature=1.0 if greedy or j.temperature == 0 else j.temperature,
            do_sample=not greedy,
        )
        pad = self.tokenizer.pad_token_id
        out: list[str] = []
        for start in range(0, len(prompt_ids), j.micro_batch_size):
            rows = prompt_ids[start : start + j.micro_batch_size]
            width = max(len(r) for r in rows)
            ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows], dtype=torch.long, device=self.device)
            mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows], device=self.device)
            gen = torch.Generator(device=self.device).manual_seed(self.settings.seed * 1009 + attempt * 7919 + start)
            result = self.engine.generate(ids, mask, params, generator=gen)
            lengths = result["response_mask"].long().sum(-1).tolist()
            out += self.tokenizer.batch_decode(
                [row[:n] for row, n in zip(result["responses"].tolist(), lengths)], skip_special_tokens=True
            )
        return out

    def compute_judge_score(self, meta: KVBatchMeta) -> KVBatchMeta:
        """Writes `rm_judge_score` (B,) and `rm_scores` (B, R), the weighted sum with the earlier rewards."""
        cpu0, t0 = time.thread_time(), time.perf_counter()
        j, s = self.settings.judge, self.settings
        fields = ["responses", "response_mask", "rm_scores", "ground_truth", PROMPT_MESSAGES]
        for extra in ("rm_rule_score", "rm_model_score"):
            if extra in meta.fields:
                fields.append(extra)
        td = self.data_plane.kv_batch_get(keys=meta.keys, partition_id=meta.partition_id, select_fields=fields)
        lengths = span_lengths(td["response_mask"].bool())
        texts = self.policy_tokenizer.batch_decode(
            [row[:n] for row, n in zip(td["responses"].tolist(), lengths.tolist())], skip_special_tokens=True
        )
        prompt_ids = self.prompt_ids([_question(p) for p in td[PROMPT_MESSAGES]], texts, list(td["ground_truth"]))
        scores: list[float | None] = [None] * len(texts)
        outputs = [""] * len(texts)
        todo, retried = list(range(len(texts))), 0
        for attempt in range(j.max_retries + 1):
            retried += len(todo) if attempt else 0
            for i, text in zip(todo, self.judge([prompt_ids[i] for i in todo], attempt)):
                outputs[i], scores[i] = text, parse_judgement(text, j.parser, j.score_tag)
            todo = [i for i in todo if scores[i] is None]
            if not todo:
                break
        if todo and j.on_unparsable == "error":
            i = todo[0]
            raise UnparsableJudgementError(
                f"sample {meta.keys[i]!r}: the judge's output stayed unparsable after {j.max_retries} retries "
                f"(parser={j.parser}): {outputs[i][:200]!r}; fix reward_model.judge.prompt_template or the parser, "
                "raise reward_model.judge.max_retries or max_new_tokens, or set "
                "reward_model.judge.on_unparsable=score"
            )
        judge = torch.tensor([j.unparsable_score if v is None else v for v in scores], dtype=torch.float32)
        rule = td["rm_rule_score"].float() if "rm_rule_score" in td.keys() else td["rm_scores"].float().sum(-1)
        reward = s.rule_weight * rule + j.weight * judge
        if "rm_model_score" in td.keys():
            reward = reward + s.model_weight * td["rm_model_score"].float()
        rm_scores = torch.zeros(td["responses"].shape, dtype=torch.float32)
        has_tokens = lengths > 0
        rm_scores[has_tokens, (lengths - 1).clamp(min=0)[has_tokens]] = reward[has_tokens]
        put = {"rm_scores": rm_scores, "rm_judge_score": judge, "rm_rule_score": rule}
        self.data_plane.kv_batch_put(keys=meta.keys, partition_id=meta.partition_id, fields=put)
        n = float(len(texts))
        metrics = {
            **weighted("reward/judge_score", float(judge.sum()), n),
            **weighted("reward/rule_score", float(rule.sum()), n),
            **weighted("reward/judge_unparsable_frac", float(len(todo)), n),
            **weighted("reward/judge_retries_per_sample", float(retried), n),
            "reward/perf/judge_s": time.perf_counter() - t0,
            "reward/perf/judge_cpu_s": time.thread_time() - cpu0,
        }
        return result_handle(meta, list(put), metrics, self.device)
