"""training/model.py against the engine: the PyTorch model the default model is trained with computes what the
engine computes, plainly and as decoding with `kv_share="last"` reads it (the K/V of earlier positions from the last
loop), so training for the shared cache trains what it decodes."""

from __future__ import annotations

import json
import subprocess
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


def test_kv_drift_is_zero_exactly_where_the_shared_cache_is_exact(trained):
    """`kv_drift` measures each loop's K/V against the last loop's: positive on the random model, whose shared-cache
    decoding differs from its per-loop one; zero when every loop's K/V are the last's; and, for K shifted by a
    constant c in the earlier loops, c² over the mean square of the last loop's K, averaged with V's zero."""
    from model import kv_drift

    model, _ = trained
    ids = torch.tensor([list(range(400, 420))])
    trace: list = []
    with torch.no_grad():
        plain = model.logits(model.hidden_states(ids, LOOPS, {LOOPS}, kv_trace=trace)[LOOPS])
        shared = model.logits(model.hidden_states(ids, LOOPS, {LOOPS}, kv_share=len(ids[0]))[LOOPS])
    assert len(trace) == LOOPS and len(trace[0]) == CFG.block_count
    assert kv_drift(trace).item() > 0.01 and (plain - shared).abs().max() > 0.05
    same = [[(k.clone(), v.clone()) for k, v in trace[-1]] for _ in range(LOOPS)]
    assert kv_drift(same).item() == 0.0
    moved = [[(k + 0.5 * k.std(), v) for k, v in loop] for loop in same[:-1]] + [same[-1]]
    expected = torch.stack([(0.5 * k.std()) ** 2 / k.pow(2).mean() for k, _ in same[-1]]).mean() / 2
    assert torch.allclose(kv_drift(moved), expected, rtol=1e-5)


def test_distill_loss_is_the_kl_from_the_teacher_per_loop_distribution(trained):
    """`train.distill_loss` is KL(teacher ‖ model) per position: zero where the model reads its input as the teacher
    does (same weights, per-loop cache), positive where it reads it through the shared cache, and equal to a direct
    computation of Σ p_t (log p_t − log p_m) averaged over positions."""
    from train import distill_loss, teacher_logprobs

    model, _ = trained
    ids = torch.tensor([list(range(300, 324))])
    with torch.no_grad():
        plain = model.hidden_states(ids, LOOPS, {LOOPS})[LOOPS]
        shared = model.hidden_states(ids, LOOPS, {LOOPS}, kv_share=len(ids[0]))[LOOPS]
        target = teacher_logprobs(model, ids, LOOPS)
        assert distill_loss(model, target, plain).item() == pytest.approx(0.0, abs=1e-5)
        got = distill_loss(model, target, shared).item()
        p_t = model.logits(plain)[0].double().log_softmax(-1)
        p_m = model.logits(shared)[0].double().log_softmax(-1)
    expected = (p_t.exp() * (p_t - p_m)).sum(-1).mean().item()
    assert expected > 0.01
    assert got == pytest.approx(expected, rel=1e-4)


def test_a_shallow_exit_adds_the_kl_from_the_teachers_last_loop_on_the_same_positions(trained):
    """`train.exit_loss` with a target scores the kept positions' cross-entropy plus weight × KL(target ‖ exit), the
    KL on the very positions the cross-entropy keeps: computed directly from the full logits with the same draw."""
    from train import exit_loss, head_loss, teacher_logprobs

    model, _ = trained
    ids = torch.tensor([list(range(400, 432)), list(range(500, 532))])
    y = ids.roll(-1, dims=1)
    with torch.no_grad():
        h1 = model.hidden_states(ids, LOOPS, {1})[1]
        target = teacher_logprobs(model, ids, LOOPS)
        got = exit_loss(model, h1, y, 0.25, torch.Generator().manual_seed(7), head_loss, target, 0.5).item()
        plain = exit_loss(model, h1, y, 0.25, torch.Generator().manual_seed(7)).item()
        keep = torch.randperm(64, generator=torch.Generator().manual_seed(7))[:16]
        logp = model.logits(h1).reshape(64, -1).double().log_softmax(-1)[keep]
        t = target.reshape(64, -1).double()[keep]
    ce = -logp[torch.arange(16), y.reshape(-1)[keep]].mean().item()
    kl = (t.exp() * (t - logp)).sum(-1).mean().item()
    assert kl > 0.01
    assert plain == pytest.approx(ce, rel=1e-4)
    assert got == pytest.approx(ce + 0.5 * kl, rel=1e-4)


def test_exit_weights_name_loops_half_and_last():
    """`--exit-weights` keys are loop numbers, `half` and `last`: a step L deep scores the named loops below L, L // 2
    and L, adding the weights of keys that name the same loop; malformed lists are refused with the flag named."""
    from train import exit_depths, parse_exit_weights

    weights = parse_exit_weights("1:0.1,2:0.2,4:0.5,half:0.3,last:1.0")
    assert exit_depths(weights, 10) == {1: 0.1, 2: 0.2, 4: 0.5, 5: 0.3, 10: 1.0}
    assert exit_depths(weights, 8) == {1: 0.1, 2: 0.2, 4: pytest.approx(0.8), 8: 1.0}
    assert exit_depths(weights, 4) == {1: 0.1, 2: pytest.approx(0.5), 4: 1.0}
    assert exit_depths(weights, 1) == {1: 1.0}
    for bad in ("1:0.1,2:0.2", "0:1,last:1", "x:1,last:1", "last:-1", "last"):
        with pytest.raises(SystemExit, match="--exit-weights"):
            parse_exit_weights(bad)


def test_tokenize_caches_the_split_and_reads_the_cache_alone(tmp_path):
    """`train.tokenize` gives tiktoken's GPT-2 ids (its BPE over the shipped ranks) with end-of-text after each
    passage and where a passage holds one, caches them as .bin, and reads that cache where the text is absent."""
    from tinyloop.modelfile.vocab import tiktoken_gpt2
    from train import EOT, tokenize

    text = tmp_path / "train.txt"
    text.write_text("Hello there, friend.\n<|endoftext|>\nUser: Hi?\nAssistant: Well met.<|endoftext|>tail")
    enc = tiktoken_gpt2()
    pieces = ["Hello there, friend.", "User: Hi?\nAssistant: Well met.", "tail"]
    expected = [i for p in pieces for i in [*enc.encode_ordinary(p), EOT]]
    assert tokenize(text).tolist() == expected
    text.unlink()
    assert tokenize(text).tolist() == expected


def test_keep_checkpoints_saves_each_periodic_evaluation(tmp_path):
    """`train.py --keep-checkpoints` leaves model.step<N>.pt beside model.pt for every periodic evaluation, each
    holding the weights and token count of that step as its log entry records them. With `--eval-every 0` every step
    is evaluated, so at least one is kept however fast the machine."""
    rng = np.random.default_rng(0)
    for split, n in (("train", 4096), ("heldout", 512)):
        rng.integers(0, 50257, n, dtype=np.uint16).tofile(tmp_path / f"{split}.bin")
    out = tmp_path / "run"
    cmd = [sys.executable, str(Path(__file__).resolve().parents[1] / "training" / "train.py"), "--data", str(tmp_path),
           "--out", str(out), "--minutes", "0.02", "--dim", "32", "--heads", "2", "--ffn", "64", "--k", "1",
           "--context", "32", "--batch", "2", "--loops-min", "1", "--loops-max", "2", "--eval-every", "0",
           "--keep-checkpoints", "--no-compile"]  # fmt: skip
    subprocess.run(cmd, check=True, capture_output=True, timeout=300)
    log = json.loads((out / "log.json").read_text())
    periodic = {e["step"]: e["tokens"] for e in log["evals"][:-1]}  # the last entry is the final evaluation
    kept = {int(p.name[len("model.step") : -len(".pt")]): p for p in out.glob("model.step*.pt")}
    assert kept and set(kept) == set(periodic)
    final = torch.load(out / "model.pt", map_location="cpu")
    for step, path in kept.items():
        ckpt = torch.load(path, map_location="cpu")
        assert ckpt["tokens"] == periodic[step] == step * 2 * 32
        same = all(torch.equal(ckpt["state"][k], final["state"][k]) for k in final["state"])
        assert same == (step == log["final"]["steps"]), step  # only a checkpoint of the last step equals the end


def test_exit_distill_adds_the_teachers_kl_at_the_shallow_exits(tmp_path):
    """`train.py --exit-distill W` (with `--distill-from`) adds W × KL to each shallow exit's loss: two runs from the
    same file on the same seed draw the same first step, and only the distilled one's loss@1 carries the (positive)
    KL term while the last exit's cross-entropy is the same. Without a teacher the flag is refused by name."""
    rng = np.random.default_rng(0)
    for split, n in (("train", 4096), ("heldout", 512)):
        rng.integers(0, 50257, n, dtype=np.uint16).tofile(tmp_path / f"{split}.bin")
    cfg = TrainConfig(dim=32, n_heads=2, n_kv_heads=2, ffn_dim=64, block_count=1, vocab_size=50257, context=32)
    torch.manual_seed(1)
    model = LoopedLM(cfg)
    with torch.no_grad():  # weights of real size, so that loop 1 and loop 3 disagree
        for p in model.parameters():
            p.copy_(torch.randn_like(p) / p.shape[-1] ** 0.5 if p.ndim == 2 else 1 + 0.1 * torch.randn_like(p))
    teacher = tmp_path / "t.tinyloop"
    write_model(teacher, file_config(cfg, 3, 3), model.export_weights(), weight_type="F32")
    base = [sys.executable, str(Path(__file__).resolve().parents[1] / "training" / "train.py"), "--data",
            str(tmp_path), "--minutes", "0.01", "--dim", "32", "--heads", "2", "--ffn", "64", "--k", "1",
            "--context", "32", "--batch", "2", "--loops-min", "3", "--loops-max", "3", "--eval-every", "100",
            "--exit-weights", "1:0.5,last:1", "--init-from", str(teacher), "--no-compile"]  # fmt: skip
    refused = subprocess.run([*base, "--out", str(tmp_path / "x"), "--exit-distill", "1"], capture_output=True,
                             text=True, timeout=300)  # fmt: skip
    assert refused.returncode != 0 and "--exit-distill needs --distill-from" in refused.stderr
    first = {}
    for name, extra in (("plain", []), ("distilled", ["--exit-distill", "2"])):
        out = tmp_path / name
        cmd = [*base, "--out", str(out), "--distill-from", str(teacher), *extra]
        subprocess.run(cmd, check=True, capture_output=True, timeout=300)
        first[name] = json.loads((out / "log.json").read_text())["steps"][0]
    plain, distilled = first["plain"], first["distilled"]
    assert distilled["loss@3"] == pytest.approx(plain["loss@3"], rel=1e-5)
    assert distilled["distill"] == pytest.approx(plain["distill"], abs=1e-4)
    assert distilled["loss@1"] > plain["loss@1"] + 1e-3
