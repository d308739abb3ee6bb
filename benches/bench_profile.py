"""Where one decode step's time goes, next to what the machine allows: a stream of tokens through `Engine.stream`
(the Python API a caller iterates) or 16 streams stepped together (`Engine.step_many`, as the server steps them)
with the engine's stage timers on (`tinyloop.start_profile`): the shipped default model (F16) greedy and with each
sampling setting of `bench_sampling.py`, and the seed-shaped model in Q4_0 (random weights, 407M parameters: every
decode step streams its weights from memory) greedy and at `temperature 1`; loops 1 and 8.

    pytest benches/bench_machine.py benches/bench_profile.py --benchmark-json=.benchmarks/profile.json
    python benches/report_profile.py .benchmarks/profile.json    # the tables in docs/performance.md

Stages per token (`rust/profile.rs`; with 16 streams, per token of all of them — a batched step's wall time over
the tokens it produced): the layers' weight products, attention (RoPE, KV write, attention over the cache), the
rest of the blocks (norms, residual adds, activations), the final norm and head, choosing the token (penalties,
sampling, emitting), the rest of the engine's step, and Python — the caller's loop and the binding (wall time minus
the engine's step). Each case also records the bytes of weights a token reads (every block layer once per loop,
the prelude and the head once; shared by the tokens of a batched step) and the multiply-adds, for the report to
set the achieved rate beside the machine's read bandwidth and FLOP rate measured in the same run
(`bench_machine.py`).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

import tinyloop
from tinyloop import Generation, SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_sampling import SAMPLING as SAMPLED
from quant_models import DEFAULT, SEED, random_model, weight_bytes
from streams import step_until_done

MODELS = {"default F16": lambda: DEFAULT, "seed Q4_0": lambda: random_model(SEED, "Q4_0")}
SAMPLING = {"greedy": dict(temperature=0.0)} | SAMPLED
BATCH = 16
TOKENS = {("default F16", 1): 128, ("default F16", BATCH): 32, ("seed Q4_0", 1): 24}
CASES = [
    *[("default F16", streams, loops, s) for streams in (1, BATCH) for loops in (1, 8) for s in SAMPLING],
    *[("seed Q4_0", 1, loops, s) for loops in (1, 8) for s in ("greedy", "temperature 1")],
]
PROMPT = "The little dog ran to the park and"
_ENGINES: dict[str, tinyloop.Engine] = {}


def multiply_adds(info, loops: int) -> int:
    """Weight multiply-adds of one decode token (attention over a short context is left out)."""
    d, hd = info.dim, info.head_dim
    layer = d * hd * (info.n_heads * 2 + info.n_kv_heads * 2) + 3 * d * info.ffn_dim
    return layer * (info.prelude_count + loops * info.block_count) + d * info.vocab_size


def _engine(name: str) -> tuple[Path, tinyloop.Engine]:
    path = MODELS[name]()
    if name not in _ENGINES:
        _ENGINES[name] = tinyloop.Engine(path)
    return path, _ENGINES[name]


def _profiled(engine, streams: int, loops: int, sampling: dict, tokens: int) -> dict[str, float]:
    """Seconds per stage while `streams` streams decode `tokens` tokens each (prompt prefills left out)."""

    def stream(i: int):
        params = SamplingParams(max_tokens=tokens + 1, ignore_eos=True, seed=i, **sampling)
        return engine.stream(engine.encode(f"{PROMPT} {i}"), Generation(params, loops=loops))

    running = [stream(i) for i in range(streams)]
    engine.step_many(running)  # the prefills and each stream's first token
    tinyloop.start_profile()
    start = time.perf_counter()
    if streams == 1:
        produced = sum(ev.token_id >= 0 for ev in running[0])
    else:
        produced = step_until_done(engine, running)
    wall = time.perf_counter() - start
    stages = {name: seconds for name, seconds, _calls in tinyloop.stop_profile()}
    assert produced == tokens * streams
    return {"wall": wall, **stages}


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-{c[1]}streams-loops{c[2]}-{c[3]}".replace(" ", ""))
def test_profile(benchmark, case):
    name, streams, loops, sampling = case
    path, engine = _engine(name)
    tokens = TOKENS[(name, streams)]
    rounds: list[dict[str, float]] = []
    benchmark.pedantic(
        lambda: rounds.append(_profiled(engine, streams, loops, SAMPLING[sampling], tokens)),
        rounds=3,
        iterations=1,
        warmup_rounds=1,
    )
    best = min(rounds[1:], key=lambda r: r["wall"])  # the warmup round is the first appended
    w = weight_bytes(path)
    produced = tokens * streams
    benchmark.extra_info.update(
        model=name,
        streams=streams,
        loops=loops,
        sampling=sampling,
        tokens=produced,
        ms_per_token={stage: 1e3 * s / produced for stage, s in best.items()},
        bytes_per_token=(w["prelude"] + loops * w["block"] + w["head"]) / streams,
        block_bytes=w["block"] / streams,
        head_bytes=w["head"] / streams,
        multiply_adds=multiply_adds(engine.info, loops),
    )
