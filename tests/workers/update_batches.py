"""The batch the worker tests update on: left-padded prompts, ragged right-padded responses, random advantages."""

from __future__ import annotations

import torch


def ragged_update_fields(b: int, p: int, r: int, vocab: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """`prompts`/`prompt_mask` (b, p) with two rows left-padded, `responses`/`response_mask` (b, r) ragged
    (row 4 a single token), and `advantages` (b, r) zero under the padding."""
    prompts = torch.randint(4, vocab, (b, p), generator=gen)
    prompt_mask = torch.ones(b, p, dtype=torch.bool)
    prompt_mask[0, :2] = False
    prompt_mask[3, :1] = False
    prompts[~prompt_mask] = 0
    responses = torch.randint(4, vocab, (b, r), generator=gen)
    response_mask = torch.ones(b, r, dtype=torch.bool)
    response_mask[1, 2:] = False
    response_mask[4, 1:] = False
    response_mask[6:, 3:] = False
    responses[~response_mask] = 0
    advantages = torch.randn(b, r, generator=gen) * response_mask
    return {
        "prompts": prompts,
        "prompt_mask": prompt_mask,
        "responses": responses,
        "response_mask": response_mask,
        "advantages": advantages,
    }
