"""The draft vocabulary: the tokens speculative drafts may propose, stored in the model file.

    tinyloop draft-vocab IN.tinyloop OUT.tinyloop --corpus TEXT [--size 4096]

counts the tokens of a corpus (the model's training text, say), keeps the `size` most frequent (and always the end
of text token) and writes the model again with `tinyloop.draft.token_ids` added — tensors and every other key as
they were. The engine then drafts through those rows of the head only (rust/draft_head.rs): a draft costs a small
fraction of the full 50,257-row head, and since verification reads the full head, output does not change.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Iterable
from os import PathLike
from pathlib import Path

from .format import GGUFContents, V, read_gguf, write_gguf

KEY = "tinyloop.draft.token_ids"
PASSAGE_SEPARATOR = "\n<|endoftext|>\n"


def count_tokens(encode, text: str) -> Counter[int]:
    """Token counts of `text`, encoded passage by passage (passages end with the end-of-text token)."""
    counts: Counter[int] = Counter()
    for passage in text.split(PASSAGE_SEPARATOR):
        if passage.strip():
            counts.update(encode(passage))
    return counts


def top_tokens(counts: Counter[int], size: int, always: Iterable[int] = ()) -> list[int]:
    """The `size` most frequent ids (ties: lower id first), plus `always`; ascending."""
    if size < 1:
        raise ValueError(f"size must be >= 1, got {size}")
    keep = set(always)
    for t, _ in sorted(counts.items(), key=lambda e: (-e[1], e[0])):
        if len(keep) >= size:
            break
        keep.add(t)
    return sorted(keep)


def coverage(counts: Counter[int], ids: Iterable[int]) -> float:
    """Share of the counted tokens that are in `ids`."""
    total = sum(counts.values())
    return sum(counts[t] for t in set(ids)) / total if total else 0.0


def write_with_draft_vocab(src: str | PathLike[str], dst: str | PathLike[str], ids: list[int]) -> None:
    """Copy a model file, its tensors bit for bit, with the draft vocabulary key set to `ids`."""
    contents = read_gguf(src, raw=True)
    vocab_size = len(contents.metadata["tokenizer.ggml.tokens"][0])
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"token id {bad[0]} is outside the {vocab_size}-token vocabulary")
    metadata = dict(contents.metadata)
    metadata[KEY] = (sorted(set(ids)), V.ARRAY, V.UINT32)
    tmp = Path(f"{dst}.tmp")  # then renamed: `dst` may be `src`, still mapped by the reader
    write_gguf(tmp, GGUFContents(metadata, contents.tensors))
    os.replace(tmp, dst)


def build(src: Path, dst: Path, corpus: Path, size: int = 4096) -> tuple[list[int], float]:
    """Count `corpus` with the model's own tokenizer, write `dst`; returns the ids and their corpus coverage."""
    from .. import Engine

    engine = Engine(src)
    counts = count_tokens(engine.encode, corpus.read_text(encoding="utf-8"))
    ids = top_tokens(counts, size, always=[engine.eos_token_id])
    write_with_draft_vocab(src, dst, ids)
    return ids, coverage(counts, ids)
