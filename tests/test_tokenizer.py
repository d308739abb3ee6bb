"""The Rust GPT-2 tokenizer, built from the model file's tokens/merges, against tiktoken's GPT-2 encoding."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from corpus import documents
from tinyloop.modelfile.vocab import EOT_ID, tiktoken_gpt2


@pytest.fixture(scope="module")
def reference():
    return tiktoken_gpt2()


def test_parity_with_tiktoken_on_a_megabyte(tiny_engine, reference):
    docs = documents()
    total = sum(len(d.encode("utf-8")) for d in docs)
    assert total >= 1_000_000
    mismatches = []
    for i, doc in enumerate(docs):
        want = reference.encode_ordinary(doc)
        got = tiny_engine.encode(doc)
        if got != want:
            mismatches.append(i)
    assert mismatches == [], f"{len(mismatches)} of {len(docs)} documents differ, first {mismatches[:5]}"


def test_decode_and_token_bytes_match_tiktoken(tiny_engine, reference):
    for doc in documents()[-40:]:
        ids = reference.encode_ordinary(doc)
        assert tiny_engine.decode(ids) == doc
        assert b"".join(tiny_engine.token_bytes(i) for i in ids) == doc.encode("utf-8")
    for i in [0, 1, 255, 256, 1000, 50255]:
        assert tiny_engine.token_bytes(i) == reference.decode_single_token_bytes(i)


def test_special_token_only_when_asked(tiny_engine, reference):
    text = "a<|endoftext|>b"
    assert tiny_engine.encode(text) == reference.encode_ordinary(text)
    assert EOT_ID not in tiny_engine.encode(text)
    assert tiny_engine.encode(text, allow_special=True) == reference.encode(text, allowed_special="all")
    assert EOT_ID in tiny_engine.encode(text, allow_special=True)
    assert tiny_engine.token_bytes(EOT_ID) == b"<|endoftext|>"


def test_bad_ids_are_errors_not_crashes(tiny_engine):
    import tinyloop

    with pytest.raises(tinyloop.InvalidRequestError, match="50257"):
        tiny_engine.token_bytes(50257)
    with pytest.raises(tinyloop.InvalidRequestError):
        tiny_engine.decode([1, 2, 999_999])


def test_partial_utf8_decodes_to_replacement(tiny_engine, reference):
    ids = reference.encode_ordinary("😀")
    assert len(ids) > 1  # the emoji spans several byte-level tokens
    assert tiny_engine.decode(ids[:1]).endswith("\ufffd")


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet=st.characters(exclude_categories=("Cs",)), max_size=200))
def test_roundtrip_arbitrary_unicode(tiny_engine, reference, s):
    ids = tiny_engine.encode(s)
    assert tiny_engine.decode(ids) == s
    assert ids == reference.encode_ordinary(s)
