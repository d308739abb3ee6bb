"""The device path (candle tensors on a candle device: the code a CUDA GPU runs) against the CPU engine, run on
candle's CPU device (`device="candle-cpu"`): candle's ops — its matmuls, quantized matmul kernels, RMSNorm, softmax and
RoPE — not the CPU engine's own kernels.

The two compute the same function with the arithmetic in another order (candle's RMSNorm sums in f32 where the CPU
engine sums in f64, its matmuls block their sums differently), so outputs may differ in the last bits, and a greedy
choice between two tokens whose log-probabilities are that close may go either way. Hence two checks, with a
tolerance per weight type on a token's log-probability `lp`, `|Δlp| ≤ tol · (1 + |lp|)`:

- teacher-forced, every position's log-probabilities within the tolerance;
- generated, greedy tokens identical to the CPU engine's up to the first step where the CPU engine's top two tokens
  are within the tolerance of each other (a near-tie) — on most sequences, all of them.

The tolerances:
- F32: 1e-4 — the same products summed in another order (f32 rounding, ~1e-7 relative, through 8 loops).
- F16: 5e-3 — the device rounds each product's input to f16 (2^-11 relative) so that a half weight is read as half,
  where the CPU engine multiplies f32 rows by the f16 weights. Measured ≤ 1e-3.
- BF16: 2e-2 — the same with bf16's 2^-8. Measured ≤ 6e-4.
- Q8_0 / Q4_0: 5e-2 — both round each product's input to Q8_0 blocks, but a value that the earlier layers' last-bit
  differences put on a rounding boundary lands on either side: one step of the 8-bit grid, ~1/127 of the block's
  largest value. Measured ≤ 3e-2 (and up to 0.11 absolute on tokens of log-probability below −5).
"""

from __future__ import annotations

import dataclasses
import importlib.resources
import random

import pytest

import tinyloop
from shapes import TINY, TINY_NOPRE
from tinyloop import SamplingParams
from tinyloop.modelfile.quantize import Options, quantize_file

DEVICE = "candle-cpu"
TOLERANCE = {"F32": 1e-4, "F16": 5e-3, "BF16": 2e-2, "Q8_0": 5e-2, "Q4_0": 5e-2}
DEFAULT = importlib.resources.files("tinyloop") / "models" / "default.tinyloop"
PROMPTS = ["Once upon a time, there was", "The capital of France is", "def fib(n):\n   "]


def greedy(max_tokens: int = 24, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


def close(a: float, b: float, tol: float) -> bool:
    return abs(a - b) <= tol * (1 + abs(a))


def agreed(host, prompt: list[int], got: list[int], tol: float, **kw) -> None:
    """`got` is the CPU engine's greedy generation (`kw`: its settings) up to a first difference, which must come at
    a near-tie: where the CPU engine's top two tokens (its own log-probabilities while generating) are within `2·tol`
    and the device chose the second."""
    want = host.generate(prompt, greedy(len(got), logprobs=2), **kw)
    assert len(got) == len(want.tokens)
    first = next((i for i, (a, b) in enumerate(zip(want.tokens, got, strict=True)) if a != b), None)
    if first is not None:
        top = want.logprobs[first][1]
        assert top[0][1] - top[1][1] <= 2 * tol, f"token {first} differs, host top two {top}, device {got[first]}"
        assert got[first] == top[1][0], f"token {first}: the device chose neither of the host's top two"


@pytest.fixture(scope="module")
def default_models(tmp_path_factory):
    """The default model as shipped (F16) and quantized to Q8_0 and Q4_0 (round to nearest)."""
    out = {"F16": str(DEFAULT)}
    for name, opts in [("Q8_0", Options(bits=8, progress=False)), ("Q4_0", Options(bits=4, progress=False))]:
        path = tmp_path_factory.mktemp("device") / f"default-{name}.tinyloop"
        quantize_file(DEFAULT, path, opts)
        out[name] = str(path)
    return out


@pytest.fixture(scope="module")
def engines(default_models):
    cache: dict[tuple[str, str, str], tinyloop.Engine] = {}

    def get(weight: str, device: str, kv_share: str = "none") -> tinyloop.Engine:
        key = (weight, device, kv_share)
        if key not in cache:
            cache[key] = tinyloop.Engine(default_models[weight], device=device, kv_share=kv_share)
        return cache[key]

    return get


def test_the_engine_says_where_it_computes(engines):
    assert engines("F16", "cpu").info.device == "cpu"
    assert engines("F16", DEVICE).info.device == DEVICE


@pytest.mark.parametrize("weight", ["F16", "Q8_0", "Q4_0"])
@pytest.mark.parametrize("loops", [1, 3, 8])
def test_default_model_greedy_tokens_are_the_cpu_engines(engines, weight, loops):
    host, dev = engines(weight, "cpu"), engines(weight, DEVICE)
    for text in PROMPTS:
        prompt = host.encode(text)
        agreed(host, prompt, dev.generate(prompt, greedy(), loops=loops).tokens, TOLERANCE[weight], loops=loops)


@pytest.mark.parametrize("weight", ["F16", "Q4_0"])
def test_default_model_chunked_prefill_matches(engines, weight):
    # A prompt longer than PREFILL_CHUNK is prefilled in chunks, each attending to the earlier ones' KV.
    host, dev = engines(weight, "cpu"), engines(weight, DEVICE)
    prompt = host.encode(" ".join(PROMPTS) * 20)
    assert len(prompt) > tinyloop.PREFILL_CHUNK
    agreed(host, prompt, dev.generate(prompt, greedy(12), loops=4).tokens, TOLERANCE[weight], loops=4)


@pytest.mark.parametrize("weight", ["F16", "Q8_0"])
def test_default_model_batched_requests_of_different_lengths_and_depths(engines, weight):
    host, dev = engines(weight, "cpu"), engines(weight, DEVICE)
    rng = random.Random(3)
    cases = [
        (host.encode(t * rng.randint(1, 4)), loops) for t, loops in zip(PROMPTS * 2, [1, 3, 8, 5, 2, 8], strict=True)
    ]
    streams = [dev.stream(p, greedy(16), loops=loops) for p, loops in cases]
    got: list[list[int]] = [[] for _ in cases]
    for _ in range(200):
        events = dev.step_many(streams)
        if all(e is None for e in events):
            break
        for i, e in enumerate(events):
            assert not isinstance(e, Exception), e
            if e is not None and e.token_id >= 0:
                got[i].append(e.token_id)
    for (prompt, loops), g in zip(cases, got, strict=True):
        agreed(host, prompt, g, TOLERANCE[weight], loops=loops)
        assert g == dev.generate(prompt, greedy(16), loops=loops).tokens, "batched rows differ from solo ones"


@pytest.mark.parametrize("weight", ["F16", "Q4_0"])
@pytest.mark.parametrize(("draft_loops", "verify_loops", "ahead"), [(1, 3, 4), (2, 8, 4), (3, 8, 2)])
def test_default_model_chain_speculative_is_plain_generation(engines, weight, draft_loops, verify_loops, ahead):
    host, dev = engines(weight, "cpu"), engines(weight, DEVICE)
    for text in PROMPTS:
        prompt = host.encode(text)
        plain = dev.generate(prompt, greedy(), loops=verify_loops)
        spec = dev.generate(prompt, greedy(), loops=verify_loops, draft=(draft_loops, ahead))
        assert spec.tokens == plain.tokens, (weight, draft_loops, verify_loops, ahead, text)
        agreed(host, prompt, spec.tokens, TOLERANCE[weight], loops=verify_loops)
        assert spec.draft_rounds > 0 and 0 <= spec.draft_accepted <= spec.draft_proposed


@pytest.mark.parametrize("weight", ["F16", "Q8_0"])
def test_default_model_auto_depth_matches(engines, weight):
    host, dev = engines(weight, "cpu"), engines(weight, DEVICE)
    for text in PROMPTS:
        prompt = host.encode(text)
        want = host.generate(prompt, greedy(), loops="auto")
        got = dev.generate(prompt, greedy(), loops="auto")
        agreed(host, prompt, got.tokens, TOLERANCE[weight], loops="auto")
        # A token whose distribution settles right at the threshold may stop a loop earlier or later.
        assert abs(got.auto_loops[1] - want.auto_loops[1]) <= 3, (got.auto_loops, want.auto_loops)
        rule = tinyloop.AutoDepth(min_loops=3)
        drafted = dev.generate(prompt, greedy(), loops=rule, draft=(2, 4))
        assert drafted.tokens == dev.generate(prompt, greedy(), loops=rule).tokens


@pytest.mark.parametrize("weight", ["F16", "Q4_0"])
def test_default_model_shared_kv_matches(engines, weight):
    host, dev = engines(weight, "cpu", "last"), engines(weight, DEVICE, "last")
    assert dev.info.kv_share == "last"
    for text in PROMPTS:
        prompt = host.encode(text)
        for loops in (3, 8):
            agreed(host, prompt, dev.generate(prompt, greedy(), loops=loops).tokens, TOLERANCE[weight], loops=loops)


def test_the_prompt_cache_reuses_device_kv(default_models):
    dev = tinyloop.Engine(default_models["F16"], device=DEVICE, prompt_cache_entries=4)
    host = tinyloop.Engine(default_models["F16"])
    first = dev.encode(PROMPTS[0])
    turn = dev.generate(first, greedy(8), loops=4)
    follow = first + turn.tokens + dev.encode(" and then")
    again = dev.generate(follow, greedy(8), loops=4)
    assert again.cached_tokens > 0
    assert (
        again.tokens
        == dev.generate(follow, greedy(8), loops=4).tokens
        == host.generate(follow, greedy(8), loops=4).tokens
    )


def teacher_forced(engine, ids, loops):
    return engine.prompt_logprobs(ids, loops, 2)


@pytest.mark.parametrize("shape", [TINY, TINY_NOPRE], ids=["prelude-gqa", "untied-mha"])
@pytest.mark.parametrize("weight", ["F32", "F16", "BF16", "Q8_0", "Q4_0"])
@pytest.mark.parametrize("loops", [1, 3, 8])
def test_random_models_logits_within_tolerance(model_factory, shape, weight, loops):
    model = model_factory(shape, weight_type=weight, seed=5)
    host, dev = tinyloop.Engine(model.path), tinyloop.Engine(model.path, device=DEVICE)
    tol = TOLERANCE[weight]
    ids = [random.Random(loops).randrange(50257) for _ in range(48)]
    want, got = teacher_forced(host, ids, loops), teacher_forced(dev, ids, loops)
    for i, ((lp_h, top_h), (lp_d, top_d)) in enumerate(zip(want, got, strict=True)):
        assert close(lp_h, lp_d, tol), (i, lp_h, lp_d)
        if top_h[0][1] - top_h[1][1] > 2 * tol:
            assert top_d[0][0] == top_h[0][0], (i, top_h, top_d)
        for (tok_h, v_h), (tok_d, v_d) in zip(top_h, top_d, strict=True):
            assert tok_h != tok_d or close(v_h, v_d, tol)


@pytest.mark.parametrize("weight", ["F32", "Q4_0"])
def test_random_model_generation_agrees_up_to_near_ties(model_factory, weight):
    """Greedy generation, plain and chain-speculative, on a model with a prelude and grouped-query attention: the
    device's tokens are the CPU engine's until the first step whose top two tokens are within the tolerance."""
    model = model_factory(TINY, weight_type=weight, seed=6)
    host, dev = tinyloop.Engine(model.path), tinyloop.Engine(model.path, device=DEVICE)
    tol = TOLERANCE[weight]
    rng = random.Random(11)
    for _ in range(4):
        prompt = [rng.randrange(50257) for _ in range(rng.randint(2, 20))]
        agreed(host, prompt, dev.generate(prompt, greedy(20), loops=3).tokens, tol, loops=3)
        agreed(host, prompt, dev.generate(prompt, greedy(20), loops=3, draft=(1, 3)).tokens, tol, loops=3)


OURO = dataclasses.replace(TINY, post_norms=True, loop_norm=True, exit_gate=True, name="tiny-ouro")
QWEN = dataclasses.replace(TINY_NOPRE, attn_bias=True, name="tiny-bias")


@pytest.mark.parametrize("shape", [OURO, QWEN], ids=["ouro-layers", "qkv-bias"])
def test_converted_layer_kinds_match(model_factory, shape):
    """Ouro's sandwich norms, its normed recurrence and exit gate (which then drives `loops: "auto"`), and Qwen2's
    Q/K/V biases, on the device: the same log-probabilities, and under the gate the same exits."""
    model = model_factory(shape, weight_type="F32", seed=7)
    host, dev = tinyloop.Engine(model.path), tinyloop.Engine(model.path, device=DEVICE)
    ids = [random.Random(2).randrange(50257) for _ in range(32)]
    for loops in (1, 3, 8):
        for (lp_h, _), (lp_d, _) in zip(teacher_forced(host, ids, loops), teacher_forced(dev, ids, loops), strict=True):
            assert close(lp_h, lp_d, TOLERANCE["F32"]), (loops, lp_h, lp_d)
    if shape.exit_gate:
        assert dev.exit_rule == "gate"
        rule = tinyloop.AutoDepth(min_loops=1, threshold=0.9)  # tokens stop after different numbers of loops
        want = host.generate(ids[:5], greedy(16), loops=rule)
        got = dev.generate(ids[:5], greedy(16), loops=rule)
        agreed(host, ids[:5], got.tokens, TOLERANCE["F32"], loops=rule)
        assert got.auto_loops == want.auto_loops
        assert want.auto_loops[0] < want.auto_loops[1] < 3 * want.auto_loops[0], want.auto_loops


def test_what_the_device_path_does_not_run_is_refused_by_name(engines, default_models):
    dev = engines("F16", DEVICE)
    with pytest.raises(tinyloop.InvalidRequestError, match=r"tree speculative.*candle-cpu"):
        dev.generate([1, 2], greedy(4), loops=4, draft=(1, 2), k_branches=2)
    with pytest.raises(tinyloop.InvalidRequestError, match=r"cache_window.*candle-cpu"):
        dev.generate([1, 2], greedy(4), loops=4, cache_window=16)
    with pytest.raises(tinyloop.InvalidRequestError, match="window"):
        dev.sequence(window=8)
    for mode in ("int8", "int4", "int4-h"):
        with pytest.raises(tinyloop.InvalidRequestError, match=f'KV cache mode "{mode}".*candle-cpu'):
            tinyloop.Engine(default_models["F16"], device=DEVICE, kv_cache_mode=mode)
    with pytest.raises(tinyloop.InvalidRequestError, match=r"max_seq_len 5000 beyond.*context_length"):
        tinyloop.Engine(default_models["F16"], device=DEVICE, max_seq_len=5000)
    with pytest.raises(tinyloop.InvalidRequestError, match="prompt_cache_disk"):
        tinyloop.Engine(default_models["F16"], device=DEVICE, prompt_cache_disk="/nonexistent")
    # The engine keeps serving after each refusal.
    assert (
        dev.generate([1, 2], greedy(4), loops=2).tokens
        == engines("F16", "cpu").generate([1, 2], greedy(4), loops=2).tokens
    )


def test_unknown_devices_and_cuda_without_it_are_clear_errors():
    with pytest.raises(tinyloop.InvalidRequestError, match=r'unknown device "gpu".*"cuda:N"'):
        tinyloop.Engine(DEFAULT, device="gpu")
    try:
        engine = tinyloop.Engine(DEFAULT, device="cuda")
    except tinyloop.DeviceError as e:
        assert "CUDA" in str(e) or "GPU" in str(e)
    else:  # a CUDA build on a machine with a GPU
        assert engine.info.device.startswith("cuda:")
