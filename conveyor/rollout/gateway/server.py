"""The gateway's HTTP side: an OpenAI-compatible server, one base URL per session, in front of the run's engine.

Routes, under `/sessions/{id}`: `GET /v1/models`, `POST /v1/chat/completions`,
`POST /v1/completions` (each with `stream` as server-sent events), and
`POST /reward` (`{"reward": x}`). Every request must carry the run's key
(`Authorization: Bearer KEY`): without it 401, for a session that is not
running 404, with a field the gateway cannot honour 400 naming the field
(OpenAI's error body: `{"error": {"message", "type", "param", "code"}}`).

Sampling is the run's: temperature, top-p, top-k and the seed a request gives
are overridden (the response's `conveyor.overridden` lists them), since the
trainer scores every token under the run's own settings. `max_tokens` and
`stop` are honoured; `n` > 1, penalties, logit biases, response formats,
forced tool choices and top alternatives' log-probs are refused: the engine
samples one continuation of one distribution.

A request is turned into token ids here (`session.Renderer`), queued for the
batcher (`GatewayLoop`, which runs the engine on the trainer's thread) and
answered when its completion is recorded. The server runs uvicorn on a thread
of its own, bound to loopback unless told otherwise.

What it deliberately does not do: run the engine, start agents or keep
anything past the session that made it.
"""

import asyncio
import json
import logging
import math
import socket
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from conveyor.rollout.gateway.session import GatewayError, Renderer, Session, served_key
from conveyor.rollout.gateway.trajectory import Call, Sample, room

logger = logging.getLogger(__name__)

__all__ = ["GatewayServer", "Request"]

# Fields a client may send that change nothing here (SDKs fill them in).
_IGNORED = frozenset(
    {
        "model",
        "user",
        "metadata",
        "store",
        "parallel_tool_calls",
        "stream_options",
        "service_tier",
        "prompt_cache_key",
        "safety_identifier",
    }
)
# The run fixes these (the trainer scores tokens under its own sampling): given, they are overridden and said so.
_RUN_FIXED = ("temperature", "top_p", "top_k", "min_p", "seed")


@dataclass
class Request:
    """One completion request, as the batcher takes it."""

    session: Session
    prompt: list[int]
    text: str | None  # the prompt's text where the gateway rendered it (it splices later prompts onto it)
    max_new_tokens: int
    stop: tuple[tuple[int, ...], ...]
    future: Future
    arrived: float
    # A vision-language policy's: the images of the sample's first prompt (pixel values or None, grids), and how many
    # of the prompt's tokens are that first prompt (the rest follows it, at text positions).
    images: tuple[Any, list[list[int]]] | None = None
    head: int = 0


class GatewayServer:
    """The HTTP server of one rank's gateway: sessions by id, the run's key, and a queue into the batcher."""

    def __init__(
        self,
        renderer: Renderer,
        *,
        api_key: str,
        model_name: str,
        submit: Callable[[Request], None],
        prompt_width: Callable[[], int],
        budget: Callable[[], int],
        host: str = "127.0.0.1",
        port: int = 0,
    ) -> None:
        self.renderer = renderer
        self.api_key = api_key
        self.model_name = model_name
        self.submit = submit
        self.prompt_width, self.budget = prompt_width, budget
        self.sessions: dict[str, Session] = {}
        self.lock = threading.Lock()
        self.unauthorized = 0  # requests without the run's key, all sessions
        self.unknown_session = 0  # requests for a session that is not running
        self._sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self._sock.bind((host, port))
        except OSError as err:
            self._sock.close()
            raise ValueError(
                f"actor_rollout_ref.rollout.agent.port: cannot listen on {host}:{port} ({err}); "
                "give a free port, or 0 to pick one"
            ) from None
        self._sock.listen(1024)
        self.host, self.port = host, self._sock.getsockname()[1]
        self._server: Any = None
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ life
    def start(self) -> None:
        """Serve on a thread of its own (returns once the server accepts connections)."""
        import importlib.util

        import uvicorn

        # The C parsers and loop where installed (uvicorn[standard]): a few hundred microseconds less per request.
        fast = {
            "http": "httptools" if importlib.util.find_spec("httptools") else "h11",
            "loop": "uvloop" if importlib.util.find_spec("uvloop") else "asyncio",
        }
        config = uvicorn.Config(
            self._app(), log_level="warning", access_log=False, lifespan="off", timeout_keep_alive=30, **fast
        )
        self._server = uvicorn.Server(config)
        self._server.install_signal_handlers = lambda: None  # the trainer owns the signals
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [self._sock]}, name="agent-gateway", daemon=True
        )
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the agent gateway did not start on {self.host}:{self.port}")
            time.sleep(0.01)

    def close(self) -> None:
        """Stop serving and release the port."""
        if self._server is not None:
            self._server.should_exit = True
            if self._thread is not None:
                self._thread.join(timeout=10)
            self._server = None
        self._sock.close()

    def base_url(self, session_id: str) -> str:
        """The OpenAI base URL of a session."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/sessions/{session_id}/v1"

    def add(self, session: Session) -> None:
        """Serve `session` from now on."""
        with self.lock:
            self.sessions[session.id] = session

    def remove(self, session: Session) -> None:
        """Stop serving `session`: its later requests get 404."""
        with self.lock:
            self.sessions.pop(session.id, None)
        session.open = False

    # ------------------------------------------------------------------ app
    def _app(self) -> Any:
        from fastapi import FastAPI
        from fastapi import Request as HttpRequest
        from fastapi.responses import JSONResponse, StreamingResponse

        app = FastAPI(title="conveyor agent gateway", docs_url=None, redoc_url=None, openapi_url=None)

        def error(err: GatewayError) -> JSONResponse:
            body = {"error": {"message": err.message, "type": err.kind, "param": err.param, "code": None}}
            return JSONResponse(body, status_code=err.status)

        async def entry(request: HttpRequest, sid: str, *, body: bool) -> tuple[Session, dict]:
            header = request.headers.get("authorization", "")
            if header != f"Bearer {self.api_key}":
                with self.lock:
                    self.unauthorized += 1
                raise GatewayError(
                    401,
                    "a request needs the run's key: Authorization: Bearer $OPENAI_API_KEY",
                    kind="authentication_error",
                )
            with self.lock:
                session = self.sessions.get(sid)
                if session is None:
                    self.unknown_session += 1
            if session is None or not session.open:
                raise GatewayError(404, f"no running session {sid!r}", kind="not_found_error")
            session.requests += 1
            if not body:
                return session, {}
            raw = await request.body()
            try:
                payload = json.loads(raw)
            except ValueError as err:
                session.bad_requests += 1
                raise GatewayError(400, f"the body is not JSON ({err})") from None
            if not isinstance(payload, dict):
                session.bad_requests += 1
                raise GatewayError(400, "the body must be a JSON object")
            return session, payload

        async def complete(session: Session, req: Request) -> Call:
            self.submit(req)
            try:
                return await asyncio.wrap_future(req.future)
            except GatewayError:
                raise
            except Exception as err:  # the engine failed: the run's problem, not the agent's
                raise GatewayError(500, f"generation failed: {err}", kind="server_error") from None

        @app.get("/sessions/{sid}/v1/models")
        async def models(request: HttpRequest, sid: str):
            try:
                await entry(request, sid, body=False)
            except GatewayError as err:
                return error(err)
            return {
                "object": "list",
                "data": [{"id": self.model_name, "object": "model", "created": 0, "owned_by": "conveyor"}],
            }

        @app.post("/sessions/{sid}/reward")
        async def reward(request: HttpRequest, sid: str):
            try:
                session, payload = await entry(request, sid, body=True)
                value = payload.get("reward")
                if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                    session.bad_requests += 1
                    raise GatewayError(400, 'the body must be {"reward": <a finite number>}', param="reward")
            except GatewayError as err:
                return error(err)
            session.posted_reward = float(value)
            return {"ok": True}

        async def serve(request: HttpRequest, sid: str, spec_of: Callable, body_of: Callable, events: Callable):
            try:
                session, payload = await entry(request, sid, body=True)
                try:
                    spec = spec_of(session, payload)
                except GatewayError:
                    session.bad_requests += 1
                    raise
                call = await complete(session, spec["request"])
            except GatewayError as err:
                return error(err)
            body = body_of(session, spec, call)
            if spec["stream"]:
                return StreamingResponse(events(body), media_type="text/event-stream")
            return JSONResponse(body)  # plain JSON already: FastAPI's encoder would walk every token id again

        @app.post("/sessions/{sid}/v1/chat/completions")
        async def chat(request: HttpRequest, sid: str):
            return await serve(request, sid, self._chat_spec, self._chat_body, _chat_events)

        @app.post("/sessions/{sid}/v1/completions")
        async def completions(request: HttpRequest, sid: str):
            return await serve(request, sid, self._completion_spec, self._completion_body, _completion_events)

        return app

    # ------------------------------------------------------------------ requests
    def _common(self, payload: dict, allowed: set[str]) -> tuple[list[str], tuple, bool]:
        """Checks shared by both endpoints: refused fields, overridden ones, stop sequences, stream."""
        for key, value in payload.items():
            if key in allowed or key in _IGNORED or key in _RUN_FIXED:
                continue
            if key in ("presence_penalty", "frequency_penalty", "repetition_penalty") and not value:
                continue
            if key in ("logit_bias", "response_format") and (not value or value == {"type": "text"}):
                continue
            raise GatewayError(
                400,
                f"the gateway cannot honour {key!r}: the run samples one continuation under its own sampling settings",
                param=key,
            )
        n = payload.get("n", 1)
        if n not in (1, None):
            raise GatewayError(400, "n must be 1: one session is one sample (rollout.n makes the group)", param="n")
        overridden = [k for k in _RUN_FIXED if payload.get(k) is not None]
        stop = payload.get("stop")
        stops: list[str] = [stop] if isinstance(stop, str) else list(stop or [])
        if not all(isinstance(s, str) and s for s in stops):
            raise GatewayError(400, "stop must be a string or a list of non-empty strings", param="stop")
        stop_ids = self.renderer.stop_ids(stops)
        stream = payload.get("stream", False)
        if not isinstance(stream, bool):
            raise GatewayError(400, "stream must be true or false", param="stream")
        return overridden, stop_ids, stream

    def _max_tokens(self, payload: dict, session: Session, prompt: list[int], sample: Sample | None) -> int:
        """The request's max_tokens bounded by what its sample (`sample`: the one it extends, None for a new one)
        still has room for; 400 when none is left."""
        asked = payload.get("max_completion_tokens", payload.get("max_tokens"))
        if asked is not None and (isinstance(asked, bool) or not isinstance(asked, int) or asked < 1):
            param = "max_completion_tokens" if "max_completion_tokens" in payload else "max_tokens"
            raise GatewayError(400, f"{param} must be a positive integer", param=param)
        left = room(sample, len(prompt), self.prompt_width(), self.budget())
        if left < 1:
            session.context_exceeded += 1
            raise GatewayError(
                400,
                f"this session's sample has no room left: its prompt has {len(prompt)} tokens and a sample holds at "
                f"most data.max_prompt_length + data.max_response_length tokens "
                f"({self.prompt_width()} + {self.budget()})",
                param="messages",
                kind="context_length_exceeded",
            )
        return left if asked is None else min(int(asked), left)

    def _chat_spec(self, session: Session, payload: dict) -> dict:
        allowed = {
            "messages",
            "max_tokens",
            "max_completion_tokens",
            "stop",
            "stream",
            "n",
            "logprobs",
            "top_logprobs",
            "tools",
            "tool_choice",
        }
        overridden, stops, stream = self._common(payload, allowed)
        messages = payload.get("messages")
        if not isinstance(messages, list):
            raise GatewayError(400, "messages must be a list of messages", param="messages")
        top = payload.get("top_logprobs")
        if top:
            raise GatewayError(
                400, "top_logprobs: the engine reports the sampled tokens' log-probs only", param="top_logprobs"
            )
        logprobs = bool(payload.get("logprobs"))
        tools = payload.get("tools")
        if tools is not None and not isinstance(tools, list):
            raise GatewayError(400, "tools must be a list", param="tools")
        choice = payload.get("tool_choice")
        if choice not in (None, "auto", "none"):
            raise GatewayError(
                400, "tool_choice: only auto and none (the gateway does not constrain decoding)", param="tool_choice"
            )
        use_tools = bool(tools) and choice != "none"
        text, images = self.renderer.chat_text(session, messages, tools if use_tools else None)
        prompt, text = self.renderer.prompt_ids(session, text)
        if use_tools:  # the run's call format ends a turn at its stop texts, as the built-in loop does
            stops = stops + self.renderer.format_stops
        sample = session.trajectories.extends(prompt)
        left = self._max_tokens(payload, session, prompt, sample)
        req = Request(session, prompt, text, left, stops, Future(), time.monotonic())
        self._see(req, sample, images, "messages")
        return {
            "request": req,
            "overridden": overridden,
            "stream": stream,
            "logprobs": logprobs,
            "use_tools": use_tools,
        }

    def _completion_spec(self, session: Session, payload: dict) -> dict:
        allowed = {"prompt", "max_tokens", "stop", "stream", "n", "logprobs", "echo", "suffix", "best_of"}
        overridden, stops, stream = self._common(payload, allowed)
        for key in ("echo", "suffix"):
            if payload.get(key):
                raise GatewayError(400, f"{key} is not supported", param=key)
        if payload.get("best_of") not in (None, 1):
            raise GatewayError(400, "best_of must be 1", param="best_of")
        logprobs = payload.get("logprobs")
        if logprobs not in (None, 0, False, True) and not (isinstance(logprobs, int) and logprobs <= 1):
            raise GatewayError(
                400, "logprobs: the engine reports the sampled tokens' log-probs only (0 or 1)", param="logprobs"
            )
        prompt = payload.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        if isinstance(prompt, str):
            ids, text = self.renderer.prompt_ids(session, prompt)
        elif (
            isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
        ):
            vocab = len(self.renderer.tokenizer)
            if any(t < 0 or t >= vocab for t in prompt):
                raise GatewayError(
                    400, f"prompt holds token ids outside the vocabulary (0..{vocab - 1})", param="prompt"
                )
            ids, text = list(prompt), None  # token in: taken as given
        else:
            raise GatewayError(400, "prompt must be a string or a list of token ids (one prompt)", param="prompt")
        sample = session.trajectories.extends(ids)
        req = Request(
            session, ids, text, self._max_tokens(payload, session, ids, sample), stops, Future(), time.monotonic()
        )
        self._see(req, sample, (None, []), "prompt")
        return {
            "request": req,
            "overridden": overridden,
            "stream": stream,
            "logprobs": logprobs is not None and logprobs is not False,
        }

    def _see(self, req: Request, sample: Sample | None, images: tuple[Any, list[list[int]]], param: str) -> None:
        """A vision-language policy's request: the images of the sample it extends (`sample`), or its own (`images`)
        when it starts one, checked against the image pads of that sample's first prompt, which must lie in the
        prompt columns."""
        vision = self.renderer.vision
        if vision is None:
            return
        from conveyor.models.vision import check_image_tokens

        if sample is not None:
            req.images, req.head = sample.images, len(sample.context)
        else:
            req.images, req.head = images, len(req.prompt)
        head = req.prompt[: req.head]
        try:
            check_image_tokens("the request", head, req.images[1], vision.image_token_id, vision.merge)
        except ValueError as err:
            raise GatewayError(400, str(err), param=param) from None
        width = self.prompt_width()
        if any(t == vision.image_token_id for t in head[width:]):
            req.session.context_exceeded += 1
            raise GatewayError(
                400,
                f"the prompt's images reach past its first {width} tokens (data.max_prompt_length), where a sample "
                "keeps its prompt: shorten what comes before the last image, or raise data.max_prompt_length",
                param=param,
                kind="context_length_exceeded",
            )

    # ------------------------------------------------------------------ responses
    def _finish(self, call: Call, req: Request) -> str:
        n = len(call.completion)
        ends = call.completion[-1:] == (self.renderer.eos,) or any(
            len(s) <= n and call.completion[-len(s) :] == s for s in req.stop
        )
        return "stop" if ends or n < req.max_new_tokens else "length"

    def _extension(self, session: Session, spec: dict, call: Call) -> dict:
        return {
            "overridden": spec["overridden"],
            "session": session.id,
            "prompt_token_ids": list(call.prompt),
            "completion_token_ids": list(call.completion),
        }

    def _usage(self, call: Call) -> dict:
        return {
            "prompt_tokens": len(call.prompt),
            "completion_tokens": len(call.completion),
            "total_tokens": len(call.prompt) + len(call.completion),
        }

    def _token_logprobs(self, call: Call) -> list[dict]:
        out = []
        for token, lp in zip(call.completion, call.log_probs):
            text = self.renderer.decode([token], raw=True)
            out.append({"token": text, "logprob": float(lp), "bytes": list(text.encode()), "top_logprobs": []})
        return out

    def _chat_body(self, session: Session, spec: dict, call: Call) -> dict:
        req = spec["request"]
        content, tool_calls, raw = self.renderer.message(call.completion, spec["use_tools"])
        session.served[served_key(content, tool_calls)] = raw
        message: dict[str, Any] = {"role": "assistant", "content": content}
        finish = self._finish(call, req)
        if tool_calls:
            message["tool_calls"] = tool_calls
            finish = "tool_calls"
        choice: dict[str, Any] = {
            "index": 0,
            "message": message,
            "finish_reason": finish,
            "logprobs": {"content": self._token_logprobs(call)} if spec["logprobs"] else None,
        }
        return {
            "id": f"chatcmpl-{session.id}-{session.requests}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": self.model_name,
            "choices": [choice],
            "usage": self._usage(call),
            "conveyor": self._extension(session, spec, call),
        }

    def _completion_body(self, session: Session, spec: dict, call: Call) -> dict:
        text = self.renderer.decode(call.completion)
        logprobs = None
        if spec["logprobs"]:
            logprobs = {
                "tokens": [self.renderer.decode([t], raw=True) for t in call.completion],
                "token_logprobs": [float(x) for x in call.log_probs],
                "top_logprobs": None,
                "text_offset": None,
            }
        choice = {"index": 0, "text": text, "finish_reason": self._finish(call, spec["request"]), "logprobs": logprobs}
        return {
            "id": f"cmpl-{session.id}-{session.requests}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": self.model_name,
            "choices": [choice],
            "usage": self._usage(call),
            "conveyor": self._extension(session, spec, call),
        }


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj)}\n\n"


async def _chat_events(body: dict):
    """A chat completion as OpenAI's stream of chunks: the role, the content (and calls), the finish, [DONE]."""
    choice = body["choices"][0]
    message = choice["message"]
    base = {k: body[k] for k in ("id", "created", "model")} | {"object": "chat.completion.chunk"}
    yield _sse(base | {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]})
    delta: dict[str, Any] = {}
    if message.get("content"):
        delta["content"] = message["content"]
    if message.get("tool_calls"):
        delta["tool_calls"] = [dict(c, index=i) for i, c in enumerate(message["tool_calls"])]
    if delta:
        yield _sse(
            base | {"choices": [{"index": 0, "delta": delta, "logprobs": choice["logprobs"], "finish_reason": None}]}
        )
    yield _sse(
        base
        | {
            "choices": [{"index": 0, "delta": {}, "finish_reason": choice["finish_reason"]}],
            "usage": body["usage"],
            "conveyor": body["conveyor"],
        }
    )
    yield "data: [DONE]\n\n"


async def _completion_events(body: dict):
    """A text completion as a stream: the text, then the finish, then [DONE]."""
    choice = body["choices"][0]
    base = {k: body[k] for k in ("id", "created", "model", "object")}
    yield _sse(
        base
        | {"choices": [{"index": 0, "text": choice["text"], "logprobs": choice["logprobs"], "finish_reason": None}]}
    )
    yield _sse(
        base | {"choices": [{"index": 0, "text": "", "finish_reason": choice["finish_reason"]}], "usage": body["usage"]}
    )
    yield "data: [DONE]\n\n"
