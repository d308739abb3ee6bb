"""The loader: every malformed file is a typed ModelLoadError naming the key or tensor, never a crash."""

from __future__ import annotations

import dataclasses

import gguf
import numpy as np
import pytest

import tinyloop
from conftest import TINY
from tinyloop.modelfile.format import GGUFContents, model_contents, random_weights, write_gguf

SMALL = dataclasses.replace(TINY, prelude_count=0, name="small")


@pytest.fixture(scope="module")
def contents() -> GGUFContents:
    return model_contents(SMALL, random_weights(SMALL, seed=3))


def copy(c: GGUFContents) -> GGUFContents:
    return GGUFContents(dict(c.metadata), dict(c.tensors))


def load_error(tmp_path, c: GGUFContents) -> str:
    path = tmp_path / "bad.tinyloop"
    write_gguf(path, c)
    with pytest.raises(tinyloop.ModelLoadError) as e:
        tinyloop.Engine(path)
    return str(e.value)


def test_valid_file_loads_and_reports_config(tmp_path, contents):
    path = tmp_path / "ok.tinyloop"
    write_gguf(path, contents)
    info = tinyloop.Engine(path).info
    assert (info.dim, info.n_heads, info.n_kv_heads, info.ffn_dim) == (64, 4, 2, 96)
    assert (info.block_count, info.prelude_count, info.default_loops, info.vocab_size) == (2, 0, 3, 50257)
    assert info.quant == "fp16" and info.kv_dtype == "f32" and info.name == "small"
    # Standard GGUF tooling reads it too.
    reader = gguf.GGUFReader(path)
    assert bytes(reader.fields["general.architecture"].parts[-1]).decode() == "tinyloop"


@pytest.mark.parametrize("weight_type,quant", [("F16", "fp16"), ("Q8_0", "int8"), ("Q4_0", "int4"), ("Q4_1", "int4")])
def test_quant_is_read_from_tensor_types(tmp_path, weight_type, quant):
    path = tmp_path / f"m-{weight_type}.tinyloop"
    c = model_contents(SMALL, random_weights(SMALL, seed=3), weight_type=weight_type, embedding_type="Q8_0")
    write_gguf(path, c)
    engine = tinyloop.Engine(path)
    assert engine.info.quant == quant
    out = engine.generate([1, 2, 3], tinyloop.SamplingParams(temperature=0.0, max_tokens=3))
    assert len(out.tokens) == 3


def test_missing_file(tmp_path):
    with pytest.raises(tinyloop.ModelLoadError, match="not found"):
        tinyloop.Engine(tmp_path / "nope.tinyloop")


def test_not_gguf(tmp_path):
    path = tmp_path / "text.tinyloop"
    path.write_text("hello, I am not a model\n" * 100)
    with pytest.raises(tinyloop.ModelLoadError, match="not a GGUF file"):
        tinyloop.Engine(path)
    empty = tmp_path / "empty.tinyloop"
    empty.write_bytes(b"")
    with pytest.raises(tinyloop.ModelLoadError, match="not a GGUF file"):
        tinyloop.Engine(empty)


@pytest.mark.parametrize("keep", [0.999, 0.5, 0.02])
def test_truncated_file(tmp_path, contents, keep):
    path = tmp_path / "full.tinyloop"
    write_gguf(path, contents)
    data = path.read_bytes()
    cut = tmp_path / "cut.tinyloop"
    cut.write_bytes(data[: int(len(data) * keep)])
    with pytest.raises(tinyloop.ModelLoadError) as e:
        tinyloop.Engine(cut)
    msg = str(e.value)
    assert "truncated" in msg or "not a GGUF file" in msg, msg
    if keep > 0.9:
        assert "tensor " in msg  # the header is intact: the error names the tensor whose data is cut


def test_wrong_architecture(tmp_path, contents):
    c = copy(contents)
    c.metadata["general.architecture"] = ("llama", gguf.GGUFValueType.STRING)
    assert 'general.architecture: is "llama"' in load_error(tmp_path, c)


@pytest.mark.parametrize(
    "key", ["tinyloop.block_count", "tinyloop.loops.default", "tokenizer.ggml.merges", "general.file_type"]
)
def test_missing_key(tmp_path, contents, key):
    c = copy(contents)
    del c.metadata[key]
    assert f"{key}: required key is missing" in load_error(tmp_path, c)


def test_bad_key_value(tmp_path, contents):
    c = copy(contents)
    c.metadata["tinyloop.loops.default"] = (65, gguf.GGUFValueType.UINT32)
    assert "tinyloop.loops.default: value 65 is outside 1..=64" in load_error(tmp_path, c)
    c.metadata["tinyloop.loops.default"] = contents.metadata["tinyloop.loops.default"]
    c.metadata["tinyloop.attention.head_count_kv"] = (3, gguf.GGUFValueType.UINT32)
    assert "tinyloop.attention.head_count_kv: 3 does not divide 4 heads" in load_error(tmp_path, c)


def test_missing_tensor(tmp_path, contents):
    c = copy(contents)
    del c.tensors["blk.1.ffn_up.weight"]
    assert "tensor blk.1.ffn_up.weight: missing" in load_error(tmp_path, c)


def test_extra_tensor(tmp_path, contents):
    c = copy(contents)
    c.tensors["blk.2.attn_q.weight"] = contents.tensors["blk.0.attn_q.weight"]
    assert "tensor blk.2.attn_q.weight: not part of a tinyloop model" in load_error(tmp_path, c)


def test_misshaped_tensor(tmp_path, contents):
    c = copy(contents)
    c.tensors["blk.0.attn_k.weight"] = (np.zeros((64, 64), np.float32), "F32")
    assert "tensor blk.0.attn_k.weight: shape [64, 64], expected [32, 64]" in load_error(tmp_path, c)


def test_unsupported_type(tmp_path, contents):
    c = copy(contents)
    array, _ = contents.tensors["blk.0.ffn_gate.weight"]
    c.tensors["blk.0.ffn_gate.weight"] = (array, "Q5_0")
    assert "tensor blk.0.ffn_gate.weight: unsupported type" in load_error(tmp_path, c)


def test_vocabulary_inconsistent_with_embedding(tmp_path, contents):
    c = copy(contents)
    c.tensors["token_embd.weight"] = (np.zeros((50000, 64), np.float32), "F32")
    assert "tensor token_embd.weight: has 50000 rows but the vocabulary has 50257 tokens" in load_error(tmp_path, c)


def test_broken_vocabulary(tmp_path, contents):
    c = copy(contents)
    tokens = list(contents.metadata["tokenizer.ggml.tokens"][0])
    tokens[300] = tokens[301]  # two ids with the same bytes
    c.metadata["tokenizer.ggml.tokens"] = (tokens, gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.STRING)
    assert "tokenizer.ggml.tokens/merges: tokenizer: tokens 300 and 301 spell the same bytes" in load_error(tmp_path, c)


def test_bad_optional_keys_of_converted_checkpoints(tmp_path, contents):
    """The keys a converted checkpoint brings are checked like the rest: each error names its key."""
    V = gguf.GGUFValueType
    cases = [
        (
            {"tokenizer.ggml.pre": ("llama", V.STRING)},
            'tokenizer.ggml.pre: is "llama"; supported: gpt-2, qwen2, llama-bpe',
        ),
        ({"tinyloop.end_token_ids": ([50256, 60000], V.ARRAY, V.UINT32)}, "tinyloop.end_token_ids: token id 60000"),
        ({"tokenizer.ggml.add_bos_token": (1, V.UINT32)}, "tokenizer.ggml.add_bos_token: expected a bool"),
        ({"tinyloop.rope.scaling.type": ("yarn", V.STRING)}, 'tinyloop.rope.scaling.type: is "yarn"'),
        ({"tinyloop.generation.min_p": (0.1, V.FLOAT32)}, "tinyloop.generation.min_p: not a generation field"),
        ({"tinyloop.exit_threshold": (-1.0, V.FLOAT32)}, "tinyloop.exit_threshold: -1 must be a finite number >= 0"),
        ({"tinyloop.generation.temperature": (3.0, V.FLOAT32)}, "tinyloop.generation.temperature: 3 is outside"),
        (
            {"tinyloop.rope.scaling.type": ("linear", V.STRING), "tinyloop.rope.scaling.factor": (0.0, V.FLOAT32)},
            "tinyloop.rope.scaling.factor: 0 must be finite and > 0",
        ),
        (
            {
                "tinyloop.rope.scaling.type": ("llama3", V.STRING),
                "tinyloop.rope.scaling.factor": (8.0, V.FLOAT32),
                "tinyloop.rope.scaling.low_freq_factor": (4.0, V.FLOAT32),
                "tinyloop.rope.scaling.high_freq_factor": (1.0, V.FLOAT32),
                "tinyloop.rope.scaling.original_context_length": (64, V.UINT32),
            },
            "tinyloop.rope.scaling.high_freq_factor: must be above low_freq_factor",
        ),
    ]
    for change, message in cases:
        c = copy(contents)
        c.metadata.update(change)
        assert message in load_error(tmp_path, c), message


def test_biases_are_all_or_none(tmp_path, contents):
    c = copy(contents)
    c.tensors["blk.0.attn_q.bias"] = (np.zeros(64, np.float32), "F32")
    assert "tensor blk.0.attn_k.bias: missing" in load_error(tmp_path, c)
    c = copy(contents)
    c.tensors["blk.1.attn_q.bias"] = (np.zeros(64, np.float32), "F32")
    assert "tensor blk.1.attn_q.bias: not part of a tinyloop model" in load_error(tmp_path, c)
