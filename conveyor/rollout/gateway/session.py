"""One agent session on the gateway: its task, its calls' samples, and how a request's messages become token ids.

Token in, token out. A chat request's messages are rendered with the policy's
chat template to text; where that text starts with the text of one of the
session's samples (the exact text its tokens were made from: an earlier
prompt's rendering plus the completion's own decoding), the prompt is that
sample's token ids followed by the tokens of the new text only, so what the
model sampled is never re-tokenized. An assistant message that carries a
completion this session was served (its content and tool calls as the
gateway returned them) is rendered as the model wrote it (the raw completion,
tool-call syntax included), which is what lets an agent's history extend its
earlier prompts under any template that keeps assistant turns as written.
The first prompt of a session that renders to the task's own prompt text
takes the task's token ids, as the trainer's stage 1 made them.

What it deliberately does not do: sample (the batcher does), serve HTTP
(`server.py`) or decide the sample layout (`trajectory.py`).
"""

from __future__ import annotations

import hashlib
import json
import threading
from dataclasses import dataclass, field
from typing import Any

from conveyor.rollout.gateway.trajectory import Call, Sample, SessionTrajectories
from conveyor.tools.formats import CallFormat, ToolCallError

__all__ = ["GatewayError", "Session", "Renderer", "served_key"]


class GatewayError(Exception):
    """A request the gateway refuses: its HTTP status, the OpenAI error type, the offending field and a message."""

    def __init__(self, status: int, message: str, *, param: str | None = None, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind


def served_key(content: str | None, tool_calls: list[dict] | None) -> tuple:
    """How an assistant message is matched to a completion served before: its text and its calls' names and
    arguments."""
    calls = tuple(
        (str((c.get("function") or {}).get("name")), str((c.get("function") or {}).get("arguments")))
        for c in (tool_calls or [])
        if isinstance(c, dict)
    )
    return (content or "", calls)


@dataclass
class Session:
    """One sample of one prompt, as an agent runs it: its task, its calls' samples, its reward and state."""

    id: str
    index: int  # the row of the generation batch it was made for
    task: dict[str, Any]  # what the agent reads on stdin: prompt, data_source, ground_truth, extra_info
    prompt_ids: list[int]  # the task's prompt, as the trainer tokenized it
    prompt_text: str  # ... and as it was rendered
    trajectories: SessionTrajectories = field(default_factory=SessionTrajectories)
    texts: dict[int, str] = field(default_factory=dict)  # id(sample) -> the text its token sequence stands for
    served: dict[tuple, str] = field(default_factory=dict)  # served_key -> the completion's raw text
    posted_reward: float | None = None
    last_completion: str = ""  # the text of the newest completion (the rule reward reads it)
    open: bool = True
    requests: int = 0
    bad_requests: int = 0
    context_exceeded: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def record(self, call: Call, text: str | None, raw_completion: str) -> Sample:
        """Place a served call into its sample; remember the text its sequence now stands for."""
        sample = self.trajectories.place(call)
        if text is not None:
            self.texts[id(sample)] = text + raw_completion
        else:
            self.texts.pop(id(sample), None)
        return sample


class Renderer:
    """Turns a request's messages (or a completion prompt) into prompt token ids for one session, and completions
    into OpenAI message fields, under the run's tokenizer and tool-call format.

    With a vision-language policy (`vision`, its `VisionProcessor`) a message's `image_url` parts (data URLs) are
    images: each becomes the `<image>` of its content, which the rendered text spells as vision-start, the image's
    pads and vision-end, as stage 1 spells a dataset row's; `images` gives their pixels and grids."""

    def __init__(self, tokenizer: Any, call_format: CallFormat, vision: Any = None) -> None:
        self.tokenizer = tokenizer
        self.format = call_format
        self.vision = vision
        self._pixels: dict[str, tuple[Any, list[int]]] = {}  # a data URL -> its pixel rows and grid (agents resend)
        self.eos = tokenizer.eos_token_id
        # A fast tokenizer refuses two threads at once (the server's handlers run on several).
        self.lock = threading.Lock()
        # Stop texts' ids by text: the format's own are asked for on every tool request, and a tokenizer call costs
        # about 0.1 ms of the server's thread (1 ms a request for a format with ten stop texts).
        self._stops: dict[str, tuple[int, ...]] = {}
        self.format_stops = self.stop_ids(tuple(call_format.stop_texts))

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, no special tokens added."""
        with self.lock:
            return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def stop_ids(self, texts: tuple[str, ...] | list[str]) -> tuple[tuple[int, ...], ...]:
        """The token ids of each stop text (each text encoded once per run)."""
        out = []
        for text in texts:
            ids = self._stops.get(text)
            if ids is None:
                ids = tuple(self.encode(text))
                if len(self._stops) < 4096:  # agents' own stop texts: a bounded cache
                    self._stops[text] = ids
            out.append(ids)
        return tuple(out)

    def decode(self, ids: list[int] | tuple[int, ...], *, raw: bool = False) -> str:
        """Text of `ids`: with special tokens when `raw`, without otherwise."""
        with self.lock:
            return str(self.tokenizer.decode(list(ids), skip_special_tokens=not raw))

    def raw_text(self, completion: tuple[int, ...]) -> str:
        """A completion as an assistant turn carries it in a template: its tokens' text without a final EOS."""
        ids = list(completion)
        if ids and ids[-1] == self.eos:
            ids = ids[:-1]
        return self.decode(ids, raw=True)

    def chat_text(
        self, session: Session, messages: list[dict], tools: list[dict] | None
    ) -> tuple[str, tuple[Any, list[list[int]]]]:
        """The prompt text of a chat request: its messages through the chat template (served turns as written), with
        each image spelled out; and its images in order (`images`: pixel values or None, grids)."""
        rendered = []
        urls: list[str] | None = [] if self.vision is not None else None
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise GatewayError(400, f"messages[{i}] is not a message with a role", param="messages")
            role, content = m["role"], _text_content(m.get("content"), i, urls)
            if role == "assistant":
                raw = session.served.get(served_key(content, m.get("tool_calls")))
                rendered.append({"role": "assistant", "content": raw if raw is not None else (content or "")})
            elif role == "tool":
                rendered.append({"role": "tool", "content": self.format.response_content(content or "")})
            elif role in ("system", "user", "developer"):
                rendered.append({"role": "system" if role == "developer" else role, "content": content or ""})
            else:
                raise GatewayError(400, f"messages[{i}] has an unknown role {role!r}", param="messages")
        if not rendered:
            raise GatewayError(400, "messages is empty", param="messages")
        with self.lock:
            if getattr(self.tokenizer, "chat_template", None):
                kwargs = {"tools": tools} if tools else {}
                text = str(
                    self.tokenizer.apply_chat_template(rendered, add_generation_prompt=True, tokenize=False, **kwargs)
                )
            else:
                text = "\n".join(m["content"] for m in rendered)
        if urls is None:
            return text, (None, [])
        images = self.images(urls)
        try:
            return self.vision.expand(text, images[1], "the request"), images
        except ValueError as err:  # an "<image>" typed into a message's text: placeholders and images disagree
            raise GatewayError(400, str(err), param="messages") from None

    def images(self, urls: list[str]) -> tuple[Any, list[list[int]]]:
        """(pixel values of the images in order or None, each one's grid): each data URL decoded and processed
        once (an agent sends its history's images again with every turn)."""
        import torch

        from conveyor.models.vision import image_from_url

        if not urls:
            return None, []
        pixels, grids = [], []
        for i, url in enumerate(urls):
            got = self._pixels.get(url)
            if got is None:
                try:
                    image = image_from_url(url, f"image {i} of the request")
                except ValueError as err:
                    raise GatewayError(400, str(err), param="messages") from None
                values, (grid,) = self.vision.process([image])
                got = (values, grid)
                with self.lock:
                    if len(self._pixels) >= 1024:
                        self._pixels.pop(next(iter(self._pixels)))
                    self._pixels[url] = got
            pixels.append(got[0])
            grids.append(got[1])
        return torch.cat(pixels), grids

    def prompt_ids(self, session: Session, text: str) -> tuple[list[int], str]:
        """The token ids of a prompt text: a sample's own ids plus the new text's where the text extends it."""
        best: Sample | None = None
        best_text = ""
        for sample in session.trajectories.samples:
            known = session.texts.get(id(sample))
            if known is not None and text.startswith(known) and len(known) > len(best_text):
                best, best_text = sample, known
        if best is not None:
            return best.sequence + (self.encode(text[len(best_text) :]) if len(text) > len(best_text) else []), text
        if text == session.prompt_text:
            return list(session.prompt_ids), text
        return self.encode(text), text

    def message(self, completion: tuple[int, ...], use_tools: bool) -> tuple[str | None, list[dict] | None, str]:
        """(content, tool_calls, raw text) of a completion: tool calls parsed by the run's format when tools are on."""
        text = self.decode(completion)
        if not use_tools:
            return text, None, self.raw_text(completion)
        try:
            call = self.format.parse(text)
        except ToolCallError:
            call = None  # shown as the text it is; the agent decides what to do with it
        if call is None:
            return text, None, self.raw_text(completion)
        arguments = call.arguments if call.arguments is not None else {"text": call.text or ""}
        content = _without_call(text, self.format.name)
        tool_calls = [
            {
                "id": "call_" + hashlib.sha1(text.encode()).hexdigest()[:12],  # the same text, the same id
                "type": "function",
                "function": {"name": call.name, "arguments": json.dumps(arguments)},
            }
        ]
        return content, tool_calls, self.raw_text(completion)


def _text_content(content: Any, index: int, urls: list[str] | None = None) -> str | None:
    """A message's content as text: a string, or a list of text parts joined; with `urls` (a policy that sees
    images) an `image_url` part is its `<image>`, its URL appended to `urls`. Other parts are refused."""
    from conveyor.models.vision import IMAGE_PLACEHOLDER

    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if isinstance(part, dict) and part.get("type") == "text":
                parts.append(str(part.get("text", "")))
            elif urls is not None and isinstance(part, dict) and part.get("type") == "image_url":
                image = part.get("image_url")
                url = image.get("url") if isinstance(image, dict) else image
                if not isinstance(url, str):
                    raise GatewayError(400, "an image_url part needs a url", param=f"messages[{index}].content")
                urls.append(url)
                parts.append(IMAGE_PLACEHOLDER)
            else:
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                reads = "text and image_url parts" if urls is not None else "text only (text parts)"
                raise GatewayError(
                    400,
                    f"messages[{index}].content has a {kind!r} part; this policy reads {reads}",
                    param=f"messages[{index}].content",
                )
        return "".join(parts)
    raise GatewayError(400, f"messages[{index}].content must be a string or a list of parts", param="messages")


def _without_call(text: str, format_name: str) -> str | None:
    """The text of a turn around its tool call (the call itself travels as tool_calls); None when nothing is left."""
    if format_name == "hermes":
        start = text.rfind("<tool_call>")
        rest = text[:start].strip() if start >= 0 else text.strip()
    else:
        start = text.rstrip().rfind("#")
        rest = text[:start].strip() if start >= 0 else text.strip()
    return rest or None
