"""The Responses family: `POST /v1/responses`, JSON and SSE in the Responses event sequence. A request becomes the
chat template's conversation (`template.py`): `instructions` is the system line, `function_call` items are
the assistant's calls and `function_call_output` items tool messages; the reply's calls come back as
`function_call` output items. Nothing is stored: `store: true` and `previous_response_id` are refused by name."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator, Mapping
from typing import Any, ClassVar, Literal

from fastapi import APIRouter
from pydantic import Field, model_validator

from .._core import MAX_DRAFT_AHEAD, MAX_DRAFT_LOOPS, Generation, Grammar
from .depth import DepthFields
from .errors import APIError
from .generation import ChoiceRun
from .protocol import DEFAULT_MAX_TOKENS, MAX_TOKENS_LIMIT, ChatMessage
from .request import Plan, RunningRequest, respond, tokenize
from .sampling import Sampling, drafts
from .state import ServerState, State
from .strict import Strict, ranged
from .structured import NAME_PATTERN, schema_grammar
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

# `include` values the server honours: encrypted reasoning, of which a model that does not reason has none. The rest
# name output of built-in tools, images or log-probabilities that tinyloop does not produce on this route.
INCLUDABLE = frozenset({"reasoning.encrypted_content"})


class ContentPart(Strict):
    type: Literal["input_text", "output_text", "text"]
    text: str
    annotations: list[Any] | None = None  # on output_text parts a client sends back; nothing to do with them


class Item(Strict):
    """What every input item may carry back from an earlier response: its id and status (kept, not used)."""

    id: str | None = None
    status: str | None = None


class MessageItem(Item):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[ContentPart]


class FunctionCallItem(Item):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str


class FunctionCallOutputItem(Item):
    type: Literal["function_call_output"]
    call_id: str
    output: str


class FunctionTool(Strict):
    type: str
    name: str = Field(pattern=NAME_PATTERN)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class FunctionChoice(Strict):
    type: str
    name: str


class TextFormat(Strict):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextConfig(Strict):
    format: TextFormat | None = None


class ReasoningConfig(Strict):
    effort: str | None = None


class ResponsesRequest(DepthFields):
    model: str
    input: str | list[MessageItem | FunctionCallItem | FunctionCallOutputItem]
    instructions: str | None = None
    max_output_tokens: int | None = ranged(None, 1, MAX_TOKENS_LIMIT)
    DEFAULT_ALIASES: ClassVar[dict[str, str]] = {"max_tokens": "max_output_tokens"}
    temperature: float = ranged(1.0, 0.0, 2.0)
    top_p: float = ranged(1.0, 0.0, 1.0)
    stream: bool = False
    text: TextConfig | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["auto", "none", "required"] | FunctionChoice | None = None
    parallel_tool_calls: bool | None = None
    reasoning: ReasoningConfig | None = None
    store: bool | None = None  # only false: nothing is stored
    include: list[str] | None = None  # extra output data: none to give (`INCLUDABLE`)
    draft_loops: int | None = ranged(None, 1, MAX_DRAFT_LOOPS)
    draft_ahead: int = ranged(4, 1, MAX_DRAFT_AHEAD)
    # Accepted and ignored, as on chat (docs/api.md).
    user: str | None = None
    metadata: dict[str, str] | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    service_tier: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data: Any) -> Any:
        return {k: v for k, v in data.items() if v is not None} if isinstance(data, dict) else data

    def check(self, max_tokens_limit: int) -> None:
        self.check_ranges()
        if self.max_output_tokens is None:
            self.max_output_tokens = min(DEFAULT_MAX_TOKENS, max_tokens_limit)
        if self.max_output_tokens > max_tokens_limit:
            raise APIError(400, f"max_output_tokens must be at most {max_tokens_limit}", param="max_output_tokens")
        if self.store:
            raise APIError(400, "store: true is not supported: tinyloop keeps no responses", param="store")
        if self.reasoning is not None and self.reasoning.effort not in (None, "none"):
            raise APIError(
                400, 'this model does not reason: reasoning.effort may only be "none"', param="reasoning.effort"
            )
        for i, value in enumerate(self.include or []):
            if value not in INCLUDABLE:
                raise APIError(
                    400,
                    f"include {value!r} is not supported: tinyloop runs no built-in tools, returns no "
                    "log-probabilities here and keeps no reasoning (only reasoning.encrypted_content, which is then "
                    "empty, is accepted)",
                    param=f"include.{i}",
                )

    def tool_use(self) -> ToolUse | None:
        tools = [
            Tool(type=t.type, function=FunctionDef(name=t.name, description=t.description, parameters=t.parameters))
            for t in self.tools or []
        ]
        choice = self.tool_choice
        if isinstance(choice, FunctionChoice):
            choice = NamedToolChoice(type=choice.type, function={"name": choice.name})  # type: ignore[assignment,arg-type]
        return ToolUse.of(tools or None, choice, self.parallel_tool_calls)  # type: ignore[arg-type]

    def conversation(self) -> list[ChatMessage]:
        out = [ChatMessage(role="system", content=self.instructions)] if self.instructions else []
        items = [MessageItem(role="user", content=self.input)] if isinstance(self.input, str) else self.input
        for item in items:
            if isinstance(item, MessageItem):
                text = item.content if isinstance(item.content, str) else "".join(p.text for p in item.content)
                out.append(ChatMessage(role=item.role, content=text))
            elif isinstance(item, FunctionCallItem):
                call = ToolCall(
                    id=item.call_id, type="function", function=FunctionCall(name=item.name, arguments=item.arguments)
                )
                if out and out[-1].role == "assistant":
                    out[-1].tool_calls = [*(out[-1].tool_calls or []), call]
                else:
                    out.append(ChatMessage(role="assistant", content=None, tool_calls=[call]))
            else:
                out.append(ChatMessage(role="tool", content=item.output, tool_call_id=item.call_id))
        return out

    def text_schema(self) -> dict[str, Any] | None:
        """The schema a text answer must match (`text.format`), if any."""
        fmt = self.text.format if self.text else None
        if fmt is None or fmt.type == "text":
            return None
        return (fmt.schema_ or {}) if fmt.type == "json_schema" else {"type": "object"}

    def grammar(self) -> Grammar | None:
        tools = self.tool_use()
        return schema_grammar(self.text_schema()) if tools is None else tools.grammar(self.text_schema())

    def generation(self, defaults: Mapping[str, Any], default_loops: int) -> Generation:
        """The request's generation, built once: its own sampling fields, the `defaults` (the server's and the model
        file's) for those this family has no field for, its depth and drafts."""
        own = {"temperature": self.temperature, "top_p": self.top_p, "max_tokens": self.max_output_tokens}
        sampling = Sampling.of(own, {k: v for k, v in defaults.items() if k != "max_tokens"})
        spec = drafts(self, self.draft_loops, self.draft_ahead, default_loops, sampling.temperature)
        return Generation(sampling.params(), loops=self.loop_arg_for(spec), speculative=spec, grammar=self.grammar())


async def plan(state: ServerState, req: ResponsesRequest) -> Plan:
    defaults = state.defaults()
    req.with_defaults(defaults)
    req.check(state.max_tokens_limit)
    chat = state.chat_format()
    prompts = await tokenize(state, [chat.render(req.conversation(), req.tool_use())], chat.special)
    tools = req.tool_use()
    param = "tools" if tools and tools.forced else "text.format"
    engine, _ = state.require_engine()
    generation = req.generation(defaults, engine.info.default_loops)
    mode = "generate" if req.draft_loops is None else "speculative"
    return Plan(prompts, [generation], mode, chat.stops, lstrip=True, grammar_param=param)


def _message(text: str, status: str = "completed", item_id: str | None = None) -> dict[str, Any]:
    content = [{"type": "output_text", "text": text, "annotations": []}] if status == "completed" else []
    return {
        "type": "message",
        "id": item_id or f"msg_{uuid.uuid4().hex[:24]}",
        "status": status,
        "role": "assistant",
        "content": content,
    }


def _function_call(call: Call, status: str = "completed") -> dict[str, Any]:
    return {
        "type": "function_call",
        "id": f"fc_{call.id[len('call_') :]}",
        "call_id": call.id,
        "name": call.name,
        "arguments": call.arguments if status != "in_progress" else "",
        "status": status,
    }


def _call_status(call: Call) -> str:
    """A call the generation cut short is `incomplete` (the response is too)."""
    return "completed" if call.complete else "incomplete"


class Envelope:
    """One response's fixed fields, and its final state once the generation has ended."""

    def __init__(self, req: ResponsesRequest, r: RunningRequest):
        self.req, self.r = req, r
        self.id, self.created = f"resp_{uuid.uuid4().hex[:24]}", int(time.time())

    def response(self, output: list[dict[str, Any]], status: str = "in_progress") -> dict[str, Any]:
        req = self.req
        done = status != "in_progress"
        u = self.r.usage()
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "error": {"code": "server_error", "message": self.r.error() or "aborted"} if status == "failed" else None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "model": req.model,
            "instructions": req.instructions,
            "output": output,
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "tool_choice": req.tool_choice.model_dump()
            if isinstance(req.tool_choice, FunctionChoice)
            else req.tool_choice or "auto",
            "tools": [t.model_dump(exclude_none=True) for t in req.tools or []],
            "temperature": req.temperature,
            "top_p": req.top_p,
            "max_output_tokens": req.max_output_tokens,
            "text": {"format": req.text.format.model_dump(by_alias=True, exclude_none=True)}
            if req.text and req.text.format
            else {"format": {"type": "text"}},
            "usage": {
                "input_tokens": u["prompt_tokens"],
                "input_tokens_details": {"cached_tokens": u["prompt_tokens_details"]["cached_tokens"]},
                "output_tokens": u["completion_tokens"],
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": u["total_tokens"],
            }
            if done
            else None,
            "metadata": {},
        }

    def final_status(self) -> str:
        finish = self.r.choices[0].finish_reason
        return {"length": "incomplete", "error": "failed", "aborted": "failed"}.get(finish or "", "completed")


def output_items(c: ChoiceRun, tools: ToolUse | None) -> list[dict[str, Any]]:
    if tools is None:
        return [_message(c.text)]
    content, calls = read_calls(c.text, c.finish_reason, tools)
    items = [] if content is None else [_message(content)]
    return items + [_function_call(call, _call_status(call)) for call in calls]


def body(req: ResponsesRequest, r: RunningRequest) -> dict[str, Any]:
    env = Envelope(req, r)
    return env.response(output_items(r.choices[0], req.tool_use()), env.final_status())


def _event(kind: str, seq: int, data: dict[str, Any]) -> bytes:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, 'sequence_number': seq, **data})}\n\n".encode()


class _Output:
    """The output items of a streamed response as its events build them: a message's text deltas, a function
    call's argument deltas, each item closed (`...done`) before the next one opens."""

    def __init__(self) -> None:
        self.items: list[dict[str, Any]] = []
        self.seq = iter(range(2, 1 << 62))  # 0 and 1: response.created and .in_progress
        self.open: dict[str, Any] | None = None  # the item being written: a message, or a call
        self.call: Call | None = None
        self.text = ""

    def _at(self) -> dict[str, Any]:
        assert self.open is not None
        return {"output_index": len(self.items), "item_id": self.open["id"]}

    def event(self, e: Event) -> list[bytes]:
        out: list[bytes] = []
        if e.kind == "text":
            if self.open is None:
                self.open, self.text = _message("", "in_progress"), ""
                out.append(
                    self._emit("response.output_item.added", {"output_index": len(self.items), "item": self.open})
                )
                part = {"type": "output_text", "text": "", "annotations": []}
                out.append(self._emit("response.content_part.added", {**self._at(), "content_index": 0, "part": part}))
            self.text += e.text
            out.append(self._emit("response.output_text.delta", {**self._at(), "content_index": 0, "delta": e.text}))
        elif e.kind == "start" and e.call is not None:
            out += self.close()
            self.call, self.open = e.call, _function_call(e.call, "in_progress")
            out.append(self._emit("response.output_item.added", {"output_index": len(self.items), "item": self.open}))
        elif e.kind == "args":
            out.append(self._emit("response.function_call_arguments.delta", {**self._at(), "delta": e.text}))
        elif e.kind == "end":
            out += self.close()
        return out

    def close(self) -> list[bytes]:
        """End the open item: a call with its arguments (incomplete when cut short), a message with its text."""
        if self.open is None:
            return []
        at, index = self._at(), len(self.items)
        if self.call is not None:
            done = _function_call(self.call, _call_status(self.call))
            out = [self._emit("response.function_call_arguments.done", {**at, "arguments": done["arguments"]})]
        else:
            done, part = (
                _message(self.text, item_id=self.open["id"]),
                {"type": "output_text", "text": self.text, "annotations": []},
            )
            out = [
                self._emit("response.output_text.done", {**at, "content_index": 0, "text": self.text}),
                self._emit("response.content_part.done", {**at, "content_index": 0, "part": part}),
            ]
        out.append(self._emit("response.output_item.done", {"output_index": index, "item": done}))
        self.items.append(done)
        self.open = self.call = None
        return out

    def _emit(self, kind: str, data: dict[str, Any]) -> bytes:
        return _event(kind, next(self.seq), data)


async def events(req: ResponsesRequest, r: RunningRequest) -> AsyncIterator[bytes]:
    """response.created and .in_progress; per output item its added / deltas / done events; then
    response.completed (or .incomplete, .failed) with the whole response."""
    env = Envelope(req, r)
    yield _event("response.created", 0, {"response": env.response([])})
    yield _event("response.in_progress", 1, {"response": env.response([])})
    output = _Output()
    async for _, events_, _, _ in with_calls(r.merged_deltas(), req.tool_use()):
        for e in events_:
            for event in output.event(e):
                yield event
    for event in output.close():
        yield event
    status = env.final_status()
    kind = {"completed": "response.completed", "incomplete": "response.incomplete", "failed": "response.failed"}[status]
    yield output._emit(kind, {"response": env.response(output.items, status)})


@router.post("/v1/responses")
async def responses(req: ResponsesRequest, state: State):
    return await respond(state, await plan(state, req), req.stream, lambda r: body(req, r), lambda r: events(req, r))
