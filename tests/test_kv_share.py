"""KV shared across loops (`kv_share="last"`): after the prompt, each block layer keeps one KV slot, the last loop's,
and every loop of a new token attends to past positions through it while seeing its own row. Checked against a
NumPy reference of that rule written here from the description, and for the engine's own consistency: generation,
batching and chunked prefill agree, memory per position drops to (prelude + k) slots, and what the mode cannot do
(speculative drafts, prompt reuse) is refused or off."""

from __future__ import annotations

import random

import numpy as np
import pytest

import tinyloop
from conftest import TINY
from reference import head_logits, layer_over_past
from tinyloop import SamplingParams


class SharedReference:
    """The shared rule in float64: the prompt in one pass with each loop's own K/V, then per layer only the last
    loop's K/V kept; each decoded token runs every loop attending over the kept rows plus its own current row, and
    after its last loop its rows join the kept ones."""

    def __init__(self, cfg, weights, loops: int, kv_dtype=np.float32):
        self.cfg, self.loops, self.kv = cfg, loops, kv_dtype
        self.w = {k: v.astype(np.float64) for k, v in weights.items()}
        self.kept: dict[str, tuple[np.ndarray, np.ndarray]] = {}  # layer -> (K, V) of past positions
        self.n = 0

    def _layer(self, p: str, x: np.ndarray, past: tuple | None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        return layer_over_past(self.cfg, self.w, p, x, self.n, past, self.kv)

    def _keep(self, name: str, k: np.ndarray, v: np.ndarray) -> None:
        pk, pv = self.kept.get(name, (np.zeros((0, *k.shape[1:])), np.zeros((0, *v.shape[1:]))))
        self.kept[name] = (np.concatenate([pk, k]), np.concatenate([pv, v]))

    def feed(self, tokens: list[int]) -> np.ndarray:
        """Logits of the last row after feeding `tokens` (the prompt first, then one token at a time)."""
        cfg = self.cfg
        x = self.w["token_embd.weight"][np.asarray(tokens)]
        for i in range(cfg.prelude_count):
            x, k, v = self._layer(f"pre.{i}", x, self.kept.get(f"pre.{i}"))
            self._keep(f"pre.{i}", k, v)
        last: dict[str, tuple] = {}
        for _ in range(self.loops):
            for j in range(cfg.block_count):
                x, k, v = self._layer(f"blk.{j}", x, self.kept.get(f"blk.{j}"))
                last[f"blk.{j}"] = (k, v)
        for name, (k, v) in last.items():
            self._keep(name, k, v)
        self.n += len(tokens)
        return head_logits(cfg, self.w, x[-1:])[0]


def _prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(50257) for _ in range(n)]


def _logits(raw: bytes, vocab: int) -> np.ndarray:
    return np.frombuffer(raw, dtype=np.float32).reshape(-1, vocab)[-1]


@pytest.mark.parametrize("loops", [1, 3, 5])
def test_decoding_follows_the_reference_rule(tiny, loops):
    engine = tinyloop.Engine(tiny.path, kv_share="last")
    assert engine.info.kv_share == "last"
    vocab = engine.info.vocab_size
    prompt, rest = _prompt(12, seed=loops), _prompt(6, seed=10 + loops)
    ref = SharedReference(tiny.cfg, tiny.weights, loops)
    seq = engine.sequence(capacity=64)
    got = [_logits(seq.feed(prompt, loops), vocab)]
    want = [ref.feed(prompt)]
    seq.share_loops(loops)
    for t in rest:
        got.append(_logits(seq.feed([t], loops), vocab))
        want.append(ref.feed([t]))
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert np.abs(g - w).max() < 2e-4 * max(1.0, np.abs(w).max()), f"row {i}"
    if loops > 1:  # the rule matters: every loop's own K/V gives other logits after the prompt
        plain = tinyloop.Engine(tiny.path).sequence(capacity=64)
        plain.feed(prompt, loops)
        full = [_logits(plain.feed([t], loops), vocab) for t in rest]
        assert max(np.abs(a - b).max() for a, b in zip(full, got[1:], strict=True)) > 1e-3


def test_generation_batching_and_chunked_prefill_agree(tiny):
    engine = tinyloop.Engine(tiny.path, kv_share="last")
    greedy = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    prompts = [_prompt(n, seed=n) for n in (5, 30, 240)]  # 240 > PREFILL_CHUNK: the batch prefills it in chunks
    for loops in (2, 4):
        solo = [list(engine.generate(p, greedy, loops=loops).tokens) for p in prompts]
        # Greedy generation is the argmax chain of the raw sequence under the same rule.
        seq = engine.sequence(capacity=256)
        logits = _logits(seq.feed(prompts[1], loops), engine.info.vocab_size)
        seq.share_loops(loops)
        chain = []
        for _ in range(10):
            chain.append(int(np.argmax(logits)))
            logits = _logits(seq.feed([chain[-1]], loops), engine.info.vocab_size)
        assert chain == solo[1]
        streams = [engine.stream(p, greedy, loops=loops) for p in prompts]
        batched: list[list[int]] = [[] for _ in prompts]
        while any(s is not None for s in streams):
            live = [(i, s) for i, s in enumerate(streams) if s is not None]
            for (i, _), ev in zip(live, engine.step_many([s for _, s in live]), strict=True):
                assert not isinstance(ev, BaseException), ev
                if ev.token_id >= 0:
                    batched[i].append(ev.token_id)
                if ev.finish_reason is not None:
                    streams[i] = None
        assert batched == solo


def test_memory_per_position_drops_to_one_slot_per_layer(model_factory):
    cfg = TINY
    path = model_factory(cfg, weight_type="F16").path
    prompt, loops = _prompt(40, seed=3), 5
    per_loop = tinyloop.Engine(path).sequence(capacity=128)
    shared = tinyloop.Engine(path, kv_share="last").sequence(capacity=128)
    for seq in (per_loop, shared):
        seq.feed(prompt, loops)
        seq.share_loops(loops)
        for t in prompt[:8]:
            seq.feed([t], loops)
    row = 2 * cfg.n_kv_heads * cfg.head_dim * 2  # K and V, f16
    assert per_loop.kv_bytes == 48 * row * (cfg.prelude_count + loops * cfg.block_count)
    assert shared.kv_bytes == 48 * row * (cfg.prelude_count + cfg.block_count)


def test_speculative_is_refused_and_prompt_reuse_is_off(tiny):
    engine = tinyloop.Engine(tiny.path, kv_share="last")
    with pytest.raises(tinyloop.InvalidRequestError, match="kv_share"):
        engine.generate([1, 2, 3], SamplingParams(temperature=0.0, max_tokens=4), loops=4, draft=(2, 2))
    greedy = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    engine.generate(_prompt(20, seed=1), greedy)
    assert engine.prompt_cache_usage == (0, 0)
    assert engine.generate([*_prompt(20, seed=1), 7], greedy).cached_tokens == 0
    with pytest.raises(tinyloop.InvalidRequestError, match="kv_share"):
        tinyloop.Engine(tiny.path, kv_share="first")
