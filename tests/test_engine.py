"""The Python API: generate / stream / info, sampling behaviour end to end, errors, the GIL."""

from __future__ import annotations

import threading
import time

import pytest

import tinyloop
from conftest import TINY
from tinyloop import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=12)


def test_info_reports_the_config(tiny_engine):
    info = tiny_engine.info
    assert (info.dim, info.n_heads, info.n_kv_heads, info.head_dim, info.ffn_dim) == (64, 4, 2, 16, 96)
    assert (info.vocab_size, info.block_count, info.prelude_count) == (50257, 2, 1)
    assert (info.default_loops, info.max_trained_loops, info.context_length) == (3, 8, 256)
    assert info.max_seq_len == 256 and info.quant == "fp16" and info.name == TINY.name


def test_generate_text_and_ids_agree(tiny_engine):
    ids = tiny_engine.encode("The quick brown fox")
    a = tiny_engine.generate("The quick brown fox", GREEDY)
    b = tiny_engine.generate(ids, GREEDY)
    assert a.tokens == b.tokens and len(a.tokens) == 12
    assert a.finish_reason == "length" and a.completion_tokens == 12 and a.prompt_tokens == len(ids)
    assert a.text == tiny_engine.decode(a.tokens)


def test_greedy_equals_argmax_of_the_forward_pass(tiny_engine):
    import numpy as np

    prompt = [464, 3139, 286]
    out = tiny_engine.generate(prompt, SamplingParams(temperature=0.0, max_tokens=4), loops=2)
    seq = tiny_engine.sequence()
    tokens = list(prompt)
    expected = []
    logits = np.frombuffer(seq.feed(tokens, 2), dtype=np.float32).reshape(len(tokens), -1)[-1]
    for _ in range(4):
        nxt = int(np.argmax(logits))
        expected.append(nxt)
        logits = np.frombuffer(seq.feed([nxt], 2), dtype=np.float32)
    assert out.tokens == expected


def test_loops_change_the_output(tiny_engine):
    outs = {
        tuple(tiny_engine.generate([1, 2, 3], SamplingParams(temperature=0.0, max_tokens=8), loops=n).tokens)
        for n in (1, 2, 5)
    }
    assert len(outs) > 1


def test_stream_matches_generate(tiny_engine):
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=11, max_tokens=10)
    full = tiny_engine.generate("Hello", params)
    events = list(tiny_engine.stream("Hello", params))
    tokens = [e.token_id for e in events if e.token_id >= 0]
    assert tokens == full.tokens
    assert b"".join(e.bytes for e in events) == b"".join(tiny_engine.token_bytes(t) for t in full.tokens)
    assert [e.finish_reason for e in events] == [None] * 9 + ["length"]


def test_seed_reproduces_and_differs(tiny_engine):
    p = lambda s: SamplingParams(temperature=1.0, seed=s, max_tokens=16)  # noqa: E731
    assert tiny_engine.generate("x", p(1)).tokens == tiny_engine.generate("x", p(1)).tokens
    assert tiny_engine.generate("x", p(1)).tokens != tiny_engine.generate("x", p(2)).tokens


def test_stop_tokens_and_eos(tiny_engine):
    free = tiny_engine.generate([5, 6, 7], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    stop_at = free.tokens[4]
    first = free.tokens.index(stop_at)
    out = tiny_engine.generate([5, 6, 7], SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=[stop_at]))
    assert out.finish_reason == "stop"
    assert out.tokens == free.tokens[:first]  # the stop token itself is not output
    # min_tokens holds the stop back: output then runs past it.
    held = tiny_engine.generate(
        [5, 6, 7], SamplingParams(temperature=0.0, max_tokens=12, min_tokens=first + 1, stop_token_ids=[stop_at])
    )
    assert len(held.tokens) > first


def test_eos_ends_generation(tmp_path):
    """A model rigged to prefer EOS: residual dim 0 is a large constant no layer writes to, and only EOS reads it."""
    from conftest import TINY_NOPRE
    from tinyloop.modelfile.format import random_weights, write_model

    cfg = TINY_NOPRE
    w = random_weights(cfg, seed=5)
    w["token_embd.weight"][:, 0] = 50.0
    for j in range(cfg.block_count):
        w[f"blk.{j}.attn_output.weight"][0, :] = 0.0
        w[f"blk.{j}.ffn_down.weight"][0, :] = 0.0
    w["output.weight"][:, 0] = 0.0
    w["output.weight"][50256, 0] = 10.0
    path = tmp_path / "eos.tinyloop"
    write_model(path, cfg, w)
    engine = tinyloop.Engine(path)
    out = engine.generate([1, 2], SamplingParams(temperature=0.0, max_tokens=5))
    assert out.tokens == [] and out.finish_reason == "stop"
    out = engine.generate([1, 2], SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True))
    assert len(out.tokens) == 5 and 50256 not in out.tokens and out.finish_reason == "length"
    out = engine.generate([1, 2], SamplingParams(temperature=0.0, max_tokens=5, min_tokens=3))
    assert len(out.tokens) == 3 and out.finish_reason == "stop"
    events = list(engine.stream([1, 2], SamplingParams(temperature=0.0, max_tokens=5)))
    assert [(e.token_id, e.bytes, e.finish_reason) for e in events] == [(-1, b"", "stop")]


def test_request_errors(tiny_engine):
    with pytest.raises(tinyloop.ContextLengthError, match="257 positions needed but the limit is 256"):
        tiny_engine.generate([1] * 200, SamplingParams(max_tokens=57))
    with pytest.raises(tinyloop.InvalidRequestError, match="at least one token"):
        tiny_engine.generate([], GREEDY)
    with pytest.raises(tinyloop.InvalidRequestError, match="loops"):
        tiny_engine.generate([1], GREEDY, loops=0)
    with pytest.raises(tinyloop.InvalidRequestError, match="vocabulary"):
        tiny_engine.generate([70000], GREEDY)
    with pytest.raises(tinyloop.InvalidRequestError, match="top_p"):
        SamplingParams(top_p=2.0)
    # The engine still serves afterwards.
    assert len(tiny_engine.generate([1], GREEDY).tokens) == 12


def test_max_seq_len_override(tiny):
    engine = tinyloop.Engine(tiny.path, max_seq_len=16)
    assert engine.info.max_seq_len == 16
    with pytest.raises(tinyloop.ContextLengthError, match="limit is 16"):
        engine.generate([1] * 10, SamplingParams(max_tokens=7))


def test_generate_releases_the_gil(model_factory):
    import dataclasses

    big = model_factory(dataclasses.replace(TINY, dim=256, n_heads=4, n_kv_heads=4, ffn_dim=512, name="gil"))
    engine = tinyloop.Engine(big.path)
    ticks = []
    stop = threading.Event()

    def ticker():
        while not stop.is_set():
            ticks.append(1)
            time.sleep(0.001)

    t = threading.Thread(target=ticker)
    t.start()
    try:
        before = len(ticks)
        engine.generate([1, 2, 3], SamplingParams(temperature=0.0, max_tokens=64), loops=8)
        during = len(ticks) - before
    finally:
        stop.set()
        t.join()
    # Python code ran on another thread while the whole generation was in Rust.
    assert during > 5


def test_profile_times_every_stage_of_each_step(tiny_engine):
    """`start_profile` / `stop_profile` sum wall time per stage: one step and one token choice per token, every
    layer's weight products and attention inside the blocks, nothing counted once stopped."""
    info = tiny_engine.info
    params = SamplingParams(temperature=1.0, seed=1, max_tokens=12, ignore_eos=True)
    tinyloop.start_profile()
    tokens = len(list(tiny_engine.stream("Once upon a time", params, loops=3)))
    totals = {name: (seconds, calls) for name, seconds, calls in tinyloop.stop_profile()}
    layers = info.prelude_count + 3 * info.block_count
    assert totals["step"][1] == tokens == 12
    assert totals["sample"][1] == totals["head"][1] == totals["blocks"][1] == totals["embed"][1] == tokens
    # Timed per input they read (`model::linear::Group`): q/k/v, output, gate/up, down.
    assert totals["matmul"][1] == 4 * layers * tokens
    assert totals["attention"][1] == layers * tokens
    assert all(seconds > 0 for seconds, _ in totals.values())
    seconds = {name: s for name, (s, _) in totals.items()}
    assert seconds["blocks"] >= seconds["matmul"] + seconds["attention"]
    assert seconds["step"] >= seconds["blocks"] + seconds["head"] + seconds["sample"]
    tiny_engine.generate("Once upon a time", params, loops=3)
    assert tinyloop.stop_profile() == [(name, *totals[name]) for name in totals]
    tinyloop.start_profile()
    assert all(s == 0 and c == 0 for _, s, c in tinyloop.stop_profile())
