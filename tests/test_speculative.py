"""Self-speculative decoding: greedy output is plain generation at verify_loops, token for token."""

from __future__ import annotations

import random

import pytest

import tinyloop
from conftest import TINY
from tinyloop import SamplingParams

SETTINGS = [(1, 3, 4), (2, 8, 4), (1, 8, 2), (3, 4, 8), (2, 6, 1), (4, 12, 5)]


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(50257) for _ in range(rng.randint(1, 40))] for _ in range(n)]


@pytest.mark.parametrize("weight_type", ["F32", "F16", "Q8_0"])
def test_greedy_speculative_equals_plain(model_factory, weight_type):
    engine = tinyloop.Engine(model_factory(TINY, weight_type=weight_type).path)
    checked = 0
    for i, prompt in enumerate(prompts(50, seed=len(weight_type))):
        draft_loops, verify_loops, ahead = SETTINGS[i % len(SETTINGS)]
        params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=i % 2 == 0)
        plain = engine.generate(prompt, params, loops=verify_loops)
        spec = engine.generate(prompt, params, loops=verify_loops, draft=(draft_loops, ahead))
        assert spec.tokens == plain.tokens, (prompt, draft_loops, verify_loops, ahead)
        assert spec.finish_reason == plain.finish_reason
        assert spec.draft_rounds > 0 and 0 <= spec.draft_accepted <= spec.draft_proposed
        checked += 1
    assert checked == 50


def test_penalties_and_stops_are_honoured_exactly(tiny_engine):
    params = SamplingParams(temperature=0.0, max_tokens=30, repetition_penalty=1.3, frequency_penalty=0.5)
    for prompt in prompts(10, seed=3):
        plain = tiny_engine.generate(prompt, params, loops=6)
        stop = plain.tokens[len(plain.tokens) // 2]
        with_stop = SamplingParams(
            temperature=0.0, max_tokens=30, repetition_penalty=1.3, frequency_penalty=0.5, stop_token_ids=[stop]
        )
        assert tiny_engine.generate(prompt, params, loops=6, draft=(2, 4)).tokens == plain.tokens
        a = tiny_engine.generate(prompt, with_stop, loops=6)
        b = tiny_engine.generate(prompt, with_stop, loops=6, draft=(2, 4))
        assert (
            (a.tokens, a.finish_reason)
            == (b.tokens, b.finish_reason)
            == (plain.tokens[: plain.tokens.index(stop)], "stop")
        )


def test_stream_matches_generate(tiny_engine):
    params = SamplingParams(temperature=0.0, max_tokens=20)
    full = tiny_engine.generate([1, 2, 3], params, loops=5, draft=(2, 3))
    stream = tiny_engine.stream([1, 2, 3], params, loops=5, draft=(2, 3))
    events = list(stream)
    assert [e.token_id for e in events] == full.tokens
    assert events[-1].finish_reason == "length"
    rounds, proposed, accepted = stream.draft_stats
    assert (rounds, proposed, accepted) == (full.draft_rounds, full.draft_proposed, full.draft_accepted)


def test_a_self_consistent_model_accepts_every_draft(cycle_model):
    # The cycle model's layers write nothing, so every depth predicts the same token: all drafts are accepted.
    path, ids = cycle_model
    engine = tinyloop.Engine(path)
    out = engine.generate(
        ids[:1], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True), loops=8, draft=(1, 4)
    )
    assert out.tokens == (ids[1:] + ids)[:12]
    assert out.draft_accepted == out.draft_proposed == 11  # the prefill token is not drafted


def test_bad_settings(tiny_engine):
    with pytest.raises(tinyloop.InvalidRequestError, match="below verify_loops"):
        tiny_engine.generate([1], SamplingParams(temperature=0.0), loops=4, draft=(4, 2))
    with pytest.raises(tinyloop.InvalidRequestError, match="draft_ahead"):
        tiny_engine.generate([1], SamplingParams(temperature=0.0), loops=4, draft=(2, 0))


def outcomes(engine, n, loops, draft=None, seed0=0):
    """Counts of the 3-token continuations of a fixed prompt over n seeds."""
    counts: dict[tuple, int] = {}
    for s in range(seed0, seed0 + n):
        params = SamplingParams(temperature=1.0, top_k=3, seed=s, max_tokens=3, ignore_eos=True)
        key = tuple(engine.generate([5, 6, 7], params, loops=loops, draft=draft).tokens)
        counts[key] = counts.get(key, 0) + 1
    return counts


def homogeneity(a: dict, b: dict) -> tuple[float, float]:
    """Chi-square statistic of two samples over the same categories (rare ones pooled) and its 0.999 quantile."""
    keys = sorted(set(a) | set(b), key=lambda k: -(a.get(k, 0) + b.get(k, 0)))
    na, nb = sum(a.values()), sum(b.values())
    rows, pooled = [], [0, 0]
    for k in keys:
        x, y = a.get(k, 0), b.get(k, 0)
        if (x + y) * min(na, nb) / (na + nb) >= 5:
            rows.append((x, y))
        else:
            pooled = [pooled[0] + x, pooled[1] + y]
    if sum(pooled):
        rows.append(tuple(pooled))
    chi = 0.0
    for x, y in rows:
        for obs, n in ((x, na), (y, nb)):
            exp = (x + y) * n / (na + nb)
            chi += (obs - exp) ** 2 / exp
    df = len(rows) - 1
    crit = df * (1 - 2 / (9 * df) + 3.09 * (2 / (9 * df)) ** 0.5) ** 3  # Wilson-Hilferty, p = 0.001
    return chi, crit


def test_speculative_sampling_preserves_the_verifier_distribution(tiny_engine):
    plain = outcomes(tiny_engine, 800, loops=4)
    spec = outcomes(tiny_engine, 800, loops=4, draft=(1, 3), seed0=10_000)
    chi, crit = homogeneity(plain, spec)
    assert len(plain) > 5 and chi < crit, (chi, crit)
    # The test has power: a different depth is a different distribution.
    shallow = outcomes(tiny_engine, 800, loops=1, seed0=20_000)
    chi, crit = homogeneity(plain, shallow)
    assert chi > crit, (chi, crit)


def test_seeded_speculative_sampling_reproduces(tiny_engine):
    params = SamplingParams(temperature=0.8, seed=5, max_tokens=20)
    a = tiny_engine.generate([1, 2], params, loops=6, draft=(2, 4))
    b = tiny_engine.generate([1, 2], params, loops=6, draft=(2, 4))
    assert a.tokens == b.tokens and len(a.tokens) == 20


@pytest.mark.parametrize("weight_type", ["F32", "Q8_0"])
def test_tree_greedy_equals_plain(model_factory, weight_type):
    engine = tinyloop.Engine(model_factory(TINY, weight_type=weight_type).path)
    trees = [(1, 4, 3, 2), (2, 6, 4, 4), (1, 8, 5, 3), (3, 5, 2, 8), (2, 8, 8, 8)]  # (d, L, ahead, K)
    accepted = proposed = 0
    for i, prompt in enumerate(prompts(50, seed=7)):
        d, L, ahead, K = trees[i % len(trees)]
        params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
        plain = engine.generate(prompt, params, loops=L)
        tree = engine.generate(prompt, params, loops=L, draft=(d, ahead), k_branches=K)
        assert tree.tokens == plain.tokens, (prompt, d, L, ahead, K)
        accepted += tree.draft_accepted
        proposed += tree.draft_proposed
    assert 0 < accepted <= proposed


def test_tree_with_one_branch_is_chain(tiny_engine):
    params = SamplingParams(temperature=0.0, max_tokens=20)
    for prompt in prompts(5, seed=11):
        chain = tiny_engine.generate(prompt, params, loops=6, draft=(2, 4))
        tree = tiny_engine.generate(prompt, params, loops=6, draft=(2, 4), k_branches=1)
        assert (chain.tokens, chain.draft_accepted, chain.draft_rounds) == (
            tree.tokens,
            tree.draft_accepted,
            tree.draft_rounds,
        )


def test_tree_on_a_self_consistent_model_accepts_every_draft(cycle_model):
    path, ids = cycle_model
    engine = tinyloop.Engine(path)
    out = engine.generate(
        ids[:1], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True), loops=8, draft=(1, 4), k_branches=3
    )
    assert out.tokens == (ids[1:] + ids)[:12] and out.draft_accepted == out.draft_proposed == 11


def test_tree_limits(tiny_engine):
    with pytest.raises(tinyloop.InvalidRequestError, match=r"at most|between 1 and 64"):
        tiny_engine.generate([1], SamplingParams(temperature=0.0), loops=4, draft=(2, 9), k_branches=8)
    with pytest.raises(tinyloop.InvalidRequestError, match="greedy-only"):
        tiny_engine.generate([1], SamplingParams(temperature=0.5), loops=4, draft=(2, 2), k_branches=2)


@pytest.mark.parametrize("mode", ["int8", "int4", "int4-h"])
def test_speculative_equals_plain_in_every_quantized_kv_mode(tiny, mode):
    engine = tinyloop.Engine(tiny.path, kv_cache_mode=mode)
    for i, prompt in enumerate(prompts(12, seed=21)):
        params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
        plain = engine.generate(prompt, params, loops=6)
        chain = engine.generate(prompt, params, loops=6, draft=(2, 3))
        tree = engine.generate(prompt, params, loops=6, draft=(2, 3), k_branches=3)
        assert chain.tokens == plain.tokens == tree.tokens, (i, prompt)


@pytest.mark.parametrize("mode", ["fp16", "int4-h"])
def test_speculative_equals_plain_with_a_cache_window(tiny, mode):
    """Long generations (past the windowed cache's capacity, so it drops old positions many times) with rollback
    and tree compaction: every mode still reproduces plain generation with the same window."""
    engine = tinyloop.Engine(tiny.path, max_seq_len=400, kv_cache_mode=mode)
    params = SamplingParams(temperature=0.0, max_tokens=350, ignore_eos=True)
    for prompt, window in [(prompts(1, seed=5)[0], 7), ([11] * 20, 16)]:
        plain = engine.generate(prompt, params, loops=5, cache_window=window)
        chain = engine.generate(prompt, params, loops=5, draft=(2, 4), cache_window=window)
        tree = engine.generate(prompt, params, loops=5, draft=(1, 4), k_branches=4, cache_window=window)
        assert chain.tokens == plain.tokens == tree.tokens, (mode, window)
        assert len(plain.tokens) == 350


def test_cache_window_keeps_kv_memory_constant(tiny):
    """The bytes a windowed stream holds stop growing; without a window they grow with every token."""
    engine = tinyloop.Engine(tiny.path, max_seq_len=700)
    params = SamplingParams(temperature=0.0, max_tokens=600, ignore_eos=True)
    windowed, full = (
        engine.stream([5, 6, 7], params, loops=3, cache_window=8),
        engine.stream([5, 6, 7], params, loops=3),
    )
    w_bytes, f_bytes = [], []
    for _ in range(600):
        next(windowed), next(full)
        w_bytes.append(windowed.kv_bytes)
        f_bytes.append(full.kv_bytes)
    cfg = tiny.cfg
    elem = {"f32": 4, "f16": 2}[engine.info.kv_dtype]  # "fp16" mode: f32 rows for this all-F32 model
    per_pos = (cfg.prelude_count + 3 * cfg.block_count) * 2 * cfg.n_kv_heads * cfg.head_dim * elem
    # Bounded by the window (8), the rollback slack (65) and room for one pass's rows (64 + 64 + 1), a bound
    # reached in the first 300 tokens and never passed in the next 300, while the unwindowed cache holds them all.
    assert max(w_bytes) == (8 + 65 + 64 + 64 + 1) * per_pos
    assert max(w_bytes[300:]) <= max(w_bytes[:300])
    assert f_bytes[-1] == (3 + 599) * per_pos


def test_cache_window_is_a_real_window(tiny):
    """A window shorter than the prompt changes what the model sees; one longer than the sequence does not."""
    engine = tinyloop.Engine(tiny.path)
    prompt = prompts(1, seed=9)[0] + prompts(1, seed=10)[0]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    full = engine.generate(prompt, params, loops=3).tokens
    assert engine.generate(prompt, params, loops=3, cache_window=len(prompt) + 20).tokens == full
    assert engine.generate(prompt, params, loops=3, cache_window=2).tokens != full
