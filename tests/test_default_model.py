"""The shipped default model: it loads, and its held-out perplexity is what docs/model.md says (so a broken export
or an engine regression fails CI)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import tinyloop
from tinyloop.modelfile.evaluate import evaluate, held_out_ids

ROOT = Path(__file__).resolve().parents[1]
DEFAULT = Path(tinyloop.__file__).parent / "models" / "default.tinyloop"
SAMPLE = Path(__file__).parent / "data" / "heldout_sample.txt"  # 2 held-out passages per source (20 fortunes)
CI_TOKENS = 7168


def documented() -> dict[int, float]:
    line = re.search(r"CI sample.*?perplexity (.*)", (ROOT / "docs" / "model.md").read_text())
    assert line, "docs/model.md has no 'CI sample' perplexity line"
    return {int(d): float(p) for d, p in re.findall(r"loops (\d+): ([\d.]+)", line.group(1))}


@pytest.fixture(scope="module")
def result():
    engine = tinyloop.Engine(DEFAULT)
    ids = held_out_ids(engine, SAMPLE.read_text(), CI_TOKENS)
    assert len(ids) == CI_TOKENS + 1
    return evaluate(engine, ids, engine.info.max_seq_len - 1, depths=[1, 8], progress=False)


def test_perplexity_matches_the_doc(result):
    doc = documented()
    assert abs(result["perplexity"][8] / doc[8] - 1) < 0.01, (result["perplexity"][8], doc[8])
    assert abs(result["perplexity"][1] / doc[1] - 1) < 0.01, (result["perplexity"][1], doc[1])


def test_depth_helps(result):
    assert result["perplexity"][8] < result["perplexity"][1]


def test_default_model_is_what_the_server_loads():
    from tinyloop.server.config import DEFAULT_MODEL

    assert DEFAULT_MODEL == DEFAULT and DEFAULT.stat().st_size <= 32_000_000
    info = tinyloop.Engine(DEFAULT).info
    assert (info.vocab_size, info.default_loops) == (50257, 8)
    assert info.draft_vocab_size == 4096  # drafts through the 4,096 most frequent training tokens (docs/speculative.md)
    assert info.exit_vocab_size == 256  # loops="auto" compares loops over the 256 most frequent (docs/model.md)
    assert tinyloop.Engine(DEFAULT).exit_threshold == pytest.approx(0.0025)  # measured for them (docs/model.md)


@pytest.mark.parametrize("kv_cache_mode", ["fp16", "int8"])
def test_speculative_greedy_equals_plain_on_the_default_model(kv_cache_mode):
    import random

    from tinyloop import SamplingParams

    engine = tinyloop.Engine(DEFAULT, kv_cache_mode=kv_cache_mode)
    rng = random.Random(0)
    text = SAMPLE.read_text().split()
    settings = [((2, 4), 1), ((1, 3), 1), ((3, 6), 1), ((2, 4), 3), ((1, 2), 4)]
    for i in range(50):
        start = rng.randrange(len(text) - 20)
        prompt = " ".join(text[start : start + rng.randint(1, 20)])
        draft, branches = settings[i % len(settings)]
        params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
        plain = engine.generate(prompt, params, loops=8)
        spec = engine.generate(prompt, params, loops=8, draft=draft, k_branches=branches)
        assert spec.tokens == plain.tokens, (prompt, draft, branches)


def test_batched_steps_equal_solo_generation_on_the_default_model(tmp_path):
    """Continuous batching with the real shapes (dim 256: candle's repacked AVX-512 kernels for one row and for
    many, and the padded head) gives every stream its solo output — in F16 and in a Q8_0 copy."""
    import random

    from tinyloop import SamplingParams
    from tinyloop.__main__ import main

    q8 = tmp_path / "q8.tinyloop"
    assert main(["quantize", str(DEFAULT), str(q8), "--bits", "8", "--quiet"]) == 0
    rng = random.Random(5)
    text = SAMPLE.read_text().split()
    for path in (DEFAULT, q8):
        engine = tinyloop.Engine(path)
        prompts = [" ".join(text[s : s + rng.randint(1, 30)]) for s in rng.sample(range(len(text) - 40), 8)]
        params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
        alone = [engine.generate(p, params, loops=8).tokens for p in prompts]
        streams = [engine.stream(p, params, loops=8) for p in prompts]
        got: list[list[int]] = [[] for _ in prompts]
        while any(s is not None for s in streams):
            live = [(i, s) for i, s in enumerate(streams) if s is not None]
            for (i, _s), ev in zip(live, engine.step_many([s for _, s in live]), strict=True):
                if ev.token_id >= 0:
                    got[i].append(ev.token_id)
                if ev.finish_reason is not None:
                    streams[i] = None
        assert got == alone, path


def test_the_chat_template_travels_in_the_file():
    """The file carries training/chat_template.jinja (the form of its chat training data); the server renders
    conversations with it and ends a turn at end-of-text, with no stop strings of its own."""
    from tinyloop.server.protocol import ChatMessage
    from tinyloop.server.template import ChatFormat

    engine = tinyloop.Engine(DEFAULT)
    assert engine.chat_template == (ROOT / "training" / "chat_template.jinja").read_text(encoding="utf-8")
    chat = ChatFormat(engine)
    messages = [
        ChatMessage(role="system", content="Be brief."),
        ChatMessage(role="user", content="Hi"),
        ChatMessage(role="assistant", content="Hello."),
        ChatMessage(role="user", content="Who are you?"),
    ]
    want = "System: Be brief.\nUser: Hi\nAssistant: Hello.<|endoftext|>\nUser: Who are you?\nAssistant:"
    assert chat.render(messages) == want and chat.stops == []
