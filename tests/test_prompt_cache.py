"""The prompt cache (prefix reuse): a request whose prompt starts with an earlier sequence's tokens starts from that
sequence's KV — and its output is exactly what it is without the cache, in every weight format, KV mode, speculative
mode, window and batch. Bounds (entries, bytes, least recently used), and the directory that keeps prefixes across
restarts: damaged, cut-short and foreign files are reported and never used."""

from __future__ import annotations

import random

import pytest

import tinyloop
from conftest import TINY
from tinyloop import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2)


def _prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(50257) for _ in range(n)]


def _engines(path, **kw):
    """The same model with the prompt cache on (the default) and off."""
    return tinyloop.Engine(path, **kw), tinyloop.Engine(path, prompt_cache_entries=0, **kw)


def _same(a, b):
    """Identical tokens, and log-probabilities equal to float rounding (prefill splits differently on a hit)."""
    assert a.tokens == b.tokens
    for (lp_a, top_a), (lp_b, top_b) in zip(a.logprobs, b.logprobs, strict=True):
        assert abs(lp_a - lp_b) < 1e-4
        assert [t for t, _ in top_a] == [t for t, _ in top_b]


def _second_turn(cached, plain, first: list[int], kw: dict) -> tuple:
    """Run a first turn on the cached engine, then its continuation on both engines."""
    one = cached.generate(first, GREEDY, **kw)
    follow = first + list(one.tokens) + _prompt(9, seed=len(first))
    return cached.generate(follow, GREEDY, **kw), plain.generate(follow, GREEDY, **kw), len(first) + len(one.tokens)


@pytest.mark.parametrize("kv", ["fp16", "int8", "int4", "int4-h"])
@pytest.mark.parametrize("weight_type", ["F32", "F16", "Q8_0", "Q4_0"])
def test_a_hit_gives_the_same_output_in_every_format(model_factory, weight_type, kv):
    cached, plain = _engines(model_factory(TINY, weight_type=weight_type).path, kv_cache_mode=kv)
    hit, miss, fed = _second_turn(cached, plain, _prompt(70, seed=1), {})
    # The first turn ended by length: every token but the last was fed, and all of those are reused.
    assert hit.cached_tokens == fed - 1 and miss.cached_tokens == 0
    _same(hit, miss)


@pytest.mark.parametrize(
    "kw",
    [
        {"loops": 5, "draft": (2, 3)},
        {"loops": 4, "draft": (1, 2), "k_branches": 3},
        {"loops": 2},
        {"cache_window": 6},
        {"loops": 5, "draft": (2, 2), "cache_window": 8},
    ],
)
def test_a_hit_gives_the_same_output_in_every_mode(tiny, kw):
    cached, plain = _engines(tiny.path)
    hit, miss, _ = _second_turn(cached, plain, _prompt(40, seed=2), kw)
    assert hit.cached_tokens > 40
    _same(hit, miss)
    assert (hit.draft_rounds, hit.draft_accepted) != (0, 0) or "draft" not in kw


def test_depth_and_window_must_match(tiny):
    cached, plain = _engines(tiny.path)
    first = _prompt(30, seed=3)
    cached.generate(first, GREEDY, loops=3)
    follow = first + _prompt(5, seed=4)
    for kw in ({"loops": 2}, {"loops": 4}, {"loops": 3, "cache_window": 6}):
        other = cached.generate(follow, GREEDY, **kw)
        assert other.cached_tokens == 0, kw
        _same(other, plain.generate(follow, GREEDY, **kw))
    assert cached.generate(follow, GREEDY, loops=3).cached_tokens == 30


def test_a_window_that_dropped_positions_is_never_kept(tiny):
    cached, plain = _engines(tiny.path)
    first = _prompt(220, seed=5)  # past the window's capacity (window + slack + chunk): older positions dropped
    cached.generate(first, GREEDY, cache_window=6)
    follow = first + _prompt(5, seed=6)
    again = cached.generate(follow, GREEDY, cache_window=6)
    assert again.cached_tokens == 0
    _same(again, plain.generate(follow, GREEDY, cache_window=6))


def test_batched_streams_reuse_prefixes_and_match_solo(tiny):
    cached, plain = _engines(tiny.path)
    firsts = [_prompt(20 + 15 * i, seed=10 + i) for i in range(3)]
    for p in firsts:
        cached.generate(p, GREEDY)
    prompts = [p + _prompt(4, seed=20 + i) for i, p in enumerate(firsts)] + [_prompt(33, seed=30)]
    streams = [cached.stream(p, GREEDY) for p in prompts]
    tokens: list[list[int]] = [[] for _ in prompts]
    live = list(range(len(prompts)))
    while live:
        events = cached.step_many([streams[i] for i in live])
        for i, ev in zip(list(live), events, strict=True):
            assert not isinstance(ev, BaseException), ev
            if ev.token_id >= 0:
                tokens[i].append(ev.token_id)
            if ev.finish_reason is not None:
                live.remove(i)
    assert [s.cached_tokens for s in streams] == [len(p) for p in firsts] + [0]
    assert tokens == [list(plain.generate(p, GREEDY).tokens) for p in prompts]


def test_a_released_stream_offers_what_it_fed(tiny):
    """A request that ends early (its client left, or a stop string matched) still leaves its prompt for the next."""
    cached, _ = _engines(tiny.path)
    first = _prompt(50, seed=7)
    stream = cached.stream(first, GREEDY)
    next(stream)  # the prompt is prefilled and one token emitted
    stream.release()
    assert list(stream) == []  # a released stream is over
    assert cached.generate([*first, 11, 12], GREEDY).cached_tokens == 50


def test_entries_are_bounded_and_least_recently_used_go_first(tiny):
    engine = tinyloop.Engine(tiny.path, prompt_cache_entries=3)
    prompts = [_prompt(20, seed=40 + i) for i in range(4)]
    for p in prompts[:3]:
        engine.generate(p, GREEDY)
    # A hit whose own sequence an entry already covers: prompts[0]'s entry becomes the most recently used.
    short = engine.generate(prompts[0][:10], SamplingParams(temperature=0.0, max_tokens=1))
    assert short.cached_tokens == 9 and engine.prompt_cache_usage[0] == 3
    engine.generate(prompts[3], GREEDY)  # a fourth entry: the least recently used (prompts[1]'s) goes
    entries, held = engine.prompt_cache_usage
    assert entries == 3 and held > 0
    assert engine.generate(prompts[0] + [5], GREEDY).cached_tokens == 20
    assert engine.generate(prompts[1] + [5], GREEDY).cached_tokens == 0


def test_a_conversation_keeps_one_entry(tiny):
    """Each turn's entry extends the previous one, which is dropped as redundant."""
    engine = tinyloop.Engine(tiny.path)
    convo = _prompt(10, seed=50)
    for turn in range(4):
        out = engine.generate(convo, GREEDY)
        assert out.cached_tokens == (0 if turn == 0 else len(convo) - 4)
        convo = convo + list(out.tokens) + _prompt(3, seed=60 + turn)
    assert engine.prompt_cache_usage[0] == 1


def test_byte_bound_and_off(tiny):
    engine = tinyloop.Engine(tiny.path, prompt_cache_mib=1)
    long = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    for seed in range(3):
        # 239 positions × 7 slots × 2 KV heads × 16 dims × 4 bytes × K and V: 0.41 MiB; two fit in 1 MiB, three not.
        engine.generate(_prompt(200, seed=seed), long)
    entries, held = engine.prompt_cache_usage
    assert entries == 2 and 0 < held <= 1 << 20
    assert engine.generate([*_prompt(200, seed=0), 1], GREEDY).cached_tokens == 0
    assert engine.generate([*_prompt(200, seed=2), 1], GREEDY).cached_tokens == 200
    off = tinyloop.Engine(tiny.path, prompt_cache_entries=0)
    off.generate(_prompt(20, seed=9), GREEDY)
    assert off.prompt_cache_usage == (0, 0)
    assert off.generate([*_prompt(20, seed=9), 1], GREEDY).cached_tokens == 0
