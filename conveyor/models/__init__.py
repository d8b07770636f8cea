"""Models: tiny causal LMs built from config, a char tokenizer, checkpoint loading and a value head.

Routing capture and replay for MoE models live in `conveyor.models.moe_routing`
(import it from there). This package does not train or generate: see
`conveyor.workers` and `conveyor.rollout`.
"""

from conveyor.models.loading import load_causal_lm, load_tokenizer, save_pretrained_checkpoint
from conveyor.models.tiny import TINY_ARCHS, build_tiny_model, tiny_config
from conveyor.models.tokenizer import DEFAULT_ALPHABET, build_char_tokenizer
from conveyor.models.value_head import ValueModel

__all__ = [
    "DEFAULT_ALPHABET",
    "TINY_ARCHS",
    "ValueModel",
    "build_char_tokenizer",
    "build_tiny_model",
    "load_causal_lm",
    "load_tokenizer",
    "save_pretrained_checkpoint",
    "tiny_config",
]
