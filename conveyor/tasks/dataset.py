"""Batches of prompt records for the trainer, and the prompt text a model sees.

``PromptDataset`` walks a list of records in a shuffled order, one epoch
after another, reshuffling each epoch with ``seed + epoch``; its state is the
epoch and the position inside it, so a run resumed from ``state_dict()``
sees exactly the prompts an uninterrupted run would. ``render_prompt`` turns
a record's chat messages into the string the rollout tokenizes, and
``check_prompt_length`` applies the ``data.truncation`` policy.

This module neither tokenizes nor pads (the rollout does), and it does not
repeat prompts per group (the trainer's prompt stage does).
"""

from __future__ import annotations

import copy
import random
from collections.abc import Sequence
from typing import Any

__all__ = ["TRUNCATION_MODES", "PromptDataset", "check_prompt_length", "render_prompt"]

TRUNCATION_MODES: tuple[str, ...] = ("error", "left", "right")
"""Values of `data.truncation`: fail, keep the last tokens, or keep the first tokens."""


class PromptDataset:
    """A deterministic, resumable, endlessly cycling iterator over prompt records (shuffled each epoch unless told
    not)."""

    def __init__(self, records: Sequence[dict], *, seed: int, shuffle: bool = True) -> None:
        self._records = list(records)
        if not self._records:
            raise ValueError("records is empty; a PromptDataset needs at least one prompt record")
        if not isinstance(seed, int) or isinstance(seed, bool):
            raise ValueError(f"seed must be an int, got {seed!r}")
        self._seed = seed
        self._shuffle = bool(shuffle)
        self._epoch = 0
        self._position = 0
        self._order = self._epoch_order(0)

    def __len__(self) -> int:
        """Number of records in one epoch."""
        return len(self._records)

    @property
    def epoch(self) -> int:
        """The epoch the next record comes from (0-based)."""
        return self._epoch

    @property
    def position(self) -> int:
        """How many records of the current epoch have been handed out."""
        return self._position

    def _epoch_order(self, epoch: int) -> list[int]:
        order = list(range(len(self._records)))
        if self._shuffle:
            random.Random(self._seed + epoch).shuffle(order)
        return order

    def next_batch(self, batch_size: int) -> list[dict]:
        """The next `batch_size` records (copies), continuing into the next epoch when this one runs out."""
        if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size <= 0:
            raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
        batch = []
        for _ in range(batch_size):
            if self._position == len(self._records):
                self._epoch += 1
                self._position = 0
                self._order = self._epoch_order(self._epoch)
            # Copies, so a caller that edits a record cannot change later epochs.
            batch.append(copy.deepcopy(self._records[self._order[self._position]]))
            self._position += 1
        return batch

    def state_dict(self) -> dict[str, int]:
        """`{"epoch", "position", "seed", "num_records"}`: enough to resume at the same prompt."""
        return {
            "epoch": self._epoch,
            "position": self._position,
            "seed": self._seed,
            "num_records": len(self._records),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from `state_dict()`; a different seed or record count is a `ValueError` (the order would differ)."""
        missing = [k for k in ("epoch", "position") if k not in state]
        if missing:
            raise ValueError(f"PromptDataset state lacks key(s) {missing}; got keys {sorted(state)}")
        if "num_records" in state and state["num_records"] != len(self._records):
            raise ValueError(
                f"PromptDataset state was saved with num_records={state['num_records']} but this dataset has "
                f"{len(self._records)} records; resume with the same prompt data"
            )
        if "seed" in state and state["seed"] != self._seed:
            raise ValueError(
                f"PromptDataset state was saved with seed={state['seed']} but this dataset has seed={self._seed}; "
                "resume with the same seed"
            )
        epoch, position = int(state["epoch"]), int(state["position"])
        if epoch < 0 or not 0 <= position <= len(self._records):
            raise ValueError(
                f"PromptDataset state has epoch={epoch}, position={position}; need epoch >= 0 and "
                f"0 <= position <= {len(self._records)}"
            )
        self._epoch, self._position = epoch, position
        self._order = self._epoch_order(epoch)


def _messages(record: dict) -> list[dict]:
    messages = record.get("prompt") if isinstance(record, dict) else None
    if not isinstance(messages, list) or not all(isinstance(m, dict) and "content" in m for m in messages):
        raise ValueError(
            f"record['prompt'] must be a list of chat messages ({{'role': ..., 'content': ...}}), got {messages!r:.200}"
        )
    return messages


def render_prompt(record: dict, tokenizer: Any | None = None) -> str:
    """The prompt text of `record`: its chat template (with generation prompt) or its contents joined by "\n".

    Without a chat template a one-message prompt renders as its bare content
    (the synthetic task's model sees exactly ``"23+45="``).
    """
    messages = _messages(record)
    if tokenizer is not None and getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        assert isinstance(text, str), type(text)
        return text
    return "\n".join(str(m["content"]) for m in messages)


def check_prompt_length(token_ids: list[int], max_len: int, truncation: str) -> list[int]:
    """`token_ids` if it fits `max_len`, else cut ("left": keep the last, "right": keep the first) or fail ("error")."""
    if truncation not in TRUNCATION_MODES:
        raise ValueError(f"data.truncation must be one of {TRUNCATION_MODES}, got {truncation!r}")
    if not isinstance(max_len, int) or isinstance(max_len, bool) or max_len <= 0:
        raise ValueError(f"data.max_prompt_length must be a positive int, got {max_len!r}")
    ids = list(token_ids)
    if len(ids) <= max_len:
        return ids
    if truncation == "left":
        return ids[-max_len:]
    if truncation == "right":
        return ids[:max_len]
    raise ValueError(
        f"prompt has {len(ids)} tokens, more than data.max_prompt_length={max_len}; "
        "raise data.max_prompt_length, or set data.truncation=left to keep the last tokens "
        "(or data.truncation=right to keep the first)"
    )
