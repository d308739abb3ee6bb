"""This machine's physical limits, to read the other benches against: memory read bandwidth and the f32
multiply-add rate, each with the threads tinyloop uses (one per core), through numpy's BLAS (OpenBLAS).

    pytest benches/bench_machine.py --benchmark-json=.benchmarks/machine.json

- Read bandwidth: a matrix-vector product over a 512 MiB f32 matrix, far larger than any cache, so every byte
  comes from memory once — the access pattern of a decode step reading its weights. GB/s = bytes / best time.
- f32 peak: a 2048 × 2048 × 2048 matrix product (2·2048³ FLOPs), which BLAS runs near the cores' FMA limit; f16
  weights are widened to f32 in registers and multiplied at this rate, so it bounds both.
"""

from __future__ import annotations

import numpy as np
import pytest

READ_BYTES = 512 << 20
COLS = 4096
GEMM = 2048


@pytest.fixture(scope="module")
def rng():
    return np.random.default_rng(0)


def test_read_bandwidth(benchmark, rng):
    a = rng.standard_normal((READ_BYTES // 4 // COLS, COLS), dtype=np.float32)
    x = rng.standard_normal(COLS, dtype=np.float32)
    y = benchmark.pedantic(lambda: a @ x, rounds=8, iterations=1, warmup_rounds=1)
    assert np.allclose(y[:4], a[:4] @ x, rtol=1e-4, atol=1e-3)
    benchmark.extra_info.update(bytes=a.nbytes, gb_per_s=round(a.nbytes / benchmark.stats.stats.min / 1e9, 1))


def test_f32_flops(benchmark, rng):
    a = rng.standard_normal((GEMM, GEMM), dtype=np.float32)
    b = rng.standard_normal((GEMM, GEMM), dtype=np.float32)
    c = benchmark.pedantic(lambda: a @ b, rounds=5, iterations=1, warmup_rounds=1)
    assert np.allclose(c[0, :4], a[0] @ b[:, :4], rtol=1e-3, atol=1e-2)
    flops = 2 * GEMM**3
    benchmark.extra_info.update(flops=flops, gflops=round(flops / benchmark.stats.stats.min / 1e9, 1))
