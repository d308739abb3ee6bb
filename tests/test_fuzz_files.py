"""Fuzzing the model-file loader and the tokenizer.

A malformed `.tinyloop` file either loads (and then generates, or fails typed) or raises `ModelLoadError`: never
another exception, a crash, a hang, or an allocation out of proportion to the file. Files are loaded by a worker
process (tests/fuzz_files.py), so a crash or a hang fails one case instead of ending the run, and each load's peak
memory is measured. The tokenizer round-trips any text exactly and refuses unencodable strings and ids outside the
vocabulary with typed errors. benches/bench_fuzz_files.py runs the same generators for much longer.
"""

from __future__ import annotations

import dataclasses
from datetime import timedelta

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tinyloop
from fuzz_files import Case, Seed, Worker, edge_values, mutations, problem, random_files, seed_configs, write_seeds
from tinyloop.modelfile.vocab import EOT_ID, EOT_TOKEN

# A load takes a millisecond or two; a deadline far above that flags a slow path without flaking on a busy machine.
FUZZ = settings(deadline=timedelta(seconds=5), suppress_health_check=[HealthCheck.too_slow])


@pytest.fixture(scope="module")
def seeds(tmp_path_factory) -> list[Seed]:
    return write_seeds(tmp_path_factory.mktemp("fuzz"))


@pytest.fixture(scope="module")
def worker():
    with Worker() as w:
        yield w


def check(worker: Worker, case: Case, run: bool = True) -> dict:
    result = worker.load(case.data, run=run)
    why = problem(case, result)
    assert why is None, why
    return result


# --- files ------------------------------------------------------------------------------------------------------------


def test_seeds_load_and_run(worker, seeds):
    for seed in seeds:
        assert check(worker, Case(f"seed {seed.name}", seed.data))["outcome"] == "loaded"


def test_every_interesting_truncation(worker, seeds):
    """Every prefix ending at, or one byte into or before the end of, a field of the header, metadata or tensor
    infos, or at a tensor's data (about 1,700 files)."""
    for seed in seeds:
        for n in seed.cuts:
            result = check(worker, Case(f"{seed.name}: first {n} bytes", seed.data[:n]), run=False)
            assert result["outcome"] == "ModelLoadError", (n, result)


def test_every_numeric_field_at_its_edges(worker, seeds):
    """Each count, length, type, dimension, offset and scalar value set to 0, its top bit, all ones, and one more
    (about 2,000 files)."""
    for seed in seeds:
        for case in edge_values(seed):
            check(worker, case)


@settings(FUZZ, max_examples=600)
@given(data=st.data())
def test_mutated_files(worker, seeds, data):
    check(worker, data.draw(mutations(seeds), label="case"))


@settings(FUZZ, max_examples=150)
@given(case=random_files())
def test_random_files(worker, case):
    assert check(worker, case)["outcome"] == "ModelLoadError"


# --- declared sizes beyond the file: refused before anything that size is allocated -----------------------------------


def patched(seed: Seed, changes: dict[int, int]) -> bytes:
    """`seed` with the fields starting at these offsets set to these values (each keeps its size)."""
    sizes = {f.offset: f.size for f in seed.fields}
    data = bytearray(seed.data)
    for offset, value in changes.items():
        data[offset : offset + sizes[offset]] = value.to_bytes(sizes[offset], "little")
    return bytes(data)


def value_offset(seed: Seed, key: str, kind: str = "value", nth: int = 0) -> int:
    return [f.offset for f in seed.fields if f.owner == key and f.kind == kind][nth]


def declaring_huge_model(seed: Seed) -> bytes:
    """The seed re-declared at dim 65,536 and ffn 2^18, every tensor's shape to match: tens of GB of weights
    declared in a file of 30 KB."""
    cfg = dataclasses.replace(seed_configs()[seed.name][0], dim=1 << 16, ffn_dim=1 << 18)
    changes = {
        value_offset(seed, "tinyloop.embedding_length"): cfg.dim,
        value_offset(seed, "tinyloop.feed_forward_length"): cfg.ffn_dim,
    }
    for name, shape in cfg.tensor_shapes().items():
        for i, d in enumerate(reversed(shape)):  # GGUF stores the dimensions innermost first
            changes[value_offset(seed, name, "dim", i)] = d
    return patched(seed, changes)


def with_byte_array(seed: Seed, key: str, n: int) -> bytes:
    """The seed with one more metadata key, an array of about `n` zero bytes, before the others. The entry is made
    a multiple of the 32-byte alignment, so the tensor data moves by exactly its length and stays where the tensor
    infos (offsets relative to the data section) say."""
    head = len(key).to_bytes(8, "little") + key.encode() + (9).to_bytes(4, "little") + (0).to_bytes(4, "little")
    n += -(len(head) + 8 + n) % 32
    entry = head + n.to_bytes(8, "little") + bytes(n)
    n_kv = int.from_bytes(seed.data[16:24], "little") + 1
    return seed.data[:16] + n_kv.to_bytes(8, "little") + entry + seed.data[24:]


def huge_declarations(seed: Seed) -> dict[str, bytes]:
    tokens = "tokenizer.ggml.tokens"
    return {
        "tensors of tens of GB": declaring_huge_model(seed),
        "2^40 tokens": patched(seed, {value_offset(seed, tokens, "count"): 1 << 40}),
        "a token of 2^62 bytes": patched(seed, {value_offset(seed, tokens, "length"): 1 << 62}),
        "2^40 metadata keys": patched(seed, {16: 1 << 40}),
        "2^60 tensors": patched(seed, {8: 1 << 60}),
        "a tensor of 2^64 elements": patched(seed, {value_offset(seed, "token_embd.weight", "dim", 1): 1 << 63}),
    }


def test_declared_sizes_beyond_the_file_are_refused_before_allocating(worker, seeds):
    for seed in seeds:
        for what, data in huge_declarations(seed).items():
            result = check(worker, Case(f"{seed.name}: {what}", data), run=False)
            assert result["outcome"] == "ModelLoadError", (what, result)
            assert result["rss_growth_mib"] < 16, (what, result)


def test_a_large_array_costs_memory_in_proportion(worker, seeds):
    # A 4 MB byte array under a key the loader does not read. Held as one 32-byte value per element it took
    # 128 MB; held as its bytes, about 4 MB.
    data = with_byte_array(seeds[0], "fuzz.bytes", 4 << 20)
    result = check(worker, Case("4 MB byte array", data), run=False)
    assert result["outcome"] == "loaded" and result["rss_growth_mib"] < 16, result


@pytest.mark.parametrize(
    "specials,reason",
    [
        # An empty control token matched everywhere without advancing: encode(..., allow_special=True) never returned.
        ([""], "control token 321 is empty"),
        (["<a>", "<b>", "<a>"], "control tokens 321 and 323 are both"),
        # Control tokens become one regex: 20,000 of them took 68 MB to compile from a 0.8 MB file.
        ([f"<|{i}|>" for i in range(20_000)], "more than 1024 control tokens"),
    ],
    ids=["empty", "duplicate", "20000"],
)
def test_control_tokens_that_cannot_work_are_refused(tmp_path, worker, specials, reason):
    from fuzz_files import small_vocab
    from tinyloop.modelfile.format import random_weights, write_model
    from tinyloop.modelfile.vocab import Vocabulary

    v = small_vocab()
    vocab = Vocabulary(
        v.tokens + specials, v.token_types + [3] * len(specials), v.merges, v.eos_token_id, v.bos_token_id
    )
    cfg = dataclasses.replace(seed_configs()["quant"][0], vocab_size=len(vocab))
    path = tmp_path / "controls.tinyloop"
    write_model(path, cfg, random_weights(cfg), "Q4_0", vocab=vocab)
    result = check(worker, Case(f"{len(specials)} control tokens, first {specials[:3]}", path.read_bytes()))
    assert result["outcome"] == "ModelLoadError" and reason in result["message"], result
    assert result["rss_growth_mib"] < 16, result


# --- the tokenizer, through the Python API ----------------------------------------------------------------------------

TEXT = st.text(alphabet=st.characters(exclude_categories=("Cs",)), max_size=200)  # any scalar value, NUL included
WITH_SPECIALS = st.lists(
    st.one_of(TEXT, st.sampled_from([EOT_TOKEN, "<|endoftext", "|>", "<|", "\0"])), max_size=6
).map("".join)


def assert_round_trip(engine, text: str, allow_special: bool) -> None:
    ids = engine.encode(text, allow_special=allow_special)
    assert engine.decode(ids) == text
    assert b"".join(engine.token_bytes(i) for i in ids) == text.encode("utf-8")
    assert allow_special or EOT_ID not in ids


@settings(FUZZ, max_examples=300)
@given(text=st.one_of(TEXT, WITH_SPECIALS), allow_special=st.booleans())
def test_encode_decode_round_trips(tiny_engine, text, allow_special):
    assert_round_trip(tiny_engine, text, allow_special)


@settings(FUZZ, max_examples=200)
@given(raw=st.binary(max_size=200), errors=st.sampled_from(["surrogateescape", "surrogatepass", "replace", "ignore"]))
def test_text_from_random_bytes(tiny_engine, raw, errors):
    try:
        text = raw.decode("utf-8", errors)  # surrogatepass still refuses bytes that are not UTF-8
    except UnicodeDecodeError:
        text = (raw + b"\xed\xa0\x80").decode("utf-8", "surrogateescape")  # invalid bytes as lone surrogates
    if any("\ud800" <= c <= "\udfff" for c in text):
        with pytest.raises((ValueError, tinyloop.TinyloopError)):  # UnicodeEncodeError from PyO3's str -> String
            tiny_engine.encode(text)
    else:
        assert_round_trip(tiny_engine, text, False)


@settings(FUZZ, max_examples=100)
@given(text=st.tuples(TEXT, st.characters(categories=["Cs"]), TEXT).map("".join), allow_special=st.booleans())
def test_lone_surrogates_are_refused(tiny_engine, text, allow_special):
    with pytest.raises((ValueError, tinyloop.TinyloopError)):
        tiny_engine.encode(text, allow_special=allow_special)


def token_ids(vocab: int) -> st.SearchStrategy[int]:
    edges = [-(2**63), -(2**32), -1, vocab - 1, vocab, 2**31, 2**32 - 1, 2**32, 2**63, 2**64]
    return st.one_of(st.integers(0, vocab - 1), st.sampled_from(edges), st.integers(-(2**70), 2**70))


@settings(FUZZ, max_examples=300)
@given(data=st.data())
def test_ids_outside_the_vocabulary(tiny_engine, data):
    # Ids are u32 in Rust: PyO3 refuses a negative or >= 2^32 id with OverflowError before tinyloop sees it; an id
    # in [vocab, 2^32) is tinyloop's InvalidRequestError.
    vocab = tiny_engine.info.vocab_size
    ids = data.draw(st.lists(token_ids(vocab), max_size=8), label="ids")
    if any(not 0 <= i < 2**32 for i in ids):
        expected: type[Exception] | None = OverflowError
    elif any(i >= vocab for i in ids):
        expected = tinyloop.InvalidRequestError
    else:
        expected = None
    if expected is None:
        assert tiny_engine.decode(ids) == b"".join(tiny_engine.token_bytes(i) for i in ids).decode("utf-8", "replace")
        return
    with pytest.raises(expected):
        tiny_engine.decode(ids)
    bad = next(i for i in ids if not 0 <= i < vocab)
    with pytest.raises(OverflowError if not 0 <= bad < 2**32 else tinyloop.InvalidRequestError):
        tiny_engine.token_bytes(bad)
