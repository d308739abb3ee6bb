"""Every kernel level side by side in one run (`TINYLOOP_ISA`: avx512, avx2, scalar; rust/kernels/isa.rs) — decode
tokens/s of the shipped default model (F16) at loops 1 and 8 and its prefill, the default model as Q8_0 (int8), and
the seed-shaped Q4_0 model, whose weights stream from memory at every token (its bytes per token are recorded for
the bandwidth bound). Each level runs in its own processes, the levels alternating round by round, so all see the
same stretch of the machine's load; a level this CPU lacks reports the level it fell back to. With the machine's
limits and llama.cpp on the same models (its unrolled export, greedy, 2 threads) in the same run:

    pytest benches/bench_machine.py benches/bench_isa.py "benches/bench_llama.py::test_decode" -k \
        "not default-Q4_0 and (machine or isa or llama.cpp)" --benchmark-json=.benchmarks/isa.json
    python benches/report_isa.py .benchmarks/isa.json
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from quant_models import DEFAULT, SEED, model_path, random_model, weight_bytes

LEVELS = ["avx512", "avx2", "scalar"]
ROUNDS = 3
# (model, weight type, loops) -> (tokens per timed generation, prefill length or 0). The model and weight type name
# the same files as benches/bench_llama.py's cases, whose llama.cpp rows report_isa.py puts beside these.
CASES: dict[tuple[str, str, int], tuple[int, int]] = {
    ("default", "F16", 1): (128, 0),
    ("default", "F16", 8): (128, 384),
    ("default", "Q8_0", 8): (128, 0),
    ("seed", "Q4_0", 8): (16, 0),
}


def _path(model: str, weight_type: str) -> Path:
    if model == "seed":
        return random_model(SEED, weight_type)
    return DEFAULT if weight_type == "F16" else model_path({"Q8_0": "int8", "Q4_0": "int4 RTN"}[weight_type])


SCRIPT = r"""
import json, sys, time, tinyloop
from tinyloop import SamplingParams
path, loops, tokens, prefill = sys.argv[1], *map(int, sys.argv[2:5])
engine = tinyloop.Engine(path)
ids = engine.encode("The little dog ran to the park and")
greedy = lambda n: SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)

def best_rate(prompt, n, count):
    # Best of three: `count(generation)` items per second of `generate(prompt, n tokens)`.
    rates = []
    for _ in range(3):
        start = time.perf_counter()
        got = count(engine.generate(prompt, greedy(n), loops=loops))
        rates.append(got / (time.perf_counter() - start))
    return max(rates)

engine.generate(ids, greedy(4), loops=loops)
out = {"isa": tinyloop._core.isa(), "decode_tok_s": best_rate(ids, tokens, lambda g: len(g.tokens))}
if prefill:
    long = (ids * (prefill // len(ids) + 1))[:prefill]
    out["prefill_tok_s"] = best_rate(long, 1, lambda g: len(long))
print(json.dumps(out))
"""


def _run(level: str, path: Path, loops: int, tokens: int, prefill: int) -> dict:
    env = os.environ | {"TINYLOOP_ISA": level}
    args = [sys.executable, "-c", SCRIPT, str(path), str(loops), str(tokens), str(prefill)]
    out = subprocess.run(args, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout)


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_levels_side_by_side(benchmark, case):
    model, weight_type, loops = case
    tokens, prefill = CASES[case]
    path = _path(model, weight_type)
    runs: dict[str, list[dict]] = {level: [] for level in LEVELS}

    def round_of_levels():
        for level in LEVELS:
            runs[level].append(_run(level, path, loops, tokens, prefill))

    benchmark.pedantic(round_of_levels, rounds=ROUNDS, iterations=1)
    w = weight_bytes(path)
    levels = {}
    for got in runs.values():
        assert len({r["isa"] for r in got}) == 1
        levels[got[0]["isa"]] = {key: max(r[key] for r in got) for key in got[0] if key != "isa"}
    assert any(isa.startswith("scalar") for isa in levels), levels
    benchmark.extra_info.update(
        model=model,
        weight_type=weight_type,
        loops=loops,
        levels=levels,
        bytes_per_token=w["prelude"] + loops * w["block"] + w["head"],
    )
