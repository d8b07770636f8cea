"""GPU memory per rank, phase by phase, counted from a model config: the accounting and the start-up check.

`account(layout, setup)` adds, per rank and phase, the resident state (the
actor's parameter shards and AdamW's moments, the reference's and the
critic's, and colocated teachers' and reward model's, unless offloaded) and
what the phase itself adds at its peak. The
rollout phase is the hf rollout's (gathered layers, its KV cache) or, with a
vLLM engine (`Setup.engine`), the engine awake beside what the trainer keeps
on the GPU while it generates. `benchmarks/memory.py` checks the accounting
against resident memory on CPU ranks and prints it for real models
(`--account`); `check_memory` refuses, before anything is built, a vLLM
layout that cannot fit one GPU, naming the keys that change it.

What vLLM takes (vllm/v1/worker): an engine claims `gpu_memory_utilization`
x the GPU's memory for itself, whatever else the device holds (start-up is
refused when less is free); its weights (the engine's dtype, 1/tp each), its
profiling forward's activations and CUDA graphs come out of that share and
the KV cache is the rest, which must hold one sequence of `max_model_len`.
conveyor's engine (conveyor.rollout.vllm) sleeps at level 2 after every
generation when `free_cache_engine` is on: weights and KV cache leave the GPU
while the trainer computes, and come back (weights for the sync, then the KV
cache) before the next generation, while the trainer's state stays resident.

Everything here is arithmetic on a model built on the meta device: no
weights, no GPU. It leaves out the allocator's slack, the CUDA context and the
libraries' buffers (NCCL's, vLLM's CUDA graphs): treat 5-10 GB per GPU as theirs.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import torch

from conveyor.algos.fused_logprob import DEFAULT_FUSED_CHUNK_ELEMENTS

logger = logging.getLogger(__name__)

__all__ = [
    "GB",
    "Layout",
    "Engine",
    "Setup",
    "Frozen",
    "Misfit",
    "layout_of",
    "account",
    "total",
    "engine_terms",
    "misfits",
    "setup_of",
    "check_memory",
    "kv_bytes_per_token",
]

GB = 1e9
_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# What the fit leaves to the allocator, the CUDA context and NCCL: below it the check warns (docs/distributed.md).
HEADROOM_GB = 5.0
_KEY = "actor_rollout_ref"


@dataclasses.dataclass(frozen=True)
class Layout:
    """What a model's memory depends on, counted from the model built on the meta device."""

    params: int  # all parameters
    layer_params: int  # the largest decoder layer (one FSDP2 unit)
    root_params: int  # outside the decoder layers (embeddings, final norm, lm_head): the root unit
    hidden: int
    layers: int
    vocab: int
    kv_dim: int  # key/value heads x head dim
    ffn_tokens_dim: int  # per-token width of the MLP's intermediate (top_k x moe_intermediate for MoE)
    layer_expert_params: int = 0  # the experts of the largest decoder layer (what expert parallelism splits)
    top_k: int = 1  # experts per token (rows each token sends through the all-to-all)
    kv_heads: int = 1  # key/value heads (what vLLM's tensor parallelism splits, down to one per rank)
    q_dim: int = 0  # attention heads x head dim (0: the hidden size), what sequence parallelism's all-to-all moves
    heads: int = 1  # attention heads (sequence parallelism's size must divide them and the key/value heads)


def layout_of(config: Any, *, trust_remote_code: bool = False) -> Layout:
    """The `Layout` of a transformers config (built on the meta device: no memory, exact counts)."""
    from transformers import AutoModelForCausalLM

    from conveyor.workers.training.strategy import decoder_layers

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
    layers = decoder_layers(model)
    total_params = sum(p.numel() for p in model.parameters())
    per_layer = [sum(p.numel() for p in layer.parameters()) for layer in layers]
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    top_k = getattr(config, "num_experts_per_tok", None)
    ffn = top_k * config.moe_intermediate_size if top_k else config.intermediate_size
    biggest = layers[per_layer.index(max(per_layer))]
    experts = sum(p.numel() for n, p in biggest.named_parameters() if ".experts." in f".{n}")
    return Layout(
        total_params,
        max(per_layer),
        total_params - sum(per_layer),
        config.hidden_size,
        len(layers),
        config.vocab_size,
        kv_heads * head_dim,
        ffn,
        experts,
        top_k or 1,
        kv_heads,
        config.num_attention_heads * head_dim,
        config.num_attention_heads,
    )


@dataclasses.dataclass(frozen=True)
class Engine:
    """A vLLM engine as memory sees it, on one of its GPUs."""

    capacity: float  # bytes of one GPU
    gpu_memory_utilization: float  # the engine's share of `capacity`
    tp: int = 1  # tensor_model_parallel_size: GPUs one engine's weights are split over
    weight_bytes: int = 2  # rollout.dtype (null: model.dtype); its KV cache is in the same dtype
    max_model_len: int = 2048
    max_num_seqs: int = 256
    # vLLM's profiling forward pushes this many tokens through the model (its default for the offline engine:
    # 16384 on GPUs of 70 GB and more, 8192 below; conveyor does not set it).
    batched_tokens: int = 16384
    sleeps: bool = True  # free_cache_engine: the engine leaves the GPU while the trainer computes
    colocated: bool = True  # on the trainer's GPUs (placement=colocated), else on GPUs of its own


@dataclasses.dataclass(frozen=True)
class Frozen:
    """A frozen model on the actor's GPUs (a colocated teacher or reward model) as memory sees it, per rank."""

    name: str  # "teacher <name>" or "reward model"
    params: int
    bytes_per_param: int
    world: int  # ranks its parameters are sharded over (1 for dp/none)
    offload_key: str  # the key that keeps its shards on the host

    @property
    def resident(self) -> float:
        """Bytes of its parameters one rank keeps on the GPU."""
        return self.params / self.world * self.bytes_per_param


@dataclasses.dataclass(frozen=True)
class Setup:
    """A run's settings as memory sees them, per rank."""

    world: int  # ranks the state is sharded over (1 for dp/none)
    rollout_seqs: int  # sequences this rank generates at once (the hf rollout)
    seq_len: int  # prompt + response tokens
    micro_seqs: int  # sequences per forward (log-prob and update micro-batches)
    master_bytes: int = 4  # model.dtype: parameters, gradients, AdamW's two moments
    compute_bytes: int = 4  # fsdp_config.param_dtype (what a gathered layer and the activations take)
    reference: bool = True
    ref_offload: bool = False  # ref.fsdp_config.param_offload: the reference's shards on the host
    optimizer_offload: bool = False  # actor.fsdp_config.optimizer_offload: AdamW's state on the host but in its step
    param_offload: bool = False  # actor.fsdp_config.param_offload: shards, gradients and AdamW's step on the host
    checkpointing: bool = False
    kv_bytes: int = 4
    ep: int = 1  # fsdp_config.expert_parallel_size: a layer's forward gathers 1/ep of its experts
    lora: bool = False  # adapters train: the base weights are frozen (no gradients, no AdamW state worth counting)
    critic: bool = False  # a value model of the policy's size, with its own AdamW
    critic_param_offload: bool = False
    critic_optimizer_offload: bool = False
    engine: Engine | None = None  # a vLLM rollout; None = the hf rollout over the actor's own modules
    # model.use_fused_kernels: log-probs inside the LM head a block at a time, no (tokens, vocabulary) logits
    fused_logprob: bool = False
    # actor.ulysses_sequence_parallel_size: each micro-batch's tokens split over this many ranks
    sp: int = 1
    # colocated teachers and reward model whose shards stay on the GPU (not param_offload)
    frozen: tuple[Frozen, ...] = ()
    # model.lm_head_fp32: the actor's head computes from a float32 copy of its weight (below float32 compute)
    lm_head_fp32: bool = False


def _state(lay: Layout, s: Setup) -> dict[str, float]:
    """What stays on the GPU between phases: the roles' shards and optimizer state that are not offloaded."""
    shard = lay.params / s.world
    state: dict[str, float] = {}
    if not s.param_offload:
        state["actor parameters"] = shard * s.master_bytes
        if not s.optimizer_offload and not s.lora:
            state["optimizer state"] = 2 * shard * s.master_bytes
    if s.reference and not s.ref_offload:
        state["reference parameters"] = shard * s.master_bytes
    if s.critic:
        if not s.critic_param_offload:
            state["critic parameters"] = shard * s.master_bytes
            if not s.critic_optimizer_offload:
                state["critic optimizer state"] = 2 * shard * s.master_bytes
    for model in s.frozen:
        state[f"{model.name} parameters"] = model.resident
    return state


def engine_terms(lay: Layout, eng: Engine) -> dict[str, float]:
    """One GPU's share of an awake engine: its weights, its profiling activations, and the KV cache (the rest).

    The KV cache is what vLLM sizes it to: the engine's share less what else it holds, below zero when the
    weights alone do not fit.
    """
    budget = eng.gpu_memory_utilization * eng.capacity
    weights = lay.params * eng.weight_bytes / eng.tp
    # The profiling forward: hidden states and one MLP's intermediate (split over tp) of its tokens, and the
    # sampler's float32 logits of max_num_seqs positions (every rank gathers the full vocabulary).
    tokens = max(eng.batched_tokens, eng.max_num_seqs)
    activations = (
        tokens * (4 * lay.hidden + 3 * lay.ffn_tokens_dim / eng.tp) * eng.weight_bytes
        + eng.max_num_seqs * lay.vocab * 4
    )
    return {"engine weights": weights, "engine activations": activations, "KV cache": budget - weights - activations}


def kv_bytes_per_token(lay: Layout, eng: Engine) -> float:
    """KV cache bytes one token takes on one GPU of the engine (key/value heads split over tp, at least one)."""
    heads = max(1, lay.kv_heads // eng.tp)
    return 2 * lay.layers * heads * (lay.kv_dim / lay.kv_heads) * eng.weight_bytes


def account(lay: Layout, s: Setup) -> dict[str, dict[str, float]]:
    """Bytes per rank by phase and term: resident state plus what the phase adds at its peak.

    State: the actor's parameter shards and AdamW's two moments (master dtype),
    the reference's shards unless offloaded (and the critic's, when on; and
    each colocated frozen model's, `Setup.frozen`). A
    phase adds what it gathers (under fsdp2 over several ranks: the root unit,
    and one decoder layer in flight plus the next one prefetched, in the
    compute dtype; with one rank nothing is gathered) and its activations: the
    KV cache of the hf rollout; the hidden states and one MLP's intermediate
    of a micro-batch for a no-grad forward; for the update also its gradient
    shards, a layer's unsharded gradient with the buffer it is
    reduce-scattered from (several ranks), and the activations kept for the
    backward (every layer's, or the layer boundaries only under gradient
    checkpointing). Logits are one micro-batch's, in the compute dtype; with
    the fused log-prob (`fused_logprob`) only one block of them is alive
    (float32, with the few block-sized temporaries of its log-softmax), and
    the update adds a float32 accumulator of the LM head's gradient when the
    compute dtype is lower. A float32 LM head over a lower compute dtype
    (`lm_head_fp32`) makes the logits float32 and adds a float32 copy of the
    head's weight to every phase that runs the head (the hf rollout, the
    no-grad forwards, and the update, which also holds that copy's gradient).
    Under sequence parallelism (`sp`) every per-token term is a rank's 1/sp
    of the tokens, plus the attention all-to-all's buffers.

    With a vLLM engine the rollout is the engine awake (`engine_terms`) beside
    the state, or the engine alone on GPUs of its own; an engine that does not
    sleep keeps its share through the other phases too.
    """
    w = s.world
    shard = lay.params / w
    optim = 2 * shard * s.master_bytes
    state = _state(lay, s)
    # Under EP a layer gathers its dense part and its own experts (1/ep of them): the rest stay on their ranks.
    layer = lay.layer_params - lay.layer_expert_params * (1 - 1 / s.ep)
    gathered = (lay.root_params + 2 * layer) * s.compute_bytes if w > 1 else 0.0
    # Under sequence parallelism a rank runs 1/sp of each micro-batch's tokens (padded to a multiple of sp): every
    # activation, the logits and the fused blocks' tokens shrink with it; the state and gathered layers do not.
    tokens = -(-s.micro_seqs * s.seq_len // s.sp)
    # A float32 head (below float32 compute) makes its logits float32 and holds a float32 copy of its weight while
    # it runs; the update's backward adds that copy's gradient, in float32 too, before it is cast back.
    fp32_head = s.lm_head_fp32 and s.compute_bytes < 4
    head_copy = lay.vocab * lay.hidden * 4 if fp32_head else 0.0
    logits = tokens * lay.vocab * (4 if fp32_head else s.compute_bytes)
    per_layer_act = tokens * (4 * lay.hidden + 3 * lay.ffn_tokens_dim) * s.compute_bytes
    kv = s.rollout_seqs * s.seq_len * lay.layers * 2 * lay.kv_dim * s.kv_bytes
    rollout_logits = s.rollout_seqs * lay.vocab * 4  # one position per sequence, float32 for sampling
    no_grad = {"gathered weights": gathered, "activations": per_layer_act, "logits": logits}
    kept = lay.layers * tokens * lay.hidden * s.compute_bytes if s.checkpointing else lay.layers * per_layer_act
    update = {
        "gathered weights": gathered,
        "activations kept": kept + per_layer_act,
        "logits and their gradient": 2 * logits,
    }
    if s.fused_logprob:
        block = min(tokens, max(1, DEFAULT_FUSED_CHUNK_ELEMENTS // lay.vocab)) * lay.vocab
        # The forward holds a block's logits, their float32 copy and its exponentials; the backward adds the
        # block's gradient (conveyor.algos.fused_logprob).
        no_grad = {"gathered weights": gathered, "activations": per_layer_act, "log-prob blocks": 3 * block * 4}
        update = {"gathered weights": gathered, "activations kept": kept + per_layer_act}
        update["log-prob blocks"] = 4 * block * 4
        if s.compute_bytes < 4 and not s.lora:
            update["LM head gradient (float32 sum)"] = lay.vocab * lay.hidden * 4
    if fp32_head:
        no_grad["LM head float32 copy"] = head_copy
        update["LM head float32 copy and its gradient"] = 2 * head_copy
    trained = not s.lora and not s.param_offload  # frozen weights have no gradients; offloaded ones are the host's
    if trained:
        update = {"gathered weights": gathered, "gradients": shard * s.master_bytes, **update}
    if w > 1:  # a layer's unsharded gradient and the buffer it is reduce-scattered from (float32)
        update["a layer's gradient in flight"] = 2 * layer * 4
    if s.ep > 1:  # the rows a layer sends and receives (about top_k per token each way), and their outputs
        exchange = 2 * tokens * lay.top_k * lay.hidden * s.compute_bytes
        no_grad["all-to-all buffers"] = update["all-to-all buffers"] = exchange
    if s.sp > 1:  # one attention's q, k, v and output, sent and received (the same bytes either side of the swap)
        q_dim = lay.q_dim or lay.hidden
        exchange = 2 * tokens * (2 * q_dim + 2 * lay.kv_dim) * s.compute_bytes
        no_grad["sequence all-to-all buffers"] = update["sequence all-to-all buffers"] = exchange
    grads = shard * s.master_bytes
    if trained and s.optimizer_offload and optim + grads > total(update):
        update = {"gradients": grads, "optimizer state (in its step)": optim}  # the step outgrows the backward
    rollout = {"gathered weights": gathered, "KV cache": kv, "logits": rollout_logits}
    if fp32_head:  # the hf rollout decodes through the same head
        rollout["LM head float32 copy"] = head_copy
    eng = s.engine
    if eng is not None:
        rollout = {k: max(v, 0.0) for k, v in engine_terms(lay, eng).items()}
    phases = {
        "rollout": rollout,
        "old_log_prob": dict(no_grad),
        "ref": dict(no_grad) if s.reference else {},
        "update_actor": update,
    }
    out = {p: {**state, **extra} for p, extra in phases.items() if extra or p != "ref"}
    if eng is not None and not eng.colocated:
        out["rollout"] = dict(rollout)  # the engine's GPUs hold nothing of the trainer's
    elif eng is not None and not eng.sleeps:
        for p in out:
            if p != "rollout":
                out[p]["vLLM engine (not sleeping)"] = eng.gpu_memory_utilization * eng.capacity
    return out


def total(terms: dict[str, float]) -> float:
    """The sum of a phase's terms."""
    return float(sum(terms.values()))


@dataclasses.dataclass(frozen=True)
class Misfit:
    """One reason a layout does not fit a GPU: what, the bytes needed and available, and the keys that change it."""

    what: str
    need: float
    have: float
    keys: tuple[str, ...]

    def describe(self) -> str:
        """The reason in words, with the keys to change."""
        return f"{self.what} ({self.need / GB:.1f} GB needed, {self.have / GB:.1f} GB there); change " + ", ".join(
            self.keys
        )


def _engine_sizes(lay: Layout, eng: Engine) -> tuple[float, float]:
    """(bytes the engine's share must hold besides its KV cache, bytes of one max_model_len sequence's KV cache)."""
    terms = engine_terms(lay, eng)
    return terms["engine weights"] + terms["engine activations"], kv_bytes_per_token(lay, eng) * eng.max_model_len


def _smallest_tp(lay: Layout, eng: Engine, world: int) -> int | None:
    """The smallest tensor_model_parallel_size dividing `world` whose weights leave the share one sequence of KV."""
    for tp in range(1, max(world, 1) + 1):
        if world % tp == 0:
            fixed, seq = _engine_sizes(lay, dataclasses.replace(eng, tp=tp))
            if fixed + seq <= eng.gpu_memory_utilization * eng.capacity:
                return tp
    return None


def misfits(lay: Layout, s: Setup, capacity: float, ranks: int | None = None) -> list[Misfit]:
    """What does not fit a GPU of `capacity` bytes in a vLLM layout (empty when it fits); the check's one verdict.

    The engine's share must hold its weights, its profiling activations and one sequence of max_model_len;
    colocated, the engine awake plus the state the trainer keeps must fit the GPU, and so must every phase of
    an engine that does not sleep. `ranks`: the GPUs an engine's tensor parallelism may span (default
    `s.world`). The hf rollout has no engine: nothing here (its phases are `account`'s, not refused).
    """
    eng = s.engine
    if eng is None:
        return []
    ro = f"{_KEY}.rollout"
    out: list[Misfit] = []
    budget = eng.gpu_memory_utilization * eng.capacity
    fixed, seq = _engine_sizes(lay, eng)
    state = _state(lay, s) if eng.colocated else {}
    if fixed + seq > budget:
        keys = []
        if fixed + seq <= capacity - total(state):  # a larger share only helps where the trainer leaves room for it
            keys.append(f"{ro}.gpu_memory_utilization (at least {(fixed + seq) / eng.capacity:.2f} for one sequence)")
        tp = _smallest_tp(lay, eng, ranks or s.world)
        if tp is not None and tp > eng.tp:
            keys.append(f"{ro}.tensor_model_parallel_size (at least {tp})")
        elif eng.tp < (ranks or s.world):
            keys.append(f"{ro}.tensor_model_parallel_size (larger)")
        if eng.weight_bytes > 2:
            keys.append(f"{ro}.dtype=bfloat16")
        if not keys:
            keys.append("trainer.n_gpus_per_node or trainer.nnodes (GPUs for a larger tensor_model_parallel_size)")
        what = (
            "the vLLM engine's weights do not fit its share of the GPU"
            if fixed > budget
            else f"the vLLM engine's KV cache cannot hold one sequence of max_model_len={eng.max_model_len}"
        )
        if fixed <= budget:
            keys.append(f"{ro}.max_model_len (or data.max_prompt_length + data.max_response_length)")
        out.append(Misfit(what, fixed + seq, budget, tuple(keys)))
    if not eng.colocated:
        return out
    acc = account(lay, s)
    awake = total(state) + max(budget, fixed)  # vLLM claims its whole share when it starts and when it wakes
    if awake > capacity:
        keys = [
            f"{ro}.gpu_memory_utilization (at most {(capacity - total(state)) / capacity:.2f} beside the "
            f"trainer's {total(state) / GB:.1f} GB)"
        ]
        if "optimizer state" in state:
            keys.append(f"{_KEY}.actor.fsdp_config.optimizer_offload=true")
        if "actor parameters" in state:
            keys.append(f"{_KEY}.actor.fsdp_config.param_offload=true")
        if "reference parameters" in state:
            keys.append(f"{_KEY}.ref.fsdp_config.param_offload=true")
        if "critic parameters" in state:
            keys.append("critic.fsdp_config.param_offload=true or critic.fsdp_config.optimizer_offload=true")
        keys.extend(model.offload_key for model in s.frozen)
        keys.append("trainer.n_gpus_per_node or trainer.nnodes (more ranks: smaller shards)")
        out.append(
            Misfit("the vLLM engine awake beside what the trainer keeps on the GPU", awake, capacity, tuple(keys))
        )
    if not eng.sleeps:
        for phase, terms in acc.items():
            if phase != "rollout" and total(terms) > capacity:
                out.append(
                    Misfit(
                        f"the {phase} phase beside a vLLM engine that does not sleep",
                        total(terms),
                        capacity,
                        (f"{ro}.free_cache_engine=true", f"{ro}.gpu_memory_utilization"),
                    )
                )
    return out


def setup_of(cfg: Any, plan: Any, capacity: float) -> Setup:
    """The `Setup` of a run of `cfg` under `plan` on GPUs of `capacity` bytes (what a rank holds, per the config)."""
    from conveyor.rollout.base import served_dtype
    from conveyor.workers.training.strategy import mixed_precision, resolve_strategy

    arr, t, d = cfg.actor_rollout_ref, cfg.trainer, cfg.data
    actor, ro, model = arr.actor, arr.rollout, arr.model
    ranks = t.nnodes * max(t.n_gpus_per_node, t.num_cpu_workers)
    strategy = resolve_strategy(actor.strategy, ranks)
    world = _sharded_over(actor.strategy, actor.fsdp_config, ranks)
    compute, _ = mixed_precision(strategy, actor.fsdp_config.param_dtype, None, plan.device)
    master = _BYTES[model.dtype]
    seq_len = d.max_prompt_length + d.max_response_length
    micro = actor.ppo_micro_batch_size_per_gpu
    if actor.use_dynamic_bsz:
        micro = max(1, actor.ppo_max_token_len_per_gpu // seq_len)
    engine = None
    if _claims_gpu_fraction(plan):
        engine = Engine(
            capacity=capacity,
            gpu_memory_utilization=ro.gpu_memory_utilization,
            tp=ro.tensor_model_parallel_size,
            weight_bytes=_BYTES[served_dtype(ro, model.dtype, plan.device)],
            max_model_len=plan.engine_max_model_len or seq_len,
            max_num_seqs=ro.max_num_seqs,
            batched_tokens=16384 if capacity >= 70 * 2**30 else 8192,
            sleeps=ro.free_cache_engine,
            colocated=plan.rollout_placement == "colocated",
        )
    reference = plan.use_reference and not plan.reference_from_actor
    critic = cfg.critic.fsdp_config
    share = max(1, d.train_batch_size * ro.n // max(ranks, 1))
    return Setup(
        world=world,
        rollout_seqs=min(ro.max_num_seqs, share),
        seq_len=seq_len,
        micro_seqs=micro,
        master_bytes=master,
        compute_bytes=_BYTES[compute] if compute else master,
        reference=reference,
        ref_offload=arr.ref.fsdp_config.param_offload,
        optimizer_offload=actor.fsdp_config.optimizer_offload,
        param_offload=actor.fsdp_config.param_offload,
        checkpointing=model.enable_gradient_checkpointing,
        kv_bytes=_BYTES[compute] if compute else master,
        ep=actor.fsdp_config.expert_parallel_size,
        lora=model.lora_rank > 0,
        critic=plan.use_critic,
        critic_param_offload=critic.param_offload,
        critic_optimizer_offload=critic.optimizer_offload,
        engine=engine,
        fused_logprob=model.use_fused_kernels,
        sp=actor.ulysses_sequence_parallel_size,
        frozen=colocated_frozen(cfg, plan, ranks),
        lm_head_fp32=model.lm_head_fp32,
    )


def _sharded_over(strategy: str | None, fsdp: Any, ranks: int) -> int:
    """Ranks a role's parameters are sharded over: fsdp_size (or all its ranks) under fsdp2, else 1."""
    from conveyor.workers.training.strategy import resolve_strategy

    return (fsdp.fsdp_size or ranks) if resolve_strategy(strategy, ranks) == "fsdp2" else 1


def colocated_frozen(cfg: Any, plan: Any, ranks: int) -> tuple[Frozen, ...]:
    """The teachers and reward model that share the actor's GPUs with their shards resident, counted from the
    config.json of their checkpoints (built on the meta device; no weights read)."""
    from transformers import AutoConfig

    def config_of(path: str, key: str, remote: bool) -> Any | None:
        try:
            return AutoConfig.from_pretrained(path, trust_remote_code=remote)
        except (OSError, ValueError) as err:  # its loader refuses the path later, with the key to change
            logger.warning("memory check: %s=%s not counted (%s)", key, path, str(err).splitlines()[0])
            return None

    out = []
    model = cfg.actor_rollout_ref.model
    remote = bool(model.trust_remote_code)
    if plan.use_teacher and plan.teacher_placement == "colocated":
        for name, teacher in cfg.distillation.teacher_models.items():
            if teacher.fsdp_config.param_offload:
                continue
            config = config_of(teacher.model_path, f"distillation.teacher_models.{name}.model_path", remote)
            if config is None:
                continue
            out.append(
                Frozen(
                    f"teacher {name}",
                    layout_of(config, trust_remote_code=remote).params,
                    _BYTES[model.dtype],  # teachers load in the actor's model.dtype
                    _sharded_over(teacher.strategy, teacher.fsdp_config, ranks),
                    f"distillation.teacher_models.{name}.fsdp_config.param_offload=true",
                )
            )
    rm = cfg.reward_model
    if plan.use_reward_model and plan.reward_model_placement == "colocated" and not rm.fsdp_config.param_offload:
        rm_remote = bool(rm.model.trust_remote_code)
        config = config_of(rm.model.path, "reward_model.model.path", rm_remote)
        if config is None:
            return tuple(out)
        lay = layout_of(config, trust_remote_code=rm_remote)
        # A value head or a one-label classifier in place of the LM head: the body, without an untied LM head.
        untied_head = 0 if getattr(config, "tie_word_embeddings", False) else lay.vocab * lay.hidden
        out.append(
            Frozen(
                "reward model",
                lay.params - untied_head + lay.hidden,
                _BYTES[rm.model.dtype],
                _sharded_over(rm.strategy, rm.fsdp_config, ranks),
                "reward_model.fsdp_config.param_offload=true",
            )
        )
    return tuple(out)


def _claims_gpu_fraction(plan: Any) -> bool:
    """Whether the plan's engine claims a fraction of each GPU of its own (its declared capability, not its name)."""
    from conveyor.rollout.base import engine_spec

    return engine_spec(plan.engine).capabilities(plan.device).claims_gpu_fraction


def _gpu_capacity() -> float | None:
    """Bytes of memory of this process's current CUDA device, or None when none is visible."""
    if not torch.cuda.is_available():
        return None
    return float(torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory)


def check_memory(cfg: Any, plan: Any, model_config: Any, device: str, capacity: float | None = None) -> None:
    """Refuse (ConfigError) a vLLM rollout layout that cannot fit one GPU of `capacity` bytes, naming the keys.

    Runs for the vllm engine on CUDA; `capacity` defaults to the current device's memory (a driver that sees
    no GPU skips the check, saying so). Warns when it fits with less than HEADROOM_GB to spare.
    """
    from conveyor.config import ConfigError

    if not _claims_gpu_fraction(plan) or device != "cuda":
        return
    if capacity is None:
        capacity = _gpu_capacity()
        if capacity is None:
            logger.info("vLLM memory check skipped: this process sees no GPU to size it against")
            return
    lay = layout_of(model_config, trust_remote_code=cfg.actor_rollout_ref.model.trust_remote_code)
    s = setup_of(cfg, plan, capacity)
    t = cfg.trainer
    found = misfits(lay, s, capacity, ranks=t.nnodes * max(t.n_gpus_per_node, t.num_cpu_workers))
    if found:
        raise ConfigError(
            f"the vllm rollout does not fit a GPU of {capacity / GB:.1f} GB by the memory accounting "
            "(docs/distributed.md, python benchmarks/memory.py --account): " + "; ".join(m.describe() for m in found)
        )
    worst = max(total(terms) for terms in account(lay, s).values())
    if capacity - worst < HEADROOM_GB * GB:
        logger.warning(
            "the vllm rollout fits a GPU of %.1f GB by the accounting with %.1f GB to spare; the "
            "allocator, the CUDA context and NCCL take several GB (docs/distributed.md)",
            capacity / GB,
            (capacity - worst) / GB,
        )
