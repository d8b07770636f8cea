"""A session's calls as they happened, cut into training samples where a prompt stops extending them.

Every completion the gateway serves is recorded as a `Call`: the exact prompt
token ids the engine was fed, the ids it sampled, their log-probs and the
experts each fed token was routed to. A session's calls become samples by one
rule (`SessionTrajectories.place`): a call whose prompt starts with the whole
token sequence of one of the session's samples (its first prompt, everything
sampled since and what came between) extends that sample; its new prompt
tokens (a tool's answer, a user turn, the template's markers) are context the
model did not sample, masked out of the loss. Any other call (a template that
drops earlier `<think>` blocks, an agent that edits or summarises its history,
a sub-agent with a conversation of its own) starts a new sample of the same
session. Nothing is re-tokenized from text: a sample's tokens are the calls'
own ids.

How a sample lies in a data-plane row of a batch whose prompts are `P`
columns wide and whose responses have a budget of `R` columns (`layout`):
the prompt columns hold the first min(P, len(first prompt)) tokens of its
first prompt, left-padded; the response columns hold the rest of that prompt
(context), then every later token in order. `room` is how many tokens a call
may still sample so that its sample fits.

Each token carries the policy version of the call that fed or sampled it (the
engine's weights version then; `UNKNOWN_VERSION` where the engine named none,
as a replica labels weights no sync has named): the first prompt's tokens the
first call's, a call's new context and its completion that call's, and a row's
padding its last call's. This is what the built-in rollout writes per token
(`token_policy_version`, `conveyor.workers.ranks.replica`), where versions
only grow along a response.

This module is pure: token lists and tensors in, samples out; it does not
serve HTTP, run agents or talk to an engine.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
from torch import Tensor

__all__ = [
    "Call",
    "Sample",
    "SessionTrajectories",
    "layout",
    "room",
    "Row",
    "TASK_FIELDS",
    "UNKNOWN_VERSION",
    "session_task",
]

# The per-sample fields a session's task is made from (stage 1 writes them); copied onto a cut session's extra rows.
TASK_FIELDS = ("uid", "data_source", "ground_truth", "raw_prompt", "prompt_messages", "extra_info")
# A token's policy version where the engine named none: the label a replica gives weights no sync has named.
UNKNOWN_VERSION = -1


def session_task(
    messages: Any, data_source: Any, ground_truth: Any, extra_info: Any, raw_prompt: str
) -> dict[str, Any]:
    """One row's task for `GatewayLoop.run`: what its agent reads on stdin (the dataset row in verl's shape, SPEC
    section 6) and the prompt text the trainer rendered it to."""
    return {
        "agent_task": {
            "prompt": messages,
            "data_source": data_source,
            "ground_truth": ground_truth,
            "extra_info": extra_info if isinstance(extra_info, dict) else {},
        },
        "raw_prompt": raw_prompt,
    }


@dataclass(frozen=True)
class Call:
    """One served completion: the fed prompt ids, the sampled ids and log-probs, and the routing of both.

    `routing` is (len(prompt) + len(completion), L, K) int16 with -1 where unknown (the last sampled token is never
    fed), or None when the engine returned none. `version` is the engine's weights version when it sampled.
    """

    prompt: tuple[int, ...]
    completion: tuple[int, ...]
    log_probs: tuple[float, ...]
    routing: Tensor | None = None
    version: int | None = None
    images: tuple[Any, list[list[int]]] | None = None  # a vision-language policy's: the first prompt's pixels, grids


@dataclass
class Sample:
    """One training sample of a session: its first prompt, then every token after it, each marked model or not."""

    context: list[int]
    tokens: list[int] = field(default_factory=list)
    model: list[bool] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)  # per token of `tokens`: the policy version of its call
    context_version: int = UNKNOWN_VERSION  # ... and of the first prompt's tokens (its first call's)
    routing: Tensor | None = None  # (len(context) + len(tokens), L, K) int16, -1 unknown
    calls: int = 0
    # Per call: its prompt's and completion's token counts and the weights version that sampled it.
    records: list[dict] = field(default_factory=list)
    images: tuple[Any, list[list[int]]] | None = None  # its first prompt's (pixel values or None, grids)

    @property
    def sequence(self) -> list[int]:
        """Every token of the sample in order: its first prompt, then what followed."""
        return self.context + self.tokens

    def extended_by(self, prompt: list[int] | tuple[int, ...]) -> bool:
        """Whether `prompt` starts with this sample's whole sequence (so a call with it continues the sample)."""
        seq = self.sequence
        return len(prompt) >= len(seq) and list(prompt[: len(seq)]) == seq


def room(sample: Sample | None, prompt_len: int, prompt_width: int, budget: int) -> int:
    """Tokens a call with a prompt of `prompt_len` tokens may sample so that its sample still fits its row.

    `sample`: the sample the call extends (None: it starts one). A row holds `prompt_width` prompt columns and
    `budget` response columns; the first prompt's tokens beyond the prompt columns spill into the response columns.
    """
    first = len(sample.context) if sample is not None else prompt_len
    used = prompt_len - min(prompt_width, first)
    return budget - used


class SessionTrajectories:
    """The samples one session's calls make, built call by call.

    `image_token_id` (a vision-language policy's image pad): an image belongs to a sample's first prompt, since the
    trainer places every token after that prompt at text positions; a prompt whose new tokens hold an image pad
    starts a sample of its own."""

    def __init__(self, image_token_id: int | None = None) -> None:
        self.samples: list[Sample] = []
        self.image_token_id = image_token_id

    def extends(self, prompt: list[int] | tuple[int, ...]) -> Sample | None:
        """The sample a call with `prompt` would continue (the longest one it extends), or None for a new one."""
        best = None
        pad = self.image_token_id
        for s in self.samples:
            if s.extended_by(prompt) and (best is None or len(s.sequence) > len(best.sequence)):
                if pad is not None and pad in prompt[len(s.sequence) :]:
                    continue
                best = s
        return best

    def place(self, call: Call) -> Sample:
        """Record `call`: it continues the sample its prompt extends, or starts a new one; returns that sample."""
        sample = self.extends(call.prompt)
        prompt = list(call.prompt)
        n = len(call.completion)
        version = UNKNOWN_VERSION if call.version is None else int(call.version)
        if sample is None:
            sample = Sample(context=prompt, context_version=version, images=call.images)
            self.samples.append(sample)
            if call.routing is not None:
                sample.routing = call.routing[: len(prompt)].to(torch.int16).clone()
        else:
            new = prompt[len(sample.sequence) :]
            known = len(sample.sequence)
            sample.tokens.extend(new)
            sample.model.extend([False] * len(new))
            sample.log_probs.extend([0.0] * len(new))
            sample.versions.extend([version] * len(new))  # fed first by this call
            if call.routing is not None:
                sample.routing = _merge_routing(sample, call.routing, known, len(new))
        sample.tokens.extend(call.completion)
        sample.model.extend([True] * n)
        sample.log_probs.extend(float(x) for x in call.log_probs)
        sample.versions.extend([version] * n)
        if call.routing is not None and sample.routing is not None:
            tail = call.routing[len(prompt) : len(prompt) + n].to(torch.int16)
            sample.routing = torch.cat([sample.routing, tail])
        elif call.routing is None:
            sample.routing = None  # one call without routing: the sample's routing is unknown as a whole
        sample.calls += 1
        sample.records.append({"prompt_tokens": len(prompt), "completion_tokens": n, "version": call.version})
        return sample


def _merge_routing(sample: Sample, routing: Tensor, known: int, new: int) -> Tensor | None:
    """The sample's routing after a call that extends it: positions it already had keep their first record, except
    where none was known (the last token of the previous completion, fed only now, takes this call's); the new
    context tokens stay -1, as a multi-turn loop's tool tokens do (only the first prompt and the model's tokens carry
    routing)."""
    if sample.routing is None:
        return None
    old = sample.routing
    mine = routing[:known].to(torch.int16)
    is_model = torch.tensor([True] * len(sample.context) + sample.model[: known - len(sample.context)])
    unknown = (old < 0).all(dim=-1).all(dim=-1) & is_model
    merged = old.clone()
    merged[unknown] = mine[unknown]
    pad = torch.full((new, *old.shape[1:]), -1, dtype=torch.int16)
    return torch.cat([merged, pad])


class Row(NamedTuple):
    """A sample laid out as a data-plane row (`layout`)."""

    prompt: list[int]  # left-padded to the prompt width
    response: list[int]
    mask: list[bool]  # the model's tokens
    log_probs: list[float]
    versions: list[int]  # each response token's policy version
    head: int  # how many of the first prompt's tokens are in the prompt columns


def layout(sample: Sample, prompt_width: int, pad: int) -> Row:
    """The sample as a row: its first prompt's head left-padded into `prompt_width` columns, the rest after."""
    head = min(prompt_width, len(sample.context))
    prompt = [pad] * (prompt_width - head) + sample.context[:head]
    spill = sample.context[head:]
    response = spill + sample.tokens
    mask = [False] * len(spill) + sample.model
    log_probs = [0.0] * len(spill) + sample.log_probs
    versions = [sample.context_version] * len(spill) + sample.versions
    return Row(prompt, response, mask, log_probs, versions, head)
