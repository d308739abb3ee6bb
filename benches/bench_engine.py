"""Decode and prefill throughput of the engine on random models (no quality meaning, only speed).

pytest benches/bench_engine.py --benchmark-json=.benchmarks/engine.json
python benches/report.py .benchmarks/engine.json   # prints the table for docs/performance.md
"""

from __future__ import annotations

import pytest

from tinyloop import SamplingParams

DECODE_TOKENS = {"small": 32, "seed": 4}
PREFILL_TOKENS = 128
CASES = [(shape, wt, loops) for shape in ("small", "seed") for wt in ("F16", "Q8_0") for loops in (1, 2, 8)]


def _id(case):
    return "-".join(map(str, case))


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_decode(benchmark, bench_model, case):
    shape, wt, loops = case
    engine = bench_model(shape, wt)
    n = DECODE_TOKENS[shape]
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    out = benchmark.pedantic(engine.generate, args=([464], params, loops), rounds=2, iterations=1, warmup_rounds=0)
    assert len(out.tokens) == n
    benchmark.extra_info.update(kind="decode", shape=shape, weight_type=wt, loops=loops, tokens=n)


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_prefill(benchmark, bench_model, case):
    shape, wt, loops = case
    engine = bench_model(shape, wt)
    prompt = [(17 * i) % 50000 for i in range(PREFILL_TOKENS)]
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    out = benchmark.pedantic(engine.generate, args=(prompt, params, loops), rounds=2, iterations=1, warmup_rounds=0)
    assert out.prompt_tokens == PREFILL_TOKENS
    benchmark.extra_info.update(kind="prefill", shape=shape, weight_type=wt, loops=loops, tokens=PREFILL_TOKENS)
