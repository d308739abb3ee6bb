"""What sampling costs: decode tokens/s on the shipped default model with each kind of sampling, next to greedy
decoding of the same model in the same run, at loops 1 and 8 (single stream, `Engine.generate`, 128 tokens).

    pytest benches/bench_sampling.py --benchmark-json=.benchmarks/sampling.json
    python benches/report_sampling.py .benchmarks/sampling.json     # the table in docs/performance.md

Greedy decoding takes the argmax; every other case builds the distribution the token is drawn from
(`rust/sampler/`), so its tokens/s over greedy's is the share of a decode step that sampling leaves to the model.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

import tinyloop
from tinyloop import Generation, SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parent))
from quant_models import DEFAULT

TOKENS = 128
SAMPLING = {
    "greedy": dict(temperature=0.0),
    "temperature 1": dict(temperature=1.0),
    "temperature 1, top_p 0.9": dict(temperature=1.0, top_p=0.9),
    "temperature 1, top_k 50": dict(temperature=1.0, top_k=50),
    "temperature 1, penalties": dict(
        temperature=1.0, repetition_penalty=1.1, presence_penalty=0.5, frequency_penalty=0.3
    ),
}
CASES = [(name, loops) for loops in (1, 8) for name in SAMPLING]


@pytest.fixture(scope="module")
def engine():
    return tinyloop.Engine(DEFAULT)


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0].replace(' ', '').replace(',', '-')}-loops{c[1]}")
def test_decode(benchmark, engine, case):
    name, loops = case
    prompt = engine.encode("The little dog ran to the park and")
    seeds = iter(range(1000))

    def run():
        params = SamplingParams(max_tokens=TOKENS, ignore_eos=True, seed=next(seeds), **SAMPLING[name])
        return engine.generate(prompt, Generation(params, loops=loops))

    out = benchmark.pedantic(run, rounds=15, iterations=1, warmup_rounds=1)
    assert len(out.tokens) == TOKENS
    benchmark.extra_info.update(sampling=name, loops=loops, tokens=TOKENS)
