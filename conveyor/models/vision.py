"""What a prompt with images becomes before any forward: pixels, grids, image-pad tokens and M-RoPE positions.

`VisionProcessor` runs a checkpoint's image processor on a record's images
(verl's `images` column: `{"bytes", "path"}` structs or PIL images), swaps
each `<image>` of the rendered prompt for `<|vision_start|>`, as many
`<|image_pad|>` as the image's merged patches, and `<|vision_end|>` (what
Qwen-VL's processor writes), and computes the prompt's M-RoPE positions
(`mrope_positions`): three rows (time, height, width), the image's patches
placed on a grid and the text after it continuing from the grid's extent.
They are computed once per prompt, in stage 1, and travel with the sample;
a response token's positions are its index plus the prompt's `rope_delta`
in all three rows (as transformers' decode does).

`check_image_tokens` is the one check that image-pad tokens and pixels
agree, naming the sample when they do not.

It deliberately does not run the vision tower (the forwards do), nor handle
videos (refused where they are read).
"""

from __future__ import annotations

import io
import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "IMAGE_PLACEHOLDER",
    "VISION_FIELDS",
    "VisionBatch",
    "context_vision",
    "with_vision_fields",
    "VisionProcessor",
    "check_image_tokens",
    "refuse_pads_without_pixels",
    "decode_positions",
    "image_data_url",
    "image_from_url",
    "load_image",
    "openai_messages",
    "mrope_positions",
    "unplaceholder",
    "vision_processor",
]

#: How a prompt's content marks where an image goes (verl's multimodal layout).
IMAGE_PLACEHOLDER = "<image>"

#: The data-plane fields stage 1 writes for a vision-language policy: each sample's pixel values (patches, D) and
#: image grids (images, 3) (lists), its prompt's M-RoPE positions (3, P) left-padded as the prompt, its rope delta.
VISION_FIELDS: tuple[str, ...] = ("pixel_values", "image_grid_thw", "mrope_positions", "rope_delta")


def with_vision_fields(fields: Sequence[str], have: Sequence[str]) -> list[str]:
    """`fields` plus the vision fields when a forward reads the prompts and the samples have them (`have`)."""
    fields = list(fields)
    if "prompts" in fields and VISION_FIELDS[0] in have:
        fields += [f for f in VISION_FIELDS if f not in fields]
    return fields


@dataclass
class VisionBatch:
    """The image inputs of a batch of left-padded prompts: what a forward over them needs besides the ids."""

    pixel_values: torch.Tensor | None  # (patches of every image of the batch, D), in row order
    image_grid_thw: torch.Tensor | None  # (images, 3)
    positions: torch.Tensor  # (B, 3, P): the prompts' M-RoPE positions, 0 on padding
    rope_delta: torch.Tensor  # (B,)
    images_per_row: list[int] | None = None  # how many of the images are each row's, in order (None: unknown)

    @classmethod
    def from_fields(cls, td: Any) -> VisionBatch | None:
        """The vision inputs of a batch read with `VISION_FIELDS`, or None when it has none (a text policy)."""
        if VISION_FIELDS[0] not in td.keys():
            return None
        pixels = [p for p in _column(td, "pixel_values") if p is not None and p.numel()]
        row_grids = _column(td, "image_grid_thw")
        grids = [g for g in row_grids if g is not None and g.numel()]
        device = td["mrope_positions"].device
        return cls(
            pixel_values=torch.cat(pixels).to(device) if pixels else None,
            image_grid_thw=torch.cat(grids).to(device) if grids else None,
            positions=td["mrope_positions"],
            rope_delta=td["rope_delta"],
            images_per_row=[0 if g is None else int(g.shape[0]) for g in row_grids],
        )

    def rows(self, index: Sequence[int], positions: torch.Tensor | None = None) -> VisionBatch:
        """The batch of rows `index` (in that order): their images and deltas, with `positions` (B', 3, W) in place
        of the prompts' own when given (a prompt extended by tokens, say)."""
        if self.images_per_row is None:
            raise ValueError("VisionBatch.rows: the batch does not know which images are whose (images_per_row)")
        grids = self.image_grid_thw if self.image_grid_thw is not None else torch.zeros(0, 3, dtype=torch.long)
        patches = grids.prod(-1).tolist()
        first_image = [0, *itertools.accumulate(self.images_per_row)]
        first_patch = [0, *itertools.accumulate(patches)]
        pixels, kept = [], []
        for row in index:
            a, b = first_image[row], first_image[row + 1]
            kept += range(a, b)
            if b > a and self.pixel_values is not None:
                pixels.append(self.pixel_values[first_patch[a] : first_patch[b]])
        return VisionBatch(
            pixel_values=torch.cat(pixels) if pixels else None,
            image_grid_thw=grids[kept] if kept else None,
            positions=self.positions[list(index)] if positions is None else positions,
            rope_delta=self.rope_delta[list(index)],
            images_per_row=[self.images_per_row[row] for row in index],
        )

    def model_kwargs(self) -> dict[str, torch.Tensor]:
        """The pixel keywords of a Qwen-VL forward (none when no row has an image)."""
        if self.pixel_values is None:
            return {}
        return {"pixel_values": self.pixel_values, "image_grid_thw": self.image_grid_thw}

    def sequence_positions(self, attention_mask: torch.Tensor) -> torch.Tensor:
        """(3, B, P+R) positions of prompts + responses: the prompt's own, then index + rope delta on every row."""
        prompt_len = self.positions.shape[-1]
        index = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)[:, prompt_len:]
        tail = (index + self.rope_delta.view(-1, 1)).unsqueeze(0).expand(3, -1, -1)
        return torch.cat([self.positions.permute(1, 0, 2), tail], dim=-1)


def context_vision(
    rows: Sequence[tuple[torch.Tensor | None, Sequence[Sequence[int]], int, int]],
    batch_ids: torch.Tensor,
    config: Any,
) -> VisionBatch:
    """The images and M-RoPE positions of left-padded contexts (`batch_ids`, (B, W)), each a first prompt with its
    images followed by tokens placed as the trainer places a response (index + rope delta, on every row).

    `rows[i]`: (the first prompt's pixel values or None, its images' grids, its length, the context's length). The
    tokens after the first prompt are fed as the trainer feeds a response, in place: an image pad there (sampled, or
    in a tool's or user's text) has no pixels (`unplaceholder`). Used by the multi-turn loop and the agent gateway."""
    image_token_id, merge = int(config.image_token_id), int(config.vision_config.spatial_merge_size)
    width = batch_ids.shape[1]
    positions = torch.zeros((len(rows), 3, width), dtype=torch.long)
    deltas = torch.zeros(len(rows), dtype=torch.long)
    pixels, grids, counts = [], [], []
    for row, (own_pixels, own_grids, head, n) in enumerate(rows):
        if n > head:
            batch_ids[row, width - (n - head) :] = unplaceholder(batch_ids[row, width - (n - head) :], config)
        # Text after the last image continues from index + delta: one pass over the context gives both parts.
        pos, delta = mrope_positions(batch_ids[row, width - n :].tolist(), own_grids, image_token_id, merge)
        positions[row, :, width - n :] = pos
        deltas[row] = delta
        if own_pixels is not None:
            pixels.append(own_pixels)
        grids.extend(list(map(int, g)) for g in own_grids)
        counts.append(len(own_grids))
    return VisionBatch(
        pixel_values=torch.cat(pixels) if pixels else None,
        image_grid_thw=torch.tensor(grids, dtype=torch.long).view(-1, 3) if grids else None,
        positions=positions,
        rope_delta=deltas,
        images_per_row=counts,
    )


def unplaceholder(ids: torch.Tensor, config: Any) -> torch.Tensor:
    """`ids` with every image- or video-pad token replaced by the vision-end token, for feeding generated tokens.

    A Qwen-VL forward puts image features at *every* image-pad token of its input: one the policy sampled in a
    response would take a feature it has none of (and the forward stops: tokens and features disagree). The
    engine feeds such a sampled token back as vision-end, and the trainer's forward does the same to the response
    part of its input; the token itself stays the response's (its log-prob is taken under the full vocabulary
    in both), so rollout and training see the same sequence."""
    stand_in = getattr(config, "vision_end_token_id", None)
    stand_in = 0 if stand_in is None else int(stand_in)
    out = ids
    for name in ("image_token_id", "video_token_id"):
        tid = getattr(config, name, None)
        if tid is not None:
            out = out.masked_fill(out == int(tid), stand_in)
    return out


def _column(td: Any, name: str) -> list[Any]:
    """A list column of a TensorDict (a NonTensorStack or a list) as a Python list."""
    value = td[name]
    return list(value) if not isinstance(value, list) else value


def load_image(item: Any, where: str) -> Any:
    """A PIL RGB image from one entry of an `images` column: a `{"bytes", "path"}` struct, a path or a PIL image."""
    from PIL import Image

    if isinstance(item, Image.Image):
        return item.convert("RGB")
    if isinstance(item, dict):
        data, path = item.get("bytes"), item.get("path")
        if data:
            return Image.open(io.BytesIO(data)).convert("RGB")
        item = path
    if isinstance(item, (str, Path)) and item and Path(item).is_file():
        return Image.open(item).convert("RGB")
    raise ValueError(
        f"{where}: an image is neither bytes, a readable file nor a PIL image ({str(item)[:80]!r}); give each "
        "image as {'bytes': <encoded image>, 'path': ...} (verl's layout) or a path to a file"
    )


def image_data_url(item: Any, where: str) -> str:
    """A `data:` URL of one entry of an `images` column (the encoded bytes as they are, a path's file or a PIL image
    as PNG): how an image travels to an agent inside OpenAI content parts."""
    import base64

    from PIL import Image

    data = item.get("bytes") if isinstance(item, dict) else None
    if not data:
        image = load_image(item, where)
        out = io.BytesIO()
        image.save(out, format="PNG")
        data = out.getvalue()
    kind = (Image.open(io.BytesIO(data)).format or "PNG").lower()
    return f"data:image/{kind};base64,{base64.b64encode(data).decode('ascii')}"


def image_from_url(url: Any, where: str) -> Any:
    """The PIL RGB image of a `data:` URL (an `image_url` part's `url`); other URLs are refused (nothing is fetched)."""
    import base64
    import binascii

    if not isinstance(url, str) or not url.startswith("data:"):
        raise ValueError(f"{where}: an image must come as a data: URL (data:image/png;base64,...); nothing is fetched")
    head, _, payload = url.partition(",")
    if ";base64" not in head:
        raise ValueError(f"{where}: an image's data: URL must be base64-encoded (data:image/png;base64,...)")
    try:
        data = base64.b64decode(payload, validate=True)
        return load_image({"bytes": data}, where)
    except (binascii.Error, OSError, ValueError) as err:
        raise ValueError(f"{where}: the image does not decode ({err})") from None


def openai_messages(messages: Any, images: Sequence[Any], where: str) -> Any:
    """A record's chat messages in OpenAI's shape for an agent: each `<image>` of a message's content becomes an
    `image_url` part holding the record's next image as a data URL, the text around it `text` parts (messages
    without images stay as they are)."""
    if not images or not isinstance(messages, list):
        return messages
    urls = [image_data_url(item, where) for item in images]
    out, used = [], 0
    for m in messages:
        content = m.get("content") if isinstance(m, dict) else None
        if not isinstance(content, str) or IMAGE_PLACEHOLDER not in content:
            out.append(m)
            continue
        parts: list[dict] = []
        for i, piece in enumerate(content.split(IMAGE_PLACEHOLDER)):
            if i:
                parts.append({"type": "image_url", "image_url": {"url": urls[used]}})
                used += 1
            if piece:
                parts.append({"type": "text", "text": piece})
        out.append({**m, "content": parts})
    return out


def mrope_positions(
    ids: Sequence[int], grids: Sequence[Sequence[int]], image_token_id: int, merge: int
) -> tuple[torch.Tensor, int]:
    """(3, T) M-RoPE positions of one unpadded prompt and its rope delta (the last position + 1 - T).

    Text advances all three rows by one; a run of image-pad tokens is the image's (t, h/merge, w/merge) grid
    placed at the current position, after which text continues from the grid's largest extent."""
    rows: list[torch.Tensor] = []
    pos, i, image = 0, 0, 0
    n = len(ids)
    while i < n:
        if ids[i] != image_token_id:
            j = i
            while j < n and ids[j] != image_token_id:
                j += 1
            rows.append(torch.arange(j - i).expand(3, -1) + pos)
            pos += j - i
            i = j
            continue
        t, h, w = (int(x) for x in grids[image])
        h, w = h // merge, w // merge
        tt = torch.arange(t).view(-1, 1).expand(-1, h * w).flatten()
        hh = torch.arange(h).view(1, -1, 1).expand(t, -1, w).flatten()
        ww = torch.arange(w).view(1, 1, -1).expand(t, h, -1).flatten()
        rows.append(torch.stack([tt, hh, ww]) + pos)
        pos += max(h, w)  # transformers' get_rope_index: an image's extent is its larger side, not its time
        i += t * h * w
        image += 1
    positions = torch.cat(rows, dim=1) if rows else torch.zeros(3, 0, dtype=torch.long)
    return positions.long(), int(pos - n)


def decode_positions(rope_delta: int, start: int, length: int) -> torch.Tensor:
    """(3, length) positions of tokens `start .. start+length-1` after a prompt: index + rope delta on every row."""
    return (torch.arange(start, start + length) + rope_delta).expand(3, -1).clone()


def check_image_tokens(name: str, ids: Sequence[int], grids: Sequence[Sequence[int]], image_token_id: int, merge: int):
    """Refuse a sample whose image-pad tokens do not match its images' merged patches (none or a different count)."""
    pads = sum(1 for x in ids if x == image_token_id)
    want = sum(int(t) * int(h) * int(w) // (merge * merge) for t, h, w in grids)
    if pads != want:
        if not grids:
            what = f"{pads} image-pad tokens and no pixels"
        elif not pads:
            what = f"pixels of {len(grids)} image(s) ({want} patches) and no image-pad tokens"
        else:
            what = f"{pads} image-pad tokens but {len(grids)} image(s) of {want} merged patches"
        raise ValueError(
            f"sample {name!r}: {what}; the model would run its vision tower on the wrong pixels or none "
            "(give each '<image>' of the prompt one entry of its `images` column, and no more)"
        )


def vision_processor(path: Any, tokenizer: Any, model_config: Any) -> VisionProcessor | None:
    """Stage 1's image half for the checkpoint `path` when its model sees images (`model_config`), else None."""
    if model_config is None or getattr(model_config, "vision_config", None) is None:
        return None
    from conveyor.models.tiny_vlm import load_image_processor

    return VisionProcessor(load_image_processor(path), tokenizer, model_config)


def refuse_pads_without_pixels(prompts: torch.Tensor, config: Any, where: str) -> None:
    """Stop a forward of a vision-language model whose prompts hold image-pad tokens but that was given no pixels.

    Without pixel values a Qwen-VL forward embeds image-pad tokens as ordinary tokens, silently: the log-probs
    would be of another sequence than the one sampled."""
    tid = getattr(config, "image_token_id", None)
    if tid is None or getattr(config, "vision_config", None) is None:
        return
    rows = (prompts == int(tid)).any(dim=-1).nonzero().flatten().tolist()
    if rows:
        raise ValueError(
            f"{where}: rows {rows[:8]} of the batch hold image-pad tokens but no pixels were read with them; "
            f"read the fields {list(VISION_FIELDS)} with `prompts` (conveyor.models.vision.with_vision_fields)"
        )


class VisionProcessor:
    """Stage 1's half for images: a record's images -> pixel values, grids, the expanded prompt and its positions."""

    def __init__(self, image_processor: Any, tokenizer: Any, model_config: Any):
        from conveyor.models.tiny_vlm import IMAGE_PAD, VISION_END, VISION_START

        self.image_processor = image_processor
        self.merge = int(getattr(image_processor, "merge_size", 2))
        self.image_token_id = int(model_config.image_token_id)
        self.image_pad = tokenizer.convert_ids_to_tokens(self.image_token_id) or IMAGE_PAD
        self.vision_start, self.vision_end = VISION_START, VISION_END

    def images(self, record: dict, where: str) -> list[Any]:
        """The PIL images of a record's `images` column (none when it has none); videos are refused."""
        if record.get("videos"):
            raise ValueError(f"{where}: the row carries videos; only images are read so far (drop the `videos` column)")
        return [load_image(item, where) for item in record.get("images") or []]

    def process(self, images: list[Any]) -> tuple[torch.Tensor | None, list[list[int]]]:
        """(pixel values (patches, C*T*P*P) of every image in order or None, each image's (t, h, w) patch grid)."""
        if not images:
            return None, []
        out = self.image_processor(images=images, return_tensors="pt")
        return out["pixel_values"].float(), [list(map(int, g)) for g in out["image_grid_thw"]]

    def positions(self, name: str, ids: Sequence[int], grids: Sequence[Sequence[int]]) -> tuple[torch.Tensor, int]:
        """A prompt's M-RoPE positions (3, len(ids)) and rope delta, after checking its pads against its images'
        grids (one error naming `name` when they disagree)."""
        check_image_tokens(name, ids, grids, self.image_token_id, self.merge)
        return mrope_positions(ids, grids, self.image_token_id, self.merge)

    def openai_messages(self, messages: Any, images: Sequence[Any], where: str) -> Any:
        """A record's messages in OpenAI's shape for an agent, its images as `image_url` parts (`openai_messages`)."""
        return openai_messages(messages, images, where)

    def expand(self, text: str, grids: list[list[int]], where: str) -> str:
        """The prompt text with each `<image>` replaced by its vision-start, image-pad tokens and vision-end."""
        parts = text.split(IMAGE_PLACEHOLDER)
        if len(parts) - 1 != len(grids):
            raise ValueError(
                f"{where}: the prompt has {len(parts) - 1} '<image>' placeholder(s) but the row has {len(grids)} "
                "image(s); give one image per placeholder"
            )
        out = [parts[0]]
        for grid, rest in zip(grids, parts[1:]):
            pads = grid[0] * grid[1] * grid[2] // (self.merge * self.merge)
            out.append(self.vision_start + self.image_pad * pads + self.vision_end + rest)
        return "".join(out)
