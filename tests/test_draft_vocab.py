"""The draft and exit vocabularies (`tinyloop draft-vocab`, rust/model/row_head.rs): drafts propose only listed
tokens, through a head of those rows alone; output is still exactly plain generation's (greedy) or plain sampling's
distribution. (The exit vocabulary's use by `loops="auto"` is tested in test_auto_depth.py.)"""

from __future__ import annotations

import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

import tinyloop
from conftest import TINY
from test_batch import SPECULATIVE, _alone, _batched, _requests
from test_speculative import homogeneity, outcomes, prompts
from tinyloop import SamplingParams
from tinyloop.modelfile.draft_vocab import EXIT_KEY, KEY, count_tokens, coverage, top_tokens, write_vocabularies
from tinyloop.modelfile.format import V, read_gguf, write_gguf
from tinyloop.modelfile.vocab import tiktoken_gpt2

SAMPLE = Path(__file__).parent / "data" / "heldout_sample.txt"


def with_vocab(src: Path, tmp_path: Path, ids, name: str = "dv.tinyloop") -> Path:
    out = tmp_path / name
    write_vocabularies(src, out, list(ids))
    return out


def test_counts_and_top_tokens_match_tiktoken(tiny_engine):
    text = SAMPLE.read_text(encoding="utf-8")
    counts = count_tokens(tiny_engine.encode, text)
    enc = tiktoken_gpt2()
    expected: Counter[int] = Counter()
    for passage in text.split("\n<|endoftext|>\n"):
        if passage.strip():
            expected.update(enc.encode_ordinary(passage))
    assert counts == expected
    ids = top_tokens(counts, 100, always=[50256])
    by_count = sorted(expected.items(), key=lambda e: (-e[1], e[0]))
    assert ids == sorted({t for t, _ in by_count[:99]} | {50256})
    assert coverage(counts, ids) == pytest.approx(sum(c for _, c in by_count[:99]) / sum(expected.values()))
    with pytest.raises(ValueError, match="size"):
        top_tokens(counts, 0)


@pytest.mark.parametrize("weight_type", ["F16", "Q8_0", "Q4_0"])
def test_rewrite_keeps_every_tensor_bit_for_bit(model_factory, tmp_path, weight_type):
    src = model_factory(TINY, weight_type=weight_type).path
    out = with_vocab(src, tmp_path, [7, 3, 50256, 3])
    before, after = read_gguf(src, raw=True), read_gguf(out, raw=True)
    assert before.tensors.keys() == after.tensors.keys()
    for name, (array, ttype) in before.tensors.items():
        assert after.tensors[name][1] == ttype
        assert np.array_equal(after.tensors[name][0], array), name
    assert list(after.metadata[KEY][0]) == [3, 7, 50256] and EXIT_KEY not in after.metadata
    assert (tinyloop.Engine(out).info.draft_vocab_size, tinyloop.Engine(out).info.exit_vocab_size) == (3, 3)
    assert tinyloop.Engine(out, draft_vocab=False).info.draft_vocab_size == 0
    assert (tinyloop.Engine(src).info.draft_vocab_size, tinyloop.Engine(src).info.exit_vocab_size) == (0, 0)
    with pytest.raises(ValueError, match="outside"):
        with_vocab(src, tmp_path, [50257], name="bad.tinyloop")
    # An exit vocabulary: written beside the draft one, dropped when a later rewrite lists none.
    both = tmp_path / "both.tinyloop"
    write_vocabularies(out, both, [5, 6], [9, 2, 9], exit_threshold=0.002)
    meta = read_gguf(both, raw=True).metadata
    assert (list(meta[KEY][0]), list(meta[EXIT_KEY][0])) == ([5, 6], [2, 9])
    engine = tinyloop.Engine(both)
    assert (engine.info.draft_vocab_size, engine.info.exit_vocab_size) == (2, 2)
    assert engine.exit_threshold == pytest.approx(0.002) != tinyloop.Engine(src).exit_threshold
    write_vocabularies(both, both, [5])  # the threshold stays; the exit vocabulary goes
    assert EXIT_KEY not in read_gguf(both, raw=True).metadata
    assert tinyloop.Engine(both).exit_threshold == pytest.approx(0.002)
    with pytest.raises(ValueError, match="token id 60000 is outside"):
        write_vocabularies(src, tmp_path / "bad.tinyloop", [5], [60000])
    for bad in (-0.1, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="exit threshold must be finite and >= 0"):
            write_vocabularies(src, tmp_path / "bad.tinyloop", [5], exit_threshold=bad)


@pytest.mark.parametrize("key", [KEY, EXIT_KEY])
@pytest.mark.parametrize(
    "ids, item, message",
    [
        ([5, 60000], V.UINT32, "outside"),
        ([5, 5], V.UINT32, "twice"),
        ([-1], V.INT32, "outside"),
        (["a"], V.STRING, "integers"),
    ],
)
def test_bad_lists_are_load_errors(tiny, tmp_path, key, ids, item, message):
    c = read_gguf(tiny.path, raw=True)
    c.metadata[key] = (ids, V.ARRAY, item)
    path = tmp_path / "bad.tinyloop"
    write_gguf(path, c)
    with pytest.raises(tinyloop.ModelLoadError, match=message) as e:
        tinyloop.Engine(path)
    assert key in str(e.value)


@pytest.mark.parametrize("weight_type", ["F32", "F16"])
def test_a_list_of_every_token_drafts_exactly_like_the_full_head(model_factory, tmp_path, weight_type):
    # Each draft logit is the same dot product as the full head's, so proposals and counters are identical.
    src = model_factory(TINY, weight_type=weight_type).path
    full, listed = tinyloop.Engine(src), tinyloop.Engine(with_vocab(src, tmp_path, range(50257)))
    assert listed.info.draft_vocab_size == 50257
    for i, prompt in enumerate(prompts(6, seed=4)):
        params = SamplingParams(temperature=0.0 if i % 2 else 0.8, seed=i, max_tokens=12)
        a, b = (e.generate(prompt, params, loops=5, draft=(2, 3)) for e in (full, listed))
        assert (a.tokens, a.draft_proposed, a.draft_accepted) == (b.tokens, b.draft_proposed, b.draft_accepted)


def test_only_listed_tokens_are_drafted(cycle_model, tmp_path):
    path, ids = cycle_model
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    every = tinyloop.Engine(with_vocab(path, tmp_path, ids, "all.tinyloop"))
    out = every.generate(ids[:1], params, loops=8, draft=(1, 4))
    assert out.tokens == (ids[1:] + ids)[:12] and out.draft_accepted == out.draft_proposed == 11
    # Without the cycle's tokens no draft can be right; output is unchanged all the same.
    none = tinyloop.Engine(with_vocab(path, tmp_path, [t for t in range(50257) if t not in ids][:64], "none.tinyloop"))
    out = none.generate(ids[:1], params, loops=8, draft=(1, 4))
    assert out.tokens == (ids[1:] + ids)[:12] and out.draft_accepted == 0 and out.draft_proposed > 0
    # Tree drafting reads the same head.
    out = none.generate(ids[:1], params, loops=8, draft=(1, 2), k_branches=2)
    assert out.tokens == (ids[1:] + ids)[:12] and out.draft_accepted == 0


def _partial_vocab(engine, prompt_list, n=48):
    """Half of the tokens plain greedy generation uses on these prompts, plus unrelated ones."""
    seen: list[int] = []
    for prompt in prompt_list:
        for t in engine.generate(prompt, SamplingParams(temperature=0.0, max_tokens=12), loops=5).tokens:
            if t not in seen:
                seen.append(t)
    return seen[::2] + list(range(1000, 1000 + n))


@pytest.mark.parametrize("weight_type", ["F32", "Q8_0", "Q4_0"])
def test_greedy_output_is_plain_output(model_factory, tmp_path, weight_type):
    src = model_factory(TINY, weight_type=weight_type).path
    plain_engine = tinyloop.Engine(src)
    engine = tinyloop.Engine(with_vocab(src, tmp_path, _partial_vocab(plain_engine, prompts(12, seed=2))))
    accepted = 0
    for i, prompt in enumerate(prompts(12, seed=2)):
        params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
        plain = plain_engine.generate(prompt, params, loops=5)
        kw = {"draft": (2, 3)} if i % 3 else {"draft": (1, 3), "k_branches": 2}
        spec = engine.generate(prompt, params, loops=5, **kw)
        assert spec.tokens == plain.tokens
        accepted += spec.draft_accepted
    assert accepted > 0  # the listed half of the tokens does get drafted


def test_sampling_keeps_the_verifier_distribution(tiny, tmp_path):
    # q is zero outside the list, so the residual max(0, p - q) carries the unlisted tokens: the distribution of
    # speculative samples must still be plain sampling's.
    plain_engine = tinyloop.Engine(tiny.path)
    counts = outcomes(plain_engine, 800, loops=4)
    tokens = sorted({t for key in counts for t in key})
    engine = tinyloop.Engine(with_vocab(tiny.path, tmp_path, tokens[::2]))
    spec = outcomes(engine, 800, loops=4, draft=(1, 3), seed0=10_000)
    chi, crit = homogeneity(counts, spec)
    assert len(counts) > 5 and chi < crit, (chi, crit)


@pytest.mark.parametrize("weight_type", ["F16", "Q8_0"])
def test_batched_drafts_equal_solo(model_factory, tmp_path, weight_type):
    src = model_factory(TINY, weight_type=weight_type).path
    reqs = _requests(seed=11)
    produced = sorted({t for tokens, _ in _alone(tinyloop.Engine(src), reqs) for t in tokens})
    engine = tinyloop.Engine(with_vocab(src, tmp_path, produced[::2] + list(range(1000, 1064))))
    alone = _alone(engine, reqs)
    assert any(alone[i][1][2] > 0 for i in SPECULATIVE)
    assert _batched(engine, reqs, join_every=0) == alone
    assert _batched(engine, reqs, join_every=2) == alone


def test_cli(tiny, tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("the cat sat on the mat\n<|endoftext|>\nthe dog sat", encoding="utf-8")
    out = tmp_path / "cli.tinyloop"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "tinyloop",
            "draft-vocab",
            str(tiny.path),
            str(out),
            "--corpus",
            str(corpus),
            "--size",
            "4",
            "--exit-size",
            "2",
            "--exit-threshold",
            "0.0025",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    # " sat" and "the"/" the" are the most frequent; the end-of-text token is always listed.
    enc = tiktoken_gpt2()
    counts = Counter(enc.encode_ordinary("the cat sat on the mat") + enc.encode_ordinary("the dog sat"))
    top3 = [t for t, _ in sorted(counts.items(), key=lambda e: (-e[1], e[0]))[:3]]
    meta = read_gguf(out, raw=True).metadata
    assert list(meta[KEY][0]) == sorted([*top3, 50256]) and list(meta[EXIT_KEY][0]) == sorted(top3[:2])
    share = sum(counts[t] for t in top3) / sum(counts.values())
    assert f"4 draft tokens, covering {share:.1%} of the corpus's tokens; 2 exit tokens" in r.stdout
    assert tinyloop.Engine(out).exit_threshold == pytest.approx(0.0025)
    command = [sys.executable, "-m", "tinyloop", "draft-vocab", str(tiny.path), str(out), "--corpus", str(corpus)]
    bad = subprocess.run(
        [*command, "--exit-size", "-1"],
        capture_output=True,
        text=True,
    )
    assert bad.returncode == 1 and "exit size must be >= 0, got -1" in bad.stderr
