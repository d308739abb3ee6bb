"""The OpenAI family: `/v1/models`, `/v1/chat/completions`, `/v1/completions` — JSON bodies and SSE chunks in
the shapes the openai SDK reads. The LM Studio family (lmstudio.py) reuses these with its extra sections."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter

from ..errors import APIError
from .protocol import ChatCompletionRequest, ChatMessage, CompletionRequest, OpenAISampling
from .request import Plan, RunningRequest, respond, tokenize
from .sse import SSE_DONE, sse, stream_error
from .state import ServerState, State

router = APIRouter()

ROLE_NAMES = {"system": "System", "developer": "System", "user": "User", "assistant": "Assistant"}
# A raw LM keeps writing the conversation; these end the assistant's turn unless the request gives its own `stop`.
CHAT_DEFAULT_STOP = ["\nUser:", "\nSystem:", "\nAssistant:"]


def render_chat(messages: list[ChatMessage]) -> str:
    """The "Role: content" template: one line per message, then the opened assistant turn."""
    return "".join(f"{ROLE_NAMES[m.role]}: {m.text()}\n" for m in messages) + "Assistant:"


def new_id(prefix: str) -> str:
    return f"{prefix}{uuid.uuid4().hex[:24]}"


async def chat_plan(state: ServerState, req: ChatCompletionRequest) -> Plan:
    req.check(state.max_tokens_limit)
    prompts = await tokenize(state, [render_chat(req.messages)])
    return Plan(prompts, req.generations(), req.mode_label(), req.stops(CHAT_DEFAULT_STOP), lstrip=True)


async def completion_plan(state: ServerState, req: CompletionRequest) -> Plan:
    req.check(state.max_tokens_limit)
    p = req.prompt
    if isinstance(p, str):
        prompts = await tokenize(state, [p])
    elif p and all(isinstance(x, int) for x in p):
        prompts = [list(p)]  # type: ignore[arg-type]
    elif p and all(isinstance(x, list) for x in p):
        prompts = [list(x) for x in p]  # type: ignore[union-attr]
    elif p:
        prompts = await tokenize(state, list(p))  # type: ignore[arg-type]
    else:
        raise APIError(400, "prompt must not be an empty list", param="prompt")
    return Plan(prompts, req.generations(), req.mode_label(), req.stops([]))


def chat_body(req: ChatCompletionRequest, r: RunningRequest) -> dict[str, Any]:
    return {
        "id": new_id("chatcmpl-"),
        "object": "chat.completion",
        "created": int(time.time()),
        "model": req.model,
        "choices": [
            {"index": i, "message": {"role": "assistant", "content": c.text}, "finish_reason": c.finish_reason}
            for i, c in enumerate(r.choices)
        ],
        "usage": r.usage(),
    }


def completion_body(req: CompletionRequest, r: RunningRequest) -> dict[str, Any]:
    return {
        "id": new_id("cmpl-"),
        "object": "text_completion",
        "created": int(time.time()),
        "model": req.model,
        "choices": [
            {"text": c.text, "index": i, "logprobs": None, "finish_reason": c.finish_reason}
            for i, c in enumerate(r.choices)
        ],
        "usage": r.usage(),
    }


def _chunker(req: OpenAISampling, obj: str, prefix: str):
    """The chunk framing of one stream: its id and fields, and `usage: null` in every chunk when the client asked
    for usage (the final usage chunk then carries the figures)."""
    base = {"id": new_id(prefix), "object": obj, "created": int(time.time()), "model": req.model}
    with_usage = bool(req.stream_options and req.stream_options.include_usage)

    def chunk(choices: list[dict[str, Any]]) -> bytes:
        return sse({**base, "choices": choices, **({"usage": None} if with_usage else {})})

    def tail(r: RunningRequest) -> list[bytes]:
        out = [stream_error(error)] if (error := r.error()) is not None else []
        if with_usage:
            out.append(sse({**base, "choices": [], "usage": r.usage()}))
        return [*out, SSE_DONE]

    return chunk, tail


async def chat_events(req: ChatCompletionRequest, r: RunningRequest) -> AsyncIterator[bytes]:
    chunk, tail = _chunker(req, "chat.completion.chunk", "chatcmpl-")
    for i in range(len(r.choices)):
        yield chunk([{"index": i, "delta": {"role": "assistant"}, "finish_reason": None}])
    async for i, delta, finish, _ in r.merged_deltas():
        if delta:
            yield chunk([{"index": i, "delta": {"content": delta}, "finish_reason": None}])
        if finish is not None:
            yield chunk([{"index": i, "delta": {}, "finish_reason": finish}])
    for event in tail(r):
        yield event


async def completion_events(req: CompletionRequest, r: RunningRequest) -> AsyncIterator[bytes]:
    chunk, tail = _chunker(req, "text_completion", "cmpl-")
    async for i, delta, finish, _ in r.merged_deltas():
        if delta:
            yield chunk([{"text": delta, "index": i, "logprobs": None, "finish_reason": None}])
        if finish is not None:
            yield chunk([{"text": "", "index": i, "logprobs": None, "finish_reason": finish}])
    for event in tail(r):
        yield event


@router.get("/v1/models")
async def models(state: State):
    return state.models()


@router.post("/v1/chat/completions")
async def chat(req: ChatCompletionRequest, state: State):
    return await respond(
        state, await chat_plan(state, req), req.stream, lambda r: chat_body(req, r), lambda r: chat_events(req, r)
    )


@router.post("/v1/completions")
async def completions(req: CompletionRequest, state: State):
    return await respond(
        state,
        await completion_plan(state, req),
        req.stream,
        lambda r: completion_body(req, r),
        lambda r: completion_events(req, r),
    )
