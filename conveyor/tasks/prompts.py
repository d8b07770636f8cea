"""Stage 1, wherever it runs: prompt records -> the prompt fields of a generation batch.

`PromptEncoder` renders each record's chat messages (`render_prompt`),
tokenizes them, applies `data.truncation`, left-pads the batch into
`prompts` / `prompt_mask` and fills the list fields later stages read
(`uid`, `data_source`, `ground_truth`, `raw_prompt`, `prompt_messages`). The trainer runs it to
put a batch's prompts into the data plane; a rollout replica in a process
of its own runs the same code on the records its generation call carries
(`RENDER_PROMPTS`), and writes the prompts with the rollout's fields in one
put: the trainer's process then neither tokenizes nor writes them.

Keys: a prompt's group is its `uid`; its samples are `<uid>/s<j>`
(`sample_keys`, `uid_of`), so any rank's share of a batch's keys names the
records it samples.

What it deliberately does not do: draw records (`PromptDataset` does) or
decide where it runs (the asynchronous source does, by where the replicas are).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import torch

from conveyor.tasks.dataset import check_prompt_length, render_prompt

__all__ = ["PromptEncoder", "RENDER_PROMPTS", "PROMPT_MESSAGES", "sample_keys", "uid_of"]

#: The field of each sample's prompt as its record gives it (chat messages): a reward model with a
#: chat template of its own renders the conversation from it.
PROMPT_MESSAGES = "prompt_messages"

# The `extra_info` entry of a generation call whose replica renders its prompts: {"records": {uid: record},
# "width": the batch's prompt width}.
RENDER_PROMPTS = "render_prompts"

_SAMPLE = "/s"


def sample_keys(uids: Sequence[str], n: int) -> list[str]:
    """The keys of `n` samples of each prompt group, group by group."""
    return [f"{uid}{_SAMPLE}{j}" for uid in uids for j in range(n)]


def uid_of(key: str) -> str:
    """The prompt group (`uid`) of a sample key made by `sample_keys`."""
    return key.rsplit(_SAMPLE, 1)[0]


class PromptEncoder:
    """Token ids and the prompt fields of records; each distinct prompt is rendered and tokenized once per run."""

    def __init__(
        self, tokenizer: Any, max_prompt_length: int, truncation: str, vision: Any = None, agent_images: bool = False
    ):
        self.tokenizer = tokenizer
        # A vision-language policy's processor (`conveyor.models.vision.VisionProcessor`): a record's images become
        # pixel values, image-pad tokens and M-RoPE positions here, once per prompt.
        self.vision = vision
        # An agent reads its task's messages: with images, in OpenAI's shape (image_url parts holding data URLs).
        self.agent_images = bool(agent_images) and vision is not None
        self.max_prompt_length, self.truncation = max_prompt_length, truncation
        self._texts: dict[str, str] = {}  # a record's messages (their repr) -> its rendered prompt
        self._ids: dict[str, list[int]] = {}  # a rendered prompt -> its token ids
        # An asynchronous source's rollout thread renders ReMax's greedy prompts while the trainer renders a batch's:
        # a fast tokenizer refuses to be used by two threads at once.
        self._lock = threading.Lock()

    def longest(self, records: Sequence[dict]) -> int:
        """The longest prompt of `records` in tokens, at most `max_prompt_length` (a width every batch of them fits)."""
        with self._lock:
            texts = list(dict.fromkeys(render_prompt(rec, self.tokenizer) for rec in records))
            ids = self.tokenizer(texts, add_special_tokens=False)["input_ids"]
        return min(max(len(x) for x in ids), self.max_prompt_length)

    def encode(self, records: Sequence[dict]) -> tuple[list[str], list[list[int]]]:
        """The prompt texts of `records` and their token ids, truncated per `data.truncation` (errors name the
        prompt)."""
        texts, token_lists, _ = self._encode(records)
        return texts, token_lists

    def _encode(self, records: Sequence[dict]) -> tuple[list[str], list[list[int]], list[tuple[Any, list]]]:
        """`encode`, and each record's (pixel values or None, image grids) when the policy sees images."""
        media: list[tuple[Any, list]] = [(None, [])] * len(records)
        with self._lock:
            # Prompts recur every epoch: a chat template is a Jinja rendering (about 20 us a prompt), the repr of its
            # messages under 2 us.
            texts = []
            for rec in records:
                key = repr(rec.get("prompt"))
                text = self._texts.get(key)
                if text is None:
                    text = self._texts[key] = render_prompt(rec, self.tokenizer)
                texts.append(text)
            if self.vision is not None:
                # Images differ between records of one prompt text: processed per record, not cached.
                for i, rec in enumerate(records):
                    where = f"prompt {texts[i][:60]!r} (data_source {rec.get('data_source')!r})"
                    images = self.vision.images(rec, where)
                    if images:
                        pixels, grids = self.vision.process(images)
                        media[i] = (pixels, grids)
                        texts[i] = self.vision.expand(texts[i], grids, where)
            # ...and each distinct text is tokenized once, in one batched call.
            new = [t for t in dict.fromkeys(texts) if t not in self._ids]
            if new:
                for text, ids in zip(new, self.tokenizer(new, add_special_tokens=False)["input_ids"]):
                    self._ids[text] = ids
        token_lists = []
        for rec, text in zip(records, texts):
            try:
                ids = check_prompt_length(self._ids[text], self.max_prompt_length, self.truncation)
            except ValueError as err:
                raise ValueError(f"prompt {text[:60]!r} (data_source {rec.get('data_source')!r}): {err}") from err
            if not ids:
                raise ValueError(f"prompt {text[:60]!r} is empty after tokenization")
            token_lists.append(ids)
        return texts, token_lists, media

    def fields(
        self,
        records: Sequence[dict],
        uids: Sequence[str],
        rows: Sequence[int],
        width: int | None = None,
    ) -> tuple[dict[str, Any], list[int]]:
        """The prompt fields of samples (`rows[i]`: the index in `records` / `uids` of sample i's prompt), left-padded
        to the longest prompt or to `width` when wider; and each sample's prompt length in tokens."""
        texts, token_lists, media = self._encode(records)
        if self.agent_images:
            # An agent may show images in later turns too, and a sample's images must lie in its prompt columns (the
            # trainer places what follows them at text positions): room for a prompt of data.max_prompt_length.
            width = max(width or 0, self.max_prompt_length)
        width = max([len(x) for x in token_lists] + [width or 0])
        pad = self.tokenizer.pad_token_id
        # Left padding, built once per prompt and indexed per sample (one group per prompt).
        padded = torch.tensor([[pad] * (width - len(ids)) + ids for ids in token_lists], dtype=torch.long)
        lengths = torch.tensor([len(ids) for ids in token_lists])
        mask = torch.arange(width).unsqueeze(0) >= (width - lengths).unsqueeze(1)
        index = torch.tensor(list(rows), dtype=torch.long)
        fields = {
            "prompts": padded[index],
            "prompt_mask": mask[index],
            "uid": [uids[i] for i in rows],
            "data_source": [records[i]["data_source"] for i in rows],
            "ground_truth": [str(records[i]["reward_model"]["ground_truth"]) for i in rows],
            "raw_prompt": [texts[i] for i in rows],
            PROMPT_MESSAGES: self._messages(records, rows),
            # The record's own side data (verl's extra_info): an agent reads it with its task.
            "extra_info": [records[i].get("extra_info") for i in rows],
        }
        if self.vision is not None:
            fields.update(self._vision_fields(token_lists, media, uids, rows, width))
        return fields, [len(token_lists[i]) for i in rows]

    def _messages(self, records: Sequence[dict], rows: Sequence[int]) -> list[Any]:
        """Each sample's prompt messages; for an agent of a vision-language policy, with its images as OpenAI
        `image_url` parts (data URLs) where the content says `<image>`."""
        if not self.agent_images:
            return [records[i].get("prompt") for i in rows]
        shaped: dict[int, Any] = {}
        for i in dict.fromkeys(rows):
            rec = records[i]
            where = f"the prompt of data_source {rec.get('data_source')!r}"
            shaped[i] = self.vision.openai_messages(rec.get("prompt"), rec.get("images") or [], where)
        return [shaped[i] for i in rows]

    def _vision_fields(
        self,
        token_lists: list[list[int]],
        media: list[tuple[Any, list]],
        uids: Sequence[str],
        rows: Sequence[int],
        width: int,
    ) -> dict[str, Any]:
        """`VISION_FIELDS` of the samples: pixels and grids per sample, M-RoPE positions left-padded to `width`."""
        positions = torch.zeros((len(token_lists), 3, width), dtype=torch.long)
        deltas = torch.zeros(len(token_lists), dtype=torch.long)
        for i, (ids, (_, grids)) in enumerate(zip(token_lists, media)):
            # The one check that pads and pixels agree: a truncated prompt or a stray pad token stops here.
            pos, delta = self.vision.positions(uids[i], ids, grids)
            positions[i, :, width - len(ids) :] = pos
            deltas[i] = delta
        index = torch.tensor(list(rows), dtype=torch.long)
        return {
            "pixel_values": [media[i][0] for i in rows],
            "image_grid_thw": [torch.tensor(media[i][1], dtype=torch.long).view(-1, 3) for i in rows],
            "mrope_positions": positions[index],
            "rope_delta": deltas[index],
        }

    def for_keys(
        self,
        keys: Sequence[str],
        records: dict[str, dict],
        width: int | None = None,
    ) -> tuple[dict[str, Any], list[int]]:
        """`fields` of the samples `keys` (made by `sample_keys`), their prompts' records by uid."""
        uids = list(dict.fromkeys(uid_of(k) for k in keys))
        at = {uid: i for i, uid in enumerate(uids)}
        return self.fields([records[uid] for uid in uids], uids, [at[uid_of(k)] for k in keys], width)
