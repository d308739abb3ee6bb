"""Log probabilities in OpenAI's shapes: chat's `logprobs.content` entries and completions' parallel lists. The
values are the engine's (`StepEvent.logprob`: the log-softmax of the raw logits, what `Engine.score` computes);
each token is named by its text (bytes that are not whole UTF-8 characters shown as U+FFFD) and its `bytes`."""

from __future__ import annotations

from typing import Any

from .._core import Engine

# One token's engine entry: (log-probability, [(alternative id, its log-probability), ...]).
Entry = tuple[float, list[tuple[int, float]]]


def _named(engine: Engine, token: int) -> tuple[str, list[int]]:
    raw = engine.token_bytes(token)
    return raw.decode("utf-8", errors="replace"), list(raw)


def chat_content(engine: Engine, tokens: list[int], entries: list[Entry]) -> list[dict[str, Any]]:
    """`choices[i].logprobs.content` of chat completions (also each stream chunk's, for its tokens)."""
    out = []
    for token, (logprob, top) in zip(tokens, entries, strict=True):
        text, raw = _named(engine, token)
        alternatives = []
        for alt, alt_logprob in top:
            alt_text, alt_raw = _named(engine, alt)
            alternatives.append({"token": alt_text, "logprob": alt_logprob, "bytes": alt_raw})
        out.append({"token": text, "logprob": logprob, "bytes": raw, "top_logprobs": alternatives})
    return out


def completion_lists(engine: Engine, tokens: list[int], entries: list[Entry], offset: int) -> dict[str, Any]:
    """`choices[i].logprobs` of completions: tokens, token_logprobs, top_logprobs (a dict per token) and text_offset
    (each token's start in the choice's text, counting from `offset`)."""
    names, offsets, position = [], [], offset
    for token in tokens:
        text, _ = _named(engine, token)
        names.append(text)
        offsets.append(position)
        position += len(text)
    return {
        "tokens": names,
        "token_logprobs": [logprob for logprob, _ in entries],
        "top_logprobs": [{_named(engine, alt)[0]: lp for alt, lp in top} for _, top in entries],
        "text_offset": offsets,
    }
