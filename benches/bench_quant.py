"""Decode throughput of the default model in each weight type, all in one run (ratios vs fp16 go into
docs/quantization.md through benches/quantization.py).

    pytest benches/bench_quant.py --benchmark-json=.benchmarks/quant.json
"""

from __future__ import annotations

import pytest

import tinyloop
from quant_models import WEIGHTS, model_path
from tinyloop import SamplingParams

TOKENS = 48


@pytest.mark.parametrize("name", list(WEIGHTS))
def test_decode(benchmark, name):
    engine = tinyloop.Engine(model_path(name))
    params = SamplingParams(temperature=0.0, max_tokens=TOKENS, ignore_eos=True)
    out = benchmark.pedantic(
        engine.generate, args=("The king said", params, 8), rounds=3, iterations=1, warmup_rounds=1
    )
    assert len(out.tokens) == TOKENS
    benchmark.extra_info.update(weights=name, quant=engine.info.quant, tokens=TOKENS, loops=8)
