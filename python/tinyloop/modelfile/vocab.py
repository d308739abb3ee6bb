"""The GPT-2 vocabulary that every tinyloop model file embeds.

The ranks come from ``assets/gpt2.tiktoken`` (MIT licensed, taken from the ``openai-whisper`` sdist; see
``scripts/fetch_gpt2_vocab.py``). GGUF wants token *strings* and *merges*:

* a token string is the token's bytes spelled with GPT-2's byte-to-unicode table;
* the 50,000 merges are recovered by re-running BPE on each token's bytes with only lower ranks allowed
  (what llama.cpp's converter does for tiktoken vocabularies); the last step always joins exactly two parts.
"""

from __future__ import annotations

import base64
import functools
import hashlib
from dataclasses import dataclass
from pathlib import Path

GPT2_TIKTOKEN = Path(__file__).parents[1] / "assets" / "gpt2.tiktoken"
GPT2_TIKTOKEN_SHA256 = "306cd27f03c1a714eca7108e03d66b7dc042abe8c258b44c199a7ed9838dd930"
EOT_TOKEN = "<|endoftext|>"
EOT_ID = 50256
# GPT-2's pre-tokenizer, as tiktoken spells it (possessive form, equivalent to the original).
GPT2_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)|\s"""


@dataclass(frozen=True)
class Vocabulary:
    tokens: list[str]  # GGUF token strings (byte-to-unicode spelling), index = id
    token_types: list[int]  # llama.cpp TokenType: 1 normal, 3 control
    merges: list[str]  # "left right", in priority order
    eos_token_id: int
    bos_token_id: int
    pre: str = "gpt-2"  # the pre-tokenizer's name (tokenizer.ggml.pre): gpt-2, qwen2 or llama-bpe
    add_bos_token: bool = False  # plain-text prompts start with bos_token_id
    end_token_ids: tuple[int, ...] = ()  # further tokens that end generation as eos does

    def __len__(self) -> int:
        return len(self.tokens)


@functools.cache
def byte_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from bytes to printable unicode characters."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    chars = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(printable, chars, strict=True)}


def spell(token: bytes) -> str:
    table = byte_to_unicode()
    return "".join(table[b] for b in token)


@functools.cache
def gpt2_ranks() -> dict[bytes, int]:
    """bytes -> rank from the shipped gpt2.tiktoken, checked against its published sha256."""
    raw = GPT2_TIKTOKEN.read_bytes()
    digest = hashlib.sha256(raw).hexdigest()
    if digest != GPT2_TIKTOKEN_SHA256:
        raise RuntimeError(f"{GPT2_TIKTOKEN} has sha256 {digest}, expected {GPT2_TIKTOKEN_SHA256}")
    ranks: dict[bytes, int] = {}
    for line in raw.splitlines():
        if line:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    return ranks


def _last_merge(token: bytes, ranks: dict[bytes, int]) -> tuple[bytes, bytes]:
    """Run BPE on `token` using only ranks below its own; return the final two parts."""
    limit = ranks[token]
    parts = [token[i : i + 1] for i in range(len(token))]
    while len(parts) > 2:
        best = None
        for i in range(len(parts) - 1):
            rank = ranks.get(parts[i] + parts[i + 1])
            if rank is not None and rank < limit and (best is None or rank < best[0]):
                best = (rank, i)
        if best is None:
            break
        i = best[1]
        parts[i : i + 2] = [parts[i] + parts[i + 1]]
    if len(parts) != 2:
        raise ValueError(f"token {token!r} is not reachable by BPE merges of lower rank")
    return parts[0], parts[1]


@functools.cache
def gpt2_vocabulary() -> Vocabulary:
    ranks = gpt2_ranks()
    by_rank = sorted(ranks.items(), key=lambda kv: kv[1])
    if [r for _, r in by_rank] != list(range(len(by_rank))):
        raise RuntimeError("gpt2.tiktoken ranks are not 0..n-1")
    tokens = [spell(b) for b, _ in by_rank] + [EOT_TOKEN]
    types = [1] * len(by_rank) + [3]
    merges = []
    for token, _ in by_rank:
        if len(token) > 1:
            left, right = _last_merge(token, ranks)
            merges.append(f"{spell(left)} {spell(right)}")
    return Vocabulary(tokens, types, merges, eos_token_id=EOT_ID, bos_token_id=EOT_ID)


def tiktoken_gpt2():  # pragma: no cover - exercised by the tests; tiktoken is a test dependency
    """tiktoken's GPT-2 encoding built offline from the shipped ranks (the tokenizer parity reference)."""
    import tiktoken

    return tiktoken.Encoding(
        name="gpt2",
        pat_str=GPT2_PATTERN,
        mergeable_ranks=gpt2_ranks(),
        special_tokens={EOT_TOKEN: EOT_ID},
        explicit_n_vocab=EOT_ID + 1,
    )
