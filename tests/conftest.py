"""Shared fixtures: small random models written with `tinyloop.modelfile.format`, cached per test session."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest

from serverutil import running_server
from shapes import TINY, TINY_NOPRE
from tinyloop.modelfile.format import ModelConfig, random_weights, write_model


@dataclasses.dataclass
class BuiltModel:
    cfg: ModelConfig
    weights: dict[str, np.ndarray]
    path: Path
    weight_type: str


@pytest.fixture(scope="session")
def model_factory(tmp_path_factory):
    cache: dict[tuple, BuiltModel] = {}

    def build(cfg: ModelConfig = TINY, weight_type: str = "F32", seed: int = 0) -> BuiltModel:
        key = (cfg, weight_type, seed)
        if key not in cache:
            weights = random_weights(cfg, seed=seed)
            path = tmp_path_factory.mktemp("models") / f"{cfg.name}-{weight_type}-{seed}.tinyloop"
            write_model(path, cfg, weights, weight_type=weight_type)
            cache[key] = BuiltModel(cfg, weights, path, weight_type)
        return cache[key]

    return build


@pytest.fixture(scope="session")
def tiny(model_factory) -> BuiltModel:
    return model_factory(TINY)


@pytest.fixture(scope="session")
def tiny_long(model_factory) -> BuiltModel:
    """TINY with a long context: a generation of thousands of tokens takes seconds, so a test can tell a request
    that was cancelled from one that ran to its end whatever the machine's speed."""
    return model_factory(dataclasses.replace(TINY, context_length=8192, name="tiny-long"))


@pytest.fixture(scope="session")
def tiny_engine(tiny):
    import tinyloop

    return tinyloop.Engine(tiny.path)


CYCLE_TEXT = "X日本語👍🏽é\u0301"  # every token distinct; 13 of its 15 tokens are partial UTF-8


@pytest.fixture(scope="session")
def cycle_model(tmp_path_factory):
    """A model whose greedy output is CYCLE_TEXT's tokens in order, from a prompt of its first token.

    Its layers write nothing (attn_output and ffn_down are zero), so the head reads the current token's embedding;
    token i of the text is embedded as unit vector i and the head maps unit vector i to token i + 1.
    """
    from tinyloop.modelfile.vocab import tiktoken_gpt2

    ids = tiktoken_gpt2().encode_ordinary(CYCLE_TEXT)
    assert len(set(ids)) == len(ids) <= TINY_NOPRE.dim
    w = random_weights(TINY_NOPRE, seed=9, scale=0.01)
    for j in range(TINY_NOPRE.block_count):
        w[f"blk.{j}.attn_output.weight"][:] = 0.0
        w[f"blk.{j}.ffn_down.weight"][:] = 0.0
    w["output_norm.weight"][:] = 1.0
    w["output.weight"][:] = 0.0
    for i, t in enumerate(ids):
        w["token_embd.weight"][t] = 0.0
        w["token_embd.weight"][t, i] = 1.0
        w["output.weight"][ids[(i + 1) % len(ids)], i] = 10.0
    path = tmp_path_factory.mktemp("models") / "cycle.tinyloop"
    write_model(path, TINY_NOPRE, w)
    return path, ids


@pytest.fixture(scope="module")
def server(tiny):
    """A server on the TINY model, one per test module (modules that need other flags define their own)."""
    with running_server(tiny.path) as base:
        yield base


@pytest.fixture(scope="module")
def client(server):
    """The openai SDK pointed at `server`."""
    import openai

    with openai.OpenAI(base_url=f"{server}/v1", api_key="unused") as c:
        yield c
