"""The kernels' instruction-set level (`rust/kernels/isa.rs`): `TINYLOOP_ISA` lowers it, a bad value is refused
where a model loads, every level this CPU has computes the same model within the kernels' tolerance, and the build
runs on a CPU without AVX-512 (under qemu). Each level runs in its own process: the level is chosen once per
process."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

LEVELS = ["scalar", "avx2", "avx512"]
SCORE = """
import json, sys, tinyloop
from tinyloop import SamplingParams
engine = tinyloop.Engine(sys.argv[1])
ids = engine.encode("Once upon a time there was a little dog who ran to the park")
greedy = engine.generate(ids, SamplingParams(temperature=0.0, max_tokens=8), loops=3).tokens
print(json.dumps({"isa": tinyloop._core.isa(), "scores": engine.score(ids, [1, 3]), "greedy": greedy}))
"""


def _run(model, level: str | None) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TINYLOOP_ISA"} | ({"TINYLOOP_ISA": level} if level else {})
    out = subprocess.run(
        [sys.executable, "-c", SCORE, str(model)], env=env, capture_output=True, text=True, timeout=120, check=True
    )
    return json.loads(out.stdout)


def _rank(isa: str) -> int:
    return LEVELS.index(isa.split("+")[0])


# F32 runs the dense kernel; Q4_0 and Q8_0 the block-quantized one (AVX-512 VNNI, AVX2 or candle's below those).
WEIGHTS = ["F32", "Q4_0", "Q8_0"]


@pytest.mark.parametrize("weights", WEIGHTS)
def test_each_level_computes_the_same_model(model_factory, weights):
    tiny = model_factory(weight_type=weights)
    best = _run(tiny.path, None)
    seen = set()
    for level in LEVELS:
        got = _run(tiny.path, level)
        # A level the CPU lacks falls back to the best it has; never above what was asked.
        assert _rank(got["isa"]) == min(LEVELS.index(level), _rank(best["isa"])), (level, got["isa"])
        seen.add(got["isa"])
        for (lp, argmax), (lp_best, argmax_best) in zip(got["scores"], best["scores"], strict=True):
            assert lp == pytest.approx(lp_best, abs=2e-3)
            same = sum(a == b for a, b in zip(argmax, argmax_best, strict=True))
            assert same >= len(argmax) - 1, (level, argmax, argmax_best)
    assert "scalar" in seen and len(seen) == len({min(_rank(best["isa"]), i) for i in range(3)})


def test_an_unknown_level_is_refused_where_a_model_loads(tiny):
    env = os.environ | {"TINYLOOP_ISA": "avx9000"}
    code = (
        "import sys, tinyloop\n"
        "try:\n    tinyloop.Engine(sys.argv[1])\nexcept tinyloop.InvalidRequestError as e:\n    print(e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code, str(tiny.path)], env=env, capture_output=True, text=True)
    assert out.returncode == 0 and "TINYLOOP_ISA" in out.stdout and "avx9000" in out.stdout, out.stdout + out.stderr


@pytest.mark.skipif(shutil.which("qemu-x86_64") is None, reason="needs Debian's qemu-user (.ci/run installs it)")
@pytest.mark.parametrize("weights", WEIGHTS)
def test_the_extension_runs_on_a_cpu_without_avx512(model_factory, weights):
    """The extension as built (`pip install .`) under `qemu-x86_64 -cpu Haswell`, a CPU with AVX2, FMA and F16C and no
    AVX-512: it picks the avx2 level and computes the same model as on this machine."""
    tiny = model_factory(weight_type=weights)
    native = _run(tiny.path, None)
    env = {k: v for k, v in os.environ.items() if k != "TINYLOOP_ISA"}
    out = subprocess.run(
        ["qemu-x86_64", "-cpu", "Haswell", sys.executable, "-c", SCORE, str(tiny.path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    haswell = json.loads(out.stdout)
    assert haswell["isa"] == "avx2"
    for (lp, argmax), (lp_native, argmax_native) in zip(haswell["scores"], native["scores"], strict=True):
        assert lp == pytest.approx(lp_native, abs=2e-3)
        assert sum(a == b for a, b in zip(argmax, argmax_native, strict=True)) >= len(argmax) - 1
