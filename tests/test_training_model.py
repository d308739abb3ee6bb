"""training/model.py against the engine: the PyTorch model the default model is trained with computes what the
engine computes, plainly and as decoding with `kv_share="last"` reads it (the K/V of earlier positions from the last
loop), so training for the shared cache trains what it decodes."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import tinyloop
from tinyloop.modelfile.format import write_model

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "training"))

from model import LoopedLM, TrainConfig, file_config

CFG = TrainConfig(dim=64, n_heads=4, n_kv_heads=2, ffn_dim=96, block_count=2, vocab_size=50257, context=64)
LOOPS = 3


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    torch.manual_seed(0)
    model = LoopedLM(CFG).eval()
    with torch.no_grad():  # weights of real size, so the loops matter
        for p in model.parameters():
            p.copy_(torch.randn_like(p) / p.shape[-1] ** 0.5 if p.ndim == 2 else 1 + 0.1 * torch.randn_like(p))
    path = tmp_path_factory.mktemp("train") / "m.tinyloop"
    write_model(path, file_config(CFG, LOOPS, LOOPS), model.export_weights(), weight_type="F32")
    return model, path


def _torch_logits(model, ids, kv_share: int):
    with torch.no_grad():
        h = model.hidden_states(torch.tensor([ids]), LOOPS, {LOOPS}, kv_share=kv_share)[LOOPS]
        return model.logits(h)[0].numpy()


def test_plain_forward_matches_the_engine(trained):
    model, path = trained
    ids = list(range(100, 140))
    seq = tinyloop.Engine(path).sequence()
    got = np.frombuffer(seq.feed(ids, LOOPS), dtype=np.float32).reshape(len(ids), -1)
    assert np.abs(got - _torch_logits(model, ids, 0)).max() < 1e-3


def test_kv_share_forward_matches_decoding_with_the_shared_cache(trained):
    """After a prompt, the first decoded token sees the prompt through its last loop's K/V and itself through each
    loop's own: what `hidden_states(..., kv_share=1)` computes at that position."""
    model, path = trained
    ids = list(range(200, 233))
    seq = tinyloop.Engine(path, kv_share="last").sequence()
    seq.feed(ids[:-1], LOOPS)
    seq.share_loops(LOOPS)
    got = np.frombuffer(seq.feed(ids[-1:], LOOPS), dtype=np.float32)
    shared, plain = _torch_logits(model, ids, 1)[-1], _torch_logits(model, ids, 0)[-1]
    assert np.abs(got - shared).max() < 1e-3
    assert np.abs(got - plain).max() > 0.05  # the shared cache changes the answer: the test can tell them apart


def test_kv_share_passes_reach_decoding_from_the_first_token(trained):
    """Decoding every token with the shared cache from the first on: position t reads the earlier positions' K/V as
    their own shared loops left them. Position 0 has no past; each pass fixes one more position's K/V, so n passes
    give positions 0..n exactly, as many passes as tokens the whole sequence, and fewer leave the later ones off."""
    model, path = trained
    ids = list(range(300, 308))
    seq = tinyloop.Engine(path, kv_share="last").sequence()
    vocab = CFG.vocab_size
    got = [np.frombuffer(seq.feed(ids[:1], LOOPS), dtype=np.float32)]
    seq.share_loops(LOOPS)
    got += [np.frombuffer(seq.feed([t], LOOPS), dtype=np.float32) for t in ids[1:]]
    got = np.stack(got).reshape(len(ids), vocab)
    assert np.abs(got - _torch_logits(model, ids, len(ids))).max() < 1e-3
    two = np.abs(got - _torch_logits(model, ids, 2)).max(axis=1)
    assert two[:3].max() < 1e-3
    assert two[3] > 0.05
