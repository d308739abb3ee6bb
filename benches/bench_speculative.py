"""Self-speculative decoding vs plain generation at the same verify depth, on the shipped default model (greedy).

pytest benches/bench_speculative.py --benchmark-json=.benchmarks/spec.json
python benches/report_speculative.py .benchmarks/spec.json docs/speculative_speed.png   # table for the doc
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

import tinyloop
from tinyloop import SamplingParams
from tinyloop.server.protocol import SpeculativeRequest

MODEL = Path(tinyloop.__file__).parent / "models" / "default.tinyloop"
PROMPTS = [
    "In the beginning God created",
    "To be, or not to be, that is",
    "The LORD is my shepherd;",
    "Blessed is the man that walketh not",
]
VERIFY = 8
TOKENS = 32
# (draft_loops, draft_ahead, K_branches, head): chain across depths and lengths, then trees; drafts through the
# model's draft vocabulary ("draft") and, for comparison, through the full 50,257-row head ("full").
SETTINGS = (
    [None]
    + [(d, k, 1, "draft") for d in (1, 2, 3, 4) for k in (2, 4, 8)]
    + [(2, k, b, "draft") for k in (2, 4) for b in (2, 3, 4)]
    + [(d, 4, 1, "full") for d in (1, 2, 3)]
    + [(2, 4, 2, "full")]
)


@pytest.fixture(scope="module")
def engines():
    return {"draft": tinyloop.Engine(MODEL), "full": tinyloop.Engine(MODEL, draft_vocab=False)}


@pytest.fixture(scope="module")
def engine(engines):
    return engines["draft"]


@pytest.fixture(scope="module")
def reference(engine):
    params = SamplingParams(temperature=0.0, max_tokens=TOKENS, ignore_eos=True)
    return [engine.generate(p, params, loops=VERIFY).tokens for p in PROMPTS]


@pytest.mark.parametrize("setting", SETTINGS, ids=lambda s: "plain" if s is None else f"d{s[0]}-k{s[1]}-K{s[2]}-{s[3]}")
def test_decode(benchmark, engines, reference, setting):
    params = SamplingParams(temperature=0.0, max_tokens=TOKENS, ignore_eos=True)
    draft, branches = (setting[:2], setting[2]) if setting else (None, 1)
    head = setting[3] if setting else "draft"
    engine = engines[head]

    def run():
        return [engine.generate(p, params, loops=VERIFY, draft=draft, k_branches=branches) for p in PROMPTS]

    outs = benchmark.pedantic(run, rounds=2, iterations=1, warmup_rounds=0)
    assert [o.tokens for o in outs] == reference  # identical greedy output
    rounds = sum(o.draft_rounds for o in outs)
    accepted = sum(o.draft_accepted for o in outs)
    benchmark.extra_info.update(
        draft_loops=draft[0] if draft else 0,
        draft_ahead=draft[1] if draft else 0,
        k_branches=branches,
        head=head,
        draft_vocab=engine.info.draft_vocab_size,
        tokens=TOKENS * len(PROMPTS),
        rounds=rounds,
        accepted=accepted,
        proposed=sum(o.draft_proposed for o in outs),
    )


# The server's drafts when a request asks for them without settings: the request schema's defaults.
SERVER_DEFAULT = tuple(SpeculativeRequest.model_fields[f].default for f in ("draft_loops", "draft_ahead"))


def test_server_default_interleaved(benchmark, engine, reference):
    """Drafts at the server's defaults against plain decoding, interleaved: every round decodes the prompts plainly
    (pytest-benchmark's untimed `setup`, timed here) and then with drafts, so both best times come from the same
    stretch of the run."""
    params = SamplingParams(temperature=0.0, max_tokens=TOKENS, ignore_eos=True)
    plain_s: list[float] = []

    def plain_first():
        start = time.perf_counter()
        outs = [engine.generate(p, params, loops=VERIFY) for p in PROMPTS]
        plain_s.append(time.perf_counter() - start)
        assert [o.tokens for o in outs] == reference

    def run():
        return [engine.generate(p, params, loops=VERIFY, draft=SERVER_DEFAULT) for p in PROMPTS]

    outs = benchmark.pedantic(run, setup=plain_first, rounds=8, iterations=1, warmup_rounds=1)
    assert [o.tokens for o in outs] == reference
    benchmark.extra_info.update(
        interleaved=True,
        draft_loops=SERVER_DEFAULT[0],
        draft_ahead=SERVER_DEFAULT[1],
        tokens=TOKENS * len(PROMPTS),
        plain_min_s=min(plain_s),
        rounds=sum(o.draft_rounds for o in outs),
        accepted=sum(o.draft_accepted for o in outs),
    )
