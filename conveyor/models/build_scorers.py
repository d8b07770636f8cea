"""A small reward model and a small judge for the built-in task, built on a laptop in about a minute.

`conveyor build-reward-models --out DIR` (`make reward-models`) writes, from the run config's synthetic task:

- `DIR/reward_model`: a tiny sequence classifier (one label) with the policy's character tokenizer, trained for
  a few hundred steps to tell the task's right answers from wrong ones (`build_reward_model`). Its wrong answers
  are near misses (off by one or ten, digits reversed, a digit dropped) and random numbers, so the score
  correlates with correctness on such answers (held-out accuracy about 0.68), not on the warm-started
  policy's own mistakes, where it is at chance (docs/rewards.md): it is for running the path, not learning.
- `DIR/judge`: a tiny causal LM and its prompt template (`DIR/judge/template.txt`), for `parser=yes_no`
  (`build_judge`). Its weights are written, not trained: its layers add nothing, and its head answers "yes"
  after a digit and "no" after anything else. The template ends with the response, so the judge says whether
  the response ends in a digit: a format check, which never reads the question or the reference.

Both are for trying the reward-model and judge paths end to end on a CPU (`examples/reward_model_tiny.yaml`,
`examples/judge_tiny.yaml`). What this deliberately does not do: build a reward model or judge worth training
a real policy against; use a real checkpoint for that (docs/rewards.md).
"""

from __future__ import annotations

import logging
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger(__name__)

__all__ = ["JUDGE_TEMPLATE", "RewardModelReport", "bigram_judge", "build_judge", "build_reward_model", "wrong_answer"]

#: The judge's template: the response last, since the judge answers from the last character it reads.
JUDGE_TEMPLATE = "question: {question}\nis the response a number? {response}"


@dataclass(frozen=True)
class RewardModelReport:
    """What `build_reward_model` wrote and how well it tells right from wrong on problems it never saw."""

    path: Path
    steps: int
    seconds: float
    heldout_accuracy: float  # share of held-out (answer, label) pairs whose score's sign is right
    heldout_pairs: int


def wrong_answer(truth: str, rng: random.Random) -> str:
    """A wrong answer to a problem whose answer is `truth`: a near miss or a random number, never `truth`."""
    n = int(truth)
    kind = rng.randrange(5)
    if kind == 0:
        wrong = str(n + rng.choice((-1, 1)))
    elif kind == 1:
        wrong = str(abs(n + rng.choice((-10, 10))))
    elif kind == 2:
        wrong = truth.lstrip("-")[::-1]
    elif kind == 3:
        wrong = str(rng.randrange(2 * max(abs(n), 10)))
    else:
        wrong = truth[:-1]
    # A reversal of a palindrome, or a dropped digit of a one-digit answer, is not wrong or not an answer.
    return wrong if wrong not in ("", "-", truth) else str(n + 2)


def _labelled(records: list[dict], tokenizer: Any, rng: random.Random) -> list[tuple[list[int], float]]:
    """(ids of prompt + answer + <eos>, 1.0 for the right answer or 0.0) : one right and one wrong per record."""
    from conveyor.tasks.dataset import render_prompt

    rows = []
    for rec in records:
        prompt = render_prompt(rec, tokenizer)
        truth = str(rec["reward_model"]["ground_truth"])
        for answer, label in ((truth, 1.0), (wrong_answer(truth, rng), 0.0)):
            ids = tokenizer(prompt + answer, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
            rows.append((ids, label))
    return rows


def _batch(rows: list[tuple[list[int], float]], pad: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Left-padded ids, their attention mask and labels: the score is read at the last position, as it is scored."""
    width = max(len(ids) for ids, _ in rows)
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, (row, _) in enumerate(rows):
        ids[i, width - len(row) :] = torch.tensor(row)
        mask[i, width - len(row) :] = 1
    return ids, mask, torch.tensor([label for _, label in rows])


def _scores(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    return model(input_ids=ids, attention_mask=mask, position_ids=positions).logits[:, 0]


def build_reward_model(
    out: str | Path,
    train_records: list[dict],
    heldout_records: list[dict],
    *,
    steps: int = 300,
    batch_size: int = 64,
    lr: float = 1e-3,
    seed: int = 0,
) -> RewardModelReport:
    """Train a tiny sequence classifier on right and wrong answers to `train_records` and save it (with its tokenizer)
    in `out`; its accuracy is measured on `heldout_records`."""
    from conveyor.models.reward_model import build_tiny_reward_model
    from conveyor.models.tokenizer import build_char_tokenizer

    if steps <= 0:
        raise ValueError(f"--rm-steps must be at least 1 (training steps of the reward model), got {steps}")
    if not train_records or not heldout_records:
        raise ValueError(
            "the reward model needs training and held-out problems; raise data.synthetic.num_train/num_val"
        )
    tokenizer = build_char_tokenizer()  # the tiny policy's: its ids are scored as they are, no re-tokenization
    rng = random.Random(seed)
    train = _labelled(train_records, tokenizer, rng)
    heldout = _labelled(heldout_records, tokenizer, rng)
    model = build_tiny_reward_model(tokenizer, seed=seed, hidden_size=64, num_layers=2, intermediate_size=128)
    # build_tiny_reward_model widens the head for tests that want spread scores; training wants it small.
    torch.nn.init.normal_(model.score.weight, std=0.02, generator=torch.Generator().manual_seed(seed))
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    start = time.monotonic()
    model.train()
    for step in range(1, steps + 1):
        ids, mask, labels = _batch(
            [train[rng.randrange(len(train))] for _ in range(batch_size)], tokenizer.pad_token_id
        )
        loss = torch.nn.functional.binary_cross_entropy_with_logits(_scores(model, ids, mask), labels)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if step % 100 == 0 or step == steps:
            logger.info("reward model: step %d/%d, loss %.3f", step, steps, loss.item())
    model.eval()
    with torch.no_grad():
        ids, mask, labels = _batch(heldout, tokenizer.pad_token_id)
        accuracy = float(((_scores(model, ids, mask) > 0).float() == labels).float().mean())
    path = Path(out)
    model.save_pretrained(str(path))
    tokenizer.save_pretrained(str(path))
    return RewardModelReport(path, steps, time.monotonic() - start, accuracy, len(heldout))


def bigram_judge(tokenizer: Any, successors: dict[str, list[str]]) -> Any:
    """A tiny causal LM that answers by a bigram chain: after token c it says one of successors[c] (tied if several).

    Every layer's output projection is zeroed (the layers add nothing), the embedding is one-hot and the LM head
    maps each token to its successors: generation follows the chain from the prompt's last token to its end.
    """
    from conveyor.models.tiny import build_tiny_model

    # Heads of 32 values: a size vLLM's CPU attention serves too.
    model = build_tiny_model("qwen3", tokenizer, hidden_size=64, num_layers=1, num_heads=2, num_kv_heads=2)
    vocab = len(tokenizer)
    ids = tokenizer.convert_tokens_to_ids
    with torch.no_grad():
        # Layers whose outputs are zero leave each position's one-hot embedding as it is: the head alone answers.
        for name, p in model.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                p.zero_()
        model.model.embed_tokens.weight.zero_()
        model.model.embed_tokens.weight[:, :vocab] = torch.eye(vocab)
        model.lm_head.weight.zero_()
        for src, dsts in successors.items():
            for dst in dsts:
                model.lm_head.weight[ids(dst), ids(src)] = 5.0
    return model


def build_judge(out: str | Path) -> Path:
    """Write the format judge (a tiny causal LM, its tokenizer and `template.txt`) into `out`; returns `out`."""
    from conveyor.models.tokenizer import build_char_tokenizer

    tokenizer = build_char_tokenizer()
    # Each token's successor: the first answer token follows the prompt's last character, then the word runs out.
    after = {tok: ["n"] for tok in tokenizer.get_vocab()}
    after.update({d: ["y"] for d in "0123456789"})
    after.update({"y": ["e"], "e": ["s"], "s": [tokenizer.eos_token], "n": ["o"], "o": [tokenizer.eos_token]})
    model = bigram_judge(tokenizer, after)
    path = Path(out)
    model.save_pretrained(str(path))
    tokenizer.save_pretrained(str(path))
    # No newline at the end: the judge answers from the template's last character, which must be the response's.
    (path / "template.txt").write_text(JUDGE_TEMPLATE)
    return path
