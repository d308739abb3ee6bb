"""Model shapes the tests and benches build random models of (tests/conftest.py writes them)."""

from __future__ import annotations

import dataclasses

from tinyloop.modelfile.format import ModelConfig

# A tiny GQA model with a prelude (2 query heads per KV head) and one without prelude, both full GPT-2 vocab.
TINY = ModelConfig(
    dim=64,
    n_heads=4,
    n_kv_heads=2,
    ffn_dim=96,
    block_count=2,
    prelude_count=1,
    default_loops=3,
    context_length=256,
    name="tiny-test",
)
TINY_NOPRE = dataclasses.replace(TINY, prelude_count=0, n_kv_heads=4, tied_head=False, name="tiny-nopre")
