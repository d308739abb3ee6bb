"""What sampling costs: decode tokens/s on the shipped default model with each kind of sampling, next to greedy
decoding of the same model in the same rounds, at loops 1 and 8: a single stream (`Engine.generate`, 128 tokens)
and 16 streams stepped together (`Engine.step_many`, what the server's engine thread does; 32 tokens each).

    pytest benches/bench_sampling.py --benchmark-json=.benchmarks/sampling.json
    python benches/report_sampling.py .benchmarks/sampling.json     # the table in docs/performance.md

Greedy decoding takes the argmax; every other case builds the distribution the token is drawn from
(`rust/sampler/`), so its tokens/s over greedy's is the share of a decode step that sampling leaves to the model.
This machine's speed drifts by 10-30% over a minute, so each round runs the greedy decode first (pytest-benchmark's
untimed `setup`, timed here and kept in `extra_info`) and then the sampled one: the two best times come from the
same stretch of the run.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

import tinyloop
from tinyloop import Generation, SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parent))
from quant_models import DEFAULT
from streams import step_until_done

TOKENS = 128
BATCH, BATCH_TOKENS = 16, 32
GREEDY = dict(temperature=0.0)
SAMPLING = {
    "temperature 1": dict(temperature=1.0),
    "temperature 1, top_p 0.9": dict(temperature=1.0, top_p=0.9),
    "temperature 1, top_k 50": dict(temperature=1.0, top_k=50),
    "temperature 1, penalties": dict(
        temperature=1.0, repetition_penalty=1.1, presence_penalty=0.5, frequency_penalty=0.3
    ),
}
CASES = [(name, loops, streams) for streams in (1, BATCH) for loops in (1, 8) for name in SAMPLING]


@pytest.fixture(scope="module")
def engine():
    return tinyloop.Engine(DEFAULT)


def _single(engine, sampling: dict, loops: int, seed: int) -> int:
    prompt = engine.encode("The little dog ran to the park and")
    params = SamplingParams(max_tokens=TOKENS, ignore_eos=True, seed=seed, **sampling)
    return len(engine.generate(prompt, Generation(params, loops=loops)).tokens)


def _batch(engine, sampling: dict, loops: int, seed: int) -> int:
    def generation(i: int) -> Generation:
        params = SamplingParams(max_tokens=BATCH_TOKENS, ignore_eos=True, seed=seed + i, **sampling)
        return Generation(params, loops=loops)

    streams = [engine.stream([464 + i, 3290, 318], generation(i)) for i in range(BATCH)]
    return step_until_done(engine, streams)


@pytest.mark.parametrize(
    "case", CASES, ids=lambda c: f"{c[0].replace(' ', '').replace(',', '-')}-loops{c[1]}-{c[2]}streams"
)
def test_decode(benchmark, engine, case):
    name, loops, streams = case
    run = _single if streams == 1 else _batch
    seeds = iter(range(0, 1_000_000, BATCH))
    greedy: list[float] = []

    def before_each_round():
        start = time.perf_counter()
        run(engine, GREEDY, loops, 0)
        greedy.append(time.perf_counter() - start)

    produced = benchmark.pedantic(
        lambda: run(engine, SAMPLING[name], loops, next(seeds)),
        setup=before_each_round,
        rounds=15 if streams == 1 else 6,
        iterations=1,
        warmup_rounds=1,
    )
    assert produced == (TOKENS if streams == 1 else BATCH * BATCH_TOKENS)
    benchmark.extra_info.update(sampling=name, loops=loops, streams=streams, tokens=produced, greedy_min_s=min(greedy))
