"""`POST /tokenize`, `POST /detokenize` and `GET /tokenizer_info`: text to the model's token ids and back, in
llama.cpp's server's shapes and in vLLM's (which lm-evaluation-harness's remote tokenizer speaks).

`/tokenize` takes one of two bodies, told apart by the text's field:
- llama.cpp's, `{"content": ...}` with `add_special`, `parse_special`, `with_pieces`; answers `{"tokens": [...]}`.
  `add_special` adds the special tokens the model's tokenizer puts before a text: the beginning-of-sequence token
  for a file whose tokenizer adds it (`add_bos_token`, Llama's), none for GPT-2's or Qwen2's. `parse_special`
  (default true, as in llama.cpp) reads control tokens' text (`<|endoftext|>`) as those tokens; false encodes it as
  plain text.
- vLLM's, `{"prompt": ...}` with `add_special_tokens` (default true, as in vLLM: the same special tokens as
  `add_special`), `return_token_strs` and `model`; answers `{"count", "max_model_len", "tokens", "token_strs"}`.
  Control tokens' text is read as those tokens, as Hugging Face tokenizers (and so vLLM) do.
A body with both texts or neither, or with a field of the other shape, is a 400 naming it.

`/detokenize` takes `{"tokens": [...]}` (and vLLM's optional `model`) and answers with the text under both
servers' names: `content` (llama.cpp) and `prompt` (vLLM).

`/tokenizer_info` is vLLM's: the tokenizer's configuration as `tokenizer_config.json` has it (`eos_token`,
`bos_token`, `pad_token`, `add_bos_token`, `model_max_length`, `chat_template` when the file has one, and
`tokenizer_class`), from which lm-eval finds the end-of-text and prefix tokens.
"""

from __future__ import annotations

import asyncio
from functools import cache
from typing import Any

from fastapi import APIRouter

from .errors import APIError
from .state import State
from .strict import Strict

router = APIRouter()

LLAMA_CPP_FIELDS = ("add_special", "parse_special", "with_pieces")
VLLM_FIELDS = ("add_special_tokens", "return_token_strs", "model")


class TokenizeRequest(Strict):
    content: str | None = None  # llama.cpp's text
    add_special: bool = False
    parse_special: bool = True
    with_pieces: bool = False
    prompt: str | None = None  # vLLM's text
    add_special_tokens: bool = True
    return_token_strs: bool | None = False
    model: str | None = None


class DetokenizeRequest(Strict):
    tokens: list[int]
    model: str | None = None  # vLLM's; the server's model answers (with `--models-dir`, the one it names)


def piece(raw: bytes) -> str | list[int]:
    """A token's piece as llama.cpp writes it: the text when its bytes are whole UTF-8, else the byte values."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return list(raw)


@cache
def _byte_chars() -> list[str]:
    """GPT-2's byte-to-character table, which byte-level BPE vocabularies (every tinyloop tokenizer's) are written
    in: printable Latin-1 bytes stand for themselves, the others for the characters from U+0100 on."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


def token_str(raw: bytes) -> str:
    """A token as Hugging Face's `convert_ids_to_tokens` writes it (vLLM's `token_strs`): its vocabulary entry, the
    bytes in GPT-2's byte alphabet (`Ġworld` for ` world`)."""
    table = _byte_chars()
    return "".join(table[b] for b in raw)


def _shape(req: TokenizeRequest) -> str:
    """Which server's body this is ("llama.cpp" or "vllm"); 400 for both texts, neither, or mixed fields."""
    sent = req.model_fields_set
    if req.content is not None and req.prompt is not None:
        raise APIError(400, "send the text as either `content` (llama.cpp) or `prompt` (vLLM), not both", "prompt")
    if req.content is None and req.prompt is None:
        raise APIError(400, "the text to tokenize is missing: send `content` (llama.cpp) or `prompt` (vLLM)", "content")
    if req.prompt is not None:
        shape, text, other = "vllm", "prompt", LLAMA_CPP_FIELDS
    else:
        shape, text, other = "llama.cpp", "content", VLLM_FIELDS
    stray = next((f for f in other if f in sent), None)
    if stray is not None:
        raise APIError(400, f"unsupported parameter: {stray} does not go with `{text}`", param=stray)
    return shape


@router.post("/tokenize")
async def tokenize(req: TokenizeRequest, state: State):
    shape = _shape(req)
    engine, _ = state.require_engine()
    loop = asyncio.get_running_loop()
    if shape == "vllm":
        assert req.prompt is not None
        text, add = req.prompt, req.add_special_tokens
        ids = await loop.run_in_executor(
            state.tokenizer_pool, lambda: engine.encode(text, allow_special=True, add_special=add)
        )
        strs = [token_str(engine.token_bytes(t)) for t in ids] if req.return_token_strs else None
        return {"count": len(ids), "max_model_len": engine.info.max_seq_len, "tokens": ids, "token_strs": strs}
    assert req.content is not None
    content = req.content
    ids = await loop.run_in_executor(
        state.tokenizer_pool,
        lambda: engine.encode(content, allow_special=req.parse_special, add_special=req.add_special),
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
    text = await loop.run_in_executor(state.tokenizer_pool, engine.decode, req.tokens)
    return {"content": text, "prompt": text}


def _text(engine: Any, token: int) -> str:
    return engine.token_bytes(token).decode("utf-8", errors="replace")


@router.get("/tokenizer_info")
async def tokenizer_info(state: State):
    engine, _ = state.require_engine()
    info: dict[str, Any] = {
        "tokenizer_class": "TinyloopBPETokenizer",
        "eos_token": _text(engine, engine.eos_token_id),
        "bos_token": _text(engine, engine.bos_token_id),
        "pad_token": None,
        "add_bos_token": engine.add_bos_token,
        "add_eos_token": False,
        "model_max_length": engine.info.max_seq_len,
    }
    if engine.chat_template:
        info["chat_template"] = engine.chat_template
    return info
