"""`tinyloop export-llama`: the unrolled llama GGUF computes exactly what the looped model computes.

llama.cpp itself is not a test dependency (benches/bench_llama.py runs the exported file through llama-cpp-python);
here the independent NumPy reference runs the exported file as a plain (un-looped) transformer."""

from __future__ import annotations

import dataclasses

import gguf
import numpy as np
import pytest

import tinyloop
from conftest import TINY
from reference import forward as ref_forward
from tinyloop.modelfile.export_llama import ExportError, export_llama

PROMPT = [464, 3139, 286, 4881, 318, 6342, 13, 198, 50256, 1]


def _read(path):
    reader = gguf.GGUFReader(path)
    fields = {k: f for k, f in reader.fields.items()}
    tensors = {t.name: t for t in reader.tensors}
    return fields, tensors


def _scalar(field):
    return field.parts[field.data[0]].tolist()[0]


@pytest.mark.parametrize("weight_type", ["F32", "Q8_0"])
def test_unrolled_file_is_the_looped_model(model_factory, tmp_path, weight_type):
    built = model_factory(TINY, weight_type=weight_type)
    loops = 3
    out = tmp_path / "unrolled.gguf"
    n_layers = export_llama(built.path, out, loops=loops, progress=False)
    assert n_layers == TINY.prelude_count + TINY.block_count * loops
    fields, tensors = _read(out)
    assert bytes(fields["general.architecture"].parts[-1]).decode() == "llama"
    assert _scalar(fields["llama.block_count"]) == n_layers
    assert _scalar(fields["llama.rope.dimension_count"]) == TINY.head_dim
    assert _scalar(fields["llama.attention.head_count_kv"]) == TINY.n_kv_heads
    src_fields, src = _read(built.path)
    assert len(fields["tokenizer.ggml.merges"].data) == len(src_fields["tokenizer.ggml.merges"].data)
    # Same bytes, same types: layer prelude + l*k + j is block layer j of loop l.
    for lp in range(loops):
        for j in range(TINY.block_count):
            a = tensors[f"blk.{TINY.prelude_count + lp * TINY.block_count + j}.ffn_down.weight"]
            b = src[f"blk.{j}.ffn_down.weight"]
            assert a.tensor_type == b.tensor_type and np.array_equal(np.asarray(a.data), np.asarray(b.data))
    # The reference, running the export as a plain transformer of n_layers layers, matches the engine at `loops`.
    weights = {}
    for name, t in tensors.items():
        shape = tuple(int(x) for x in reversed(t.shape))
        data = t.data if t.tensor_type in (0, 1) else gguf.quants.dequantize(t.data, t.tensor_type)
        weights[name] = np.asarray(data, dtype=np.float32).reshape(shape)
    plain = dataclasses.replace(TINY, prelude_count=0, block_count=n_layers)
    want = ref_forward(plain, weights, PROMPT, 1, act_q8=weight_type != "F32")
    seq = tinyloop.Engine(built.path).sequence()
    got = np.frombuffer(seq.feed(PROMPT, loops), dtype=np.float32).reshape(len(PROMPT), -1)
    err = np.abs(got - want).max() / np.abs(want).max()
    assert err < (1e-4 if weight_type == "F32" else 2.5e-2), err
    assert list(got.argmax(1)) == list(want.argmax(1))


def test_export_errors_are_clear(tmp_path, tiny):
    with pytest.raises(ExportError, match="no such file"):
        export_llama(tmp_path / "missing.tinyloop", tmp_path / "x.gguf")
    junk = tmp_path / "junk.tinyloop"
    junk.write_bytes(b"not gguf at all")
    with pytest.raises(ExportError, match="not a GGUF"):
        export_llama(junk, tmp_path / "x.gguf")
    with pytest.raises(ExportError, match=r"1\.\.64"):
        export_llama(tiny.path, tmp_path / "x.gguf", loops=0)


def test_cli(tiny, tmp_path, capsys):
    from tinyloop.__main__ import main

    out = tmp_path / "u.gguf"
    assert main(["export-llama", str(tiny.path), str(out), "--loops", "2", "--quiet"]) == 0
    fields, _tensors = _read(out)
    assert _scalar(fields["llama.block_count"]) == TINY.prelude_count + 2 * TINY.block_count
    assert main(["export-llama", str(tmp_path / "nope.tinyloop"), str(out)]) == 1
    assert "no such file" in capsys.readouterr().err
