"""The installed extension next to another build of it: decode tokens/s of the shipped default model at loops 1 and
8, each build in its own processes, alternating, so both see the same stretch of the machine's load. The other
build is any interpreter with tinyloop installed, named by `TINYLOOP_OTHER_PYTHON` (the case is skipped without
it) — for instance a build for the machine itself next to the portable x86-64-v3 one `pip install .` makes:

    python -m venv /tmp/native && /tmp/native/bin/pip install numpy gguf tqdm fastapi pydantic granian orjson \\
        prometheus-client
    RUSTFLAGS="-C target-cpu=native" CARGO_TARGET_DIR=/tmp/target-native maturin build --release -o /tmp/wheels
    /tmp/native/bin/pip install --no-deps /tmp/wheels/tinyloop-*.whl
    TINYLOOP_OTHER_PYTHON=/tmp/native/bin/python pytest benches/bench_builds.py \\
        --benchmark-json=.benchmarks/builds.json

Each process loads the model, warms up with 32 tokens, then decodes 128 tokens five times; the best counts.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROUNDS = 6
DECODE = r"""
import json, sys, time, tinyloop
from pathlib import Path
from tinyloop import SamplingParams
engine = tinyloop.Engine(Path(tinyloop.__file__).parent / "models" / "default.tinyloop")
ids = engine.encode("The little dog ran to the park and")
loops = int(sys.argv[1])
engine.generate(ids, SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True), loops=loops)
best = 0.0
for _ in range(5):
    start = time.perf_counter()
    n = len(engine.generate(ids, SamplingParams(temperature=0.0, max_tokens=128, ignore_eos=True), loops=loops).tokens)
    best = max(best, n / (time.perf_counter() - start))
print(json.dumps({"tok_s": best, "isa": tinyloop._core.isa()}))
"""


def _decode(python: str, loops: int) -> dict:
    out = subprocess.run([python, "-c", DECODE, str(loops)], capture_output=True, text=True, timeout=300, check=True)
    return json.loads(out.stdout)


@pytest.mark.parametrize("loops", [1, 8])
def test_builds_side_by_side(benchmark, loops):
    other = os.environ.get("TINYLOOP_OTHER_PYTHON")
    if not other:
        pytest.skip("TINYLOOP_OTHER_PYTHON names no other build")
    this: list[dict] = []
    theirs: list[dict] = []
    benchmark.pedantic(
        lambda: this.append(_decode(sys.executable, loops)),
        setup=lambda: theirs.append(_decode(other, loops)),
        rounds=ROUNDS,
        iterations=1,
    )
    assert this[0]["isa"] == theirs[0]["isa"], "compare builds at one kernel level"
    benchmark.extra_info.update(
        loops=loops,
        isa=this[0]["isa"],
        this_tok_s=max(r["tok_s"] for r in this),
        other_tok_s=max(r["tok_s"] for r in theirs),
    )
