"""The Anthropic Messages family: `POST /v1/messages` (JSON, and SSE in Anthropic's event sequence) and
`POST /v1/messages/count_tokens`. A request becomes the chat template's conversation (`template.py`):
`tool_use` blocks are the assistant's calls, `tool_result` blocks are tool messages, and the reply's calls come back
as `tool_use` blocks. Errors on these routes have Anthropic's shape (`errors.py`)."""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator, Mapping
from typing import Any, ClassVar, Literal

from fastapi import APIRouter
from pydantic import Field

from .._core import MAX_DRAFT_AHEAD, MAX_DRAFT_LOOPS, MAX_TOP_K, Generation, Grammar
from .depth import DepthFields
from .errors import APIError
from .generation import ChoiceRun
from .protocol import MAX_TOKENS_LIMIT, ChatMessage
from .request import Plan, RunningRequest, respond, tokenize
from .sampling import Sampling, drafts
from .state import ServerState, State
from .strict import Strict, ranged
from .structured import NAME_PATTERN, schema_grammar
from .template import DEFAULT_STOP, ChatFormat
from .tools import (
    Call,
    Event,
    FunctionCall,
    FunctionDef,
    NamedToolChoice,
    Tool,
    ToolCall,
    ToolUse,
    read_calls,
    with_calls,
)

router = APIRouter()


class TextBlock(Strict):
    type: Literal["text"]
    text: str
    cache_control: CacheControl | None = None


class ToolUseBlock(Strict):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]
    cache_control: CacheControl | None = None


class ToolResultBlock(Strict):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlock] = ""
    is_error: bool = False
    cache_control: CacheControl | None = None


class Message(Strict):
    role: Literal["user", "assistant"]
    content: str | list[TextBlock | ToolUseBlock | ToolResultBlock]


class CacheControl(Strict):
    """A prompt-caching breakpoint: accepted and ignored — the prompt cache reuses every shared prefix unasked."""

    type: Literal["ephemeral"]
    ttl: str | None = None


class AnthropicTool(Strict):
    type: Literal["custom"] | None = None  # the anthropic SDK's `ToolParam` declares it: a tool the client runs
    name: str = Field(pattern=NAME_PATTERN)
    description: str | None = None
    input_schema: dict[str, Any]
    cache_control: CacheControl | None = None
    strict: bool | None = None  # enforced or not by tool_choice, as on chat
    eager_input_streaming: bool | None = None  # the input always streams as it is written


class ToolChoiceSpec(Strict):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False


class Thinking(Strict):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = None


class OutputFormat(Strict):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(Strict):
    format: OutputFormat | None = None


class Conversation(Strict):
    """What both routes read (the body of `/v1/messages/count_tokens`): the conversation and its tools."""

    model: str
    messages: list[Message] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[AnthropicTool] | None = None
    tool_choice: ToolChoiceSpec | None = None
    thinking: Thinking | None = None
    output_config: OutputConfig | None = None
    cache_control: CacheControl | None = None  # automatic caching: what the prompt cache does unasked

    def prompt(self, chat: ChatFormat) -> str:
        """The text `/v1/messages` prefills: the chat template over the conversation and the tools."""
        return chat.render(self.conversation(), self.tool_use())

    def check_conversation(self) -> None:
        if self.thinking is not None and self.thinking.type != "disabled":
            raise APIError(
                400,
                f"thinking.type {self.thinking.type!r} is not supported: this model does not think",
                param="thinking",
            )

    def tool_use(self) -> ToolUse | None:
        tools = [
            Tool(
                type="function", function=FunctionDef(name=t.name, description=t.description, parameters=t.input_schema)
            )
            for t in self.tools or []
        ]
        spec = self.tool_choice
        kinds = {"auto": "auto", "any": "required", "none": "none"}
        choice: str | NamedToolChoice | None = kinds.get(spec.type) if spec else None
        if spec is not None and spec.type == "tool":
            if spec.name is None:
                raise APIError(400, "tool_choice of type tool needs a name")
            choice = NamedToolChoice(type="function", function={"name": spec.name})  # type: ignore[arg-type]
        parallel = not (spec and spec.disable_parallel_tool_use)
        return ToolUse.of(tools or None, choice, parallel)  # type: ignore[arg-type]

    def conversation(self) -> list[ChatMessage]:
        """The request as the chat template's messages."""
        system = self.system if isinstance(self.system, str) else "".join(b.text for b in self.system or [])
        out = [ChatMessage(role="system", content=system)] if system else []
        for m in self.messages:
            blocks = [TextBlock(type="text", text=m.content)] if isinstance(m.content, str) else m.content
            text = "".join(b.text for b in blocks if isinstance(b, TextBlock))
            calls = [
                ToolCall(id=b.id, type="function", function=FunctionCall(name=b.name, arguments=json.dumps(b.input)))
                for b in blocks
                if isinstance(b, ToolUseBlock)
            ]
            for b in blocks:
                if isinstance(b, ToolResultBlock):
                    result = b.content if isinstance(b.content, str) else "".join(t.text for t in b.content)
                    out.append(ChatMessage(role="tool", content=result, tool_call_id=b.tool_use_id))
            if text or calls or not any(isinstance(b, ToolResultBlock) for b in blocks):
                out.append(ChatMessage(role=m.role, content=text, tool_calls=calls or None))
        return out


class MessagesRequest(DepthFields, Conversation):
    max_tokens: int = ranged(..., 1, MAX_TOKENS_LIMIT)  # required, as Anthropic requires it
    DEFAULT_ALIASES: ClassVar[dict[str, str]] = {"stop": "stop_sequences"}
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float = ranged(1.0, 0.0, 1.0)
    top_p: float = ranged(1.0, 0.0, 1.0)
    top_k: int = ranged(0, 0, MAX_TOP_K)
    draft_loops: int | None = ranged(None, 1, MAX_DRAFT_LOOPS)
    draft_ahead: int = ranged(4, 1, MAX_DRAFT_AHEAD)
    # Accepted and ignored (docs/api.md): nothing is stored or billed per user, and there is one service tier.
    metadata: dict[str, Any] | None = None
    service_tier: str | None = None

    def check(self, max_tokens_limit: int) -> None:
        self.check_ranges()
        if self.max_tokens > max_tokens_limit:
            raise APIError(400, f"max_tokens must be at most {max_tokens_limit}", param="max_tokens")
        self.check_conversation()

    def generation(self, defaults: Mapping[str, Any], default_loops: int) -> Generation:
        """The request's generation, built once: its own sampling fields, the `defaults` (the server's and the model
        file's) for those this family has no field for (`stop` is `stop_sequences`), its depth and drafts."""
        own = {"temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k, "max_tokens": self.max_tokens}
        sampling = Sampling.of(own, defaults)
        spec = drafts(self, self.draft_loops, self.draft_ahead, default_loops, sampling.temperature)
        return Generation(sampling.params(), loops=self.loop_arg_for(spec), speculative=spec, grammar=self.grammar())

    def grammar(self) -> Grammar | None:
        fmt = self.output_config.format if self.output_config else None
        text = fmt.schema_ if fmt else None
        tools = self.tool_use()
        return schema_grammar(text) if tools is None else tools.grammar(text)


async def plan(state: ServerState, req: MessagesRequest) -> Plan:
    defaults = state.defaults()
    req.with_defaults(defaults)
    req.check(state.max_tokens_limit)
    chat = state.chat_format()
    prompts = await tokenize(state, [req.prompt(chat)], chat.special)
    engine, _ = state.require_engine()
    generation = req.generation(defaults, engine.info.default_loops)
    stop = [*(req.stop_sequences or []), *chat.stops]
    tools = req.tool_use()
    param = "tools" if tools and tools.forced else "output_config"
    mode = "generate" if req.draft_loops is None else "speculative"
    return Plan(prompts, [generation], mode, stop, lstrip=True, grammar_param=param)


def _blocks(c: ChoiceRun, tools: ToolUse | None) -> list[dict[str, Any]]:
    """The reply's content blocks. A call the generation cut short (`max_tokens`) has no `tool_use` block: its input
    is not a whole object (a stream has already sent what was written of it)."""
    if tools is None:
        return [{"type": "text", "text": c.text}]
    content, calls = read_calls(c.text, c.finish_reason, tools)
    made = [call for call in calls if call.complete]
    out: list[dict[str, Any]] = [] if content is None else [{"type": "text", "text": content}]
    return out + [{**_tool_use(call), "input": json.loads(call.arguments)} for call in made]


def _tool_use(call: Call) -> dict[str, Any]:
    return {"type": "tool_use", "id": f"toolu_{call.id[len('call_') :]}", "name": call.name, "input": {}}


def _stop(r: RunningRequest, called: bool) -> tuple[str, str | None]:
    c = r.choices[0]
    if c.finish_reason in ("error", "aborted"):
        raise APIError(500 if c.finish_reason == "error" else 503, r.error() or "the request was aborted")
    if c.finish_reason == "length":
        return "max_tokens", None
    if called:
        return "tool_use", None
    if c.stop_string is not None and c.stop_string not in DEFAULT_STOP:
        return "stop_sequence", c.stop_string
    return "end_turn", None


def _usage(r: RunningRequest) -> dict[str, int]:
    """Anthropic's split of the prompt: `input_tokens` were prefilled, `cache_read_input_tokens` came from the prompt
    cache (their sum is the prompt's length); nothing is billed as a cache write."""
    u = r.usage()
    cached = u["prompt_tokens_details"]["cached_tokens"]
    return {
        "input_tokens": u["prompt_tokens"] - cached,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": cached,
        "output_tokens": u["completion_tokens"],
    }


def body(req: MessagesRequest, r: RunningRequest) -> dict[str, Any]:
    content = _blocks(r.choices[0], req.tool_use())
    stop_reason, stop_sequence = _stop(r, any(b["type"] == "tool_use" for b in content))
    return {
        "id": f"msg_{uuid.uuid4().hex[:24]}",
        "type": "message",
        "role": "assistant",
        "model": req.model,
        "content": content,
        "stop_reason": stop_reason,
        "stop_sequence": stop_sequence,
        "usage": _usage(r),
    }


def _event(name: str, data: dict[str, Any]) -> bytes:
    return f"event: {name}\ndata: {json.dumps({'type': name, **data})}\n\n".encode()


async def events(req: MessagesRequest, r: RunningRequest) -> AsyncIterator[bytes]:
    """message_start, ping, then per content block its start, deltas and stop, then message_delta (stop reason and
    usage) and message_stop; a failure after the 200 ends the stream with an `error` event."""
    message = {"id": f"msg_{uuid.uuid4().hex[:24]}", "type": "message", "role": "assistant", "model": req.model}
    # The prompt cache's share is known from the engine's first step on: message_delta carries the final split.
    usage = {"input_tokens": sum(len(p) for p in r.plan.prompts), "output_tokens": 0}
    yield _event(
        "message_start",
        {"message": {**message, "content": [], "stop_reason": None, "stop_sequence": None, "usage": usage}},
    )
    yield _event("ping", {})
    blocks = _Blocks()
    async for _, events_, _, _ in with_calls(r.merged_deltas(), req.tool_use()):
        for e in events_:
            for event in blocks.event(e):
                yield event
    for event in blocks.close():
        yield event
    called = blocks.called
    try:
        stop_reason, stop_sequence = _stop(r, called)
    except APIError as e:
        yield _event("error", {"error": e.body_for("/v1/messages")["error"]})
        return
    yield _event(
        "message_delta",
        {
            "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
            "usage": _usage(r),
        },
    )
    yield _event("message_stop", {})


class _Blocks:
    """A streamed reply's content blocks as its events build them: text deltas, a call's `input_json_delta`s as its
    arguments are written, each block stopped before the next one starts."""

    def __init__(self) -> None:
        self.index, self.called = 0, False
        self.open: str | None = None  # the block being written: "text" or "tool_use"

    def event(self, e: Event) -> list[bytes]:
        out: list[bytes] = []
        if e.kind == "text":
            if self.open != "text":
                out += self.close()
                block = {"type": "text", "text": ""}
                out.append(_event("content_block_start", {"index": self.index, "content_block": block}))
                self.open = "text"
            out.append(
                _event("content_block_delta", {"index": self.index, "delta": {"type": "text_delta", "text": e.text}})
            )
        elif e.kind == "start" and e.call is not None:
            out += self.close()
            out.append(_event("content_block_start", {"index": self.index, "content_block": _tool_use(e.call)}))
            self.open = "tool_use"
        elif e.kind == "args":
            delta = {"type": "input_json_delta", "partial_json": e.text}
            out.append(_event("content_block_delta", {"index": self.index, "delta": delta}))
        elif e.kind == "end":
            self.called = self.called or bool(e.call and e.call.complete)
            out += self.close()
        return out

    def close(self) -> list[bytes]:
        if self.open is None:
            return []
        out = [_event("content_block_stop", {"index": self.index})]
        self.index, self.open = self.index + 1, None
        return out


@router.post("/v1/messages")
async def messages(req: MessagesRequest, state: State):
    return await respond(state, await plan(state, req), req.stream, lambda r: body(req, r), lambda r: events(req, r))


@router.post("/v1/messages/count_tokens")
async def count_tokens(req: Conversation, state: State):
    """The tokens `/v1/messages` would prefill for the same request; nothing is generated."""
    req.check_conversation()
    chat = state.chat_format()
    return {"input_tokens": len((await tokenize(state, [req.prompt(chat)], chat.special))[0])}
