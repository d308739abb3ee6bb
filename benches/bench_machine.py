"""This machine's physical limits, to read the other benches against: memory read bandwidth and the f32
multiply-add rate, each with the threads tinyloop uses (one per core), through numpy's BLAS (OpenBLAS); and the
read bandwidth of the L2 and L3 caches, on one core and on all of them.

    pytest benches/bench_machine.py --benchmark-json=.benchmarks/machine.json

- Read bandwidth: a matrix-vector product over a 512 MiB f32 matrix, far larger than any cache, so every byte
  comes from memory once — the access pattern of a decode step reading its weights. GB/s = bytes / best time.
- f32 peak: a 2048 × 2048 × 2048 matrix product (2·2048³ FLOPs), which BLAS runs near the cores' FMA limit; f16
  weights are widened to f32 in registers and multiplied at this rate, so it bounds both.
- L2 / L3 read bandwidth: `tinyloop._core.read_bandwidth` (`rust/probe.rs`), each thread reading a buffer of its own
  over and over: half a core's L2 (served from L2), and eight L2s' worth within a quarter of the L3 per thread
  (served from L3), on 1 thread and on one per core. The cache sizes come from the kernel's sysfs
  (`/sys/devices/system/cpu/cpu0/cache`); without it the cases skip. `report_profile.py` sets each decode
  stage beside the level its weights are read from.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import tinyloop

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


def cache_sizes() -> dict[int, int]:
    """Bytes of each data cache level of CPU 0 (per core for L2, shared for L3), from sysfs."""
    sizes = {}
    for index in sorted(Path("/sys/devices/system/cpu/cpu0/cache").glob("index*")):
        kind = (index / "type").read_text().strip()
        if kind in ("Data", "Unified"):
            size = (index / "size").read_text().strip()
            scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(size[-1], 1)
            sizes[int((index / "level").read_text())] = int(size.rstrip("KMG")) * scale
    return sizes


def working_set(level: int, threads: int, sizes: dict[int, int]) -> int:
    """Bytes per thread that the cache `level` serves: half an L2; for L3 eight L2s, within a quarter of the L3."""
    if level == 2:
        return sizes[2] // 2
    return min(8 * sizes[2], sizes[3] // (4 * threads))


@pytest.mark.parametrize("threads", ["1", "all"])
@pytest.mark.parametrize("level", [2, 3])
def test_cache_bandwidth(benchmark, level, threads):
    sizes = cache_sizes() if Path("/sys/devices/system/cpu/cpu0/cache").exists() else {}
    if 2 not in sizes or 3 not in sizes:
        pytest.skip("no L2 / L3 sizes in sysfs")
    n = 1 if threads == "1" else tinyloop._core.num_threads()
    size = working_set(level, n, sizes)
    rates: list[float] = []
    benchmark.pedantic(
        lambda: rates.append(tinyloop._core.read_bandwidth(size, n)), rounds=3, iterations=1, warmup_rounds=0
    )
    assert size < sizes[2] if level == 2 else size > sizes[2]
    benchmark.extra_info.update(
        level=level, threads=n, bytes_per_thread=size, cache_bytes=sizes[level], gb_per_s=round(max(rates), 1)
    )
