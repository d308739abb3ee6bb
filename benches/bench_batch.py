"""Continuous batching: aggregate decode tokens/s of n concurrent greedy streams stepped together with
`Engine.step_many` (what the server's engine thread does), against one stream, in one run.

    pytest benches/bench_batch.py --benchmark-json=.benchmarks/batch.json
    python benches/report_batch.py .benchmarks/batch.json
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

import tinyloop
from tinyloop import SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parent))
from quant_models import model_path
from streams import step_until_done

TOKENS = 32
CASES = [(w, n) for w in ("fp16", "int8", "int4 RTN") for n in (1, 4, 16)]


def _run(engine, n: int) -> int:
    params = SamplingParams(temperature=0.0, max_tokens=TOKENS, ignore_eos=True)
    streams = [engine.stream([464 + i, 3290, 318], params, loops=8) for i in range(n)]
    return step_until_done(engine, streams)


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0].replace(' ', '_')}-{c[1]}streams")
def test_aggregate_decode(benchmark, case):
    weights, n = case
    engine = tinyloop.Engine(model_path(weights))
    produced = benchmark.pedantic(_run, args=(engine, n), rounds=2, iterations=1, warmup_rounds=1)
    assert produced == n * TOKENS
    benchmark.extra_info.update(weights=weights, streams=n, tokens=n * TOKENS)
