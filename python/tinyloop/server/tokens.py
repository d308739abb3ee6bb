"""`POST /tokenize` and `POST /detokenize` in llama.cpp's server's shapes: text to the model's token ids (each with
its piece, on request) and ids back to text.

`add_special` adds the special tokens the model's tokenizer puts before a text: the beginning-of-sequence token for
a file whose tokenizer adds it (`add_bos_token`, Llama's), none for GPT-2's or Qwen2's. `parse_special` (default
true, as in llama.cpp) reads control tokens' text (`<|endoftext|>`) as those tokens; false encodes it as plain text.
"""

from __future__ import annotations

import asyncio

from fastapi import APIRouter

from ..errors import APIError
from .state import State
from .strict import Strict

router = APIRouter()


class TokenizeRequest(Strict):
    content: str
    add_special: bool = False
    parse_special: bool = True
    with_pieces: bool = False


class DetokenizeRequest(Strict):
    tokens: list[int]


def piece(raw: bytes) -> str | list[int]:
    """A token's piece as llama.cpp writes it: the text when its bytes are whole UTF-8, else the byte values."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return list(raw)


@router.post("/tokenize")
async def tokenize(req: TokenizeRequest, state: State):
    engine, _ = state.require_engine()
    loop = asyncio.get_running_loop()
    ids = await loop.run_in_executor(
        state.tokenizer_pool,
        lambda: engine.encode(req.content, allow_special=req.parse_special, add_special=req.add_special),
    )
    if not req.with_pieces:
        return {"tokens": ids}
    return {"tokens": [{"id": t, "piece": piece(engine.token_bytes(t))} for t in ids]}


@router.post("/detokenize")
async def detokenize(req: DetokenizeRequest, state: State):
    engine, _ = state.require_engine()
    vocab = engine.info.vocab_size
    bad = next((t for t in req.tokens if not 0 <= t < vocab), None)
    if bad is not None:
        raise APIError(400, f"token id {bad} is not in the vocabulary [0, {vocab})", param="tokens")
    loop = asyncio.get_running_loop()
    return {"content": await loop.run_in_executor(state.tokenizer_pool, engine.decode, req.tokens)}
