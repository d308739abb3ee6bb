"""The Rust forward pass against the independent NumPy reference (tests/reference.py), and the cache's behaviour."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import tinyloop
from conftest import TINY, TINY_NOPRE
from reference import forward as ref_forward
from tinyloop.modelfile.format import dequantized

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


# Tolerances for quantized weights (relative to the largest |logit|), each against a reference that uses the file's
# own dequantized weights and rounds K/V to f16 like the cache:
# - F16: weights are exact in f32, so only accumulation order remains: the F32 bound, 1e-4 (measured ~1e-5).
# - Q4_0: the kernel quantizes each activation row to Q8_0 (8 bits per 32 values) before the integer dot product;
#   the reference does the same (act_q8). Measured 1e-7 at most depths; where an activation sits on a rounding
#   boundary one quantization step flips and the logits move by up to ~2e-3, hence 1e-2. A wrong weight decode is
#   off by > 0.1 (checked below: the unquantized weights already differ by ~0.2).
# - Q8_0: on AVX-512 machines candle repacks Q8_0 weights and quantizes activations per 256 values (Q8_K), on others
#   per 32 (Q8_0), so no single activation model is exact here; both are within 1.4e-2 of the float-activation
#   reference on these random models, hence 2.5e-2.
QUANT_CASES = {"F16": (1e-4, False), "BF16": (1e-4, False), "Q4_0": (1e-2, True), "Q8_0": (2.5e-2, False)}


@pytest.mark.parametrize("weight_type", QUANT_CASES)
@pytest.mark.parametrize("loops", [1, 3, 8])
def test_quantized_weights_match_reference(model_factory, weight_type, loops):
    m = model_factory(TINY, weight_type=weight_type)
    tol, act_q8 = QUANT_CASES[weight_type]
    got = engine_logits(m.path, PROMPT, loops)
    wq = {k: dequantized(v, "F32" if v.ndim == 1 else weight_type) for k, v in m.weights.items()}
    want = ref_forward(m.cfg, wq, PROMPT, loops, kv_dtype=np.float16, act_q8=act_q8)
    assert rel_err(got, want) <= tol
    if weight_type == "Q4_0":
        assert rel_err(got, ref_forward(m.cfg, m.weights, PROMPT, loops)) > 0.1
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


def test_score_reads_every_depth_in_one_pass(tiny):
    engine = tinyloop.Engine(tiny.path)
    depths = [1, 3, 5]
    scored = engine.score(PROMPT, depths)
    assert len(scored) == 3
    for d, (logp, argmax) in zip(depths, scored, strict=True):
        want = ref_forward(tiny.cfg, tiny.weights, PROMPT, d)[:-1]
        want_logp = (
            want - np.log(np.exp(want - want.max(1, keepdims=True)).sum(1, keepdims=True)) - want.max(1, keepdims=True)
        )
        np.testing.assert_allclose(logp, want_logp[np.arange(len(PROMPT) - 1), PROMPT[1:]], atol=1e-3)
        assert argmax == list(want.argmax(1))
    with pytest.raises(tinyloop.InvalidRequestError, match="ascending"):
        engine.score(PROMPT, [3, 1])


# Quantized KV: the reference rounds K and V per (token, head) exactly as the cache does (int4-h: rotate, round,
# rotate back); what remains is f32 vs f64 arithmetic and the occasional value on a rounding boundary, which moves
# by one step (int8: max|x|/127; int4: (max-min)/15, so its bound is looser). Against the unrounded reference each
# mode is off by much more (checked below), so the bounds do test the rounding.
KV_MODES = {"int8": 1e-3, "int4": 5e-3, "int4-h": 5e-3}


@pytest.mark.parametrize("mode", list(KV_MODES))
@pytest.mark.parametrize("loops", [1, 3, 8])
def test_quantized_kv_matches_reference(tiny, mode, loops):
    engine = tinyloop.Engine(tiny.path, kv_cache_mode=mode)
    assert (engine.info.kv_cache_mode, engine.info.kv_dtype) == (mode, mode)
    seq = engine.sequence()
    got = np.frombuffer(seq.feed(PROMPT, loops), dtype=np.float32).reshape(len(PROMPT), -1)
    want = ref_forward(tiny.cfg, tiny.weights, PROMPT, loops, kv_dtype=mode)
    assert rel_err(got, want) <= KV_MODES[mode]
    assert rel_err(got, ref_forward(tiny.cfg, tiny.weights, PROMPT, loops)) > 3 * rel_err(got, want)
    cfg = tiny.cfg
    row = cfg.head_dim + 4 if mode == "int8" else cfg.head_dim // 2 + 4
    per_token = (cfg.prelude_count + loops * cfg.block_count) * 2 * cfg.n_kv_heads * row
    assert seq.kv_bytes == len(PROMPT) * per_token


@pytest.mark.parametrize("mode", list(KV_MODES))
def test_quantized_kv_decode_equals_prefill(tiny, mode):
    full = engine_logits_kv(tiny.path, PROMPT, 3, [len(PROMPT)], mode)
    stepwise = engine_logits_kv(tiny.path, PROMPT, 3, [4] + [1] * (len(PROMPT) - 4), mode)
    np.testing.assert_allclose(stepwise, full, rtol=0, atol=1e-4 * np.abs(full).max())


def engine_logits_kv(path, tokens, loops, chunks, mode="fp16", window=0, capacity=None):
    seq = tinyloop.Engine(path, kv_cache_mode=mode).sequence(capacity, window=window)
    out, start = [], 0
    for n in chunks:
        out.append(np.frombuffer(seq.feed(tokens[start : start + n], loops), dtype=np.float32))
        start += n
    return np.concatenate(out).reshape(len(tokens), -1)


LONG = [(i * 7919 + 13) % 50000 for i in range(90)]


WINDOW, CHUNKS = 6, [8] + [1] * 30 + [4] * 13


def test_cache_window_matches_sliding_window_reference(tiny):
    """Each row attends to the last W positions; a cache far smaller than the sequence drops older ones as it
    goes (the capacity here forces it to compact many times)."""
    got = engine_logits_kv(tiny.path, LONG, 3, CHUNKS, window=WINDOW, capacity=WINDOW + 65 + 8)
    want = ref_forward(tiny.cfg, tiny.weights, LONG, 3, window=WINDOW)
    assert rel_err(got, want) <= 1e-4
    # Without the window the last rows differ: the test can tell windowed attention from full attention.
    assert rel_err(got[-10:], ref_forward(tiny.cfg, tiny.weights, LONG, 3)[-10:]) > 1e-2


@pytest.mark.parametrize("mode", list(KV_MODES))
def test_cache_window_compaction_is_exact_in_every_mode(tiny, mode):
    """Dropping old positions only moves stored rows: a small windowed cache gives bit-identical logits to a
    windowed cache that never compacts. (Against the reference, quantized modes are checked above: feeding rows
    one at a time changes the GEMM's rounding, and a K value on an int4 rounding boundary then moves by a step.)"""
    small = engine_logits_kv(tiny.path, LONG, 3, CHUNKS, mode, window=WINDOW, capacity=WINDOW + 65 + 8)
    roomy = engine_logits_kv(tiny.path, LONG, 3, CHUNKS, mode, window=WINDOW)
    assert np.array_equal(small, roomy)
    unwindowed = engine_logits_kv(tiny.path, LONG, 3, CHUNKS, mode)
    assert rel_err(small[-10:], unwindowed[-10:]) > 1e-2


def test_unknown_kv_mode_is_rejected(tiny):
    with pytest.raises(tinyloop.InvalidRequestError, match="int4-h"):
        tinyloop.Engine(tiny.path, kv_cache_mode="int3")
