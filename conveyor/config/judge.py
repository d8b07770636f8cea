"""The `reward_model.judge` section: a generative judge (LLM-as-a-judge) that scores each response from text.

It deliberately loads nothing: the judge worker (`conveyor.workers.ranks.judge`) reads the template file,
builds the engine and parses the outputs.
"""

from __future__ import annotations

from dataclasses import dataclass

from conveyor.config.fields import F, S, check, registry
from conveyor.config.model import DTYPES

__all__ = ["JudgeConfig", "JudgeModelConfig", "JUDGE_PARSERS", "JUDGE_ON_UNPARSABLE"]

#: How a score is read from the judge's text: a number inside a tag (`<score>7</score>`), or a yes/no answer.
JUDGE_PARSERS = ("tag", "yes_no")
#: What an output that stays unparsable after the retries does: stop the run with an error, or score a number.
JUDGE_ON_UNPARSABLE = ("error", "score")


@dataclass
class JudgeModelConfig:
    """The judge's checkpoint (a causal LM) and how it is loaded."""

    path: str | None = F(None, "a local Hugging Face causal-LM checkpoint directory (its tokenizer beside it)")
    dtype: str = F(
        "float32", "dtype the judge is loaded in (an engine with its own dtype rule applies it)", choices=DTYPES
    )
    trust_remote_code: bool = F(False, "run code shipped in the checkpoint's directory")


@dataclass
class JudgeConfig:
    """A generative judge: a prompt template around the question and the response, generated, a score parsed."""

    enable: bool = F(False, "score every response with the judge model at reward_model.judge.model.path")
    model: JudgeModelConfig = S(JudgeModelConfig, "the judge's checkpoint")
    engine: str = F(
        "hf",
        "the rollout engine that serves the judge (any registered one; the engine tuning keys are "
        "actor_rollout_ref.rollout's)",
        choices=registry("conveyor.rollout.base", "ROLLOUT_ENGINES"),
    )
    prompt_template: str | None = F(
        None,
        "a text file with {question}, {response} and {ground_truth} placeholders (Python format fields; write "
        "{{ and }} for braces); null = a built-in template asking for <score>0-10</score>",
    )
    parser: str = F(
        "tag", "tag: the number inside <score_tag>...</score_tag>; yes_no: yes = 1, no = 0", choices=JUDGE_PARSERS
    )
    score_tag: str = F("score", "the tag the number is read from (parser=tag)")
    max_new_tokens: int = F(64, "most tokens of one judgement", gt=0)
    temperature: float = F(0.0, "sampling temperature of the judgement (0 = greedy)", ge=0)
    max_retries: int = F(
        2, "regenerations of an unparsable judgement (sampled at temperature 1 when temperature is 0)", ge=0
    )
    on_unparsable: str = F(
        "score",
        "after the retries: score = give unparsable_score (counted in reward/judge_unparsable_frac); error = stop "
        "the run naming the sample and the output",
        choices=JUDGE_ON_UNPARSABLE,
    )
    unparsable_score: float = F(0.0, "the score of a judgement that stays unparsable (on_unparsable=score)")
    micro_batch_size: int = F(64, "judgements generated in one engine call", gt=0, resume_neutral=True)
    weight: float = F(
        1.0,
        "the reward adds weight x the judge's score to reward_model.rule_weight x the rule reward (and "
        "reward_model.model_weight x the reward model's score when one runs)",
        ge=0,
    )

    def validate(self, prefix: str) -> None:
        """An enabled judge names its checkpoint; the tag is a plain name."""
        check(
            not self.enable or self.model.path is not None,
            f"{prefix}.model.path",
            "reward_model.judge.enable=true needs the judge's checkpoint directory; set it (or enable=false)",
        )
        check(
            bool(self.score_tag) and self.score_tag.replace("_", "").replace("-", "").isalnum(),
            f"{prefix}.score_tag",
            f"must be a tag name of letters, digits, - and _, got {self.score_tag!r}",
        )
