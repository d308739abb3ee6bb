"""`tinyloop convert` on Ouro checkpoints, against an independent PyTorch reference of Ouro's architecture
(tests/ouro_reference.py): logits at every depth, greedy continuations, GPTQ's calibration forward, and the looped
model's own modes — self-speculative decoding from its shallow loops, adaptive depth by its exit gate."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer

import tinyloop
from ouro_reference import build_ouro_checkpoint, forward, score_gated
from tinyloop.modelfile.convert import convert
from tinyloop.modelfile.format import model_config, read_gguf

TEXT = "In the beginning the quick brown fox jumped over 12 lazy dogs; naïve café, twice. " * 2


@pytest.fixture(scope="module")
def ouro(tmp_path_factory):
    root = tmp_path_factory.mktemp("ouro")
    cfg, weights = build_ouro_checkpoint(root / "hf")
    out = root / "ouro.tinyloop"
    convert(root / "hf", out, outtype="f32", progress=False)
    ids = Tokenizer.from_file(str(root / "hf" / "tokenizer.json")).encode(TEXT).ids
    return cfg, weights, out, ids


def _engine_logits(path, ids: list[int], loops: int) -> np.ndarray:
    seq = tinyloop.Engine(path).sequence()
    return np.frombuffer(seq.feed(ids, loops), dtype=np.float32).reshape(len(ids), -1)


@pytest.mark.parametrize("steps", [1, 2, 4])
def test_logits_match_the_reference_at_every_depth(ouro, steps):
    cfg, weights, out, ids = ouro
    with torch.no_grad():
        want = forward(cfg, weights, ids, steps).numpy()
    got = _engine_logits(out, ids, steps)
    assert np.abs(want).max() > 2.0
    assert np.abs(got - want).max() < 1e-3


def test_the_file_is_a_four_loop_model_with_ouros_parts(ouro):
    _, _, out, _ = ouro
    info = tinyloop.Engine(out).info
    cfg = model_config(read_gguf(out))
    assert (info.default_loops, cfg.max_trained_loops, cfg.block_count, cfg.prelude_count) == (4, 4, 2, 0)
    assert cfg.loop_norm and cfg.post_norms and cfg.exit_gate and not cfg.attn_bias and not cfg.tied_head


def test_greedy_continuation_and_self_speculation(ouro):
    cfg, weights, out, ids = ouro
    engine = tinyloop.Engine(out)
    want = list(ids)
    with torch.no_grad():
        for _ in range(16):  # argmax with the end tokens out, as ignore_eos has them
            logits = forward(cfg, weights, want)[-1]
            logits[engine.end_token_ids] = float("-inf")
            want.append(int(logits.argmax()))
    params = tinyloop.SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    assert engine.generate(ids, params).tokens == want[len(ids) :]
    drafted = engine.generate(ids, params, draft=(1, 3))  # drafts from one step, verified at four
    assert drafted.tokens == want[len(ids) :] and drafted.draft_proposed > 0
    # "auto" follows the exit gate with the config's threshold, 1.0: never before the last step.
    assert (engine.exit_rule, engine.exit_threshold) == ("gate", 1.0)
    adaptive = engine.generate(ids, params, loops="auto")
    assert adaptive.tokens == want[len(ids) :] and adaptive.auto_loops == (15, 60)  # the first: the prompt's pass
    with pytest.raises(tinyloop.InvalidRequestError, match="exit gate"):
        engine.generate(ids, params, loops=tinyloop.AutoDepth(min_loops=2), draft=(1, 3))


def _clear_gate_threshold(cfg, weights, ids, min_steps):
    """A threshold at which the reference's tokens exit at different steps, at least 0.002 from every cumulative exit
    probability it meets (so float rounding cannot move an exit), with the reference's result."""
    for q in np.arange(0.3, 0.96, 0.01):
        logps, depths, cdfs = score_gated(cfg, weights, ids, 4, min_steps, float(q))
        if len(set(depths[1:])) >= 2 and min(abs(c - q) for seen in cdfs for c in seen) > 0.002:
            return float(q), logps, depths
    raise AssertionError("no threshold clear of the gate's values")


@pytest.mark.parametrize("min_steps", [1, 2])
def test_adaptive_depth_follows_the_exit_gate(ouro, min_steps):
    """Q-exit with the skipped steps' K/V filled from the exit step's, against the reference decoding the same way."""
    cfg, weights, out, ids = ouro
    ids = ids[:40]
    with torch.no_grad():
        q, want_lp, want_depths = _clear_gate_threshold(cfg, weights, ids, min_steps)
    assert min(want_depths) >= min_steps
    engine = tinyloop.Engine(out)
    got_lp, got_depths = engine.score_auto(ids, tinyloop.AutoDepth(min_loops=min_steps, threshold=q))
    assert got_depths == want_depths
    assert np.abs(np.array(got_lp) - np.array(want_lp)).max() < 1e-3
    # and in generation: fewer steps than fixed depth, the same rule
    params = tinyloop.SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    out_auto = engine.generate(ids, params, loops=tinyloop.AutoDepth(min_loops=min_steps, threshold=q))
    tokens, steps = out_auto.auto_loops
    assert tokens == 11 and min_steps * 11 <= steps < 4 * 11


def test_gptq_calibration_forward_matches_the_reference(ouro):
    from tinyloop.modelfile.calibrate import logits

    cfg, weights, out, ids = ouro
    contents = read_gguf(out)
    w = {k: v for k, (v, _) in contents.tensors.items()}
    got = logits(model_config(contents), w, np.array([ids]), 4)[0]
    with torch.no_grad():
        want = forward(cfg, weights, ids).numpy()
    assert np.abs(got - want).max() < 1e-3


def test_smollm_tokenization_matches_tokenizers_on_the_corpus(ouro):
    """Ouro's tokenizer (SmolLM's: every digit apart, then GPT-2's regex) as `tokenizers` runs it."""
    from hf_checkpoints import tokenization_mismatches

    _, _, out, _ = ouro
    tok = Tokenizer.from_file(str(out.parent / "hf" / "tokenizer.json"))
    engine = tinyloop.Engine(out)
    bad = tokenization_mismatches(engine, tok)
    assert bad == [], f"{len(bad)} documents differ, first {bad[:5]}"
    text = "x<|im_start|>12³ ٣<|im_end|>"
    assert engine.encode(text, allow_special=True) == tok.encode(text, add_special_tokens=False).ids
    assert tok.token_to_id("<|im_start|>") not in engine.encode(text)


def test_export_llama_refuses_ouro(ouro, tmp_path):
    from tinyloop.modelfile.export_llama import ExportError, export_llama

    with pytest.raises(ExportError, match=r"no form in llama\.cpp's llama architecture"):
        export_llama(ouro[2], tmp_path / "x.gguf", progress=False)
