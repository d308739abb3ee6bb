"""The LM Studio family (`/api/v0`): the OpenAI endpoints with the loop knobs (`mode`, speculative settings,
`cache_window`, `repetition_penalty`) and `stats`, `model_info` and `runtime` — in a non-streamed answer's body, and
in a stream's last chunk (the usage chunk, when the stream has one)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from . import openai
from .protocol import LMChatCompletionRequest, LMCompletionRequest
from .request import RunningRequest, respond
from .state import ServerState, State

router = APIRouter(prefix="/api/v0")


def sections(state: ServerState, r: RunningRequest) -> dict[str, Any]:
    return {"stats": r.stats(), "model_info": state.model_info(), "runtime": state.runtime()}


def with_sections(state: ServerState, r: RunningRequest, body: dict[str, Any]) -> dict[str, Any]:
    return {**body, **sections(state, r)}


@router.get("/models")
async def models(state: State):
    return state.models()


@router.post("/chat/completions")
async def chat(req: LMChatCompletionRequest, state: State):
    plan = await openai.chat_plan(state, req)
    return await respond(
        state,
        plan,
        req.stream,
        lambda r: with_sections(state, r, openai.chat_body(req, r)),
        lambda r: openai.chat_events(req, r, openai.Framing(state.always_usage, lambda r: sections(state, r))),
    )


@router.post("/completions")
async def completions(req: LMCompletionRequest, state: State):
    plan = await openai.completion_plan(state, req)
    return await respond(
        state,
        plan,
        req.stream,
        lambda r: with_sections(state, r, openai.completion_body(req, r)),
        lambda r: openai.completion_events(req, r, openai.Framing(state.always_usage, lambda r: sections(state, r))),
    )
