"""The Rust forward pass against the independent NumPy reference (tests/reference.py), and the cache's behaviour."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import tinyloop
from tinyloop.format import dequantized

from conftest import TINY, TINY_NOPRE
from reference import forward as ref_forward

PROMPT = [464, 3139, 286, 4881, 318, 6342, 13, 198, 50256, 1, 40000, 262, 262, 262]

# GQA and no prelude / untied head; and a model where every head has its own KV head plus a prelude.
CONFIGS = {
    "gqa-prelude": TINY,
    "mha-noprelude-untied": TINY_NOPRE,
    "gqa4-prelude2": dataclasses.replace(TINY, n_heads=8, n_kv_heads=2, prelude_count=2, name="gqa4"),
}


def engine_logits(path, tokens, loops, chunks=None):
    engine = tinyloop.Engine(path)
    seq = engine.sequence()
    chunks = chunks or [len(tokens)]
    out, start = [], 0
    for n in chunks:
        out.append(np.frombuffer(seq.feed(tokens[start : start + n], loops), dtype=np.float32))
        start += n
    return np.concatenate(out).reshape(len(tokens), -1)


def rel_err(a, b):
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


@pytest.mark.parametrize("name", CONFIGS)
@pytest.mark.parametrize("loops", [1, 2, 3, 8])
def test_f32_matches_numpy_reference(model_factory, name, loops):
    m = model_factory(CONFIGS[name])
    got = engine_logits(m.path, PROMPT, loops)
    want = ref_forward(m.cfg, m.weights, PROMPT, loops, kv_dtype=np.float32)
    assert got.shape == want.shape == (len(PROMPT), 50257)
    assert rel_err(got, want) <= 1e-4
    # The check has teeth: a different depth is far away.
    other = ref_forward(m.cfg, m.weights, PROMPT, loops + 1, kv_dtype=np.float32)
    assert rel_err(got, other) > 1e-2


# F16 weights: the reference uses the same f16-rounded weights, and K/V rounded to f16 like the cache; what remains
# is f32 accumulation order, so the bound is the F32 one. Q8_0 weights: candle also quantizes each activation row to
# Q8_0 blocks (8-bit, per 32 values) before the integer dot product, an error of up to ~0.4% per dot product that
# compounds over 2 layers x loops; 3% of the logit range at 8 loops covers it with margin on these random models,
# while a wrong dequantization (e.g. a swapped block scale) is off by far more (checked below against F32 weights).
QUANT_TOL = {"F16": 1e-4, "Q8_0": 3e-2}


@pytest.mark.parametrize("weight_type", ["F16", "Q8_0"])
@pytest.mark.parametrize("loops", [1, 3, 8])
def test_quantized_weights_match_reference(model_factory, weight_type, loops):
    m = model_factory(TINY, weight_type=weight_type)
    got = engine_logits(m.path, PROMPT, loops)
    wq = {k: dequantized(v, "F32" if v.ndim == 1 else weight_type) for k, v in m.weights.items()}
    want = ref_forward(m.cfg, wq, PROMPT, loops, kv_dtype=np.float16)
    assert rel_err(got, want) <= QUANT_TOL[weight_type]
    assert tinyloop.Engine(m.path).info.kv_dtype == "f16"


def test_decode_equals_prefill_and_rollback(tiny):
    loops = 3
    full = engine_logits(tiny.path, PROMPT, loops)
    stepwise = engine_logits(tiny.path, PROMPT, loops, chunks=[5] + [1] * (len(PROMPT) - 5))
    np.testing.assert_allclose(stepwise, full, rtol=0, atol=1e-4 * np.abs(full).max())

    engine = tinyloop.Engine(tiny.path)
    seq = engine.sequence()
    first = np.frombuffer(seq.feed(PROMPT, loops), dtype=np.float32).reshape(len(PROMPT), -1)
    seq.truncate(6)
    assert len(seq) == 6
    # Feed different tokens after the rollback, then roll back again and re-decode the original suffix.
    seq.feed([11, 12, 13], loops)
    seq.truncate(6)
    again = np.frombuffer(seq.feed(PROMPT[6:], loops), dtype=np.float32).reshape(len(PROMPT) - 6, -1)
    np.testing.assert_allclose(again, first[6:], rtol=0, atol=1e-4 * np.abs(first).max())


def test_kv_bytes_count_every_loop_and_layer(tiny):
    engine = tinyloop.Engine(tiny.path)
    seq = engine.sequence()
    seq.feed(PROMPT[:10], 4)
    cfg = tiny.cfg
    per_token = (cfg.prelude_count + 4 * cfg.block_count) * 2 * cfg.n_kv_heads * cfg.head_dim * 4  # f32 cache
    assert seq.kv_bytes == 10 * per_token
    seq.truncate(3)
    assert seq.kv_bytes == 3 * per_token


def test_cache_capacity_and_depth_errors(tiny):
    engine = tinyloop.Engine(tiny.path)
    seq = engine.sequence(capacity=8)
    with pytest.raises(tinyloop.ContextLengthError, match="9 positions needed but the limit is 8"):
        seq.feed(list(range(9)), 2)
    with pytest.raises(tinyloop.InvalidRequestError, match="loops"):
        seq.feed([1, 2], 65)
    with pytest.raises(tinyloop.InvalidRequestError, match="vocabulary"):
        seq.feed([50257], 1)
    seq.feed([1, 2, 3], 2)
    # Deeper loops were never computed for the earlier tokens: refused, not silently wrong.
    with pytest.raises(tinyloop.EngineError, match="holds 0 positions"):
        seq.feed([4], 3)
