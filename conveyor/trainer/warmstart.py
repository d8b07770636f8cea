"""A short supervised warm start of the tiny model on the task's answer format.

Reinforcement learning needs a policy that already emits answers of the right
shape now and then; a randomly initialised model almost never does. This
trains on (prompt, answer) pairs of the training split and deliberately stops
early, so that the RL run has something to learn. It never sees the held-out
split.

It can stop at an accuracy instead of a step count: the exact-match accuracy
of greedy decoding on the training batches is read off the logits the loss
already needs (greedy decoding reproduces an answer exactly when every answer
token, given the right ones before it, is the most likely one), so it costs
nothing. The supervised curve of a tiny model has a sharp, seed-dependent
jump (it learns to carry), and a fixed step count lands before it on one CPU
and after it on another; stopping at an accuracy hands RL the same starting
point on every machine.

A vision-language policy (`vision`, stage 1's `VisionProcessor`) trains on
its records' images the way a rollout sees them: each `<image>` expanded to
its image-pad tokens, the pixels through the vision tower, the M-RoPE
positions of prompt + answer (`warm_start_tiny_vlm` builds a tiny VLM
warm-started on the visual sum task).

With `aux_loss_coef` > 0 the loss also carries the routers' load-balancing loss (what MoE pre-training uses
to keep every expert trained): a model whose experts all learned the task, for measuring a routing control
against (`benchmarks/router_control.py`).
"""

from __future__ import annotations

import contextlib
import logging
import random
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from conveyor.models.moe_routing import moe_layers
from conveyor.models.router_control import RouterTap

logger = logging.getLogger(__name__)

__all__ = ["supervised_warmstart", "warm_start_tiny_vlm", "WarmstartProgress"]

# Without a terminal (a log file, a CI job) a progress line every this many steps; a terminal gets a bar.
_LOG_EVERY = 100


class WarmstartProgress:
    """How far the warm start is: a bar on a terminal (stderr), else a log line every `log_every` steps.

    The warm start takes from seconds to minutes before the first training row; without this the run looks
    hung. `bar=None` decides from whether stderr is a terminal.
    """

    def __init__(self, total: int, *, bar: bool | None = None, log_every: int = _LOG_EVERY):
        self.total = total
        self.log_every = max(1, log_every)
        use_bar = sys.stderr.isatty() if bar is None else bar
        self._bar = None
        if use_bar:
            from tqdm import tqdm

            # leave=False: once done, the bar gives its line to the summary the warm start logs.
            self._bar = tqdm(total=total, desc="warm start", unit="step", file=sys.stderr, leave=False)

    def update(self, step: int, loss: float, accuracy: float | None) -> None:
        """Record that `step` (1-based) is done, with its loss and the exact match so far (None: not measured)."""
        acc = f"{accuracy:.2f}" if accuracy is not None else None
        if self._bar is not None:
            self._bar.update(1)
            self._bar.set_postfix({"loss": f"{loss:.3f}", **({"exact_match": acc} if acc else {})}, refresh=False)
        elif step % self.log_every == 0:
            logger.info(
                "warm start: step %d/%d, loss %.3f%s", step, self.total, loss, f", exact match {acc}" if acc else ""
            )

    def close(self) -> None:
        """Take the bar off the screen."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None


class _Pair(NamedTuple):
    """One warm-start example: prompt and answer ids, and for a VLM the prompt's pixels and image grids."""

    prompt: list[int]
    answer: list[int]
    pixels: torch.Tensor | None = None
    grids: Sequence[Sequence[int]] = ()


def _encode_pairs(tokenizer: PreTrainedTokenizerBase, records: list[dict], vision: Any = None) -> list[_Pair]:
    from conveyor.tasks.dataset import render_prompt

    pairs = []
    for i, rec in enumerate(records):
        pixels, grids = None, []
        if vision is None:
            text = render_prompt(rec)
        else:
            # As stage 1 renders it (the checkpoint's chat template), each <image> expanded to its pads.
            where = f"warm-start record {i} (data_source {rec.get('data_source')!r})"
            text = render_prompt(rec, tokenizer)
            images = vision.images(rec, where)
            if images:
                pixels, grids = vision.process(images)
                text = vision.expand(text, grids, where)
        prompt = tokenizer(text, add_special_tokens=False)["input_ids"]
        if vision is not None:
            vision.positions(f"warm-start record {i}", prompt, grids)  # pads and pixels agree, or one error
        # A record may carry its own target (e.g. a tool-use trace); by default the target is the ground truth.
        target = (rec.get("extra_info") or {}).get("warmstart_target", rec["reward_model"]["ground_truth"])
        answer = tokenizer(str(target), add_special_tokens=False)["input_ids"]
        pairs.append(_Pair(prompt, answer + [tokenizer.eos_token_id], pixels, grids))
    return pairs


def _vision_inputs(batch: list[_Pair], attn: torch.Tensor, vision: Any) -> dict[str, torch.Tensor]:
    """The pixel keywords and (3, B, T) M-RoPE positions of a left-padded batch of prompt + answer rows."""
    from conveyor.models.vision import mrope_positions

    width = attn.shape[1]
    positions = torch.zeros((3, len(batch), width), dtype=torch.long)
    for i, pair in enumerate(batch):
        seq = pair.prompt + pair.answer
        # The answer continues the prompt's positions, as the rollout's decode does (index + rope delta).
        positions[:, i, width - len(seq) :] = mrope_positions(seq, pair.grids, vision.image_token_id, vision.merge)[0]
    kwargs: dict[str, torch.Tensor] = {"position_ids": positions}
    pixels = [p.pixels for p in batch if p.pixels is not None]
    if pixels:
        kwargs["pixel_values"] = torch.cat(pixels)
        kwargs["image_grid_thw"] = torch.tensor([g for p in batch for g in p.grids], dtype=torch.long)
    return kwargs


def supervised_warmstart(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    records: list[dict],
    *,
    steps: int,
    lr: float,
    batch_size: int = 64,
    seed: int = 0,
    until_accuracy: float = 0.0,
    accuracy_window: int = 20,
    aux_loss_coef: float = 0.0,
    aux_loss_tokens: str = "all",
    progress: bool | None = None,
    vision: Any = None,
    short_hint: str = "raise actor_rollout_ref.model.tiny.warmstart_steps or warmstart_lr",
) -> list[float]:
    """Train `model` in place with next-token loss on the answers for at most `steps` steps; returns the loss per step.

    With `until_accuracy` > 0 it stops as soon as the greedy exact-match accuracy
    on the last `accuracy_window` training batches reaches it. With `aux_loss_coef` > 0 an MoE model's loss
    adds that times the routers' load-balancing loss (`conveyor.models.router_control`) over the real tokens, or
    with `aux_loss_tokens="answer"` over the answer tokens only (the ones a rollout generates). `progress`:
    True draws a bar on stderr, False logs a line every 100 steps, None picks the bar on a terminal. `vision`
    (a `conveyor.models.vision.VisionProcessor`) feeds a vision-language model its records' images. `short_hint`:
    what the warning of a warm start that ends short of `until_accuracy` tells the user to change.
    """
    if steps <= 0:
        return []
    if not 0.0 <= until_accuracy <= 1.0:
        raise ValueError(f"until_accuracy must be in [0, 1], got {until_accuracy}; 0 runs all `steps`")
    if not records:
        raise ValueError("the warm start needs training records; data.synthetic.num_train must be > 0")
    if aux_loss_coef < 0 or (aux_loss_coef > 0 and not moe_layers(model)):
        raise ValueError(f"aux_loss_coef must be >= 0, and 0 for a model without MoE routers; got {aux_loss_coef}")
    if aux_loss_tokens not in ("all", "answer"):
        raise ValueError(f"aux_loss_tokens must be 'all' or 'answer', got {aux_loss_tokens!r}")
    pairs = _encode_pairs(tokenizer, records, vision)
    tap = RouterTap(model, keep_logits=True, count=False) if aux_loss_coef > 0 else None
    rng = random.Random(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.98), weight_decay=0.0)
    pad = tokenizer.pad_token_id
    model.train()
    losses: list[float] = []
    recent: list[float] = []  # exact-match accuracy of the last `accuracy_window` batches
    shown = WarmstartProgress(steps, bar=progress)
    try:
        for _step in range(steps):
            batch = [pairs[rng.randrange(len(pairs))] for _ in range(batch_size)]
            seqs = [p.prompt + p.answer for p in batch]
            width = max(len(s) for s in seqs)
            ids = torch.full((len(seqs), width), pad, dtype=torch.long)
            labels = torch.full((len(seqs), width), -100, dtype=torch.long)
            attn = torch.zeros((len(seqs), width), dtype=torch.long)
            for i, (pair, s) in enumerate(zip(batch, seqs)):
                off = width - len(s)  # left padding, as at generation time
                ids[i, off:] = torch.tensor(s)
                attn[i, off:] = 1
                labels[i, off + len(pair.prompt) :] = torch.tensor(pair.answer)
            if vision is None:
                inputs = {"position_ids": (attn.cumsum(-1) - 1).clamp(min=0)}
            else:
                inputs = _vision_inputs(batch, attn, vision)
            rows = attn if aux_loss_tokens == "all" else (labels != -100).long()
            with tap.active(rows) if tap is not None else contextlib.nullcontext():
                out = model(input_ids=ids, attention_mask=attn, use_cache=False, **inputs)
            logits = out.logits[:, :-1].float()
            targets = labels[:, 1:]
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
            if tap is not None:
                loss = loss + aux_loss_coef * tap.aux_loss(int(tap.layers[0].router.top_k))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            losses.append(loss.item())
            if until_accuracy > 0:
                with torch.no_grad():
                    right = (logits.argmax(-1) == targets) | (targets == -100)
                    recent.append(float(right.all(-1).float().mean()))
                recent = recent[-accuracy_window:]
            shown.update(len(losses), losses[-1], sum(recent) / len(recent) if recent else None)
            if len(recent) == accuracy_window and sum(recent) / accuracy_window >= until_accuracy > 0:
                break
    finally:
        shown.close()
    model.eval()
    reached = f", training exact match {sum(recent) / len(recent):.2f}" if recent else ""
    logger.info("warm start: %d steps, loss %.3f -> %.3f%s", len(losses), losses[0], losses[-1], reached)
    if until_accuracy > 0 and sum(recent) / len(recent) < until_accuracy:
        logger.warning(
            "the warm start used all %d steps without reaching exact match %.2f; RL starts lower than intended: %s",
            steps,
            until_accuracy,
            short_hint,
        )
    return losses


def warm_start_tiny_vlm(
    arch: str,
    out: str | Path,
    *,
    seed: int = 0,
    until_accuracy: float = 0.25,
    steps: int = 4000,
    lr: float = 3e-3,
    max_operand: int = 9,
    progress: bool | None = None,
) -> tuple[Path, list[float]]:
    """Build a tiny VLM of `arch`, warm-start it on every training-split problem of the visual sum task, and save it.

    The warm start stops at `until_accuracy` greedy exact match on its training batches (0: run all `steps`),
    so that RL starts from a policy that reads the image now and then; the held-out split is never seen.
    Returns the checkpoint directory and the loss per step."""
    from conveyor.models.tiny_vlm import build_tiny_image_processor, build_tiny_vlm, build_vlm_tokenizer, save_vlm
    from conveyor.models.vision import VisionProcessor
    from conveyor.tasks.visual import make_visual_sum_records, visual_sum_split_size

    tokenizer = build_vlm_tokenizer()
    model = build_tiny_vlm(arch, tokenizer, seed=seed)
    image_processor = build_tiny_image_processor(arch)
    records = make_visual_sum_records(
        visual_sum_split_size(max_operand, "train"), seed=seed, max_operand=max_operand, split="train"
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        losses = supervised_warmstart(
            model,
            tokenizer,
            records,
            steps=steps,
            lr=lr,
            # Small batches: more updates per CPU second, and the plateau before the model reads the digits ends
            # sooner in steps as well as in time.
            batch_size=16,
            seed=seed,
            until_accuracy=until_accuracy,
            progress=progress,
            vision=VisionProcessor(image_processor, tokenizer, model.config),
            short_hint="raise conveyor build-vlm --warmstart-steps, or lower --warmstart-until",
        )
    return save_vlm(model, tokenizer, image_processor, out), losses
