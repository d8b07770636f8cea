"""Multi-turn rollouts with tools: generate until a tool call or the end, run the tool, append its answer, go on.

`AgentLoop.run` takes the same left-padded prompts and `SamplingParams` as
any engine's `generate` (conveyor.rollout.base) and returns the same
`GenerationOutput`, over any engine that declares stop sequences (hf, vllm), so the rest of the trainer is unchanged:
each
sample's whole trajectory (model turns and tool answers, in order) is one
right-padded `responses` row, and `response_mask` is 1 on the tokens the
model sampled and 0 on tool tokens, so losses, KL, entropy, advantages and
metrics see only the model's tokens. Forwards over the trajectory attend to
every token up to the last model token (`response_span`): tool tokens are
context, not padding.

Alignment, which is what goes wrong in this mode:

- `rollout_log_probs` of a model token is the log-prob it was sampled with,
  at its own position in the stitched sequence; 0 on tool tokens.
- `routed_experts` (B, P+R, L, K) holds, for the prompt and every model
  token, the experts that token was routed to when it was fed through the
  model (a turn's last token is fed at the start of the next turn), at its
  position in the stitched sequence; tool tokens, pads and the trajectory's
  last token hold -1.

How it runs: turns are batched. Every round generates one turn for all
samples still going (one engine `generate` call over their contexts so
far; the hf engine rebuilds its KV cache each round, one prefill per turn;
vLLM's prefix cache keeps the contexts it has seen),
then runs all the tool calls of that round at once (up to `tool_workers`
threads), so a slow tool delays its round, not each sample in turn. A call
that raises, returns junk or outlasts `tool_timeout_s` answers an error text
and is counted; the run goes on.

The whole trajectory shares one budget of `max_new_tokens` tokens
(data.max_response_length), model and tool tokens alike, as in verl.
It does not schedule samples across rounds (a sample waits for its round's
slowest tool), and it does not talk to the data plane (the worker does).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import Tensor

from conveyor.algos.trajectory import response_span
from conveyor.deadline import DeadlineExceeded, call_with_deadline
from conveyor.models.vision import VisionBatch, context_vision
from conveyor.rollout.base import GenerationEngine, GenerationOutput, SamplingParams, mask_unfed_routing
from conveyor.tools.base import Tool, ToolResult, release_all, run_call, truncate_text
from conveyor.tools.formats import CallFormat, ToolCall, ToolCallError

logger = logging.getLogger(__name__)

__all__ = ["AgentLoop", "AgentLoopSettings", "build_agent_loop", "truncate_text", "tool_turn_ids"]

_TIMEOUT_KEY = "actor_rollout_ref.rollout.multi_turn.tool_timeout_s"


@dataclass(frozen=True)
class AgentLoopSettings:
    """The loop's limits (actor_rollout_ref.rollout.multi_turn.*, without the tool file)."""

    max_assistant_turns: int | None = None
    max_user_turns: int | None = None
    max_tool_response_length: int = 256
    tool_response_truncate_side: str = "middle"
    tool_timeout_s: float = 30.0
    tool_workers: int = 16


@dataclass
class _Sample:
    """One trajectory being built."""

    index: int
    prompt: list[int]
    tokens: list[int] = field(default_factory=list)
    model: list[bool] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    routing: Tensor | None = None  # (len(prompt) + budget, L, K) int16, -1 until known
    assistant_turns: int = 0
    user_turns: int = 0
    calls: int = 0
    errors: int = 0
    latencies: list[float] = field(default_factory=list)
    tool_reward: float = 0.0
    created: set[str] = field(default_factory=set)
    instance_id: str = ""
    done: bool = False


def _chat_prefix(tokenizer: Any) -> str:
    """The text the chat template renders before any message (dropped from each tool turn, as verl does)."""
    try:
        return str(tokenizer.apply_chat_template([{}], add_generation_prompt=False, tokenize=False))
    except Exception:  # a template that refuses an empty message renders nothing to drop
        return ""


def tool_turn_ids(tokenizer: Any, content: str, prefix: str | None = None) -> list[int]:
    """Token ids of a tool message carrying `content`, as the chat template renders it (its raw text without one)."""
    text = content
    if getattr(tokenizer, "chat_template", None):
        # Rendered as text, then tokenized: what apply_chat_template(tokenize=True) returns differs across versions.
        text = str(
            tokenizer.apply_chat_template(
                [{"role": "tool", "content": content}], add_generation_prompt=True, tokenize=False
            )
        )
        prefix = _chat_prefix(tokenizer) if prefix is None else prefix
        if prefix and text.startswith(prefix):
            text = text[len(prefix) :]
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


class AgentLoop:
    """Multi-turn sampling with tools over a rollout engine; `run` returns what the engine's `generate` returns."""

    def __init__(
        self,
        engine: GenerationEngine,
        tokenizer: Any,
        tools: dict[str, Tool],
        call_format: CallFormat,
        settings: AgentLoopSettings = AgentLoopSettings(),
    ) -> None:
        if not tools:
            raise ValueError(
                "AgentLoop needs at least one tool (actor_rollout_ref.rollout.multi_turn.tool_config_path)"
            )
        if not engine.capabilities.stop_sequences:
            raise ValueError(
                f"AgentLoop: {type(engine).__name__} does not stop at token sequences, which ends a turn "
                "at a tool call; use an engine that does (actor_rollout_ref.rollout.name)"
            )
        self.engine = engine
        self.tokenizer = tokenizer
        self.tools = tools
        self.format = call_format
        self.settings = settings
        self.pad = engine.pad_token_id
        self.eos = engine.eos_token_id
        self.stop_sequences = tuple(
            tuple(tokenizer(t, add_special_tokens=False)["input_ids"]) for t in call_format.stop_texts
        )
        self._prefix = _chat_prefix(tokenizer) if getattr(tokenizer, "chat_template", None) else ""
        self._lock = threading.Lock()
        self._calls = 0  # instance ids unique over the loop's life

    # ------------------------------------------------------------------ the loop
    def run(
        self,
        input_ids: Tensor,
        attention_mask: Tensor,
        params: SamplingParams,
        *,
        generator: torch.Generator | None = None,
        vision: VisionBatch | None = None,
    ) -> GenerationOutput:
        """Trajectories for left-padded prompts (B, P): `generate`'s fields plus `metrics` and per-sample
        `tool_rewards`.

        `params.max_new_tokens` is the whole trajectory's budget; the loop adds its tool-call stop sequences.
        `vision`: the prompts' images and M-RoPE positions (a vision-language policy); every turn's context is
        the prompt with its pixels, then the trajectory so far at the positions the trainer's forward gives it.
        """
        ids, mask = input_ids.cpu(), attention_mask.cpu().bool()
        samples = [_Sample(i, ids[i][mask[i]].tolist()) for i in range(ids.shape[0])]
        budget = int(params.max_new_tokens)
        capture_routing = params.capture_routing
        sampling = (params.replace(stop_sequences=params.stop_sequences + self.stop_sequences), generator)
        try:
            while True:
                active = [s for s in samples if not s.done]
                if not active:
                    break
                calls = self._model_turn(active, budget, capture_routing, sampling, vision)
                if calls:
                    self._tool_turn(calls, budget)
        finally:
            for s in (s for s in samples if s.created):
                for message in release_all(self.tools, self._instance_id(s), s.created):
                    logger.warning("sample %d: %s", s.index, message)
        return self._assemble(samples, ids.shape[1], capture_routing, input_ids.device)

    def _instance_id(self, s: _Sample) -> str:
        """The id a stateful tool knows this trajectory by, unique over the loop's life."""
        if not s.instance_id:
            with self._lock:
                self._calls += 1
                s.instance_id = f"traj-{self._calls}"
        return s.instance_id

    def _model_turn(
        self,
        active: list[_Sample],
        budget: int,
        capture_routing: bool,
        sampling: tuple[SamplingParams, torch.Generator | None],
        vision: VisionBatch | None = None,
    ) -> list[tuple[_Sample, ToolCall | None, str | None]]:
        """One turn of every active sample; the (sample, call, parse error) of those that called a tool."""
        contexts = [s.prompt + s.tokens for s in active]
        width = max(len(c) for c in contexts)
        batch_ids = torch.full((len(active), width), self.pad, dtype=torch.long)
        batch_mask = torch.zeros((len(active), width), dtype=torch.long)
        for row, ctx in enumerate(contexts):
            batch_ids[row, width - len(ctx) :] = torch.tensor(ctx, dtype=torch.long)
            batch_mask[row, width - len(ctx) :] = 1
        left = [budget - len(s.tokens) for s in active]
        params, generator = sampling
        extra = {}
        if vision is not None:
            extra["vision"] = self._context_vision(vision, active, batch_ids, width)
        out = self.engine.generate(
            batch_ids, batch_mask, params.replace(max_new_tokens=max(left)), generator=generator, **extra
        )
        responses = out["responses"].cpu()
        lengths = out["response_mask"].sum(-1).cpu().tolist()
        log_probs = out["rollout_log_probs"].cpu()
        routed = out.get("routed_experts")
        routed = routed.cpu() if routed is not None else None
        calls = []
        for row, s in enumerate(active):
            n = min(int(lengths[row]), left[row])
            new = responses[row, :n].tolist()
            ctx_len = len(contexts[row])
            if routed is not None:
                self._record_routing(s, routed[row], width, ctx_len, n)
            s.tokens.extend(new)
            s.model.extend([True] * n)
            s.log_probs.extend(log_probs[row, :n].tolist())
            s.assistant_turns += 1
            st = self.settings
            if (
                len(s.tokens) >= budget
                or (st.max_assistant_turns is not None and s.assistant_turns >= st.max_assistant_turns)
                or (st.max_user_turns is not None and s.user_turns >= st.max_user_turns)
            ):
                s.done = True
                continue
            text = self.tokenizer.decode(new, skip_special_tokens=True)
            try:
                call, problem = self.format.parse(text), None
            except ToolCallError as err:
                call, problem = None, str(err)
            if call is None and problem is None:
                s.done = True  # no call: the model has answered
                continue
            calls.append((s, call, problem))
        return calls

    def _context_vision(self, vision: VisionBatch, active: list[_Sample], batch_ids: Tensor, width: int) -> VisionBatch:
        """The images of this turn's contexts: each sample's prompt with its pixels, then its trajectory so far as the
        trainer's forward places and feeds a response (`context_vision`)."""
        config = getattr(getattr(self.engine, "model", None), "config", None)
        if config is None:
            raise ValueError(
                f"AgentLoop: {type(self.engine).__name__} holds no Hugging Face model to read the vision token ids "
                "from; trajectories over images run on the hf engine (actor_rollout_ref.rollout.name=hf)"
            )
        rows = []
        for s in active:
            own = vision.rows([s.index])
            grids = own.image_grid_thw.tolist() if own.image_grid_thw is not None else []
            rows.append((own.pixel_values, grids, len(s.prompt), len(s.prompt) + len(s.tokens)))
        out = context_vision(rows, batch_ids, config)  # the pixels stay where the batch's are; the rest moves there
        device = vision.positions.device
        grids = None if out.image_grid_thw is None else out.image_grid_thw.to(device)
        return replace(
            out, image_grid_thw=grids, positions=out.positions.to(device), rope_delta=out.rope_delta.to(device)
        )

    def _record_routing(self, s: _Sample, routed: Tensor, width: int, ctx_len: int, n: int) -> None:
        """Copy this turn's routing into `s`: context positions not yet known, then the turn's own tokens."""
        if s.routing is None:
            budget_len = len(s.prompt) + routed.shape[0]  # enough for any trajectory of this budget
            s.routing = torch.full((budget_len, *routed.shape[1:]), -1, dtype=torch.int16)
        need = len(s.prompt) + len(s.tokens) + n
        if s.routing.shape[0] < need:
            grow = torch.full((need - s.routing.shape[0], *s.routing.shape[1:]), -1, dtype=torch.int16)
            s.routing = torch.cat([s.routing, grow])
        start = width - ctx_len  # the context's first column in this turn's left-padded batch
        ctx_part = routed[start:width].to(torch.int16)
        # Prompt and model tokens take their first record (the previous turn's last token gets its first here);
        # tool tokens stay -1: only the model's tokens carry routing.
        is_model = torch.tensor([True] * len(s.prompt) + s.model, dtype=torch.bool)
        unknown = (s.routing[:ctx_len] < 0).all(dim=-1).all(dim=-1) & is_model
        s.routing[:ctx_len][unknown] = ctx_part[unknown]
        s.routing[ctx_len : ctx_len + n] = routed[width : width + n].to(torch.int16)

    def _tool_turn(self, calls: list[tuple[_Sample, ToolCall | None, str | None]], budget: int) -> None:
        """Run the round's calls at once, then append each answer to its sample (an error text when it failed)."""
        st = self.settings
        jobs = [(s, call) for s, call, problem in calls if call is not None]
        results = self._run_calls(jobs)
        for s, _call, problem in calls:
            if problem is not None:
                result = ToolResult(f"error: {problem}", 0.0, problem, 0.0)
            else:
                result = results[s.index]
            s.calls += 1
            s.latencies.append(result.latency_s)
            if result.error is not None:
                s.errors += 1
                logger.debug("sample %d: tool call failed: %s", s.index, result.error)
            s.tool_reward += result.reward
            text = truncate_text(result.text, st.max_tool_response_length, st.tool_response_truncate_side)
            ids = tool_turn_ids(self.tokenizer, self.format.response_content(text), self._prefix)
            room = budget - len(s.tokens)
            if len(ids) >= room:
                ids, s.done = ids[:room], True  # no room left for the model to answer
            s.tokens.extend(ids)
            s.model.extend([False] * len(ids))
            s.log_probs.extend([0.0] * len(ids))
            s.user_turns += 1

    def _run_calls(self, jobs: list[tuple[_Sample, ToolCall]]) -> dict[int, ToolResult]:
        """Results by sample index: up to `tool_workers` calls at once, each given `tool_timeout_s` from its start.

        Each call runs in its own daemon thread (`conveyor.deadline`): one that times out is abandoned (a thread
        cannot be stopped) and frees its slot, so tools that hang cannot starve the calls after them, in this round
        or later ones.
        """
        st = self.settings

        def one(s: _Sample, call: ToolCall) -> ToolResult:
            started = time.perf_counter()
            try:
                return call_with_deadline(
                    run_call,
                    self.tools,
                    call,
                    self._instance_id(s),
                    s.created,
                    timeout_s=st.tool_timeout_s,
                    what=f"tool {call.name!r}",
                    key=_TIMEOUT_KEY,
                    thread_name=f"tool-{call.name}",
                )
            except DeadlineExceeded:
                message = f"tool {call.name!r} timed out after {st.tool_timeout_s:g}s"
                return ToolResult(f"error: {message}", 0.0, message, time.perf_counter() - started)

        if not jobs:
            return {}
        with ThreadPoolExecutor(max_workers=min(st.tool_workers, len(jobs)), thread_name_prefix="tool-slot") as pool:
            futures = {s.index: pool.submit(one, s, call) for s, call in jobs}
        return {index: future.result() for index, future in futures.items()}

    # ------------------------------------------------------------------ output
    def _assemble(
        self, samples: list[_Sample], prompt_width: int, capture_routing: bool, device: torch.device
    ) -> GenerationOutput:
        """The `generate` fields over all trajectories, right-padded to the longest, plus metrics."""
        batch = len(samples)
        width = max(1, max(len(s.tokens) for s in samples))
        responses = torch.full((batch, width), self.pad, dtype=torch.long)
        model_mask = torch.zeros((batch, width), dtype=torch.bool)
        log_probs = torch.zeros((batch, width), dtype=torch.float32)
        for i, s in enumerate(samples):
            n = len(s.tokens)
            responses[i, :n] = torch.tensor(s.tokens, dtype=torch.long)
            model_mask[i, :n] = torch.tensor(s.model, dtype=torch.bool)
            log_probs[i, :n] = torch.tensor(s.log_probs, dtype=torch.float32)
        routed = None
        routed_rows = [s.routing for s in samples if s.routing is not None]
        if capture_routing and routed_rows:
            shape = routed_rows[0].shape[1:]
            routed = torch.full((batch, prompt_width + width, *shape), -1, dtype=torch.int16)
            prompt_mask = torch.zeros((batch, prompt_width), dtype=torch.bool)
            for i, s in enumerate(samples):
                assert s.routing is not None
                p, n = len(s.prompt), min(len(s.tokens), s.routing.shape[0] - len(s.prompt))
                prompt_mask[i, prompt_width - p :] = True
                routed[i, prompt_width - p : prompt_width + n] = s.routing[: p + n]
            # The engines' rule, over the trajectory's span: its last model token was never fed.
            routed = mask_unfed_routing(routed, prompt_mask, response_span(model_mask).sum(-1))
        out = GenerationOutput(
            responses=responses, response_mask=model_mask, rollout_log_probs=log_probs, routed_experts=routed
        ).to(device)
        return out.replace(
            tool_rewards=torch.tensor([s.tool_reward for s in samples], dtype=torch.float32),
            metrics=self._metrics(samples, model_mask, responses),
        )

    def _metrics(self, samples: list[_Sample], model_mask: Tensor, responses: Tensor) -> dict[str, float]:
        """rollout/multi_turn/* of one call, as @sum/@count pairs (reduced over ranks by sample or call counts)."""
        n = float(len(samples))
        calls = float(sum(s.calls for s in samples))
        errors = float(sum(s.errors for s in samples))
        latencies = [x for s in samples for x in s.latencies]
        span = response_span(model_mask)
        p = "rollout/multi_turn"
        m = {
            f"{p}/assistant_turns@sum": float(sum(s.assistant_turns for s in samples)),
            f"{p}/assistant_turns@count": n,
            f"{p}/tool_calls@sum": calls,
            f"{p}/tool_calls@count": n,
            f"{p}/tool_call_rate@sum": float(sum(1 for s in samples if s.calls)),
            f"{p}/tool_call_rate@count": n,
            f"{p}/tool_errors@sum": errors,
            f"{p}/model_token_frac@sum": float(model_mask.sum()),
            f"{p}/model_token_frac@count": float(span.sum()),
            f"{p}/turns@sum": float(sum(s.assistant_turns + s.user_turns for s in samples)),
            f"{p}/turns@count": n,
            f"{p}/tool_reward@sum": math.fsum(s.tool_reward for s in samples),
            f"{p}/tool_reward@count": n,
        }
        if calls:
            m[f"{p}/tool_error_rate@sum"] = errors
            m[f"{p}/tool_error_rate@count"] = calls
            m[f"{p}/tool_latency_s@sum"] = math.fsum(latencies)
            m[f"{p}/tool_latency_s@count"] = float(len(latencies))
            m[f"{p}/tool_latency_s_max"] = max(latencies)
        return m


def build_agent_loop(multi_turn: Any, rollout: GenerationEngine, tokenizer: Any) -> AgentLoop | None:
    """The agent loop of `actor_rollout_ref.rollout.multi_turn` (a MultiTurnConfig), or None when it is off."""
    if not multi_turn.enable:
        return None
    from conveyor.tools.base import load_tools
    from conveyor.tools.formats import get_format

    settings = AgentLoopSettings(
        max_assistant_turns=multi_turn.max_assistant_turns,
        max_user_turns=multi_turn.max_user_turns,
        max_tool_response_length=multi_turn.max_tool_response_length,
        tool_response_truncate_side=multi_turn.tool_response_truncate_side,
        tool_timeout_s=multi_turn.tool_timeout_s,
        tool_workers=multi_turn.tool_workers,
    )
    return AgentLoop(
        rollout, tokenizer, load_tools(multi_turn.tool_config_path), get_format(multi_turn.format), settings
    )


def build_rollout_loop(rollout_cfg: Any, engine: GenerationEngine, tokenizer: Any, model_path: str = "") -> Any:
    """What drives the engine past one call per batch: the agent gateway (`rollout.agent`), the tool loop
    (`rollout.multi_turn`), or None for plain generation."""
    if rollout_cfg.agent.enabled:
        from conveyor.models.vision import vision_processor
        from conveyor.rollout.gateway.loop import build_gateway_loop

        name = model_path.rstrip("/").rsplit("/", 1)[-1] if model_path else ""
        config = getattr(getattr(engine, "model", None), "config", None)
        vision = vision_processor(model_path, tokenizer, config) if model_path else None
        return build_gateway_loop(
            rollout_cfg.agent, rollout_cfg.multi_turn, engine, tokenizer, name or "conveyor-policy", vision
        )
    return build_agent_loop(rollout_cfg.multi_turn, engine, tokenizer)
