"""`tinyloop convert` against `transformers` and `tokenizers`: tiny random Qwen2 and Llama checkpoints saved by
`transformers`, converted, and run by the engine — logits within 1e-3 of `transformers`' forward at every position,
greedy continuations identical, tokenization identical to `tokenizers` on the tokenizer corpus."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer

import tinyloop
from corpus import documents
from hf_checkpoints import Flavour, build_checkpoint, reference_model, tokenization_mismatches
from tinyloop.__main__ import main as cli
from tinyloop.modelfile.convert import ConvertError, convert
from tinyloop.modelfile.format import model_config, read_gguf

FLAVOURS = {
    "qwen2": Flavour("qwen2", tied=True),
    "qwen2-bf16-sharded": Flavour("qwen2", dtype="bfloat16", shard="100KB"),
    "llama": Flavour("llama"),
    "llama3-rope-scaling": Flavour(
        "llama",
        rope_scaling={
            "rope_type": "llama3",
            "rope_theta": 5e5,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    ),
}
PROMPT_TEXT = "The quick brown fox jumps over the lazy dog. Don't panic: 12345 apples, naïve café!\n\nSecond line."


@pytest.fixture(scope="module", params=list(FLAVOURS))
def converted(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    directory = build_checkpoint(root / "hf", FLAVOURS[request.param])
    out = root / "model.tinyloop"
    convert(directory, out, outtype="f32", progress=False)
    return request.param, directory, out


def _hf_logits(model, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].numpy()


def _engine_logits(path, ids: list[int]) -> np.ndarray:
    engine = tinyloop.Engine(path)
    seq = engine.sequence()
    return np.frombuffer(seq.feed(ids, 1), dtype=np.float32).reshape(len(ids), -1)


def test_logits_match_transformers_at_every_position(converted):
    _, directory, out = converted
    tok = Tokenizer.from_file(str(directory / "tokenizer.json"))
    ids = tok.encode(PROMPT_TEXT * 3).ids
    assert len(ids) > 60
    want = _hf_logits(reference_model(directory), ids)
    got = _engine_logits(out, ids)
    assert got.shape == want.shape
    assert np.abs(want).max() > 2.0  # logits of real size: a tolerance of 1e-3 means something
    assert np.abs(got - want).max() < 1e-3


def test_greedy_continuation_is_identical(converted):
    _, directory, out = converted
    model = reference_model(directory)
    tok = Tokenizer.from_file(str(directory / "tokenizer.json"))
    prompt = tok.encode(PROMPT_TEXT, add_special_tokens=False).ids
    ids = list(prompt)
    for _ in range(24):  # transformers' forward, argmax, fed back
        ids.append(int(_hf_logits(model, ids)[-1].argmax()))
    engine = tinyloop.Engine(out)
    got = engine.generate(prompt, tinyloop.SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))
    assert got.tokens == ids[len(prompt) :]


def test_tokenization_matches_tokenizers_on_the_corpus(converted):
    _, directory, out = converted
    tok = Tokenizer.from_file(str(directory / "tokenizer.json"))
    engine = tinyloop.Engine(out)
    bad = tokenization_mismatches(engine, tok)
    assert bad == [], f"{len(bad)} documents differ, first {bad[:5]}"
    for d in documents()[:50]:
        ids = tok.encode(d, add_special_tokens=False).ids
        assert engine.decode(ids) == tok.decode(ids, skip_special_tokens=False)


def test_the_file_carries_the_checkpoints_tokens_template_and_shape(converted):
    name, directory, out = converted
    engine = tinyloop.Engine(out)
    tok = Tokenizer.from_file(str(directory / "tokenizer.json"))
    hf = json.loads((directory / "config.json").read_text())
    info = engine.info
    assert (info.vocab_size, info.default_loops) == (hf["vocab_size"], 1)
    if name.startswith("qwen2"):
        assert engine.eos_token_id == tok.token_to_id("<|im_end|>")
        assert engine.end_token_ids == [tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")]
        assert not engine.add_bos_token and "<|im_start|>" in engine.chat_template
    else:
        assert engine.add_bos_token and engine.bos_token_id == tok.token_to_id("<|begin_of_text|>")
        assert engine.chat_template is None
    assert engine.encode("<|im_start|>", allow_special=True) == [tok.token_to_id("<|im_start|>")]
    # A text prompt gets what `tokenizers` adds around a text: Llama's BOS, nothing for Qwen2.
    done = engine.generate(PROMPT_TEXT, tinyloop.SamplingParams(max_tokens=1))
    assert done.prompt_tokens == len(tok.encode(PROMPT_TEXT).ids)
    assert engine.decode([hf["vocab_size"] - 1]) == f"<|unused_{hf['vocab_size'] - 1}|>"
    cfg = model_config(read_gguf(out))
    assert cfg.attn_bias == name.startswith("qwen2") and cfg.block_count == hf["num_hidden_layers"]
    assert (cfg.rope_scaling or {}).get("type") == ("llama3" if "scaling" in name else None)


def test_quantized_outtypes_stay_close(converted, tmp_path):
    _, directory, out = converted
    tok = Tokenizer.from_file(str(directory / "tokenizer.json"))
    ids = tok.encode(PROMPT_TEXT).ids
    ref = _engine_logits(out, ids)
    # Relative error bounds and greedy agreement per type (a random model's logits are close together, so 4-bit
    # rounding flips many of its argmaxes).
    for outtype, tol, agree in [("f16", 0.01, 0.95), ("q8_0", 0.05, 0.85), ("q4_0", 0.5, 0.4)]:
        path = tmp_path / f"{outtype}.tinyloop"
        assert cli(["convert", str(directory), str(path), "--outtype", outtype, "--quiet"]) == 0
        assert tinyloop.Engine(path).info.quant == {"f16": "fp16", "q8_0": "int8", "q4_0": "int4"}[outtype]
        got = _engine_logits(path, ids)
        err = np.abs(got - ref).max() / np.abs(ref).max()
        assert err < tol, (outtype, err)
        assert np.mean(got.argmax(-1) == ref.argmax(-1)) > agree, outtype


def test_unsupported_checkpoints_are_refused_by_name(tmp_path):
    directory = build_checkpoint(tmp_path / "hf", Flavour("qwen2"))
    config = json.loads((directory / "config.json").read_text())
    for change, message in [
        ({"architectures": ["MistralForCausalLM"]}, "architecture 'MistralForCausalLM' is not supported"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
        ({"use_sliding_window": True}, "use_sliding_window"),
        ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, "RoPE scaling 'yarn'"),
    ]:
        (directory / "config.json").write_text(json.dumps({**config, **change}))
        with pytest.raises(ConvertError, match=message):
            convert(directory, tmp_path / "x.tinyloop", progress=False)
    (directory / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConvertError, match=r"--loops 0: must be in 1\.\.64"):
        convert(directory, tmp_path / "x.tinyloop", loops=0, progress=False)
    tok = json.loads((directory / "tokenizer.json").read_text())
    tok["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] = r"\w+|\s+"
    (directory / "tokenizer.json").write_text(json.dumps(tok))
    with pytest.raises(ValueError, match="unsupported pre-tokenizer"):
        convert(directory, tmp_path / "x.tinyloop", progress=False)


def test_gptq_calibration_forward_reads_converted_files(converted, tmp_path):
    """GPTQ's NumPy forward (biases, scaled RoPE) reproduces `transformers` on a converted file, and `quantize
    --method gptq` writes a file the engine runs."""
    from tinyloop.modelfile.calibrate import logits

    name, directory, out = converted
    tok = Tokenizer.from_file(str(directory / "tokenizer.json"))
    ids = tok.encode(PROMPT_TEXT * 2, add_special_tokens=False).ids
    contents = read_gguf(out)
    weights = {k: v for k, (v, _) in contents.tensors.items()}
    got = logits(model_config(contents), weights, np.array([ids]), 1)[0]
    assert np.abs(got - _hf_logits(reference_model(directory), ids)).max() < 1e-3
    if name == "qwen2":
        path = tmp_path / "gptq.tinyloop"
        assert cli(["quantize", str(out), str(path), "--bits", "4", "--method", "gptq", "--quiet"]) == 0
        q = _engine_logits(path, ids)
        assert tinyloop.Engine(path).info.quant == "int4" and np.abs(q - got).max() / np.abs(got).max() < 0.5


def test_export_llama_carries_biases_tokenizer_and_rope_scaling(converted, tmp_path):
    """The unrolled llama GGUF of a converted file keeps Qwen2's biases and pre-tokenizer, and Llama 3's RoPE
    scaling as llama.cpp's `rope_freqs.weight`: per frequency, `transformers`' default over its llama3 one."""
    import gguf
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    name, directory, out = converted
    path = tmp_path / "unrolled.gguf"
    assert cli(["export-llama", str(out), str(path), "--quiet"]) == 0
    reader = gguf.GGUFReader(path)
    tensors = {t.name: t for t in reader.tensors}
    pre = bytes(reader.fields["tokenizer.ggml.pre"].parts[-1]).decode()
    assert pre == ("qwen2" if name.startswith("qwen2") else "llama-bpe")
    assert ("blk.2.attn_k.bias" in tensors) == name.startswith("qwen2")
    assert ("rope_freqs.weight" in tensors) == ("scaling" in name)
    if "scaling" in name:
        config = LlamaConfig.from_pretrained(directory)
        scaled = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")[0].numpy()
        base = 5e5 ** (-np.arange(0, 16, 2) / 16)
        np.testing.assert_allclose(np.asarray(tensors["rope_freqs.weight"].data), base / scaled, rtol=1e-5)
