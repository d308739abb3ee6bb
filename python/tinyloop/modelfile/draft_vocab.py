"""The draft and exit vocabularies: a corpus's most frequent tokens, stored in the model file.

    tinyloop draft-vocab IN.tinyloop OUT.tinyloop --corpus TEXT [--size 4096] [--exit-size 256] [--exit-threshold T]

counts the tokens of a corpus (the model's training text, say) and writes the model again with two lists added —
tensors and every other key as they were:

- `tinyloop.draft.token_ids`, the `size` most frequent tokens (and always the end of text token): speculative drafts
  read only those rows of the head (rust/model/row_head.rs), a small fraction of the full 50,257-row head; since
  verification reads the full head, output does not change.
- `tinyloop.exit.token_ids`, the `exit_size` most frequent: the tokens `loops: "auto"`'s settling rule compares
  successive loops over. The rule only asks whether the distribution still moves, and the most frequent tokens
  carry much of its mass (the default model's 256: 63% of its training tokens), so a check costs a two-hundredth
  of the full head. `exit_size=0` writes no such list (the rule then compares over the draft vocabulary). A
  divergence over 256 tokens is not one over 4,096, so the threshold that keeps a given quality depends on the
  list: `--exit-threshold T` stores the one measured for it as the file's default (`tinyloop.exit_threshold`).
"""

from __future__ import annotations

import math
import os
from collections import Counter
from collections.abc import Iterable
from os import PathLike
from pathlib import Path

from .format import GGUFContents, V, read_gguf, write_gguf

KEY = "tinyloop.draft.token_ids"
EXIT_KEY = "tinyloop.exit.token_ids"
THRESHOLD_KEY = "tinyloop.exit_threshold"
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


def write_vocabularies(
    src: str | PathLike[str],
    dst: str | PathLike[str],
    ids: list[int],
    exit_ids: list[int] | None = None,
    exit_threshold: float | None = None,
) -> None:
    """Copy a model file, its tensors bit for bit, with the draft vocabulary set to `ids` and the exit vocabulary to
    `exit_ids` (None: the file's exit vocabulary, if any, is dropped); `exit_threshold` sets the file's default
    threshold for `loops: "auto"` (None: the file's stays as it is)."""
    if exit_threshold is not None and not 0 <= exit_threshold < math.inf:
        raise ValueError(f"exit threshold must be finite and >= 0, got {exit_threshold}")
    contents = read_gguf(src, raw=True)
    vocab_size = len(contents.metadata["tokenizer.ggml.tokens"][0])
    bad = [t for t in [*ids, *(exit_ids or [])] if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"token id {bad[0]} is outside the {vocab_size}-token vocabulary")
    metadata = dict(contents.metadata)
    metadata[KEY] = (sorted(set(ids)), V.ARRAY, V.UINT32)
    metadata.pop(EXIT_KEY, None)
    if exit_ids is not None:
        metadata[EXIT_KEY] = (sorted(set(exit_ids)), V.ARRAY, V.UINT32)
    if exit_threshold is not None:
        metadata[THRESHOLD_KEY] = (float(exit_threshold), V.FLOAT32)
    tmp = Path(f"{dst}.tmp")  # then renamed: `dst` may be `src`, still mapped by the reader
    write_gguf(tmp, GGUFContents(metadata, contents.tensors))
    os.replace(tmp, dst)


def build(
    src: Path, dst: Path, corpus: Path, size: int = 4096, exit_size: int = 256, exit_threshold: float | None = None
) -> tuple[list[int], list[int], float]:
    """Count `corpus` with the model's own tokenizer, write `dst` (with `exit_threshold`, if given, as its default
    threshold); returns the draft ids, the exit ids (empty when `exit_size` is 0) and the draft ids' corpus
    coverage."""
    from .. import Engine

    if exit_size < 0:
        raise ValueError(f"exit size must be >= 0, got {exit_size}")
    engine = Engine(src)
    counts = count_tokens(engine.encode, corpus.read_text(encoding="utf-8"))
    ids = top_tokens(counts, size, always=[engine.eos_token_id])
    exit_ids = top_tokens(counts, exit_size) if exit_size else []
    write_vocabularies(src, dst, ids, exit_ids or None, exit_threshold)
    return ids, exit_ids, coverage(counts, ids)
