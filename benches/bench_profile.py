"""Where one decode step's time goes, next to what the machine allows: a stream of tokens through `Engine.stream`
(the Python API a caller iterates) with the engine's stage timers on (`tinyloop.start_profile`), on the shipped
default model (F16) and the seed-shaped model in Q4_0 (random weights, 407M parameters: every decode step streams
its weights from memory), loops 1 and 8, greedy and `temperature 1`.

    pytest benches/bench_machine.py benches/bench_profile.py --benchmark-json=.benchmarks/profile.json
    python benches/report_profile.py .benchmarks/profile.json    # the tables in docs/performance.md

Stages per token (`rust/profile.rs`): the layers' weight products, attention (RoPE, KV write, attention over the
cache), the rest of the blocks (norms, residual adds, activations), the final norm and head, choosing the token
(penalties, sampling, emitting), the rest of the engine's step, and Python — the caller's loop and the binding
(wall time minus the engine's step). Each case also records the bytes of weights a token reads (every block
layer once per loop, the prelude and the head once) and the multiply-adds, for the report to set the achieved rate
beside the machine's read bandwidth and FLOP rate measured in the same run (`bench_machine.py`).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import gguf
import pytest

import tinyloop
from tinyloop import Generation, SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parent))
from quant_models import DEFAULT, SEED, random_model

MODELS = {"default F16": lambda: DEFAULT, "seed Q4_0": lambda: random_model(SEED, "Q4_0")}
TOKENS = {"default F16": 128, "seed Q4_0": 24}
SAMPLING = {"greedy": dict(temperature=0.0), "temperature 1": dict(temperature=1.0, seed=3)}
PROMPT = "The little dog ran to the park and"


def weight_bytes(path: Path) -> dict[str, int]:
    """Bytes of the prelude layers, the looped block, and the head (the embedding table when tied)."""
    sizes = {t.name: int(t.n_bytes) for t in gguf.GGUFReader(str(path)).tensors}
    head = sizes.get("output.weight", sizes["token_embd.weight"])
    return {
        "prelude": sum(n for name, n in sizes.items() if name.startswith("pre.")),
        "block": sum(n for name, n in sizes.items() if name.startswith("blk.")),
        "head": head + sizes["output_norm.weight"],
    }


def multiply_adds(info, loops: int) -> int:
    """Weight multiply-adds of one decode token (attention over a short context is left out)."""
    d, hd = info.dim, info.head_dim
    layer = d * hd * (info.n_heads * 2 + info.n_kv_heads * 2) + 3 * d * info.ffn_dim
    return layer * (info.prelude_count + loops * info.block_count) + d * info.vocab_size


@pytest.fixture(scope="module", params=list(MODELS))
def model(request):
    path = MODELS[request.param]()
    return request.param, path, tinyloop.Engine(path)


def _profiled(engine, loops: int, sampling: dict, tokens: int) -> dict[str, float]:
    """Seconds per stage over one stream of `tokens` tokens (the prompt's prefill is left out)."""
    params = SamplingParams(max_tokens=tokens + 1, ignore_eos=True, **sampling)
    stream = iter(engine.stream(engine.encode(PROMPT), Generation(params, loops=loops)))
    next(stream)  # the prefill step and the first token
    tinyloop.start_profile()
    start = time.perf_counter()
    produced = sum(ev.token_id >= 0 for ev in stream)
    wall = time.perf_counter() - start
    stages = {name: seconds for name, seconds, _calls in tinyloop.stop_profile()}
    assert produced == tokens
    return {"wall": wall, **stages}


@pytest.mark.parametrize("loops", [1, 8])
@pytest.mark.parametrize("sampling", list(SAMPLING))
def test_profile(benchmark, model, loops, sampling):
    name, path, engine = model
    tokens = TOKENS[name]
    rounds: list[dict[str, float]] = []
    benchmark.pedantic(
        lambda: rounds.append(_profiled(engine, loops, SAMPLING[sampling], tokens)),
        rounds=3,
        iterations=1,
        warmup_rounds=1,
    )
    best = min(rounds[1:], key=lambda r: r["wall"])  # the warmup round is the first appended
    w = weight_bytes(path)
    benchmark.extra_info.update(
        model=name,
        loops=loops,
        sampling=sampling,
        tokens=tokens,
        ms_per_token={stage: 1e3 * s / tokens for stage, s in best.items()},
        bytes_per_token=w["prelude"] + loops * w["block"] + w["head"],
        block_bytes=w["block"],
        multiply_adds=multiply_adds(engine.info, loops),
    )
