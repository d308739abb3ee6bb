"""Self-speculative decoding vs plain generation at the same verify depth, on the shipped default model (greedy).

    pytest benches/bench_speculative.py --benchmark-json=.benchmarks/spec.json
    python benches/report_speculative.py .benchmarks/spec.json docs/speculative_speed.png   # table for the doc
"""

from __future__ import annotations

from pathlib import Path

import pytest

import tinyloop
from tinyloop import SamplingParams

MODEL = Path(tinyloop.__file__).parent / "models" / "default.tinyloop"
PROMPTS = ["In the beginning God created", "To be, or not to be, that is", "The LORD is my shepherd;",
           "Blessed is the man that walketh not"]
VERIFY = 8
TOKENS = 32
# (draft_loops, draft_ahead, K_branches): chain across depths and lengths, then trees.
SETTINGS = [None] + [(d, k, 1) for d in (1, 2, 3, 4) for k in (2, 4, 8)] + [(2, k, b) for k in (2, 4) for b in (2, 3, 4)]


@pytest.fixture(scope="module")
def engine():
    return tinyloop.Engine(MODEL)


@pytest.fixture(scope="module")
def reference(engine):
    params = SamplingParams(temperature=0.0, max_tokens=TOKENS, ignore_eos=True)
    return [engine.generate(p, params, loops=VERIFY).tokens for p in PROMPTS]


@pytest.mark.parametrize("setting", SETTINGS, ids=lambda s: "plain" if s is None else f"d{s[0]}-k{s[1]}-K{s[2]}")
def test_decode(benchmark, engine, reference, setting):
    params = SamplingParams(temperature=0.0, max_tokens=TOKENS, ignore_eos=True)
    draft, branches = (setting[:2], setting[2]) if setting else (None, 1)

    def run():
        return [engine.generate(p, params, loops=VERIFY, draft=draft, k_branches=branches) for p in PROMPTS]

    outs = benchmark.pedantic(run, rounds=2, iterations=1, warmup_rounds=0)
    assert [o.tokens for o in outs] == reference  # identical greedy output
    rounds = sum(o.draft_rounds for o in outs)
    accepted = sum(o.draft_accepted for o in outs)
    benchmark.extra_info.update(draft_loops=draft[0] if draft else 0, draft_ahead=draft[1] if draft else 0,
                                k_branches=branches,
                                tokens=TOKENS * len(PROMPTS), rounds=rounds, accepted=accepted,
                                proposed=sum(o.draft_proposed for o in outs))
