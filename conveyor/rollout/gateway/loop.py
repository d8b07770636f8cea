"""The gateway rollout: one agent session per sample, served by the run's engine, recorded token for token.

`GatewayLoop.run` takes what the multi-turn loop takes (left-padded prompts,
`SamplingParams`, a generator) plus each row's task (its dataset row), and
returns the same `GenerationOutput`: for every session, the samples its calls
made (`trajectory.py`), each laid out as a row after the batch's prompt
columns. A session whose calls all extend one another is one row, exactly
where the built-in loop would put it; a session cut into k samples is k rows
(`source_rows` says which input row each came from), all carrying the
session's reward.

How the engine is driven. The agents run in their own processes (or
threads); their requests arrive on the server's threads and queue here. The
trainer's thread runs the engine: it takes a batch as soon as every running
session has a request waiting (the round rule: with agents that answer
promptly, each batch is exactly the built-in loop's round, in session order,
so the same generator draws the same tokens), or when the oldest request has
waited `batch_wait_s` (so one slow agent delays the others by at most that).
Requests with other stop texts are generated in separate calls.

The reward of a session, first that applies: the last line of the agent's
standard output as `{"reward": x}` (a callable's return value); a `POST
{"reward": x}` to its `/reward` before it ended; the task's reward function
on the session's last completion (the reward stage applies it: the rows
carry `agent_reward` NaN and the text in `agent_completion`). A session that
fails (non-zero exit, timeout, an error) scores `agent.failure_reward`
instead, when that is set. Every outcome and reward source is counted under
`rollout/agent/*`.

What it deliberately does not do: score, or talk to the data plane (the
worker writes the rows).
"""

from __future__ import annotations

import logging
import math
import os
import secrets
import threading
import time
from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from conveyor.algos.trajectory import response_span
from conveyor.models.vision import VisionBatch, context_vision, mrope_positions
from conveyor.rollout.base import GenerationEngine, GenerationOutput, SamplingParams, mask_unfed_routing
from conveyor.rollout.gateway import agents
from conveyor.rollout.gateway.server import GatewayServer, Request
from conveyor.rollout.gateway.session import GatewayError, Renderer, Session
from conveyor.rollout.gateway.trajectory import TASK_FIELDS, UNKNOWN_VERSION, Call, Row, SessionTrajectories, layout
from conveyor.tools.formats import CallFormat

logger = logging.getLogger(__name__)

__all__ = ["GatewaySettings", "GatewayLoop", "build_gateway_loop", "TASK_FIELDS"]


@dataclass(frozen=True)
class GatewaySettings:
    """`actor_rollout_ref.rollout.agent`, as the loop uses it."""

    command: str | None = None
    callable: Any = None  # "module:function" / "file.py:function", or the function itself
    timeout_s: float = 600.0
    term_grace_s: float = 2.0
    max_concurrent: int = 64
    host: str = "127.0.0.1"
    port: int = 0
    api_key: str | None = None
    batch_wait_s: float = 0.5
    failure_reward: float | None = 0.0
    model_name: str = "conveyor-policy"


class GatewayLoop:
    """Agent sessions over one rank's engine through an OpenAI-compatible server; `run` returns the rows."""

    needs_tasks = True  # the worker hands `run` each row's task

    def __init__(
        self,
        engine: GenerationEngine,
        tokenizer: Any,
        call_format: CallFormat,
        settings: GatewaySettings,
        vision: Any = None,
    ):
        if not engine.capabilities.stop_sequences:
            raise ValueError(
                f"actor_rollout_ref.rollout.agent: {type(engine).__name__} does not stop at token sequences, which "
                "a request's stop texts need; use an engine that does (actor_rollout_ref.rollout.name)"
            )
        if (settings.command is None) == (settings.callable is None):
            raise ValueError("actor_rollout_ref.rollout.agent: give exactly one of command and callable")
        self.engine, self.tokenizer, self.settings = engine, tokenizer, settings
        self.argv = agents.split_command(settings.command) if settings.command else None
        self.fn = None
        if callable(settings.callable):  # a function handed over directly (from Python, not from a config)
            self.fn = settings.callable
        elif settings.callable:
            from conveyor.user_code import user_attribute

            source, _, name = settings.callable.rpartition(":")
            self.fn = user_attribute(
                source, name, key="actor_rollout_ref.rollout.agent.callable", kind="function", must_be_callable=True
            )
        self.api_key = settings.api_key or f"conveyor-{secrets.token_hex(16)}"
        # A vision-language policy's image processor (`conveyor.models.vision.VisionProcessor`): requests' image parts
        # are its images, fed with the prompt's pixels at their M-RoPE positions.
        self.renderer = Renderer(tokenizer, call_format, vision)
        self._model_config = None
        if vision is not None:
            self._model_config = getattr(getattr(engine, "model", None), "config", None)
            if self._model_config is None:
                raise ValueError(
                    f"actor_rollout_ref.rollout.agent: {type(engine).__name__} holds no Hugging Face model to read the "
                    "vision token ids from; a vision-language policy's agents run on the hf engine"
                )
        self.cwd = os.getcwd()  # the directory the run started in
        self.pad = int(engine.pad_token_id)
        self._cond = threading.Condition()
        self._pending: list[Request] = []
        self._engine_s, self._engine_calls = 0.0, 0
        self._warned: set[str] = set()  # the failure kinds already logged as warnings
        self._live: set[str] = set()
        self._prompt_width = 0
        self._budget = 0
        # One pool for the run's sessions: its threads start once, not every rollout (a thread's start waits for the
        # thread to be scheduled, which on a busy machine is most of a millisecond, 64 of them before the first call).
        self._pool = ThreadPoolExecutor(max_workers=max(1, settings.max_concurrent), thread_name_prefix="agent")
        self.server = GatewayServer(
            self.renderer,
            api_key=self.api_key,
            model_name=settings.model_name,
            submit=self._submit,
            prompt_width=lambda: self._prompt_width,
            budget=lambda: self._budget,
            host=settings.host,
            port=settings.port,
        )
        # In-process agents' HTTP clients log every request at INFO under the run's logging: keep them to warnings.
        for name in ("httpx", "httpx2", "httpcore", "httpcore2", "openai", "uvicorn", "uvicorn.error"):
            if logging.getLogger(name).level == logging.NOTSET:
                logging.getLogger(name).setLevel(logging.WARNING)
        self.server.start()
        logger.info(
            "agent gateway listening on http://%s:%d (sessions under /sessions/<id>/v1)",
            self.server.host,
            self.server.port,
        )

    def close(self) -> None:
        """Stop the server and the sessions' pool."""
        self.server.close()
        self._pool.shutdown(wait=False, cancel_futures=True)

    # ------------------------------------------------------------------ requests in
    def _submit(self, req: Request) -> None:
        with self._cond:
            if not req.session.open:
                req.future.set_exception(
                    GatewayError(404, f"no running session {req.session.id!r}", kind="not_found_error")
                )
                return
            self._pending.append(req)
            # The batcher sleeps until a batch is due: woken by the request that starts the wait or completes the
            # round, not by every one (each wake takes the GIL from the server's and the agents' threads).
            if len(self._pending) == 1 or self._ready():
                self._cond.notify_all()

    def _wake(self, _: Any = None) -> None:
        """Wake the batcher (a session ended: the round or the rollout may be complete)."""
        with self._cond:
            self._cond.notify_all()

    def _ready(self) -> bool:
        """The round rule: every running session has a request waiting, or the oldest has waited long enough."""
        if not self._pending:
            return False
        if len(self._pending) >= len(self._live) and self._live <= {r.session.id for r in self._pending}:
            return True
        return time.monotonic() >= self._due()

    def _due(self) -> float:
        """When the oldest waiting request's batch is due at the latest (monotonic seconds)."""
        return self._pending[0].arrived + self.settings.batch_wait_s  # requests queue in arrival order

    # ------------------------------------------------------------------ the run
    def run(
        self,
        input_ids: Tensor,
        attention_mask: Tensor,
        params: SamplingParams,
        *,
        generator: torch.Generator | None = None,
        tasks: list[dict] | None = None,
        vision: VisionBatch | None = None,
    ) -> GenerationOutput:
        """One session per row of `input_ids` (B, P), its agent given `tasks[row]`; the rows of every session's
        samples (`params.max_new_tokens` is each sample's response budget). `vision`: the prompts' images (a
        vision-language policy), which the row of a session that never called keeps."""
        if tasks is None or len(tasks) != input_ids.shape[0]:
            raise ValueError("GatewayLoop.run needs one task per prompt row")
        ids, mask = input_ids.cpu(), attention_mask.cpu().bool()
        width = ids.shape[1]
        self._prompt_width, self._budget = width, int(params.max_new_tokens)
        self._engine_s, self._engine_calls = 0.0, 0
        sessions = []
        for i, task in enumerate(tasks):
            sid = f"s{secrets.token_hex(8)}"
            # A vision-language policy's images belong to a sample's first prompt (SessionTrajectories).
            cuts = SessionTrajectories(self.renderer.vision.image_token_id if self.renderer.vision else None)
            prompt = ids[i][mask[i]].tolist()
            sessions.append(Session(sid, i, task["agent_task"], prompt, task["raw_prompt"], trajectories=cuts))
        results: dict[str, agents.AgentResult] = {}
        stop = threading.Event()
        t0 = time.perf_counter()
        futures: list[Future] = []
        with self._cond:
            # The sessions that start at once are live from now, not from when a pool thread gets to them: the round
            # rule must not run a batch before a session that is about to ask has started.
            self._live.update(s.id for s in sessions[: max(1, self.settings.max_concurrent)])
        try:
            futures = [self._pool.submit(self._session, s, results, stop) for s in sessions]
            for f in futures:
                f.add_done_callback(self._wake)  # the last session's end ends the rollout at once
            self._serve_until_done(futures, params, generator)
        finally:
            stop.set()
            with self._cond:
                for r in self._pending:
                    r.future.set_exception(GatewayError(404, "the rollout ended", kind="not_found_error"))
                self._pending.clear()
            for f in futures:
                f.cancel()  # sessions not started yet do not start
            wait(futures)
            with self._cond:
                self._live.difference_update(s.id for s in sessions)
            for s in sessions:
                self.server.remove(s)
        elapsed = time.perf_counter() - t0
        return self._assemble(sessions, results, width, params, input_ids.device, elapsed, vision)

    def _session(self, session: Session, results: dict, stop: threading.Event) -> None:
        """Run one session's agent to its end (on a pool thread): live while its agent runs."""
        if stop.is_set():
            results[session.id] = agents.AgentResult(agents.ERROR, None, 0.0, stderr_tail="the rollout ended")
            with self._cond:
                self._live.discard(session.id)
                self._cond.notify_all()
            return
        self.server.add(session)
        with self._cond:
            self._live.add(session.id)
        base_url = self.server.base_url(session.id)
        try:
            if self.argv is not None:
                env = dict(os.environ)
                env.update(OPENAI_BASE_URL=base_url, OPENAI_API_KEY=self.api_key, CONVEYOR_SESSION_ID=session.id)
                result = agents.run_command(
                    self.argv,
                    env=env,
                    task=session.task,
                    timeout_s=self.settings.timeout_s,
                    term_grace_s=self.settings.term_grace_s,
                    cwd=self.cwd,
                    stop=stop,
                )
            else:
                result = agents.run_callable(
                    self.fn,
                    base_url=base_url,
                    api_key=self.api_key,
                    task=session.task,
                    timeout_s=self.settings.timeout_s,
                )
        finally:
            self.server.remove(session)
            with self._cond:
                self._live.discard(session.id)
                # A request of this session still waiting is answered 404: its agent is gone.
                keep = []
                for r in self._pending:
                    if r.session is session:
                        r.future.set_exception(GatewayError(404, "the session ended", kind="not_found_error"))
                    else:
                        keep.append(r)
                self._pending = keep
                self._cond.notify_all()
        results[session.id] = result
        if result.outcome != agents.OK:
            # The first failure of each kind is said, with what the agent last wrote to stderr; the rest are counted.
            log = logger.debug if result.outcome in self._warned else logger.warning
            self._warned.add(result.outcome)
            log(
                "agent session %s: %s (exit code %s; counted under rollout/agent/%s, further ones logged at debug "
                "level)%s",
                session.id,
                result.outcome,
                result.exit_code,
                result.outcome,
                f"; its last error output:\n{result.stderr_tail[-1500:]}" if result.stderr_tail else "",
            )

    def _serve_until_done(self, futures: list, params: SamplingParams, generator: torch.Generator | None) -> None:
        """Run the engine over waiting requests until every session has ended."""
        while True:
            with self._cond:
                while not self._ready():
                    if not self._pending and not self._live and all(f.done() for f in futures):
                        for f in futures:
                            f.result()  # a failure of the session machinery itself is the run's
                        return
                    # Until the oldest request is due, or a request or a session's end wakes it.
                    due = self._due() - time.monotonic() if self._pending else 0.05
                    self._cond.wait(timeout=max(0.0, min(due, 0.05)))
                batch, self._pending = self._pending, []
            self._generate(batch, params, generator)

    def _generate(self, batch: list[Request], params: SamplingParams, generator: torch.Generator | None) -> None:
        """One engine call per distinct set of stop texts over `batch`, rows in session order; answers each."""
        groups: dict[tuple, list[Request]] = {}
        for r in sorted(batch, key=lambda r: (r.session.index, r.arrived)):
            groups.setdefault(r.stop, []).append(r)
        for stops, reqs in groups.items():
            try:
                self._generate_group(reqs, params.replace(stop_sequences=params.stop_sequences + stops), generator)
            except Exception as err:
                for r in reqs:
                    if not r.future.done():
                        r.future.set_exception(err)
                raise

    def _generate_group(self, reqs: list[Request], params: SamplingParams, generator: torch.Generator | None) -> None:
        width = max(len(r.prompt) for r in reqs)
        batch_ids = torch.full((len(reqs), width), self.pad, dtype=torch.long)
        batch_mask = torch.zeros((len(reqs), width), dtype=torch.long)
        for row, r in enumerate(reqs):
            batch_ids[row, width - len(r.prompt) :] = torch.tensor(r.prompt, dtype=torch.long)
            batch_mask[row, width - len(r.prompt) :] = 1
        extra = {}
        if self._model_config is not None:
            extra["vision"] = self._vision_batch(reqs, batch_ids)
        t0 = time.perf_counter()
        out = self.engine.generate(
            batch_ids,
            batch_mask,
            params.replace(max_new_tokens=max(r.max_new_tokens for r in reqs)),
            generator=generator,
            **extra,
        )
        self._engine_s += time.perf_counter() - t0
        self._engine_calls += 1
        responses = out["responses"].cpu()
        lengths = out["response_mask"].sum(-1).cpu().tolist()
        log_probs = out["rollout_log_probs"].cpu()
        routed = out.get("routed_experts")
        routed = routed.cpu() if routed is not None else None
        version = self.engine.weights_version  # what sampled this call (weights change only between engine calls)
        for row, r in enumerate(reqs):
            n = min(int(lengths[row]), r.max_new_tokens)
            routing = None
            if routed is not None:
                routing = routed[row, width - len(r.prompt) : width + n].to(torch.int16)
                if n < int(lengths[row]) and n > 0:  # cut short here: its last kept token was never fed
                    routing[-1] = -1
            call = Call(
                tuple(r.prompt),
                tuple(responses[row, :n].tolist()),
                tuple(log_probs[row, :n].tolist()),
                routing,
                version,
                r.images,
            )
            with r.session.lock:
                # The text the sample's tokens now stand for ends with the completion as sampled, EOS included: a
                # template that writes its own end-of-turn marker there extends it, one that writes none does not.
                r.session.record(call, r.text, self.renderer.decode(call.completion, raw=True) if r.text else "")
                r.session.last_completion = self.renderer.decode(call.completion)
            r.future.set_result(call)

    def _vision_batch(self, reqs: list[Request], batch_ids: Tensor) -> VisionBatch:
        """The group's images and M-RoPE positions: each prompt's first prompt (its sample's) with its pixels, then
        what followed it as the trainer places and feeds a response (`context_vision`)."""
        rows = []
        for r in reqs:
            own_pixels, own_grids = r.images if r.images is not None else (None, [])
            rows.append((own_pixels, own_grids, r.head, len(r.prompt)))
        return context_vision(rows, batch_ids, self._model_config)

    # ------------------------------------------------------------------ rows out
    def _version(self) -> int:
        """The engine's weights version now, as a token's policy version."""
        v = self.engine.weights_version
        return UNKNOWN_VERSION if v is None else int(v)

    def _assemble(
        self,
        sessions: list[Session],
        results: dict[str, agents.AgentResult],
        width: int,
        params: SamplingParams,
        device: torch.device,
        elapsed: float,
        vision: VisionBatch | None = None,
    ) -> GenerationOutput:
        rows: list[tuple[Session, Any]] = []
        for s in sessions:
            samples = s.trajectories.samples or [None]  # an agent that never called: one empty row
            rows.extend((s, sample) for sample in samples)
        now = self._version()
        laid = []
        for s, sample in rows:
            if sample is None:
                laid.append(Row(list(s.prompt_ids), [], [], [], [], len(s.prompt_ids)))
            else:
                laid.append(layout(sample, width, self.pad))
        resp_width = max(1, max(len(x.response) for x in laid))
        b = len(rows)
        prompts = torch.full((b, width), self.pad, dtype=torch.long)
        prompt_mask = torch.zeros((b, width), dtype=torch.bool)
        responses = torch.full((b, resp_width), self.pad, dtype=torch.long)
        model_mask = torch.zeros((b, resp_width), dtype=torch.bool)
        log_probs = torch.zeros((b, resp_width), dtype=torch.float32)
        versions = torch.full((b, resp_width), now, dtype=torch.long)
        for i, row in enumerate(laid):
            prompt = row.prompt
            if len(prompt) < width:  # the empty row of a session that never called: its task's prompt
                prompt = [self.pad] * (width - len(prompt)) + prompt
            prompts[i] = torch.tensor(prompt, dtype=torch.long)
            prompt_mask[i, width - row.head :] = True
            n = len(row.response)
            responses[i, :n] = torch.tensor(row.response, dtype=torch.long)
            model_mask[i, :n] = torch.tensor(row.mask, dtype=torch.bool)
            log_probs[i, :n] = torch.tensor(row.log_probs, dtype=torch.float32)
            if n:  # padding takes the last call's version (versions only grow along a response)
                versions[i, :n] = torch.tensor(row.versions, dtype=torch.long)
                versions[i, n:] = row.versions[-1]
        routed = self._routing(rows, laid, width, resp_width, params, prompt_mask, model_mask)
        rewards, completions, metrics = self._rewards(sessions, results, rows, elapsed)
        seen = self._vision_fields(rows, laid, width, vision) if self._model_config is not None else {}
        return GenerationOutput(
            responses=responses,
            response_mask=model_mask,
            rollout_log_probs=log_probs,
            routed_experts=routed,
            prompts=prompts,
            prompt_mask=prompt_mask,
            source_rows=torch.tensor([s.index for s, _ in rows], dtype=torch.long),
            # Per row: its session's reward (NaN: the rule scores agent_completion), each response token's policy
            # version (the built-in rollout's field), and each of its calls as it happened (prompt and completion
            # token counts, weights version).
            sample_fields={
                "agent_reward": rewards,
                "token_policy_version": versions,
                "agent_completion": completions,
                "agent_calls": [list(sample.records) if sample is not None else [] for _, sample in rows],
                **seen,
            },
            metrics=metrics,
        ).to(device)

    def _vision_fields(self, rows, laid, width: int, vision: VisionBatch | None) -> dict[str, Any]:
        """`VISION_FIELDS` of the rows: each sample's first-prompt images, and the M-RoPE positions of the prompt
        columns it fills (the row of a session that never called keeps its task's)."""
        v = self.renderer.vision
        positions = torch.zeros((len(rows), 3, width), dtype=torch.long)
        deltas = torch.zeros(len(rows), dtype=torch.long)
        pixels: list[Any] = []
        grids: list[Tensor] = []
        for i, (s, sample) in enumerate(rows):
            if sample is None:
                if vision is None:
                    raise ValueError("GatewayLoop.run: a vision-language policy's prompts need their `vision`")
                own = vision.rows([s.index])
                pixels.append(own.pixel_values)
                grids.append(own.image_grid_thw if own.image_grid_thw is not None else torch.zeros(0, 3).long())
                positions[i], deltas[i] = own.positions[0].cpu(), own.rope_delta[0].cpu()
                continue
            own_pixels, own_grids = sample.images if sample.images is not None else (None, [])
            head = laid[i].head
            pos, delta = mrope_positions(laid[i].prompt[width - head :], own_grids, v.image_token_id, v.merge)
            positions[i, :, width - head :] = pos
            deltas[i] = delta
            pixels.append(own_pixels)
            grids.append(torch.tensor(own_grids, dtype=torch.long).view(-1, 3))
        return {"pixel_values": pixels, "image_grid_thw": grids, "mrope_positions": positions, "rope_delta": deltas}

    def _routing(self, rows, laid, width, resp_width, params, prompt_mask, model_mask) -> Tensor | None:
        """(B', P+R, L, K) routing of the rows, -1 where unknown, under the engines' rule."""
        shapes = [sample.routing.shape[1:] for _, sample in rows if sample is not None and sample.routing is not None]
        if not params.capture_routing or not shapes:
            return None
        routed = torch.full((len(rows), width + resp_width, *shapes[0]), -1, dtype=torch.int16)
        for i, (_s, sample) in enumerate(rows):
            if sample is None or sample.routing is None:
                continue
            head = laid[i].head
            n = min(head + len(laid[i].response), sample.routing.shape[0])
            routed[i, width - head : width - head + n] = sample.routing[:n]
        return mask_unfed_routing(routed, prompt_mask, response_span(model_mask).sum(-1))

    def _rewards(self, sessions, results, rows, elapsed) -> tuple[Tensor, list[str], dict[str, float]]:
        """Each row's session reward (NaN: the reward stage scores `agent_completion`), and rollout/agent/*."""
        fail = self.settings.failure_reward
        reward_of: dict[str, float] = {}
        sources: Counter = Counter()
        outcomes: Counter = Counter()
        for s in sessions:
            res = results.get(s.id) or agents.AgentResult(agents.ERROR, None, 0.0)
            outcomes[res.outcome] += 1
            if res.outcome != agents.OK and fail is not None:
                reward_of[s.id], source = float(fail), "failure"
            elif res.reward is not None:
                reward_of[s.id], source = res.reward, "stdout" if self.argv is not None else "return"
            elif s.posted_reward is not None:
                reward_of[s.id], source = s.posted_reward, "post"
            else:
                reward_of[s.id], source = math.nan, "rule"
            sources[source] += 1
        n = float(len(sessions))
        p = "rollout/agent"
        m: dict[str, float] = {f"{p}/sessions@sum": n}
        for name in (agents.OK, agents.EXIT_NONZERO, agents.TIMEOUT, agents.KILLED, agents.ERROR):
            m[f"{p}/{name}@sum"] = float(outcomes[name])
        for name in ("stdout", "return", "post", "rule", "failure"):
            m[f"{p}/reward_source_{name}@sum"] = float(sources[name])
        calls = [sum(x.calls for x in s.trajectories.samples) for s in sessions]
        m.update(
            {
                f"{p}/samples_per_session@sum": float(len(rows)),
                f"{p}/samples_per_session@count": n,
                f"{p}/calls_per_session@sum": float(sum(calls)),
                f"{p}/calls_per_session@count": n,
                f"{p}/no_call_sessions@sum": float(sum(1 for c in calls if c == 0)),
                f"{p}/bad_requests@sum": float(sum(s.bad_requests for s in sessions)),
                f"{p}/context_exceeded@sum": float(sum(s.context_exceeded for s in sessions)),
                f"{p}/unauthorized@sum": float(self.server.unauthorized),
                f"{p}/unknown_session@sum": float(self.server.unknown_session),
                f"{p}/session_time_s@sum": math.fsum(
                    (results.get(s.id).seconds if results.get(s.id) else 0.0) for s in sessions
                ),
                f"{p}/session_time_s@count": n,
                f"{p}/rollout_time_s": elapsed,
                # The engine's share of it; the rest is the agents' and the gateway's (HTTP, rendering, waiting).
                f"{p}/engine_time_s": self._engine_s,
                f"{p}/engine_calls": float(self._engine_calls),
            }
        )
        self.server.unauthorized = self.server.unknown_session = 0
        rewards = torch.tensor([reward_of[s.id] for s, _ in rows], dtype=torch.float32)
        completions = [s.last_completion for s, _ in rows]
        return rewards, completions, m


def build_gateway_loop(
    agent: Any, multi_turn: Any, engine: GenerationEngine, tokenizer: Any, model_name: str, vision: Any = None
) -> GatewayLoop | None:
    """The gateway of `actor_rollout_ref.rollout.agent` (an AgentConfig), or None when no agent is set (`vision`: a
    vision-language policy's `VisionProcessor`)."""
    if not agent.enabled:
        return None
    import dataclasses

    from conveyor.tools.formats import get_format

    # The config section's keys are the settings' own names (model_name: the config's, else the model path's).
    keys = {f.name: getattr(agent, f.name) for f in dataclasses.fields(GatewaySettings)}
    settings = GatewaySettings(**{**keys, "model_name": agent.model_name or model_name})
    return GatewayLoop(engine, tokenizer, get_format(multi_turn.format), settings, vision)
