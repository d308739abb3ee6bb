"""The OpenAI family: `/v1/models`, `/v1/chat/completions`, `/v1/completions` — JSON bodies and SSE chunks in
the shapes the openai SDK reads. The LM Studio family (lmstudio.py) reuses these with its extra sections."""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter

from .errors import APIError
from .generation import ChoiceRun
from .logprobs import Echo, Entry, chat_content, completion_lists, echo
from .protocol import ChatCompletionRequest, CompletionRequest, OpenAISampling
from .request import Plan, RunningRequest, respond, tokenize
from .sse import SSE_DONE, sse, stream_error
from .state import ServerState, State
from .tools import Call, Event, read_calls, with_calls

router = APIRouter()


def new_id(prefix: str) -> str:
    return f"{prefix}{uuid.uuid4().hex[:24]}"


async def chat_plan(state: ServerState, req: ChatCompletionRequest) -> Plan:
    req.with_defaults(state.defaults())
    req.check(state.max_tokens_limit)
    chat = state.chat_format()
    prompts = await tokenize(state, [chat.render(req.messages, req.tool_use())], chat.special)
    stop = req.stops(chat.stops)
    return Plan(prompts, req.generations(), req.mode_label(), stop, lstrip=True, grammar_param=req.grammar_param())


async def completion_plan(state: ServerState, req: CompletionRequest) -> Plan:
    req.with_defaults(state.defaults())
    req.check(state.max_tokens_limit)
    p = req.prompt
    if isinstance(p, str):
        prompts = await tokenize(state, [p])
    elif p and all(isinstance(x, int) for x in p):
        prompts = [[x for x in p if isinstance(x, int)]]
    elif p and all(isinstance(x, list) for x in p):
        prompts = [list(x) for x in p if isinstance(x, list)]
    elif p:
        prompts = await tokenize(state, list(p))  # type: ignore[arg-type]
    else:
        raise APIError(400, "prompt must not be an empty list", param="prompt")
    plan = Plan(prompts, req.generations(), req.mode_label(), req.stops([]), grammar_param=req.grammar_param())
    if not req.echo:
        return plan
    texts: list[str | None] = [None] * len(prompts)  # the prompt text as given; token ids are decoded
    if isinstance(p, str):
        texts = [p]
    elif all(isinstance(x, str) for x in p):
        texts = list(p)  # type: ignore[arg-type]
    engine, _ = state.require_engine()
    depth, n = req.depth(engine.info.default_loops), req.wanted_logprobs()
    loop = asyncio.get_running_loop()
    echoes = await loop.run_in_executor(
        state.tokenizer_pool, lambda: [echo(engine, t, ids, depth, n) for t, ids in zip(texts, prompts, strict=True)]
    )
    return dataclasses.replace(plan, echo=echoes)


def chat_body(req: ChatCompletionRequest, r: RunningRequest) -> dict[str, Any]:
    return {
        "id": new_id("chatcmpl-"),
        "object": "chat.completion",
        "created": int(time.time()),
        "model": req.model,
        "choices": [_chat_choice(i, c, req) for i, c in enumerate(r.choices)],
        "usage": r.usage(),
    }


def _chat_choice(i: int, c: ChoiceRun, req: ChatCompletionRequest) -> dict[str, Any]:
    tools = req.tool_use()
    logprobs = None
    if req.wanted_logprobs() is not None:
        logprobs = {"content": chat_content(c.runner.engine, c.tokens, c.logprobs)}
    if tools is None:
        reply = {"role": "assistant", "content": c.text}
        return {"index": i, "message": reply, "logprobs": logprobs, "finish_reason": c.finish_reason}
    content, calls = read_calls(c.text, c.finish_reason, tools)
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = [call.openai() for call in calls]
    return {
        "index": i,
        "message": message,
        "logprobs": logprobs,
        "finish_reason": _tool_finish(c.finish_reason, calls),
    }


def _tool_finish(finish: str | None, calls: list[Call]) -> str | None:
    """ "tool_calls" when the turn ended on a call the client can make; a call cut short keeps the reason ("length")
    that cut it."""
    return "tool_calls" if finish == "stop" and any(c.complete for c in calls) else finish


def completion_body(req: CompletionRequest, r: RunningRequest) -> dict[str, Any]:
    return {
        "id": new_id("cmpl-"),
        "object": "text_completion",
        "created": int(time.time()),
        "model": req.model,
        "choices": [
            {
                "text": _echoed(r, i).text + c.text,
                "index": i,
                "logprobs": _completion_logprobs(
                    req, c, _echoed(r, i).tokens + c.tokens, [*_echoed(r, i).entries, *c.logprobs], 0
                ),
                "finish_reason": c.finish_reason,
            }
            for i, c in enumerate(r.choices)
        ],
        "usage": r.usage(),
    }


NO_ECHO = Echo("", [], [])


def _echoed(r: RunningRequest, choice: int) -> Echo:
    """What choice `choice` returns before its text: its prompt when the request asks for `echo`."""
    return r.plan.echo[r.plan.prompt_of(choice)] if r.plan.echo else NO_ECHO


def _completion_logprobs(
    req: CompletionRequest, c: ChoiceRun, tokens: list[int], entries: Sequence[Entry | None], offset: int
) -> dict[str, Any] | None:
    if req.wanted_logprobs() is None:
        return None
    return completion_lists(c.runner.engine, tokens, entries, offset)


class _Handed:
    """Per choice, the tokens whose log-probabilities a stream has sent: each chunk carries those of the tokens its
    text completes."""

    def __init__(self, r: RunningRequest):
        self.r, self.sent = r, [0] * len(r.choices)

    def take(self, i: int, count: int) -> tuple[list[int], list[Entry]]:
        c, start = self.r.choices[i], self.sent[i]
        self.sent[i] = max(start, count)
        return c.tokens[start:count], c.logprobs[start:count]


Sections = Callable[[RunningRequest], dict[str, Any]]
Choices = list[dict[str, Any]]


@dataclass(frozen=True)
class Framing:
    """How a stream's chunks are framed and ended. With `stream_options.include_usage` (or the server's
    `--always-include-usage`) every chunk has `usage: null` and a usage chunk (`choices: []`) follows the last
    finish_reason chunk, as OpenAI sends it; otherwise that finish_reason chunk is the last before `[DONE]`. What
    `sections` adds (the LM Studio family's stats) rides on the stream's last chunk."""

    always_usage: bool = False
    sections: Sections | None = None

    async def frame(
        self, req: OpenAISampling, obj: str, prefix: str, r: RunningRequest, chunks: AsyncIterator[Choices]
    ) -> AsyncIterator[bytes]:
        base = {"id": new_id(prefix), "object": obj, "created": int(time.time()), "model": req.model}
        usage = self.always_usage or bool(req.stream_options and req.stream_options.include_usage)
        nulls = {"usage": None} if usage else {}
        # A finish_reason chunk is held back until the next one is known (the stream's last gets the sections);
        # every other chunk goes out at once.
        last: Choices | None = None
        async for choices in chunks:
            if last is not None:
                yield sse({**base, "choices": last, **nulls})
                last = None
            if any(c.get("finish_reason") is not None for c in choices):
                last = choices
            else:
                yield sse({**base, "choices": choices, **nulls})
        more = self.sections(r) if self.sections else {}
        if last is not None:
            yield sse({**base, "choices": last, **nulls, **({} if usage else more)})
        if usage:
            yield sse({**base, "choices": [], "usage": r.usage(), **more})
        if (error := r.error()) is not None:
            yield stream_error(error)
        yield SSE_DONE


def chat_events(req: ChatCompletionRequest, r: RunningRequest, framing: Framing) -> AsyncIterator[bytes]:
    return framing.frame(req, "chat.completion.chunk", "chatcmpl-", r, _chat_chunks(req, r))


async def _chat_chunks(req: ChatCompletionRequest, r: RunningRequest) -> AsyncIterator[Choices]:
    for i in range(len(r.choices)):
        yield [{"index": i, "delta": {"role": "assistant"}, "finish_reason": None}]
    handed = _Handed(r) if req.wanted_logprobs() is not None else None
    calls: list[list[Call]] = [[] for _ in r.choices]  # per choice, the calls begun
    async for i, events, finish, count in with_calls(r.merged_deltas(), req.tool_use()):
        extra: dict[str, Any] = {}
        if handed is not None and (events or finish is not None):
            tokens, entries = handed.take(i, count)
            extra = {"logprobs": {"content": chat_content(r.choices[i].runner.engine, tokens, entries)}}
        for delta in _chat_deltas(events, calls[i]):
            yield [{"index": i, "delta": delta, **extra, "finish_reason": None}]
            extra = {"logprobs": {"content": []}} if extra else {}
        if finish is not None:
            yield [{"index": i, "delta": {}, **extra, "finish_reason": _tool_finish(finish, calls[i])}]


def _chat_deltas(events: list[Event], calls: list[Call]) -> list[dict[str, Any]]:
    """One choice's events as chat deltas: content; a call's first delta (index, id, name) and then its arguments
    as they are written, a delta per stretch."""
    out: list[dict[str, Any]] = []
    for e in events:
        if e.kind == "text":
            out.append({"content": e.text})
        elif e.kind == "start" and e.call is not None:
            calls.append(e.call)
            head = {"index": len(calls) - 1, "id": e.call.id, "type": "function"}
            out.append({"tool_calls": [{**head, "function": {"name": e.call.name, "arguments": ""}}]})
        elif e.kind == "args":
            out.append({"tool_calls": [{"index": len(calls) - 1, "function": {"arguments": e.text}}]})
    return out


def completion_events(req: CompletionRequest, r: RunningRequest, framing: Framing) -> AsyncIterator[bytes]:
    return framing.frame(req, "text_completion", "cmpl-", r, _completion_chunks(req, r))


async def _completion_chunks(req: CompletionRequest, r: RunningRequest) -> AsyncIterator[Choices]:
    handed = _Handed(r)
    texts = [0] * len(r.choices)  # characters sent per choice: the next chunk's text_offset
    for i, c in enumerate(r.choices):
        if (echoed := _echoed(r, i)) is not NO_ECHO:
            logprobs = _completion_logprobs(req, c, echoed.tokens, list(echoed.entries), 0)
            yield [{"text": echoed.text, "index": i, "logprobs": logprobs, "finish_reason": None}]
            texts[i] = len(echoed.text)
    async for i, delta, finish, count in r.merged_deltas():
        c = r.choices[i]
        logprobs = None
        if delta or finish is not None:
            tokens, entries = handed.take(i, count)
            logprobs = _completion_logprobs(req, c, tokens, entries, texts[i])
        if delta:
            yield [{"text": delta, "index": i, "logprobs": logprobs, "finish_reason": None}]
            texts[i] += len(delta)
            logprobs = None
        if finish is not None:
            yield [{"text": "", "index": i, "logprobs": logprobs, "finish_reason": finish}]


@router.get("/v1/models")
async def models(state: State):
    return state.models()


@router.post("/v1/chat/completions")
async def chat(req: ChatCompletionRequest, state: State):
    return await respond(
        state,
        await chat_plan(state, req),
        req.stream,
        lambda r: chat_body(req, r),
        lambda r: chat_events(req, r, Framing(state.always_usage)),
    )


@router.post("/v1/completions")
async def completions(req: CompletionRequest, state: State):
    return await respond(
        state,
        await completion_plan(state, req),
        req.stream,
        lambda r: completion_body(req, r),
        lambda r: completion_events(req, r, Framing(state.always_usage)),
    )
