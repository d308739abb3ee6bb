"""Endpoint logic: request schema -> prompts and sampling params -> ChoiceRuns -> response body or SSE events.

OpenAI / LM Studio field names live here and in protocol.py only; the engine sees ids and SamplingParams.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import orjson

from .. import __version__
from .._core import ContextLengthError, Engine, InvalidRequestError, SamplingParams
from ..errors import APIError, error_body
from .generation import ChoiceRun
from .protocol import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    GenerateRequest,
    LMStudioExtras,
    MAX_TOKENS_LIMIT,
    OpenAISampling,
    SpeculativeRequest,
    usage,
)
from .runner import EngineRunner, Overloaded

ROLE_NAMES = {"system": "System", "developer": "System", "user": "User", "assistant": "Assistant"}
# A raw LM keeps writing the conversation; these end the assistant's turn unless the request gives its own `stop`.
CHAT_DEFAULT_STOP = ["\nUser:", "\nSystem:", "\nAssistant:"]


def render_chat(messages: list[ChatMessage]) -> str:
    """The "Role: content" template: one line per message, then the opened assistant turn."""
    return "".join(f"{ROLE_NAMES[m.role]}: {m.text()}\n" for m in messages) + "Assistant:"


def sse(obj: Any) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


@dataclass
class ServerState:
    engine: Engine | None
    runner: EngineRunner | None
    model_id: str
    load_error: str | None
    kv_cache_mode: str
    commit: str | None
    max_tokens_limit: int = MAX_TOKENS_LIMIT

    def require_engine(self) -> tuple[Engine, EngineRunner]:
        if self.engine is None or self.runner is None:
            raise APIError(503, f"Engine not loaded: {self.load_error}", code="engine_not_loaded")
        return self.engine, self.runner

    def model_info(self) -> dict[str, Any]:
        engine, _ = self.require_engine()
        i = engine.info
        return {"arch": "weight-shared-looped-transformer", "dim": i.dim, "n_heads": i.n_heads, "ffn_dim": i.ffn_dim,
                "vocab_size": i.vocab_size, "default_loops": i.default_loops, "quant": i.quant,
                "kv_cache_mode": self.kv_cache_mode}

    def runtime(self) -> dict[str, Any]:
        return {"name": "tinyloop", "version": __version__, "commit": self.commit}


class Request:
    """One API request in flight: its prompts, choices and timing."""

    def __init__(self, state: ServerState, prompts: list[list[int]], n: int, params: list[SamplingParams],
                 loops: int | None, stop: list[str], lstrip: bool, draft: tuple[int, int, int] | None = None,
                 mode: str = "generate", cache_window: int = 0):
        self.state = state
        self.started = time.perf_counter()
        self.prompts = prompts
        engine, runner = state.require_engine()
        limit = engine.info.max_seq_len
        max_tokens = params[0].max_tokens
        vocab = engine.info.vocab_size
        for p in prompts:
            if not p:
                raise APIError(400, "prompt must contain at least one token", param="prompt")
            bad = next((t for t in p if not 0 <= t < vocab), None)
            if bad is not None:
                raise APIError(400, f"prompt token id {bad} is outside the vocabulary [0, {vocab})", param="prompt")
            if len(p) + max_tokens > limit:
                raise APIError(400, f"prompt has {len(p)} tokens and max_tokens is {max_tokens}: "
                               f"{len(p) + max_tokens} exceeds the maximum sequence length {limit}",
                               param="max_tokens", code="context_length_exceeded")
        self.choices: list[ChoiceRun] = []
        try:
            for p in prompts:
                for i in range(n):
                    self.choices.append(ChoiceRun(runner, p, params[i], loops, stop, lstrip, draft, mode,
                                                    cache_window))
        except (InvalidRequestError, ContextLengthError) as e:
            self.cancel()
            raise APIError(400, str(e)) from e
        except Overloaded as e:
            self.cancel()
            raise APIError(503, str(e), code="server_overloaded", headers={"Retry-After": "1"}) from e
        runner.metrics.prompt_tokens.inc(sum(len(p) for p in prompts))

    def cancel(self) -> None:
        for c in self.choices:
            c.cancel()

    async def complete(self) -> None:
        try:
            await asyncio.gather(*(c.run() for c in self.choices))
        finally:
            self.cancel()

    async def merged_deltas(self) -> AsyncIterator[tuple[int, str, str | None, int]]:
        """(choice index, delta, finish, tokens handed out so far) from all choices as they come. The token count
        is taken when the delta is made: the choice may already have produced more by the time the consumer reads
        it."""
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(i: int, c: ChoiceRun) -> None:
            try:
                async for delta, finish, count in c.deltas():
                    await queue.put((i, delta, finish, count))
            except BaseException as e:  # noqa: BLE001 - forwarded to the consumer, which re-raises
                await queue.put(e)

        tasks = [asyncio.create_task(pump(i, c)) for i, c in enumerate(self.choices)]
        try:
            finished = 0
            while finished < len(tasks):
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                if item[2] is not None:
                    finished += 1
                yield item
        finally:
            for t in tasks:
                t.cancel()
            self.cancel()

    def error(self) -> str | None:
        """The first engine failure among the choices, if any."""
        return next((c.error or "generation failed" for c in self.choices if c.finish_reason == "error"), None)

    def usage(self) -> dict[str, int]:
        return usage(sum(len(p) for p in self.prompts), sum(c.generated for c in self.choices))

    def stats(self, mode: str, loops_used: int) -> dict[str, Any]:
        wall = time.perf_counter() - self.started
        completion = sum(c.generated for c in self.choices)
        firsts = [c.first_token_at for c in self.choices if c.first_token_at is not None]
        ttft = (min(firsts) - self.started) if firsts else None
        first = self.choices[0] if self.choices else None
        out = {"wall_ms": round(wall * 1000, 3), "tokens_per_second": round(completion / wall, 3) if wall > 0 else 0.0,
                "prompt_tokens": sum(len(p) for p in self.prompts), "completion_tokens": completion, "mode": mode,
                "loops_used": loops_used, "time_to_first_token": round(ttft, 6) if ttft is not None else None,
                "generation_time": round(wall - (ttft or 0.0), 6),
                "stop_reason": lm_stop_reason(first)}
        if mode != "generate":
            rounds = proposed = accepted = 0
            for c in self.choices:
                r, p, a = c.draft_stats()
                rounds, proposed, accepted = rounds + r, proposed + p, accepted + a
            out.update(accepted_draft_tokens_count=accepted, rejected_draft_tokens_count=proposed - accepted,
                       total_draft_tokens_count=proposed,
                       mean_accepted_length=round(accepted / rounds, 4) if rounds else 0.0)
        return out


def lm_stop_reason(c: ChoiceRun | None) -> str | None:
    """LM Studio's `stats.stop_reason` for how a choice ended."""
    if c is None or c.finish_reason is None:
        return None
    if c.stopped_by_string:
        return "stopStringFound"
    return {"stop": "eosFound", "length": "maxPredictedTokensReached", "aborted": "userStopped",
            "error": "failed"}.get(c.finish_reason, c.finish_reason)


def stream_error(message: str) -> bytes:
    """The event that ends a stream whose generation failed after the 200 was sent (then `[DONE]` follows)."""
    return sse(error_body(500, message, code="engine_error"))


def _openai_params(req: OpenAISampling, repetition_penalty: float = 1.0) -> list[SamplingParams]:
    """One SamplingParams per sample; with a seed, sample i uses seed + i so the n samples differ."""
    return [SamplingParams(temperature=req.temperature, top_p=req.top_p, presence_penalty=req.presence_penalty,
                           frequency_penalty=req.frequency_penalty, repetition_penalty=repetition_penalty,
                           seed=None if req.seed is None else (req.seed + i) % 2**64,
                           max_tokens=req.resolved_max_tokens(),
                           min_tokens=req.min_tokens, ignore_eos=req.ignore_eos)
            for i in range(req.n)]


def _stops(stop: str | list[str] | None, default: list[str]) -> list[str]:
    if stop is None:
        return list(default)
    return [stop] if isinstance(stop, str) else list(stop)


def _loops_used(engine: Engine, req_loops: int | None) -> int:
    return req_loops if req_loops is not None else engine.info.default_loops


def _new_id(prefix: str) -> str:
    return f"{prefix}{uuid.uuid4().hex[:24]}"


def _extras(req: OpenAISampling) -> tuple[float, int | None, tuple[int, int, int] | None]:
    """(repetition_penalty, loops, draft) — the /api/v0 knobs; speculative modes verify at verify_loops."""
    if isinstance(req, LMStudioExtras):
        draft = req.draft()
        return req.repetition_penalty, req.verify_loops if draft else req.loops, draft
    return 1.0, req.loops, None


def start_chat(state: ServerState, req: ChatCompletionRequest) -> Request:
    req.check(state.max_tokens_limit)
    engine, _ = state.require_engine()
    prompt = engine.encode(render_chat(req.messages))
    rep, loops, draft = _extras(req)
    return Request(state, [prompt], req.n, _openai_params(req, rep), loops, _stops(req.stop, CHAT_DEFAULT_STOP), True,
                   draft, getattr(req, "mode", "generate"), getattr(req, "cache_window", 0))


def start_completion(state: ServerState, req: CompletionRequest) -> Request:
    req.check(state.max_tokens_limit)
    engine, _ = state.require_engine()
    p = req.prompt
    if isinstance(p, str):
        prompts = [engine.encode(p)]
    elif p and all(isinstance(x, int) for x in p):
        prompts = [list(p)]  # type: ignore[arg-type]
    elif p and all(isinstance(x, list) for x in p):
        prompts = [list(x) for x in p]  # type: ignore[union-attr]
    else:
        prompts = [engine.encode(x) for x in p]  # type: ignore[arg-type]
    if not prompts:
        raise APIError(400, "prompt must not be an empty list", param="prompt")
    rep, loops, draft = _extras(req)
    return Request(state, prompts, req.n, _openai_params(req, rep), loops, _stops(req.stop, []), False, draft,
                   getattr(req, "mode", "generate"), getattr(req, "cache_window", 0))


def chat_response(state: ServerState, req: ChatCompletionRequest, r: Request) -> dict[str, Any]:
    body = {"id": _new_id("chatcmpl-"), "object": "chat.completion", "created": int(time.time()), "model": req.model,
            "choices": [{"index": i, "message": {"role": "assistant", "content": c.text}, "finish_reason": c.finish_reason}
                        for i, c in enumerate(r.choices)],
            "usage": r.usage()}
    return _with_lm_sections(state, req, r, body)


def completion_response(state: ServerState, req: CompletionRequest, r: Request) -> dict[str, Any]:
    body = {"id": _new_id("cmpl-"), "object": "text_completion", "created": int(time.time()), "model": req.model,
            "choices": [{"text": c.text, "index": i, "logprobs": None, "finish_reason": c.finish_reason}
                        for i, c in enumerate(r.choices)],
            "usage": r.usage()}
    return _with_lm_sections(state, req, r, body)


def _with_lm_sections(state: ServerState, req: OpenAISampling, r: Request, body: dict[str, Any]) -> dict[str, Any]:
    if isinstance(req, LMStudioExtras):
        engine, _ = state.require_engine()
        body["stats"] = r.stats(req.mode, req.verify_loops if req.draft() else _loops_used(engine, req.loops))
        body["model_info"] = state.model_info()
        body["runtime"] = state.runtime()
    return body


async def chat_stream(state: ServerState, req: ChatCompletionRequest, r: Request) -> AsyncIterator[bytes]:
    base = {"id": _new_id("chatcmpl-"), "object": "chat.completion.chunk", "created": int(time.time()), "model": req.model}
    with_usage = bool(req.stream_options and req.stream_options.include_usage)

    def chunk(i: int, delta: dict[str, Any], finish: str | None) -> bytes:
        c = {**base, "choices": [{"index": i, "delta": delta, "finish_reason": finish}]}
        if with_usage:
            c["usage"] = None
        return sse(c)

    for i in range(len(r.choices)):
        yield chunk(i, {"role": "assistant"}, None)
    async for i, delta, finish, _ in r.merged_deltas():
        if delta:
            yield chunk(i, {"content": delta}, None)
        if finish is not None:
            yield chunk(i, {}, finish)
    if (error := r.error()) is not None:
        yield stream_error(error)
    if with_usage:
        yield sse({**base, "choices": [], "usage": r.usage()})
    yield SSE_DONE


async def completion_stream(state: ServerState, req: CompletionRequest, r: Request) -> AsyncIterator[bytes]:
    base = {"id": _new_id("cmpl-"), "object": "text_completion", "created": int(time.time()), "model": req.model}
    with_usage = bool(req.stream_options and req.stream_options.include_usage)

    def chunk(i: int, text: str, finish: str | None) -> bytes:
        c = {**base, "choices": [{"text": text, "index": i, "logprobs": None, "finish_reason": finish}]}
        if with_usage:
            c["usage"] = None
        return sse(c)

    async for i, delta, finish, _ in r.merged_deltas():
        if delta:
            yield chunk(i, delta, None)
        if finish is not None:
            yield chunk(i, "", finish)
    if (error := r.error()) is not None:
        yield stream_error(error)
    if with_usage:
        yield sse({**base, "choices": [], "usage": r.usage()})
    yield SSE_DONE


def start_generate(state: ServerState, req: GenerateRequest) -> tuple[Request, str, int]:
    """Native /generate and its speculative variants: (request, mode, loops used)."""
    req.check(state.max_tokens_limit)
    engine, _ = state.require_engine()
    prompt = engine.encode(req.prompt) if isinstance(req.prompt, str) else list(req.prompt)
    stop_ids: list[int] = []
    stop_text: list[str] = []
    if isinstance(req.stop, str):
        stop_text = [req.stop]
    elif req.stop:
        for s in req.stop:
            (stop_ids if isinstance(s, int) else stop_text).append(s)  # type: ignore[arg-type]
    vocab = engine.info.vocab_size
    if any(not 0 <= t < vocab for t in stop_ids):
        raise APIError(400, f"stop token ids must be in the vocabulary [0, {vocab})", param="stop")
    params = SamplingParams(temperature=req.temperature, top_k=req.top_k, top_p=req.top_p,
                            repetition_penalty=req.repetition_penalty, seed=req.sample_seed,
                            max_tokens=req.max_tokens, stop_token_ids=stop_ids)
    if isinstance(req, SpeculativeRequest):
        draft = (req.draft_loops, req.draft_ahead, getattr(req, "K_branches", 1))
        r = Request(state, [prompt], 1, [params], req.verify_loops, stop_text, False, draft, req.mode,
                    req.cache_window)
        return r, req.mode, req.verify_loops
    r = Request(state, [prompt], 1, [params], req.loops, stop_text, False, cache_window=req.cache_window)
    return r, "generate", req.loops


def generate_response(r: Request, mode: str, loops: int) -> dict[str, Any]:
    c = r.choices[0]
    return {"tokens": c.tokens, "text": c.text, "finish_reason": c.finish_reason, "stats": r.stats(mode, loops)}


async def generate_stream(r: Request) -> AsyncIterator[bytes]:
    """Native SSE: one event per token with the text handed out since the previous event, then the token_id -1
    tail event with the rest of the text and the finish reason, then [DONE] (an error event before it if the
    generation failed)."""
    c = r.choices[0]
    seen = 0
    pending = ""
    async for _, delta, finish, count in r.merged_deltas():
        pending += delta
        for t in c.tokens[seen:count]:
            yield sse({"token_id": t, "text": pending})
            pending = ""
        seen = count
        if finish is not None:
            yield sse({"token_id": -1, "text": pending, "finish_reason": finish})
            break
    if (error := r.error()) is not None:
        yield stream_error(error)
    yield SSE_DONE
