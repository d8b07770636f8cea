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


#: A tiny run without a warm start: the forward tests need a model, not a trained one.
FORWARD_BASE = [
    "data.synthetic.num_train=64",
    "data.synthetic.num_val=8",
    "actor_rollout_ref.model.tiny.warmstart_steps=0",
]


def forward_worker(impl: str, packed: bool = False, fused: bool = False, extra: tuple[str, ...] = ()):
    """A PolicyWorker of the tiny model on the forward path `impl` (hf, lean, hf-packed), packed and fused or not."""
    from conveyor.config import load_config
    from conveyor.data_plane import make_data_plane
    from conveyor.trainer.plan import build_run_plan
    from conveyor.trainer.setup import prepare_default_model
    from conveyor.workers.ranks.actor import PolicyWorker
    from conveyor.workers.ranks.settings import actor_settings

    cfg = load_config(
        None,
        FORWARD_BASE
        + [
            f"actor_rollout_ref.model.forward_impl={impl}",
            f"actor_rollout_ref.model.use_remove_padding={str(packed).lower()}",
            f"actor_rollout_ref.model.use_fused_kernels={str(fused).lower()}",
            *extra,
        ],
    )
    return PolicyWorker(
        actor_settings(cfg, build_run_plan(cfg, "cpu")),
        model_path=prepare_default_model(cfg),
        data_plane=make_data_plane("memory"),
    )
