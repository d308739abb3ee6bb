"""The native family: `/generate`, `/generate/speculative`, `/generate/tree_speculative` — token ids and text,
with the loop knobs and `stats`; SSE streams one event per token."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter

from .errors import APIError
from .protocol import GenerateRequest, SpeculativeRequest, TreeSpeculativeRequest
from .request import Plan, RunningRequest, respond, tokenize
from .sse import SSE_DONE, sse, stream_error
from .state import ServerState, State

router = APIRouter()


async def plan(state: ServerState, req: GenerateRequest) -> Plan:
    """`stop` may mix strings (matched in the text) and token ids (the engine stops on them)."""
    req.with_defaults(state.defaults())
    req.check(state.max_tokens_limit)
    engine, _ = state.require_engine()
    stops = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    stop_ids = [s for s in stops if isinstance(s, int)]
    vocab = engine.info.vocab_size
    if any(not 0 <= t < vocab for t in stop_ids):
        raise APIError(400, f"stop token ids must be in the vocabulary [0, {vocab})", param="stop")
    prompts = await tokenize(state, [req.prompt]) if isinstance(req.prompt, str) else [list(req.prompt)]
    return Plan(prompts, [req.generation(stop_ids)], req.mode_label(), [s for s in stops if isinstance(s, str)])


def body(r: RunningRequest) -> dict[str, Any]:
    c = r.choices[0]
    return {"tokens": c.tokens, "text": c.text, "finish_reason": c.finish_reason, "stats": r.stats()}


async def events(r: RunningRequest) -> AsyncIterator[bytes]:
    """One event per token with the text handed out since the previous event, then the token_id -1 tail event with
    the rest of the text and the finish reason, then [DONE] (an error event before it if the generation failed)."""
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


async def _answer(state: ServerState, req: GenerateRequest):
    return await respond(state, await plan(state, req), req.stream, body, events)


@router.post("/generate")
async def generate(req: GenerateRequest, state: State):
    return await _answer(state, req)


@router.post("/generate/speculative")
async def generate_speculative(req: SpeculativeRequest, state: State):
    return await _answer(state, req)


@router.post("/generate/tree_speculative")
async def generate_tree_speculative(req: TreeSpeculativeRequest, state: State):
    return await _answer(state, req)
