"""A causal LM's LM head that returns log-probs and entropy of given labels instead of logits, for one forward.

`fused_lm_head(model, labels, ...)` makes the model's own output-embedding
module, for the duration of a `with` block, compute
`conveyor.algos.fused_logprob.fused_linear_logprobs` on the hidden states it
is called with: the (tokens, vocabulary) logits are never held, in the forward
or the backward. The module is called where the model calls it, inside its
own forward, so whatever wraps that forward still applies: FSDP2 has gathered
the head's weight and reduces its gradient, DDP sees the weight used, tied
embeddings receive both gradients, and the lean forward and the Hugging Face
forward (padded or packed) need no second code path. The model's output in
place of logits is the log-probs, then the entropy and Σπ² when asked, stacked
in the last dim (..., 1|2|3); `split_head_output` and `head_sum_pi_squared`
take it apart.

`float32_lm_head(model)` makes the model's head compute its logits in float32
(`actor_rollout_ref.model.lm_head_fp32`): the hidden states and the weight are
upcast at the matmul, so a bf16 body's head rounds its logits to float32, not
bf16, on every path that calls it (the Hugging Face forward, padded or packed,
the lean forward, the hf rollout's decode over the same modules, and the fused
head, which upcasts the same two operands).

`fused_head_reason(model)` says why a model's head cannot be fused: an
architecture whose forward does something to the logits after the head
(soft-capping, scaling) or whose head is not a plain linear layer (a LoRA
adapter on it); such a model keeps the logits path.

What it deliberately does not do: choose labels, shift or mask positions
(the caller hands labels aligned with the positions its forward keeps), or
decide whether fusing is on (`actor_rollout_ref.model.use_fused_kernels`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from conveyor.algos.fused_logprob import fused_linear_logprobs
from conveyor.algos.sampling_mask import Truncation

__all__ = [
    "FUSED_HEAD_MODEL_TYPES",
    "Float32Head",
    "float32_lm_head",
    "fused_head_reason",
    "fused_lm_head",
    "head_sum_pi_squared",
    "split_head_output",
]

# Model types whose causal-LM forward hands the LM head's output straight back as the logits
# (no soft-capping, scaling or bias added after it), so the head may return other numbers.
FUSED_HEAD_MODEL_TYPES: tuple[str, ...] = (
    "qwen3",
    "qwen3_moe",
    "qwen2",
    "qwen2_moe",
    "llama",
    "mistral",
    "mixtral",
)


class Float32Head(nn.Linear):
    """A linear LM head whose logits are computed in float32 from float32 copies of its inputs and weight."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits (..., V) float32 of hidden states (..., H) in any dtype."""
        return F.linear(hidden.float(), self.weight.float(), None if self.bias is None else self.bias.float())


def float32_lm_head(model: nn.Module) -> nn.Module:
    """Make `model`'s LM head compute in float32 (the body keeps its dtype); returns the head. Idempotent.

    The module keeps its parameters, names and dtype (the checkpoint, the weight sync and FSDP2 see the same
    tensor); only its class changes, so every caller of the head gets float32 logits.
    """
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if isinstance(head, Float32Head):
        return head
    if head is None or type(head) is not nn.Linear:
        what = "no output embeddings" if head is None else f"a {type(head).__name__} LM head (LoRA on lm_head?)"
        raise ValueError(
            f"actor_rollout_ref.model.lm_head_fp32=true needs a plain linear LM head; the model has {what}: set "
            "lm_head_fp32=false, or leave lm_head out of actor_rollout_ref.model.target_modules"
        )
    head.__class__ = Float32Head
    return head


def fused_head_reason(model: nn.Module) -> str | None:
    """Why `fused_lm_head` cannot stand in for `model`'s LM head, or None when it can."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type not in FUSED_HEAD_MODEL_TYPES:
        return f"model_type {model_type!r} is not one of {list(FUSED_HEAD_MODEL_TYPES)}"
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is None:
        return "the model has no output embeddings"
    if hasattr(head, "lora_A") or hasattr(head, "base_layer"):
        return "the LM head has LoRA adapters"
    if not isinstance(head, nn.Linear):
        return f"the LM head is a {type(head).__name__}, not a linear layer"
    return None


@contextlib.contextmanager
def fused_lm_head(
    model: nn.Module,
    labels: torch.Tensor,
    *,
    with_entropy: bool,
    temperature: float,
    chunk_elements: int | None = None,
    with_sum_pi_squared: bool = False,
    truncation: Truncation | None = None,
) -> Iterator[None]:
    """Within the block, `model`'s LM head maps hidden states (..., H) to log-probs of `labels` (...) [entropy, Σπ²]."""
    reason = fused_head_reason(model)
    if reason is not None:
        raise ValueError(f"the LM head cannot be fused: {reason}")
    head = model.get_output_embeddings()

    def forward(hidden: torch.Tensor) -> torch.Tensor:
        if hidden.shape[:-1] != labels.shape:
            raise ValueError(
                f"fused LM head: the model kept hidden states of shape {tuple(hidden.shape)} for labels of "
                f"shape {tuple(labels.shape)}"
            )
        # Read the weight at call time: FSDP2 puts the gathered one in place only for its forward.
        weight, bias = head.weight, head.bias
        if isinstance(head, Float32Head):  # the blocks' matmul in float32, as the head's own forward computes it
            hidden, weight = hidden.float(), weight.float()
            bias = None if bias is None else bias.float()
        outputs = fused_linear_logprobs(
            hidden,
            weight,
            labels,
            bias=bias,
            with_entropy=with_entropy,
            with_sum_pi_squared=with_sum_pi_squared,
            temperature=temperature,
            truncation=truncation,
            chunk_elements=chunk_elements,
        )
        return torch.stack([o for o in outputs if o is not None], -1)

    # An instance attribute shadows the class's forward for this module only; removing it restores the class's
    # (or whatever instance forward was there before).
    before = head.__dict__.get("forward")
    head.forward = forward
    try:
        yield
    finally:
        if before is None:
            del head.forward
        else:
            head.forward = before


def split_head_output(stats: torch.Tensor, with_entropy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs (...) and entropy (...) or None from what a fused head returned in place of logits (..., 1|2)."""
    return stats[..., 0], (stats[..., 1] if with_entropy else None)


def head_sum_pi_squared(stats: torch.Tensor, with_sum_pi_squared: bool) -> torch.Tensor | None:
    """Σπ² (...) or None from what a fused head returned in place of logits: its last column when asked for."""
    return stats[..., -1] if with_sum_pi_squared else None
