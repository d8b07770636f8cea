"""The `actor_rollout_ref.model` section: which policy model, and the tiny one built when none is given.

It deliberately builds nothing: `conveyor.models` does, and names the tiny
architectures, which are read from there (`TINY_ARCHS`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from conveyor.config.fields import F, S, check, registry

__all__ = ["DTYPES", "FORWARD_IMPLS", "TinyModelConfig", "ModelConfig"]

DTYPES: tuple[str, ...] = ("float32", "bfloat16", "float16")
FORWARD_IMPLS: tuple[str, ...] = ("auto", "lean", "hf")


@dataclass
class TinyModelConfig:
    """The tiny model built from config when actor_rollout_ref.model.path is null."""

    arch: str = F(
        "qwen3_moe", "architecture (qwen3 is the dense one)", choices=registry("conveyor.models.tiny", "TINY_ARCHS")
    )
    hidden_size: int = F(64, "hidden size", gt=0)
    num_layers: int = F(2, "decoder layers", gt=0)
    num_heads: int = F(4, "attention heads", gt=0)
    num_kv_heads: int = F(2, "key/value heads", gt=0)
    intermediate_size: int = F(128, "MLP width (dense layers; expert width for MoE)", gt=0)
    num_experts: int = F(8, "experts per MoE layer", gt=0)
    top_k: int = F(2, "experts chosen per token", gt=0)
    warmstart_steps: int = F(
        3000, "most supervised steps on the task format before RL (0 = start from random init)", ge=0
    )
    warmstart_lr: float = F(3e-3, "learning rate of the warm start", gt=0)
    warmstart_until_accuracy: float = F(
        0.45,
        "stop the warm start early once greedy exact match on its last 20 training batches reaches this "
        "(0 = run all warmstart_steps): the same starting point for RL on every machine",
        ge=0,
        le=1,
        hint="0 = run all warmstart_steps",
    )
    seed: int = F(0, "initialisation seed")

    def validate(self, prefix: str) -> None:
        """The shape fits together: top_k of num_experts, even head widths, whole key/value groups."""
        check(self.top_k <= self.num_experts, f"{prefix}.top_k", "must be <= num_experts")
        # The attention splits hidden_size into num_heads heads of an even width (rotary
        # embeddings rotate pairs), and each key/value head serves a whole group of heads.
        head_dim = self.hidden_size // self.num_heads
        check(
            head_dim >= 2 and head_dim % 2 == 0,
            f"{prefix}.hidden_size",
            f"hidden_size // num_heads must be an even number >= 2, got {self.hidden_size} // {self.num_heads}",
        )
        check(
            self.num_heads % self.num_kv_heads == 0,
            f"{prefix}.num_kv_heads",
            f"num_heads={self.num_heads} must be a multiple of it (got {self.num_kv_heads})",
        )


@dataclass
class ModelConfig:
    """The policy model."""

    path: str | None = F(None, "local Hugging Face checkpoint directory; null = build the tiny model")
    tokenizer_path: str | None = F(None, "tokenizer directory if not the model's")
    trust_remote_code: bool = F(
        False,
        "run the Python code a checkpoint ships (the auto_map of its config.json or "
        "tokenizer_config.json) to build its model and tokenizer: only for checkpoints you trust",
    )
    dtype: str = F(
        "float32",
        "dtype of the weights as loaded: the master weights the trained roles (actor, critic) "
        "update and AdamW's state follow (bf16 compute over them: actor.fsdp_config.param_dtype)",
        choices=DTYPES,
    )
    allow_low_precision_master_weights: bool = F(
        False,
        "let dtype=bfloat16/float16 be the dtype the actor and critic train and keep AdamW's state in "
        "(pure low-precision training: updates smaller than the weights' precision are lost); without it such a "
        "dtype is refused",
    )
    forward_impl: str = F(
        "auto",
        "auto, lean or hf: lean computes each group's shared prompt once (Qwen3 and Qwen3-MoE); "
        "auto uses it where the model allows and the Hugging Face forward elsewhere",
        choices=FORWARD_IMPLS,
        resume_neutral=True,
    )
    use_remove_padding: bool | None = F(
        None,
        "run the trainer's Hugging Face forwards (update, old and reference log-probs, critic values) on "
        "packed rows: each micro-batch's real tokens in one row, attention kept within each sequence, no work for "
        "padding (verl's key). null = on where the model allows (full causal attention), true = required, "
        "false = padded rows",
        resume_neutral=True,
    )
    use_fused_kernels: bool = F(
        False,
        "compute the log-probs and entropy of the actor's and reference's forwards inside the LM head, block by "
        "block, never holding the (tokens, vocabulary) logits in the forward or the backward (verl's key): "
        "less than half the peak of a long response's update, about 8% slower on a CPU; models whose head is not "
        "a plain linear layer (a LoRA adapter on lm_head) keep the logits path",
        resume_neutral=True,
    )
    lm_head_fp32: bool = F(
        False,
        "compute the actor's LM head in float32 while the body stays in its dtype (bf16), on both sides: the "
        "trainer's forwards (fused head and lean forward included) and the rollout's (the hf engine's own head, "
        "vLLM's head_dtype); the hidden states and the head's weight are upcast at the matmul, a float32 copy of "
        "the head's weight per forward (counted in the memory check). A no-op for a float32 model",
    )
    enable_gradient_checkpointing: bool = F(
        False,
        "recompute activations in the backward instead of keeping them (actor and critic): less memory, "
        "about a third more compute",
        resume_neutral=True,
    )
    lora_rank: int = F(
        0,
        "rank of the LoRA adapters the actor trains instead of its weights (PEFT); 0 = off "
        "(full fine-tuning). With it on, the reference is the actor with its adapters disabled",
        ge=0,
        hint="0 = off",
    )
    lora_alpha: float = F(
        16.0, "LoRA scaling numerator: the adapters' update is scaled by lora_alpha / lora_rank", gt=0
    )
    target_modules: Any = F(
        "all-linear",
        "the layers that get adapters: all-linear (every linear layer but the LM head and the MoE "
        "router; not the fused experts) or a list of module names (e.g. [q_proj,v_proj]); the name experts "
        "adds adapters to every expert of each MoE layer (PEFT's target_parameters on the fused tensors)",
    )
    tiny: TinyModelConfig = S(TinyModelConfig, "the built-in tiny model")

    def validate(self, prefix: str) -> None:
        """target_modules is all-linear or a non-empty list of module names."""
        t = self.target_modules
        ok = t == "all-linear" or (
            isinstance(t, (list, tuple)) and len(t) > 0 and all(isinstance(x, str) and x for x in t)
        )
        check(
            ok,
            f"{prefix}.target_modules",
            f"must be all-linear or a list of module names such as [q_proj,k_proj,v_proj,o_proj], got {t!r}",
        )
