"""What a grammar costs: decode tokens/s on the shipped default model under a JSON schema, next to unconstrained
decoding of as many tokens in the same rounds — a single stream (`Engine.generate`) and 16 streams stepped together
(`Engine.step_many`, each with its own grammar state), loops 8.

    pytest benches/bench_structured.py --benchmark-json=.benchmarks/structured.json
    python benches/report_structured.py .benchmarks/structured.json   # the table in docs/structured-output.md

Each constrained round first measures the tokens it produces; the unconstrained decode of the same count (with
`ignore_eos`) runs in pytest-benchmark's untimed `setup` before the next round, timed by hand, so both best times
come from the same stretch of the run. So does the same constrained decode on an engine with no grammar threads
(`grammar_threads=0`), which computes every mask when the sampler needs it instead of during the forward pass.
The schemas: `records` (an array of objects — keys, numbers, enums, the parser's structural work at most tokens)
and `text` (one long string, where the mask is nearly the whole vocabulary).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

import tinyloop
from tinyloop import Generation, Grammar, SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parent))
from quant_models import DEFAULT
from streams import step_until_done

LOOPS, BATCH = 8, 16
RECORD = {
    "type": "object",
    "additionalProperties": False,
    "required": ["id", "name", "score", "tags"],
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 99999},
        "name": {"type": "string", "maxLength": 16},
        "score": {"type": "integer", "minimum": -50, "maximum": 50},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
    },
}
SCHEMAS = {
    "records": {"type": "array", "items": RECORD, "minItems": 4, "maxItems": 4},
    "text": {
        "type": "object",
        "required": ["text"],
        "additionalProperties": False,
        "properties": {"text": {"type": "string", "minLength": 300, "maxLength": 300}},
    },
}
SAMPLING = {"greedy": dict(temperature=0.0), "temperature 1": dict(temperature=1.0)}
CASES = [(schema, sampling, streams) for streams in (1, BATCH) for schema in SCHEMAS for sampling in SAMPLING]
PROMPT = "The little dog ran to the park and"


@pytest.fixture(scope="module")
def engine():
    return tinyloop.Engine(DEFAULT)


@pytest.fixture(scope="module")
def inline_engine():
    return tinyloop.Engine(DEFAULT, grammar_threads=0)


def _run(engine, schema: str | None, sampling: str, streams: int, seed: int, tokens: int = 400) -> int:
    """Tokens produced by `streams` generations (under `schema`, or `tokens` each without one)."""

    def generation(i: int) -> Generation:
        if schema is None:
            params = SamplingParams(max_tokens=tokens, ignore_eos=True, seed=seed + i, **SAMPLING[sampling])
            return Generation(params, loops=LOOPS)
        params = SamplingParams(max_tokens=tokens, seed=seed + i, **SAMPLING[sampling])
        return Generation(params, loops=LOOPS, grammar=Grammar.json_schema(SCHEMAS[schema]))

    if streams == 1:
        return len(engine.generate(engine.encode(PROMPT), generation(0)).tokens)
    return step_until_done(engine, [engine.stream([464 + i, 3290, 318], generation(i)) for i in range(streams)])


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-{c[1].replace(' ', '')}-{c[2]}streams")
def test_decode(benchmark, engine, inline_engine, case):
    schema, sampling, streams = case
    seeds = iter(range(0, 1_000_000, BATCH))
    constrained: list[tuple[int, float]] = []  # (tokens, seconds) of each round; sampled rounds differ in length
    plain: list[float] = []  # tokens/s of the unconstrained decode before each round
    inline: list[float] = []  # tokens/s of the same constrained decode with every mask computed inline

    def before_each_round():
        if constrained:  # as many tokens as the last constrained round produced
            per_stream = -(-constrained[-1][0] // streams)
            start = time.perf_counter()
            n = _run(engine, None, sampling, streams, 0, per_stream)
            plain.append(n / (time.perf_counter() - start))
            start = time.perf_counter()
            n = _run(inline_engine, schema, sampling, streams, seeds_used[-1])
            inline.append(n / (time.perf_counter() - start))

    seeds_used: list[int] = []

    def run():
        seeds_used.append(next(seeds))
        start = time.perf_counter()
        n = _run(engine, schema, sampling, streams, seeds_used[-1])
        constrained.append((n, time.perf_counter() - start))

    benchmark.pedantic(run, setup=before_each_round, rounds=8 if streams == 1 else 4, warmup_rounds=1)
    assert plain and min(n for n, _ in constrained) > 40 * streams
    benchmark.extra_info.update(
        schema=schema,
        sampling=sampling,
        streams=streams,
        tokens=constrained[-1][0],
        constrained_tok_s=max(n / s for n, s in constrained),
        plain_tok_s=max(plain),
        inline_tok_s=max(inline),
    )
