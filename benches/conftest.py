"""Benchmark fixtures: random models of the benchmark shapes (small, and the 407M seed shape), written once per
session."""

from __future__ import annotations

import pytest

from tinyloop.modelfile.format import ModelConfig, random_weights, write_model

SHAPES = {
    # small: dim 384, 6 heads, ffn 1024, k = 2
    "small": ModelConfig(
        dim=384, n_heads=6, n_kv_heads=6, ffn_dim=1024, block_count=2, context_length=1024, name="small"
    ),
    # seed-shaped: a 407M looped model (dim 2048, 16 heads, ffn 8192, k = 4)
    "seed": ModelConfig(
        dim=2048, n_heads=16, n_kv_heads=16, ffn_dim=8192, block_count=4, context_length=1024, name="seed"
    ),
}


@pytest.fixture(scope="session")
def bench_model(tmp_path_factory):
    import tinyloop

    engines: dict[tuple[str, str], tinyloop.Engine] = {}

    def get(shape: str, weight_type: str) -> tinyloop.Engine:
        key = (shape, weight_type)
        if key not in engines:
            cfg = SHAPES[shape]
            path = tmp_path_factory.mktemp("bench") / f"{shape}-{weight_type}.tinyloop"
            write_model(path, cfg, random_weights(cfg, seed=0), weight_type=weight_type)
            engines.clear()  # keep one large model resident at a time
            engines[key] = tinyloop.Engine(path)
        return engines[key]

    return get
