"""A critic for PPO: the transformer body of a causal LM with a scalar value head.

`ValueModel.from_causal_lm(model)` copies the decoder stack of a Hugging Face
causal LM (everything but the LM head) and puts a zero-initialised
`Linear(hidden, 1)` on top, so the critic starts from the policy's features
but owns its parameters, and its first values are exactly 0. The forward
returns one float32 value per position.

For a vision-language model (a config with a `vision_config`: Qwen2.5-VL,
Qwen3-VL, Qwen3-VL-MoE) the body is the multimodal one, the vision tower and
the text model together (`model.model`), not the text decoder alone that
`get_decoder()` gives: the forward then takes the same pixels, image grids and
M-RoPE positions as the policy's (`conveyor.workers.ranks.forward`), and the
head sits on the text model's width (`text_config.hidden_size`).

It deliberately does not compute returns, advantages or the value loss
(`conveyor.algos`), nor save itself in the Hugging Face format: its
`state_dict` is what checkpoints hold.
"""

from __future__ import annotations

import copy as _copy

from torch import Tensor, nn
from transformers import PretrainedConfig, PreTrainedModel

__all__ = ["ValueModel"]


def _decoder_of(model: PreTrainedModel) -> nn.Module:
    """The transformer body (no LM head) of a causal LM; a vision-language model's with its vision tower."""
    if getattr(getattr(model, "config", None), "vision_config", None) is not None:
        # get_decoder() of a Qwen-VL model is its text model alone: the image features would never be computed.
        body = getattr(model, getattr(model, "base_model_prefix", "model"), None)
        if isinstance(body, nn.Module) and body is not model:
            return body
    get_decoder = getattr(model, "get_decoder", None)
    if callable(get_decoder):
        decoder = get_decoder()
        if isinstance(decoder, nn.Module) and decoder is not model:
            return decoder
    body = getattr(model, getattr(model, "base_model_prefix", "model"), None)
    if isinstance(body, nn.Module):
        return body
    raise ValueError(
        f"ValueModel.from_causal_lm: cannot find the transformer body of {type(model).__name__} "
        "(neither get_decoder() nor a `model` attribute)"
    )


class ValueModel(nn.Module):
    """A transformer body plus `value_head: Linear(hidden, 1)`; forward gives values (B, S) float32."""

    def __init__(self, backbone: nn.Module, hidden_size: int) -> None:
        super().__init__()
        self.backbone = backbone
        param = next(backbone.parameters())
        self.value_head = nn.Linear(hidden_size, 1, dtype=param.dtype, device=param.device)
        # Zero init: values start at 0 and the first critic updates move only
        # the head, instead of a random head pushing noise into the body.
        nn.init.zeros_(self.value_head.weight)
        nn.init.zeros_(self.value_head.bias)

    @classmethod
    def from_causal_lm(cls, model: PreTrainedModel, *, copy: bool = True) -> ValueModel:
        """A critic whose body is a copy of `model`'s (no parameters shared with `model`); `copy=False`: `model`'s
        own."""
        config = getattr(model, "config", None)
        # A vision-language config keeps the text model's width in its text_config.
        hidden = getattr(getattr(config, "text_config", None), "hidden_size", None) or getattr(
            config, "hidden_size", None
        )
        if hidden is None:
            raise ValueError(
                f"ValueModel.from_causal_lm: {type(model).__name__} has no config.hidden_size to size the value head"
            )
        body = _decoder_of(model)
        return cls(_copy.deepcopy(body) if copy else body, int(hidden))

    @property
    def config(self) -> PretrainedConfig:
        """The backbone's Hugging Face config."""
        return self.backbone.config

    def activation_checkpointing_enable(self, **kwargs) -> None:
        """Recompute the body's activations in the backward (the head is too small to matter)."""
        enable = (
            getattr(self.backbone, "activation_checkpointing_enable", None)
            or self.backbone.gradient_checkpointing_enable
        )
        key = "activation_checkpointing_kwargs" if "activation" in enable.__name__ else "gradient_checkpointing_kwargs"
        enable(**{key: next(iter(kwargs.values()), None)})

    def forward(
        self, input_ids: Tensor, attention_mask: Tensor | None, position_ids: Tensor | None = None, **kwargs
    ) -> Tensor:
        """Values (B, S) float32 for `input_ids`, `attention_mask`: (B, S); positions from the mask when None.

        `kwargs` go to the backbone: a packed forward's sequence bounds (`conveyor.models.packing`), a
        vision-language body's pixels and image grids (its M-RoPE positions are `position_ids`).
        """
        if position_ids is None:
            # Left or right padding alike: a row's first real token is at position 0.
            position_ids = (attention_mask.long().cumsum(dim=-1) - 1).clamp(min=0)
        out = self.backbone(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            use_cache=False,
            **kwargs,
        )
        hidden = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
        return self.value_head(hidden).squeeze(-1).float()
