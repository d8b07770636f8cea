"""A short supervised warm start of the tiny model on the task's answer format.

Reinforcement learning needs a policy that already emits answers of the right
shape now and then; a randomly initialised model almost never does. This
trains for a fixed, small number of steps on (prompt, answer) pairs of the
training split, deliberately stopping early (the default leaves held-out
accuracy low) so that the RL run has something to learn. It never sees the
held-out split.
"""

from __future__ import annotations

import logging
import random

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

__all__ = ["supervised_warmstart"]


def _encode_pairs(tokenizer: PreTrainedTokenizerBase, records: list[dict]) -> list[tuple[list[int], list[int]]]:
    from conveyor.tasks.dataset import render_prompt

    pairs = []
    for rec in records:
        prompt = tokenizer(render_prompt(rec), add_special_tokens=False)["input_ids"]
        answer = tokenizer(str(rec["reward_model"]["ground_truth"]), add_special_tokens=False)["input_ids"]
        pairs.append((prompt, answer + [tokenizer.eos_token_id]))
    return pairs


def supervised_warmstart(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    records: list[dict],
    *,
    steps: int,
    lr: float,
    batch_size: int = 64,
    seed: int = 0,
) -> list[float]:
    """Train `model` in place for `steps` steps of next-token loss on the answers; returns the loss per step."""
    if steps <= 0:
        return []
    if not records:
        raise ValueError("the warm start needs training records; data.synthetic.num_train must be > 0")
    pairs = _encode_pairs(tokenizer, records)
    rng = random.Random(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.98), weight_decay=0.0)
    pad = tokenizer.pad_token_id
    model.train()
    losses = []
    for step in range(steps):
        batch = [pairs[rng.randrange(len(pairs))] for _ in range(batch_size)]
        seqs = [p + a for p, a in batch]
        width = max(len(s) for s in seqs)
        ids = torch.full((len(seqs), width), pad, dtype=torch.long)
        labels = torch.full((len(seqs), width), -100, dtype=torch.long)
        attn = torch.zeros((len(seqs), width), dtype=torch.long)
        for i, ((p, a), s) in enumerate(zip(batch, seqs)):
            off = width - len(s)  # left padding, as at generation time
            ids[i, off:] = torch.tensor(s)
            attn[i, off:] = 1
            labels[i, off + len(p):] = torch.tensor(a)
        pos = (attn.cumsum(-1) - 1).clamp(min=0)
        out = model(input_ids=ids, attention_mask=attn, position_ids=pos, use_cache=False)
        logits = out.logits[:, :-1].float()
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
    model.eval()
    logger.info("warm start: %d steps, loss %.3f -> %.3f", steps, losses[0], losses[-1])
    return losses
