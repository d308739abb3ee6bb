"""`Generation` / `Speculative`: one typed argument object; the keyword form builds the same one."""

from __future__ import annotations

import pytest

import tinyloop
from tinyloop import Generation, SamplingParams, Speculative

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


def test_a_generation_runs_as_the_keyword_arguments_do(tiny_engine):
    prompt = [5, 6, 7]
    cases = [
        (dict(loops=3), Generation(GREEDY, loops=3)),
        (dict(loops=6, draft=(2, 3)), Generation(GREEDY, speculative=Speculative(2, 6, 3))),
        (dict(loops=5, draft=(1, 4), k_branches=3), Generation(GREEDY, speculative=Speculative(1, 5, 4, k_branches=3))),
        (dict(loops=4, cache_window=8), Generation(GREEDY, loops=4, cache_window=8)),
    ]
    for kwargs, plan in cases:
        a = tiny_engine.generate(prompt, GREEDY, **kwargs)
        b = tiny_engine.generate(prompt, plan)
        assert (a.tokens, a.draft_rounds, a.draft_accepted) == (b.tokens, b.draft_rounds, b.draft_accepted), kwargs
        assert [e.token_id for e in tiny_engine.stream(prompt, plan)][: len(b.tokens)] == b.tokens


def test_other_arguments_with_a_generation_are_a_type_error(tiny_engine):
    for kwargs in (dict(loops=4), dict(draft=(1, 2)), dict(k_branches=2), dict(cache_window=4)):
        with pytest.raises(TypeError, match="Generation"):
            tiny_engine.generate([1], Generation(GREEDY), **kwargs)
    with pytest.raises(TypeError, match="SamplingParams"):
        tiny_engine.generate([1], "greedy")


def test_stream_loops_is_the_depth_tokens_are_chosen_at(tiny_engine):
    default = tiny_engine.info.default_loops
    assert tiny_engine.stream([1], GREEDY).loops == default
    assert tiny_engine.stream([1], GREEDY, loops=3).loops == 3
    assert tiny_engine.stream([1], GREEDY, loops=5, draft=(2, 2)).loops == 5
    assert tiny_engine.stream([1], GREEDY, draft=(1, 2)).loops == default
    assert tiny_engine.stream([1], Generation(GREEDY, speculative=Speculative(1, 7, 2))).loops == 7


def test_arguments_are_checked_when_the_generation_starts(tiny_engine):
    plan = Generation(GREEDY, speculative=Speculative(4, 4, 2))  # constructing it checks nothing
    assert plan.speculative.draft_loops == 4 and plan.loops is None and plan.cache_window == 0
    with pytest.raises(tinyloop.InvalidRequestError, match="below verify_loops"):
        tiny_engine.generate([1], plan)
    bad = [
        (Generation(GREEDY, loops=tinyloop.MAX_LOOPS + 1), "loops"),
        (Generation(GREEDY, cache_window=tinyloop.MAX_CACHE_WINDOW + 1), "cache_window"),
        (Generation(GREEDY, speculative=Speculative(1, 8, tinyloop.MAX_DRAFT_AHEAD + 1)), "draft_ahead"),
        (Generation(GREEDY, speculative=Speculative(1, 8, 1, tinyloop.MAX_BRANCHES + 1)), "K_branches"),
        (Generation(GREEDY, speculative=Speculative(1, 8, 9, 8)), f"between 1 and {tinyloop.MAX_TREE_ROWS}"),
        (Generation(SamplingParams(temperature=0.5), speculative=Speculative(1, 8, 2, 2)), "greedy-only"),
        (Generation(GREEDY, loops=6, speculative=Speculative(1, 8, 2)), "verify_loops"),
    ]
    for plan, message in bad:
        with pytest.raises(tinyloop.InvalidRequestError, match=message):
            tiny_engine.stream([1], plan)


def test_limits_are_exported():
    assert (tinyloop.MAX_LOOPS, tinyloop.MAX_TREE_ROWS, tinyloop.WINDOW_SLACK) == (64, 64, 65)
    assert (tinyloop.MAX_DRAFT_LOOPS, tinyloop.MAX_DRAFT_AHEAD, tinyloop.MAX_BRANCHES) == (32, 16, 16)
    assert (tinyloop.MAX_CACHE_WINDOW, tinyloop.MAX_TOP_K, tinyloop.PREFILL_CHUNK) == (1 << 20, 1000, 256)
    assert repr(Speculative(2, 8, 4)) == "Speculative(draft_loops=2, verify_loops=8, draft_ahead=4, k_branches=1)"
