"""Log probabilities in OpenAI's shapes: chat's `logprobs.content` entries and completions' parallel lists. The
values are the engine's (`StepEvent.logprob`: the log-softmax of the raw logits, what `Engine.score` computes);
each token is named by its text (bytes that are not whole UTF-8 characters shown as U+FFFD) and its `bytes`."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .._core import Engine

# One token's engine entry: (log-probability, [(alternative id, its log-probability), ...]); None for a prompt's
# first token, which nothing predicts.
Entry = tuple[float, list[tuple[int, float]]]


@dataclass(frozen=True)
class Echo:
    """A completion's prompt, returned before the completion (`echo`): its text, its tokens and, when log
    probabilities are asked for, each token's entry."""

    text: str
    tokens: list[int]
    entries: list[Entry | None]


def echo(engine: Engine, text: str | None, tokens: list[int], loops: int, n: int | None) -> Echo:
    """The prompt as given (or decoded, for token ids) and, with `n`, its log-probabilities at depth `loops`."""
    entries: list[Entry | None] = []
    if n is not None:
        entries = [None, *(engine.prompt_logprobs(tokens, loops, n) if len(tokens) > 1 else [])]
    return Echo(engine.decode(tokens) if text is None else text, tokens, entries)


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


def completion_lists(engine: Engine, tokens: list[int], entries: Sequence[Entry | None], offset: int) -> dict[str, Any]:
    """`choices[i].logprobs` of completions: tokens, token_logprobs, top_logprobs (a dict per token) and text_offset
    (each token's start in the choice's text, counting from `offset`); an echoed prompt's first token has nulls."""
    names, offsets, position = [], [], offset
    for token in tokens:
        text, _ = _named(engine, token)
        names.append(text)
        offsets.append(position)
        position += len(text)
    return {
        "tokens": names,
        "token_logprobs": [e[0] if e else None for e in entries],
        "top_logprobs": [{_named(engine, alt)[0]: lp for alt, lp in e[1]} if e else None for e in entries],
        "text_offset": offsets,
    }
