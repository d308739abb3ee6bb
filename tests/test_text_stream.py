"""The streaming detokenizer and stop-string matcher, on bytes split every possible way."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from tinyloop.server.text import TextStream

SAMPLES = ["héllo wörld", "日本語のテキスト", "👨‍👩‍👧‍👦 family", "e\u0301\u0302 combining", "mixed 🇫🇷 and 中文 ok"]


def run(data: bytes, cuts: list[int], stop=()) -> tuple[list[str], TextStream]:
    ts = TextStream(stop)
    deltas, prev = [], 0
    for c in [*sorted(set(cuts)), len(data)]:
        deltas.append(ts.push(data[prev:c]))
        prev = c
    deltas.append(ts.finish())
    return deltas, ts


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(SAMPLES), st.lists(st.integers(0, 40), max_size=12))
def test_deltas_are_whole_characters(text, cuts):
    data = text.encode()
    deltas, ts = run(data, [c for c in cuts if c < len(data)])
    assert "".join(deltas) == text == ts.text
    assert all("\ufffd" not in d for d in deltas)


@settings(max_examples=300, deadline=None)
@given(st.text(min_size=0, max_size=30), st.text(min_size=1, max_size=4), st.lists(st.integers(0, 80), max_size=10))
def test_stop_strings_are_exact_and_never_leak(text, stop, cuts):
    data = text.encode()
    deltas, ts = run(data, [c for c in cuts if c < len(data)], stop=[stop])
    joined = "".join(deltas)
    if stop in text:
        assert joined == text[: text.index(stop)] and ts.stopped
    else:
        assert joined == text and not ts.stopped
    assert all(stop not in d for d in deltas)


def test_stop_spanning_pushes_is_held_back():
    ts = TextStream(["END"])
    assert ts.push(b"abc E") == "abc "  # "E" may start the stop string
    assert ts.push(b"N") == ""
    assert ts.push(b"D tail") == ""
    assert ts.stopped and ts.text == "abc "


def test_false_start_is_released():
    ts = TextStream(["END"])
    assert ts.push(b"xEN") == "x"
    assert ts.push(b"Z") == "ENZ"


def test_incomplete_utf8_at_the_end_becomes_replacement():
    ts = TextStream()
    assert ts.push("é".encode()[:1]) == ""
    assert ts.finish() == "\ufffd"
