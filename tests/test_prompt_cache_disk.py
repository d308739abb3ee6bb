"""The prompt cache's directory (`prompt_cache_disk`): prefixes survive a restart and give the same output; files are
written whole (no temporary left behind), bounded in bytes, private to the user; a damaged, cut-short, foreign or
unrelated file is reported and never used."""

from __future__ import annotations

import random
import stat

import pytest

import tinyloop
from conftest import TINY
from tinyloop import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


def _prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(50257) for _ in range(n)]


def _files(d):
    return sorted(p for p in d.iterdir() if p.suffix == ".tlpc")


def _first_turn(path, d, kv: str = "fp16") -> tuple[list[int], list[int]]:
    """A first turn on an engine with `d` as its directory; returns (its prompt, the second turn's prompt)."""
    first = _prompt(60, seed=1)
    engine = tinyloop.Engine(path, prompt_cache_disk=d, kv_cache_mode=kv)
    out = engine.generate(first, GREEDY)
    engine.prompt_cache_flush()
    return first, first + list(out.tokens) + _prompt(5, seed=2)


@pytest.mark.parametrize("kv", ["fp16", "int4-h"])
def test_a_restart_reuses_the_prefix_with_the_same_output(tiny, tmp_path, kv):
    _, follow = _first_turn(tiny.path, tmp_path, kv)
    [file] = _files(tmp_path)
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]
    restarted = tinyloop.Engine(tiny.path, prompt_cache_disk=tmp_path, kv_cache_mode=kv)
    assert restarted.prompt_cache_usage == (0, 0)  # nothing in memory until a prompt asks
    hit = restarted.generate(follow, GREEDY)
    plain = tinyloop.Engine(tiny.path, prompt_cache_entries=0, kv_cache_mode=kv).generate(follow, GREEDY)
    assert hit.cached_tokens == len(follow) - 5 - 1 and hit.tokens == plain.tokens
    assert restarted.prompt_cache_notices() == []
    restarted.prompt_cache_flush()
    assert _files(tmp_path) != [file] and len(_files(tmp_path)) == 1  # the longer prefix replaced the older file


def test_the_directory_is_created_private(tiny, tmp_path):
    d = tmp_path / "a" / "cache"
    tinyloop.Engine(tiny.path, prompt_cache_disk=d)
    assert d.is_dir() and stat.S_IMODE(d.stat().st_mode) == 0o700


def _restarted(path, d, follow, kv: str = "fp16"):
    """A new engine on `d`: its answer to `follow` and its notices."""
    engine = tinyloop.Engine(path, prompt_cache_disk=d, kv_cache_mode=kv)
    notices = engine.prompt_cache_notices()
    out = engine.generate(follow, GREEDY)
    return out, notices + engine.prompt_cache_notices()


def test_a_damaged_file_is_reported_deleted_and_not_used(tiny, tmp_path):
    _, follow = _first_turn(tiny.path, tmp_path)
    [file] = _files(tmp_path)
    data = bytearray(file.read_bytes())
    data[-100] ^= 0x40  # one bit of the KV bytes
    file.write_bytes(bytes(data))
    out, notices = _restarted(tiny.path, tmp_path, follow)
    assert out.cached_tokens == 0
    assert out.tokens == tinyloop.Engine(tiny.path, prompt_cache_entries=0).generate(follow, GREEDY).tokens
    assert any("checksum mismatch" in n and file.name in n for n in notices), notices
    assert not file.exists()


@pytest.mark.parametrize("cut", [10, 40, 1000, -1])
def test_a_cut_short_file_is_reported_and_skipped(tiny, tmp_path, cut):
    _, follow = _first_turn(tiny.path, tmp_path)
    [file] = _files(tmp_path)
    data = file.read_bytes()
    file.write_bytes(data[:cut])
    out, notices = _restarted(tiny.path, tmp_path, follow)
    assert out.cached_tokens == 0
    assert any(file.name in n for n in notices), notices


def test_foreign_and_unrelated_files_are_reported_and_skipped(tiny, model_factory, tmp_path):
    _, follow = _first_turn(tiny.path, tmp_path, kv="int8")  # written for another KV mode
    other = model_factory(TINY, seed=7)  # same shape, other weights: another model file
    engine = tinyloop.Engine(other.path, prompt_cache_disk=tmp_path)
    engine.generate(follow[:30], GREEDY)
    engine.prompt_cache_flush()
    foreign = _files(tmp_path)
    (tmp_path / "junk.tlpc").write_bytes(b"not a cache file at all")
    (tmp_path / "notes.txt").write_text("ignored: not a .tlpc file")
    out, notices = _restarted(tiny.path, tmp_path, follow)
    assert out.cached_tokens == 0
    assert any("2 prompt cache file(s)" in n and "another model file or KV mode" in n for n in notices), notices
    assert any("junk.tlpc" in n and "not a tinyloop prompt-cache file" in n for n in notices), notices
    # Other identities' files (and files that are not the cache's) are never deleted; this engine added its own.
    assert len(foreign) == 2 and set(foreign) | {tmp_path / "junk.tlpc"} < set(_files(tmp_path))


def test_the_directory_is_bounded_in_bytes(model_factory, tmp_path):
    path = model_factory(TINY, weight_type="F32").path
    engine = tinyloop.Engine(path, prompt_cache_disk=tmp_path, prompt_cache_disk_mib=1)
    for i in range(4):  # 209 positions × 7 slots × 2 KV heads × 16 dims × 4 bytes × K and V: 0.36 MiB each
        engine.generate(_prompt(200, seed=20 + i), GREEDY)
    engine.prompt_cache_flush()
    sizes = [p.stat().st_size for p in _files(tmp_path)]
    assert 1 <= len(sizes) < 4 and sum(sizes) <= 1 << 20
    # The newest stays; the oldest went first.
    again = tinyloop.Engine(path, prompt_cache_disk=tmp_path, prompt_cache_disk_mib=1)
    assert again.generate([*_prompt(200, seed=23), 1], GREEDY).cached_tokens == 200
    assert again.generate([*_prompt(200, seed=20), 1], GREEDY).cached_tokens == 0


def test_a_file_over_the_memory_bound_leaves_the_memorys_best(tiny, tmp_path):
    long = _prompt(250, seed=30)
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    writer = tinyloop.Engine(tiny.path, prompt_cache_disk=tmp_path)
    writer.generate(long, params, loops=8)  # 251 positions × 17 slots × 256 bytes: just over 1 MiB
    writer.prompt_cache_flush()
    reader = tinyloop.Engine(tiny.path, prompt_cache_disk=tmp_path, prompt_cache_mib=1)
    reader.generate(long[:20], SamplingParams(temperature=0.0, max_tokens=1), loops=8)  # a 20-token entry in memory
    out = reader.generate([*long, 5], params, loops=8)
    assert out.cached_tokens == 20  # the file is longer but cannot be held: the memory's prefix is used
    assert reader.prompt_cache_usage[1] <= 1 << 20
