"""One rank's rollout: an engine, and the agent loop over it, turning a handle's prompts into the rollout's fields.

`Generation` is what the actor worker (colocated placement) and the rollout
worker (separate placement, `conveyor.workers.ranks.replica`) both run for
`generate_sequences`: it reads `prompts` and `prompt_mask` from the data
plane (or renders them from the records the call carries, `RENDER_PROMPTS`,
and writes them with its own fields), samples with the rank's engine (built
from the registry, `conveyor.rollout.base`), and writes `responses`,
`response_mask`, `rollout_log_probs` (+ `routed_experts`, + `tool_rewards`)
back, with the handle's `seq_len` tags updated to prompt + response tokens.

Widths. Ranks that write into one partition together agree on one response
width: the longest of any rank when they share a process group (one max
all-reduce), `max_new_tokens` when they do not (separate engine replicas),
and `max_new_tokens` for dynamic sampling's batches, which fill one partition
at different times.

What it deliberately does not do: move weights into the engine (the worker
does, before calling it) or decide what to capture (the run plan does).
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable
from typing import Any

import torch
from tensordict import TensorDict

from conveyor.data_plane.base import DataPlane
from conveyor.models.vision import VisionBatch, with_vision_fields
from conveyor.protocol import KVBatchMeta
from conveyor.rollout.base import GenerationEngine, GenerationOutput, SamplingParams
from conveyor.rollout.gateway.trajectory import TASK_FIELDS, session_task
from conveyor.tasks.prompts import RENDER_PROMPTS, PromptEncoder
from conveyor.workers.ranks.calls import GenerateCall
from conveyor.workers.ranks.forward import micro_batches
from conveyor.workers.ranks.perf import begin_phase, phase_memory_metrics, result_handle
from conveyor.workers.training.balance import SEQ_LEN_TAG, sequence_lengths, with_seq_lens

__all__ = ["Generation", "build_engine", "pad_responses"]

# A row's count of sampled tokens that no response reaches: told for rows whose generation ended before a switch.
_DONE = 2**31 - 1


def build_engine(
    settings: Any,
    model_path: str,
    model: torch.nn.Module,
    tokenizer: Any,
    *,
    rank: int,
    world_size: int,
    device: torch.device,
    lean: Any = None,
    moe: Any = None,
) -> tuple[GenerationEngine, Any]:
    """This rank's engine, from the registry (`settings.rollout.name`), and what drives it past one call a batch
    (the agent gateway, the tool loop, or None): the one place the actor and the rollout workers build them."""
    from conveyor.rollout.agent_loop import build_rollout_loop
    from conveyor.rollout.base import EngineContext, engine_spec

    m, ro = settings.model, settings.rollout
    fp32_head = bool(getattr(m, "lm_head_fp32", False))
    if fp32_head and engine_spec(ro.name).capabilities(device.type).shares_trainer_modules:
        from conveyor.models.fused_head import float32_lm_head

        # A separate replica's copy computes its head as the actor's does (the actor's own is already float32).
        float32_lm_head(model)
    engine = engine_spec(ro.name).build(
        EngineContext(
            model_path=model_path,
            model=model,
            tokenizer=tokenizer,
            rollout=ro,
            model_dtype=m.dtype,
            trust_remote_code=m.trust_remote_code,
            max_model_len=settings.max_model_len,
            seed=settings.seed,
            rank=rank,
            world_size=world_size,
            device=device,
            lean=lean,
            moe=moe,
            lm_head_fp32=fp32_head,
        )
    )
    return engine, build_rollout_loop(ro, engine, tokenizer, model_path)


def pad_responses(fields: dict[str, torch.Tensor], width: int, pad_token_id: int) -> dict[str, torch.Tensor]:
    """The rollout's fields right-padded to `width` response columns (pad token, no mask, log-prob 0, expert -1)."""
    extra = width - fields["responses"].shape[1]
    if extra <= 0:
        return fields
    pad = torch.nn.functional.pad
    out = dict(fields)
    out["responses"] = pad(fields["responses"], (0, extra), value=int(pad_token_id))
    out["response_mask"] = pad(fields["response_mask"], (0, extra), value=False)
    out["rollout_log_probs"] = pad(fields["rollout_log_probs"], (0, extra), value=0.0)
    if fields.get("routed_experts") is not None:  # (B, P+R, L, K): the new positions were never routed
        out["routed_experts"] = pad(fields["routed_experts"], (0, 0, 0, 0, 0, extra), value=-1)
    if fields.get("router_margins") is not None:  # (B, P+R, L): nor have they margins
        out["router_margins"] = pad(fields["router_margins"], (0, 0, 0, extra), value=math.nan)
    if isinstance(fields.get("token_policy_version"), torch.Tensor):  # (B, R): padding takes each row's newest
        out["token_policy_version"] = pad(fields["token_policy_version"], (0, extra), mode="replicate")
    return out


def _call_min_p(call: GenerateCall, rollout: Any) -> float:
    """The call's min-p (training: rollout.min_p; validation: val_kwargs.min_p), or the rollout's where the call
    carries none."""
    return float(call.min_p if call.min_p is not None else rollout.min_p)


def _replica_groups(replica_ranks: list[int], world_size: int) -> Any:
    """This rank's tensor-parallel replica as a process group (every rank makes every replica's: a collective)."""
    import torch.distributed as tdist

    tp = len(replica_ranks)
    mine = None
    for first in range(0, world_size, tp):
        group = tdist.new_group(list(range(first, first + tp)), backend="gloo")
        if first == replica_ranks[0]:
            mine = group
    return mine


class Generation:
    """The `generate_sequences` of one rank: its engine (and agent loop) over the rank's share of a handle."""

    def __init__(
        self,
        engine: GenerationEngine,
        *,
        agent_loop: Any,
        tokenizer: Any,
        moe: Any,
        rollout: Any,
        engine_name: str,
        strategy: Any,
        passes: Callable[[list[slice]], list[tuple[slice, bool]]],
        data_plane: DataPlane,
        rank: int,
        world_size: int,
        device: torch.device,
        over_shards: bool = False,
        prompts: PromptEncoder | None = None,
    ) -> None:
        self.engine, self.agent_loop, self.tokenizer, self.moe = engine, agent_loop, tokenizer, moe
        self.rollout, self.engine_name = rollout, engine_name
        self.strategy, self.passes = strategy, passes  # the rank's strategy (its collectives) and pass pairing
        self.data_plane = data_plane
        self.rank, self.world_size, self.device = rank, world_size, device
        # Renders the prompts of a call that carries their records (`RENDER_PROMPTS`) instead of reading them.
        self.prompts = prompts
        # Decoding over FSDP2 shards: every rank steps until the last one is done (the actor only).
        self.over_shards = over_shards
        # A partial rollout's hook (the asynchronous trainer's rollout process sets it): called between the
        # engine's tokens, True when it changed the weights mid-generation (interruptible engines only).
        self.interrupt: Callable[[int], bool] | None = None
        # A replica over several trainer ranks (colocated vLLM with tensor_model_parallel_size > 1): its ranks
        # gather their prompts, run one generation together and keep their own rows.
        self.replica_ranks = list(getattr(engine, "replica_ranks", [rank]))
        self.replica_group = _replica_groups(self.replica_ranks, world_size) if len(self.replica_ranks) > 1 else None

    def __call__(
        self,
        meta: KVBatchMeta,
        sync_metrics: dict[str, float],
        extra_fields: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]] | None = None,
    ) -> KVBatchMeta:
        """Sample the handle's prompts; writes the rollout's fields and returns the handle with this rank's metrics.

        `extra_fields(fields)`: more fields, derived from the rollout's, written in the same put.
        """
        begin_phase(self.device)
        prompt_fields = self._render(meta) if RENDER_PROMPTS in meta.extra_info else {}
        call = GenerateCall.from_extra_info({k: v for k, v in meta.extra_info.items() if k != RENDER_PROMPTS})
        if prompt_fields:
            names = with_vision_fields(["prompts", "prompt_mask"], list(prompt_fields))
            td = TensorDict({k: prompt_fields[k] for k in names}, batch_size=[len(meta)]).to(self.device)
        else:
            # A vision-language policy's samples carry their pixels and M-RoPE positions: the prefill needs them.
            names = with_vision_fields(["prompts", "prompt_mask"], meta.fields)
            td = self.data_plane.kv_batch_get(keys=meta.keys, partition_id=meta.partition_id, select_fields=names).to(
                self.device
            )
        tasks = self._tasks(meta, prompt_fields) if getattr(self.agent_loop, "needs_tasks", False) else None
        generator = None
        if call.seed is not None:
            # One stream per rank, or per replica when a tensor-parallel replica spans ranks (they sample as one).
            first = self.replica_ranks[0] if self.replica_group is not None else self.rank
            generator = torch.Generator(device=self.device).manual_seed(int(call.seed) + 7919 * first)
        t0 = time.perf_counter()
        strategy = self.strategy
        if self.over_shards:
            with strategy.sharded_no_grad():
                out = self._in_chunks(td, call, generator, synced=strategy.all_done)
        elif self.replica_group is not None:
            out = self._as_replica(td, call, generator)
        else:
            # An engine over the trainer's modules decodes with the whole model gathered once (docs/distributed.md).
            gather = self.engine.capabilities.shares_trainer_modules
            with strategy.full_params() if gather else contextlib.nullcontext():
                out = self._in_chunks(td, call, generator, tasks=tasks)
        elapsed = time.perf_counter() - t0
        if out.source_rows is not None:  # the agent gateway: a session may have made several samples
            meta, prompt_fields, td = self._session_rows(meta, out, prompt_fields, td, tasks)
        fields = {k: out[k] for k in ("responses", "response_mask", "rollout_log_probs")}
        if call.capture_routing and self.moe is not None and "routed_experts" not in out:
            # Noticed at the first rollout, not at the update that finds nothing to replay.
            raise RuntimeError(
                f"the {self.engine_name} rollout returned no routed_experts, which the run plan captures "
                "(actor_rollout_ref.actor.router_replay.mode=R3, or rollout.moe_load_balance_metrics_interval > 0): "
                "set router_replay.mode=R2 (the old-log-prob forward records the routing), or use an engine that "
                "returns routing on this device"
            )
        if "routed_experts" in out:
            from conveyor.models.moe_routing import routed_experts_dtype

            fields["routed_experts"] = out["routed_experts"].to(routed_experts_dtype(self.moe.num_experts))
        if "router_margins" in out and "routed_experts" in fields:
            # float16 keeps small gaps (the ones that matter) to their full precision in half the bytes.
            fields["router_margins"] = out["router_margins"].to(torch.float16)
        if out.sample_fields:  # the agent gateway's per-row fields (the session's reward, each token's version)
            fields.update(out.sample_fields)
        pad_id = int(self.tokenizer.pad_token_id)
        if call.pad_to_max_new_tokens or (self.world_size > 1 and not strategy.distributed):
            # Dynamic sampling's generation batches write into one partition, whose columns keep one width, at
            # different times; so do ranks that share no process group: all pad to the requested length.
            fields = pad_responses(fields, int(call.max_new_tokens), pad_id)
        elif self.world_size > 1:
            # The ranks write into one partition too, together: to the longest response of any rank, not to
            # max_new_tokens (the forwards then drop what is padding in a whole micro-batch, or pack).
            fields = pad_responses(fields, strategy.agree_count(int(fields["responses"].shape[1])), pad_id)
        if "tool_rewards" in out:  # multi-turn: the tools' rewards, which the reward worker adds to the score
            fields["tool_rewards"] = out["tool_rewards"]
        if extra_fields is not None:  # derived fields the rollout did not give itself (the gateway's own versions win)
            fields.update({k: v for k, v in extra_fields(fields).items() if k not in fields})
        cpu = {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in fields.items()}
        # Rendered prompts go in the same put as the rollout's fields (one write a batch).
        self.data_plane.kv_batch_put(keys=meta.keys, partition_id=meta.partition_id, fields={**prompt_fields, **cpu})
        # The handle's seq_len tags become prompt + response tokens: later splits over ranks balance those.
        meta = with_seq_lens(meta, sequence_lengths(td["prompt_mask"], out["response_mask"]))
        n_tokens = float(out["response_mask"].sum())
        metrics = {"rollout/generated_tokens@sum": n_tokens, "rollout/gen_time_s": elapsed, **sync_metrics}
        metrics.update(out.get("metrics") or {})  # the agent loop's rollout/multi_turn/*
        metrics.update(phase_memory_metrics("rollout", self.device))
        return result_handle(meta, list(prompt_fields) + list(fields), metrics, self.device)

    def _tasks(self, meta: KVBatchMeta, prompt_fields: dict[str, Any]) -> list[dict]:
        """Each sample's task, for an agent: its dataset row in verl's shape, and the prompt text it was rendered to."""
        names = [f for f in TASK_FIELDS if f != "uid"]
        if prompt_fields:
            cols = {f: prompt_fields[f] for f in names if f in prompt_fields}
        else:
            have = [f for f in names if f in meta.fields] or names[:4]
            got = self.data_plane.kv_batch_get(keys=meta.keys, partition_id=meta.partition_id, select_fields=have)
            cols = {f: got[f] for f in have}
        return [
            session_task(
                cols["prompt_messages"][i],
                cols["data_source"][i],
                cols["ground_truth"][i],
                cols["extra_info"][i] if "extra_info" in cols else None,
                cols["raw_prompt"][i],
            )
            for i in range(len(meta))
        ]

    def _session_rows(
        self,
        meta: KVBatchMeta,
        out: GenerationOutput,
        prompt_fields: dict[str, Any],
        td: TensorDict,
        tasks: list[dict] | None,
    ) -> tuple[KVBatchMeta, dict[str, Any], TensorDict]:
        """The handle, prompt fields and prompts of the gateway's rows: a session's first sample keeps its key, its
        k-th later one is `<key>/t<k>` with the session's task fields copied; every row's prompt columns are its own."""
        assert out.source_rows is not None and out.prompts is not None and out.prompt_mask is not None
        rows = out.source_rows.tolist()
        seen: dict[int, int] = {}
        keys = []
        for src in rows:
            k = seen.get(src, 0)
            seen[src] = k + 1
            keys.append(meta.keys[src] if k == 0 else f"{meta.keys[src]}/t{k}")
        fields: dict[str, Any] = {"prompts": out.prompts.cpu(), "prompt_mask": out.prompt_mask.cpu()}
        fields["agent_session"] = [meta.keys[src] for src in rows]
        if len(keys) > len(meta.keys):  # new samples: they carry their session's task fields
            if prompt_fields:
                base = {f: prompt_fields[f] for f in TASK_FIELDS if f in prompt_fields}
            else:
                have = [f for f in TASK_FIELDS if f in meta.fields]
                got = self.data_plane.kv_batch_get(keys=meta.keys, partition_id=meta.partition_id, select_fields=have)
                base = {f: got[f] for f in have}
            for f, col in base.items():
                fields[f] = [col[src] for src in rows]
        elif prompt_fields:
            fields.update({k: v for k, v in prompt_fields.items() if k not in fields})
        new_meta = KVBatchMeta(
            keys=keys,
            partition_id=meta.partition_id,
            fields=list(meta.fields),
            tags=[dict(meta.tags[src]) if meta.tags else {} for src in rows],
            extra_info=dict(meta.extra_info),
        )
        new_td = TensorDict({"prompts": out.prompts, "prompt_mask": out.prompt_mask}, batch_size=[len(keys)])
        return new_meta, fields, new_td

    def _render(self, meta: KVBatchMeta) -> dict[str, Any]:
        """The prompt fields of the handle's samples, from the records its call carries (`RENDER_PROMPTS`); checked
        against the prompt lengths the handle's tags say, when they say any (the trainer's rendering)."""
        if self.prompts is None:
            raise ValueError(
                f"this {self.engine_name} rollout renders no prompts: put them into the data plane "
                "before the generation call"
            )
        spec = meta.extra_info[RENDER_PROMPTS]
        fields, lengths = self.prompts.for_keys(meta.keys, spec["records"], spec["width"])
        said = [t.get(SEQ_LEN_TAG) for t in meta.tags]
        # The trainer rendered them too when several replicas share the batch (tags and width); else there is one.
        if any(v is not None for v in said) and (lengths != said or fields["prompts"].shape[1] != spec["width"]):
            raise RuntimeError(
                "the rollout replica renders the batch's prompts to other tokens than the trainer "
                "(another tokenizer or data.max_prompt_length): give both the same model.tokenizer_path"
            )
        return fields

    def _as_replica(self, td: TensorDict, call: GenerateCall, generator: torch.Generator | None) -> GenerationOutput:
        """One generation over the prompts of every rank of this tensor-parallel replica; this rank's rows of it."""
        import torch.distributed as tdist

        mine = (td["prompts"].cpu(), td["prompt_mask"].cpu())
        shares: list[Any] = [None] * len(self.replica_ranks)
        tdist.all_gather_object(shares, mine, group=self.replica_group)
        width = max(p.shape[1] for p, _ in shares)
        pad_id = int(self.tokenizer.pad_token_id)
        # Left padding to the widest share: every rank of the replica feeds the engine the same batch.
        prompts = torch.cat([torch.nn.functional.pad(p, (width - p.shape[1], 0), value=pad_id) for p, _ in shares])
        masks = torch.cat([torch.nn.functional.pad(m, (width - m.shape[1], 0), value=0) for _, m in shares])
        out = self._one(
            TensorDict({"prompts": prompts, "prompt_mask": masks}, batch_size=[len(prompts)]), call, generator
        )
        index = self.replica_ranks.index(self.rank)
        start = sum(len(p) for p, _ in shares[:index])
        rows = slice(start, start + len(mine[0]))
        cut = width - mine[0].shape[1]  # the routing's extra left-pad columns of this rank's rows
        sequence = ("routed_experts", "router_margins")
        fields = {k: v[rows] for k, v in out.items() if isinstance(v, torch.Tensor) and k not in sequence}
        if out.routed_experts is not None:
            fields["routed_experts"] = out.routed_experts[rows, cut:]
        if out.router_margins is not None:
            fields["router_margins"] = out.router_margins[rows, cut:]
        # The agent loop's metrics describe the whole replica's batch on each of its ranks: a mean over ranks
        # is the replica's (sums and counts grow alike).
        return GenerationOutput(**fields, metrics=out.metrics)

    def _in_chunks(
        self,
        td: TensorDict,
        call: GenerateCall,
        generator: torch.Generator | None,
        synced: Callable[[bool], bool] | None = None,
        tasks: list[dict] | None = None,
    ) -> GenerationOutput:
        """An engine over the trainer's modules at most `rollout.max_num_seqs` sequences at a time (its KV cache is
        bounded by them).

        Decoding over the shards, every rank runs as many chunks as the busiest (a rank short of chunks
        repeats its first and drops the result: the chunks' collectives must pair up). Engines with their own
        scheduler (vLLM) and the multi-turn loop take the whole share.
        """
        size = self.rollout.max_num_seqs
        own = not self.engine.capabilities.shares_trainer_modules
        if self.agent_loop is not None or own or len(td) <= size and synced is None:
            return self._one(td, call, generator, synced, tasks=tasks)
        slices = micro_batches(len(td), size)
        passes = self.passes(slices) if synced is not None else [(sl, True) for sl in slices]
        outs = []
        for sl, real in passes:
            out = self._one(td[sl], call, generator, synced, interrupt=self._chunk_interrupt(sl, len(td)))
            if real:
                outs.append(out)
        if len(outs) == 1:
            return outs[0]
        width = max(o["responses"].shape[1] for o in outs)
        padded = [pad_responses(dict(o), width, int(self.tokenizer.pad_token_id)) for o in outs]
        return GenerationOutput(**{k: torch.cat([o[k] for o in padded]) for k in padded[0]})

    def _chunk_interrupt(self, sl: slice, rows: int) -> Callable[[Any], bool] | None:
        """`interrupt` for the chunk `sl` of `rows`: its count of sampled tokens, told per row of the whole share
        (rows of earlier chunks are done, and a switch now changes none of their tokens; later ones have sampled
        none, so every token of theirs comes from the new weights)."""
        hook = self.interrupt
        if hook is None:
            return None
        start, stop, _ = sl.indices(rows)

        def interrupt(sampled: Any) -> bool:
            counts = list(sampled) if isinstance(sampled, list) else [int(sampled)] * (stop - start)
            return hook([_DONE] * start + counts + [0] * (rows - stop))

        return interrupt

    def _one(
        self,
        td: TensorDict,
        call: GenerateCall,
        generator: torch.Generator | None,
        synced: Callable[[bool], bool] | None = None,
        tasks: list[dict] | None = None,
        interrupt: Callable[[Any], bool] | None = None,
    ) -> GenerationOutput:
        params = SamplingParams(
            max_new_tokens=int(call.max_new_tokens),
            temperature=float(call.temperature),
            top_p=float(call.top_p),
            top_k=int(call.top_k),
            min_p=_call_min_p(call, self.rollout),
            do_sample=bool(call.do_sample),
            capture_routing=bool(call.capture_routing),
            capture_router_margins=bool(call.capture_router_margins),
        )
        vision = VisionBatch.from_fields(td)
        extra = {"vision": vision} if vision is not None else {}  # engines that take no images are refused at start
        if self.agent_loop is not None:
            if tasks is not None:
                extra["tasks"] = tasks
            return self.agent_loop.run(td["prompts"], td["prompt_mask"], params, generator=generator, **extra)
        return self.engine.generate(
            td["prompts"],
            td["prompt_mask"],
            params,
            generator=generator,
            interrupt=interrupt if interrupt is not None else self.interrupt,
            synced=synced,
            **extra,
        )
