"""The `actor_rollout_ref.rollout` section: generation, validation sampling and multi-turn rollouts with tools.

The engine names are read from `conveyor.rollout.base.ROLLOUT_ENGINES` and the
tool-call formats from `conveyor.tools.formats`, when checked; each engine
checks its own keys (`validate_config` in its module, run where the run
plan is made, `conveyor.trainer.plan`). It deliberately does not decide what an engine can do (its
declared capabilities, read by the run plan) or build one.
"""

from __future__ import annotations

from dataclasses import dataclass

from conveyor.config.fields import F, S, check, registry
from conveyor.config.model import DTYPES

#: What a request in flight does with its KV cache when weights change under it (rollout.in_flight_kv).
IN_FLIGHT_KV = ("recompute", "keep")

__all__ = [
    "PLACEMENTS",
    "TRUNCATE_SIDES",
    "ValKwargs",
    "SamplingMaskConfig",
    "MultiTurnConfig",
    "AgentConfig",
    "FaultToleranceConfig",
    "DeltaSyncConfig",
    "RolloutConfig",
]

TRUNCATE_SIDES = ("left", "middle", "right")
# Where the rollout engines run (actor_rollout_ref.rollout.placement).
PLACEMENTS = ("colocated", "separate")


@dataclass
class ValKwargs:
    """Sampling for validation."""

    temperature: float = F(0.0, "0 = greedy", ge=0, hint="0 = greedy")
    top_p: float = F(1.0, "nucleus sampling", gt=0, le=1)
    top_k: int = F(0, "top-k sampling (0 = off)", ge=0)
    min_p: float = F(
        0.0, "min-p sampling: drop tokens below min_p x the likeliest's probability (0 = off; verl's name)", ge=0, le=1
    )
    n: int = F(1, "samples per held-out prompt", gt=0)
    do_sample: bool = F(False, "sample instead of greedy decoding")


@dataclass
class MultiTurnConfig:
    """Multi-turn rollouts with tools (verl's actor_rollout_ref.rollout.multi_turn keys)."""

    enable: bool = F(False, "generate, call tools, append their responses and generate again, per sample")
    max_assistant_turns: int | None = F(
        None,
        "most model turns per sample (null = until EOS or the response budget, data.max_response_length, is spent)",
        gt=0,
        hint="no limit",
    )
    max_user_turns: int | None = F(None, "most tool-response turns per sample (null = no limit)", gt=0, hint="no limit")
    max_tool_response_length: int = F(
        256, "characters of a tool's text kept (cut on tool_response_truncate_side)", gt=0
    )
    tool_response_truncate_side: str = F(
        "middle", "which part of a long tool response is cut: left, middle or right", choices=TRUNCATE_SIDES
    )
    format: str = F(
        "hermes",
        "tool-call syntax: hermes (<tool_call>{json}</tool_call>) or hash (#name text; "
        "writable with the tiny character tokenizer)",
        choices=registry("conveyor.tools.formats", "TOOL_CALL_FORMATS"),
    )
    tool_config_path: str | None = F(None, "YAML naming the tools by Python path (see docs/agent.md)")
    tool_timeout_s: float = F(30.0, "seconds one tool call may take; a slower call answers an error message", gt=0)
    tool_workers: int = F(16, "tool calls run at once per rank (one thread each)", gt=0)

    def validate(self, prefix: str) -> None:
        """Multi-turn rollouts need a tool YAML."""
        check(
            not self.enable or bool(self.tool_config_path),
            f"{prefix}.tool_config_path",
            f"{prefix}.enable=true needs a tool YAML; give its path (see docs/agent.md) or set {prefix}.enable=false",
        )


@dataclass
class AgentConfig:
    """Any agent that speaks the OpenAI API as the rollout, through the gateway (docs/agent.md)."""

    command: str | None = F(
        None,
        "the agent's command line, run once per session (one sample of one prompt), split as a shell would and run "
        "without one, in the directory the run started in; it reads its task as JSON on stdin and the gateway's "
        "OPENAI_BASE_URL / OPENAI_API_KEY from its environment",
        hint="none",
    )
    callable: str | None = F(
        None,
        "an in-process agent instead (module:function or file.py:function), called as "
        "function(base_url, api_key, task) -> reward or None",
        hint="none",
    )
    timeout_s: float = F(600.0, "wall clock of one session; past it the agent is stopped and the session failed", gt=0)
    term_grace_s: float = F(2.0, "seconds between SIGTERM and SIGKILL for an agent past its timeout", gt=0, le=60)
    max_concurrent: int = F(64, "sessions running at once per rollout rank", gt=0, le=4096)
    host: str = F("127.0.0.1", "address the gateway listens on (loopback: only this machine's agents reach it)")
    port: int = F(0, "the gateway's port (0 = pick a free one; each rollout rank serves on its own)", ge=0, le=65535)
    api_key: str | None = F(None, "the key every request must carry (null = a random key per run)", hint="random")
    batch_wait_s: float = F(
        0.5,
        "most seconds a request waits for the other running sessions' requests before the engine runs without "
        "them (a batch runs at once when every running session has one waiting)",
        ge=0,
        le=600,
    )
    failure_reward: float | None = F(
        0.0,
        "the reward of a session whose agent failed (non-zero exit, timeout, error); null = scored like any other "
        "(its reported reward, else the task's reward function on its last completion)",
        hint="score it",
    )
    model_name: str | None = F(None, "the model name /v1/models reports (null = the model path's)", hint="path")

    @property
    def enabled(self) -> bool:
        """Whether an agent runs the rollout through the gateway."""
        return self.command is not None or self.callable is not None

    def validate(self, prefix: str) -> None:
        """One of command and callable, and a command that splits."""
        check(
            not (self.command is not None and self.callable is not None),
            f"{prefix}.callable",
            f"give one of {prefix}.command and {prefix}.callable, not both",
        )
        if self.command is not None:
            import shlex

            try:
                argv = shlex.split(self.command)
            except ValueError as err:
                argv, why = [], str(err)
            else:
                why = "it is empty"
            check(bool(argv), f"{prefix}.command", f"cannot split {self.command!r} into a command line ({why})")
        if self.enabled:
            import importlib.util

            missing = [m for m in ("fastapi", "uvicorn") if importlib.util.find_spec(m) is None]
            check(
                not missing,
                f"{prefix}.{'command' if self.command is not None else 'callable'}",
                f"the agent gateway needs {' and '.join(missing)}: pip install 'conveyor[agent]'",
            )
        check(
            self.callable is None or ":" in self.callable,
            f"{prefix}.callable",
            f"write module:function or file.py:function, got {self.callable!r}",
        )


@dataclass
class FaultToleranceConfig:
    """Replicas in processes of their own that die or hang are replaced and their batch generated again."""

    enable: bool = F(
        True,
        "replace a rollout replica whose process dies or hangs (rollout_process=own) and generate its batch again, "
        "with the same seeds; false: the run stops at the first such fault",
    )
    health_check_interval_s: float = F(
        1.0, "how often a replica's process is looked at while a call to it is outstanding", gt=0, le=60
    )
    timeout_s: float = F(
        600.0,
        "a replica that answers no call within this many seconds is taken as hung (stopped, deadlocked) and "
        "replaced; longer than the slowest batch's generation",
        gt=0,
        le=86400,
    )
    max_restarts: int = F(
        3,
        "replacements a run may make; one more fault stops it with an error naming the replica",
        ge=0,
        le=1000,
    )


@dataclass
class DeltaSyncConfig:
    """Weight syncs that send only the elements that changed since the last one (docs/rollout.md#delta-sync)."""

    enable: bool = F(
        False,
        "after a whole sync, send each tensor as the indices and values (or a bitmap and values) of the elements "
        "that changed in the engine's dtype, or whole where that is smaller; costs one copy of the model at the "
        "engine's dtype on the sender and on each receiver, and a compare and checksum of every tensor per sync "
        "(off by default: on one CPU host that takes longer than sending the whole model)",
    )
    full_every: int = F(
        10,
        "every this many syncs one is sent whole (1 = always whole); one is also whole after any receiver's "
        "checksum disagreed with the sender's",
        gt=0,
    )


# Where the trainer's replay of the sampling mask comes from (actor_rollout_ref.rollout.sampling_mask.source).
MASK_SOURCES = ("recompute",)


@dataclass
class SamplingMaskConfig:
    """Replaying the rollout's top-k / top-p / min-p mask in the trainer's log-probs (docs/rollout.md)."""

    replay: bool = F(
        True,
        "with top_k, top_p or min_p set, score every policy log-prob (old log-prob, update, rollout-correction "
        "metrics) under the truncated, renormalised distribution the rollout sampled from; false scores under the "
        "full softmax (the gap then shows in rollout_corr/*), for experiments. A no-op without truncation",
    )
    source: str = F(
        "recompute",
        "where the mask comes from: recompute = from the trainer's own logits, by the engine's rule, per block of "
        "rows (a sort of each row's vocabulary: the log-prob's own time grows 20-40x on one CPU thread, "
        "benchmarks/mismatch.py; no memory kept past a block). The engine's own mask is not carried: it is up to "
        "the vocabulary's size per token for top-p, and vLLM does not return it",
        choices=MASK_SOURCES,
    )


@dataclass
class RolloutConfig:
    """Generation."""

    name: str = F(
        "hf",
        "rollout engine: hf (conveyor's decode loop over the Hugging Face model) or vllm (a vLLM "
        "engine in the actor's process, fed the new weights after every update; docs/rollout.md)",
        choices=registry("conveyor.rollout.base", "ROLLOUT_ENGINES"),
    )
    dtype: str | None = F(
        None,
        "vllm: the dtype the engine holds the weights and computes in (the sync casts "
        "the trainer's tensors to it); null = bfloat16 on a GPU (vLLM's attention kernels and "
        "half the memory of float32 master weights, as verl rolls out) and "
        "actor_rollout_ref.model.dtype on a CPU. The hf rollout decodes with the actor's own "
        "weights and ignores it: it computes in model.dtype, or in "
        "actor.fsdp_config.param_dtype under fsdp2",
        choices=DTYPES,
    )
    n: int = F(8, "samples per prompt (the group size of GRPO/RLOO)", gt=0)
    temperature: float = F(1.0, "sampling temperature", gt=0, hint="use do_sample=false for greedy")
    top_p: float = F(1.0, "nucleus sampling (1 = off)", gt=0, le=1)
    top_k: int = F(0, "top-k sampling (0 = off)", ge=0)
    min_p: float = F(
        0.0, "min-p sampling: drop tokens below min_p x the likeliest's probability (0 = off; verl's name)", ge=0, le=1
    )
    do_sample: bool = F(True, "sample (false = greedy)")
    exact: bool = F(
        False,
        "hf rollout: the rollout's log-probs are the trainer's old-log-prob forward's, bitwise (the actor writes "
        "both fields from that one forward), so rollout_corr/* read 0 and every importance weight is 1; it runs "
        "the old-log-prob forward the hf rollout otherwise skips (docs/rollout.md). The tokens are still drawn from "
        "the decode loop's softmax, which rounds differently. Refused with vllm, a rollout.dtype other than the "
        "model's, bypass_mode=true and off-policy (asynchronous) batches",
    )
    log_prob_micro_batch_size_per_gpu: int = F(256, "sequences per old-log-prob forward", gt=0, resume_neutral=True)
    log_prob_use_dynamic_bsz: bool | None = F(
        None,
        "fill each old-log-prob forward up to log_prob_max_token_len_per_gpu real tokens; null = actor.use_dynamic_bsz",
        resume_neutral=True,
    )
    log_prob_max_token_len_per_gpu: int | None = F(
        None,
        "most real tokens per old-log-prob forward under a token budget; null = actor.ppo_max_token_len_per_gpu",
        gt=0,
        resume_neutral=True,
    )
    moe_load_balance_metrics_interval: int = F(
        0,
        "log rollout/moe/* router load-balance metrics and save the "
        "per-expert load every N steps (0 = off; the default run, "
        "examples/tiny_cpu.yaml, uses 10)",
        ge=0,
        resume_neutral=True,
    )
    moe_near_tie_eps: float = F(
        0.01,
        "router margin (k-th minus (k+1)-th router logit) below which a (token, MoE layer) pair counts as a near "
        "tie in rollout/moe/near_tie/* and actor/moe/near_tie/*",
        gt=0,
        resume_neutral=True,
    )
    gpu_memory_utilization: float = F(
        0.5,
        "vllm: the share of GPU memory the engine may take (weights and KV "
        "cache); on a CPU the KV cache is sized to max_num_seqs x max_model_len",
        gt=0,
        le=1,
    )
    tensor_model_parallel_size: int = F(1, "vllm: GPUs one engine shards the model over", gt=0)
    max_num_seqs: int = F(
        256,
        "most sequences the engine decodes at once: vllm's scheduler limit; the hf rollout "
        "generates a rank's share in chunks of this many (its KV cache grows with them)",
        gt=0,
    )
    max_model_len: int | None = F(
        None, "vllm: longest sequence the engine holds; null = data.max_prompt_length + data.max_response_length", gt=0
    )
    enforce_eager: bool | None = F(
        None,
        "vllm: true = no CUDA graphs (less memory and a faster start, slower "
        "decoding); null = false on a GPU (CUDA graphs, verl's default: the weights "
        "are updated in place, so the graphs stay valid) and true on a CPU (where "
        "false compiles the model at every engine start)",
        resume_neutral=True,
    )
    free_cache_engine: bool = F(
        True,
        "vllm, placement=colocated: release the engine's weights and KV cache "
        "between rollouts so the update can use the memory (vLLM's sleep mode, level 2: "
        "the weights are synced again before each generation; GPU only, ignored on a CPU; "
        "a separate replica has no trainer to give memory to and never sleeps)",
    )
    in_flight_kv: str = F(
        "recompute",
        "partial rollouts (trainer.v1.separate_async.partial_rollout): what requests in flight do with the KV cache "
        "when new weights load between two tokens: recompute = one prefill of each request's prompt and tokens so "
        "far under the new weights (every later token is exactly what the new weights give for that prefix; costs "
        "that prefill); keep = continue over the KV the old weights computed (no prefill; later tokens attend to "
        "old-weight keys and values; on vllm, requests that start after the load read no prefix cache until the "
        "generation ends; docs/async.md#partial-rollouts)",
        choices=IN_FLIGHT_KV,
    )
    hf_whole_gather_max_gb: float = F(
        1.0,
        "hf rollout under fsdp2: a model whose full parameters take at most "
        "this many GB is gathered whole once for generation (decoding then needs no "
        "collective); a larger one decodes over its shards, each layer gathered for "
        "every token's forward, all ranks stepping together (0 = always over the "
        "shards; docs/distributed.md)",
        ge=0,
        resume_neutral=True,
    )
    placement: str = F(
        "colocated",
        "where the engines run: colocated (an engine in every actor rank's process, on "
        "its device; the engine sleeps while the actor trains) or separate (a rollout worker group of "
        "its own, `replicas` engines on their own devices or CPUs, given the weights over "
        "torch.distributed; docs/rollout.md)",
        choices=PLACEMENTS,
        resume_neutral=True,
    )
    replicas: int = F(
        1,
        "placement=separate: engine replicas in the rollout worker group (each on "
        "tensor_model_parallel_size GPUs, or a CPU share)",
        gt=0,
        resume_neutral=True,
    )
    update_weights_bucket_megabytes: int = F(
        512,
        "weight sync: the trainer's tensors travel to an engine in buckets "
        "of at most this many MB (one tensor larger than a bucket travels "
        "alone): what the sync holds at once beyond the engine's weights",
        gt=0,
        resume_neutral=True,
    )
    val_kwargs: ValKwargs = S(ValKwargs, "validation sampling")
    sampling_mask: SamplingMaskConfig = S(SamplingMaskConfig, "replaying top-k / top-p / min-p in the trainer")
    multi_turn: MultiTurnConfig = S(MultiTurnConfig, "multi-turn rollouts with tools")
    agent: AgentConfig = S(AgentConfig, "an OpenAI-API agent as the rollout, through the gateway")
    fault_tolerance: FaultToleranceConfig = S(
        FaultToleranceConfig,
        "replacing rollout replicas (in processes of their own) that die or hang",
        resume_neutral=True,
    )
    delta_sync: DeltaSyncConfig = S(
        DeltaSyncConfig,
        "weight syncs that send only what changed since the last one",
    )

    def engine_dtype(self, model_dtype: str, device_type: str) -> str:
        """The dtype an engine with its own weights holds on `device_type`: `dtype`, else bf16 on CUDA, else the
        model's."""
        if self.dtype is not None:
            return self.dtype
        return "bfloat16" if device_type == "cuda" else model_dtype
