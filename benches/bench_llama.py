"""tinyloop next to llama.cpp (llama-cpp-python) and, in decode, mistral.rs (the `mistralrs` wheel: Rust, candle
and PyO3 like tinyloop) on the same weights: the model exported with `tinyloop export-llama` (k layers x L loops
unrolled into a k*L-layer llama GGUF, same tensor types), greedy, 2 threads each.

    pip install llama-cpp-python        # compiles llama.cpp (~5 min); not a dependency of the package or the tests
    pip install mistralrs               # optional: without it the mistral.rs cases are skipped
    pytest benches/bench_llama.py --benchmark-json=.benchmarks/llama.json
    python benches/report_llama.py .benchmarks/llama.json    # the table in docs/performance.md

mistral.rs loads the GGUF from its folder offline (`HF_HUB_OFFLINE=1`) with the tokenizer the file carries; the
file has no chat template, so it gets a completion request with the prompt as text. Its `Runner` has no thread
setting: it sizes its rayon pool from `RAYON_NUM_THREADS`, set to 2 before it starts. Its greedy text is compared
with tinyloop's and the agreement recorded (`extra_info["greedy_match"]`), not asserted: past an end-of-text token
the two differ by design (with `ignore_eos` mistral.rs emits it and goes on, tinyloop takes the runner-up).

`test_greedy_tokens_identical` is the correctness check of the export: llama.cpp's greedy tokens equal tinyloop's
for 20 prompts on each model. On a CPU with AMX, ggml's AMX matmul segfaults
on the seed-shaped Q4_0 model (ggml-org/llama.cpp#20824): build llama-cpp-python without it,
CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_BF16=ON
-DGGML_AVX_VNNI=ON" (the native build turns AMX on wherever the CPU has it).
"""

from __future__ import annotations

import os
import random
import sys
from pathlib import Path

import pytest

import tinyloop
from tinyloop import SamplingParams
from tinyloop.modelfile.export_llama import export_llama
from tinyloop.modelfile.format import ModelConfig

llama_cpp = pytest.importorskip("llama_cpp")

sys.path.insert(0, str(Path(__file__).resolve().parent))
from quant_models import CACHE, DEFAULT, SEED, random_model  # noqa: E402

THREADS = 2
LOOPS = 8
SMALL = ModelConfig(
    dim=256, n_heads=4, n_kv_heads=4, ffn_dim=768, block_count=2, context_length=1024, name="random-small"
)


def _files(name: str, weight_type: str) -> tuple[Path, Path]:
    """(tinyloop file, unrolled llama GGUF) for a model, built once under .benchmarks/quant/."""
    CACHE.mkdir(parents=True, exist_ok=True)
    if name == "default":
        src = DEFAULT
        if weight_type != "F16":
            from quant_models import model_path

            src = model_path({"Q8_0": "int8", "Q4_0": "int4 RTN"}[weight_type])
    else:
        src = random_model({"random-small": SMALL, "seed": SEED}[name], weight_type)
    gguf = CACHE / f"{src.stem}-llama{LOOPS}.gguf"
    if not gguf.exists() or gguf.stat().st_mtime < src.stat().st_mtime:
        export_llama(src, gguf, loops=LOOPS)
    return src, gguf


def _llama(path: Path, n_ctx: int = 1024):
    return llama_cpp.Llama(
        model_path=str(path),
        n_ctx=n_ctx,
        n_threads=THREADS,
        n_threads_batch=THREADS,
        n_batch=512,
        verbose=False,
        logits_all=False,
    )


def _llama_greedy(llm, prompt: list[int], n: int) -> list[int]:
    llm.reset()
    out = []
    for tok in llm.generate(prompt, top_k=1, top_p=1.0, temp=0.0, repeat_penalty=1.0, reset=True):
        if len(out) == n:
            break
        out.append(tok)
    return out


def _prompts(count: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(50000) for _ in range(rng.randint(2, 40))] for _ in range(count)]


TIE = 1e-3  # log-probability gap under which two engines' greedy choices may legitimately differ


@pytest.mark.parametrize("name", ["default", "random-small"])
def test_greedy_tokens_identical(name):
    src, gguf = _files(name, "F16")
    engine, llm = tinyloop.Engine(src), _llama(gguf)
    eos = llm.token_eos()
    # Both stop at the end-of-text token (tinyloop's output leaves it out; llama.cpp's generate yields it and goes
    # on), so each side's answer is its tokens up to and including that token.
    params = SamplingParams(temperature=0.0, max_tokens=16)
    same, ties = 0, []
    for prompt in _prompts(20, seed=1):
        completion = engine.generate(prompt, params, loops=LOOPS)
        ours = completion.tokens + ([eos] if completion.finish_reason == "stop" else [])
        theirs = _llama_greedy(llm, prompt, 16)
        theirs = theirs[: theirs.index(eos) + 1] if eos in theirs else theirs
        if ours == theirs:
            same += 1
            continue
        # The engines round differently (ggml multiplies F16 weights with activations rounded to f16), so a
        # divergence is accepted only at a numerical tie: both first-differing tokens within TIE of each other
        # in tinyloop's own log-probabilities.
        i = next(j for j in range(16) if ours[j] != theirs[j])
        lp = [engine.score(prompt + ours[:i] + [t], [LOOPS])[0][0][-1] for t in (ours[i], theirs[i])]
        ties.append(lp[0] - lp[1])
    assert all(0 <= gap < TIE for gap in ties), f"{same}/20 identical; log-prob gaps at divergences: {ties}"
    assert same >= 18, f"{same}/20 prompts identical"


# The seed shape in Q4_0 only: its F16 export would be a 3.2 GB file.
CASES = [("default", wt) for wt in ("F16", "Q8_0", "Q4_0")] + [("seed", "Q4_0")]
DECODE = {"default": 64, "seed": 8}


# Self-speculative decoding: drafts at 2 loops, 4 ahead, verified at 8 (greedy, so the same tokens as plain).
SPEC = (2, 4)


def _engine(src: Path) -> tinyloop.Engine:
    # Context 1024 like llama.cpp's (the default model was trained at 512; speed does not care). No prompt cache:
    # every round prefills its whole prompt, as llama.cpp's (reset) and mistral.rs's (prefix_cache_n=0) do.
    return tinyloop.Engine(src, max_seq_len=1024, prompt_cache_entries=0)


def _mistralrs(gguf: Path):
    """A mistral.rs runner on the GGUF (skips the case without the wheel), and a function decoding n greedy tokens
    of a text prompt: (text, completion tokens)."""
    mistralrs = pytest.importorskip("mistralrs")
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ.setdefault("RAYON_NUM_THREADS", str(THREADS))
    which = mistralrs.Which.GGUF(quantized_model_id=str(gguf.parent), quantized_filename=gguf.name)
    runner = mistralrs.Runner(which=which, prefix_cache_n=0)  # every round prefills its prompt, as tinyloop's do

    def greedy(prompt: str, n: int) -> tuple[str, int]:
        request = mistralrs.CompletionRequest(
            prompt=prompt, model=runner.get_default_model_id(), max_tokens=n, temperature=0.0, ignore_eos=True
        )
        response = runner.send_completion_request(request)
        return response.choices[0].text, response.usage.completion_tokens

    return greedy


@pytest.mark.parametrize("engine_name", ["tinyloop", "tinyloop-spec", "llama.cpp", "mistral.rs"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(c))
def test_decode(benchmark, case, engine_name):
    name, wt = case
    src, gguf = _files(name, wt)
    n = DECODE[name]
    prompt = [464, 3290, 318]
    # tinyloop runs its own cases and gives mistral.rs its prompt text and reference; llama.cpp takes token ids.
    engine = _engine(src) if engine_name != "llama.cpp" else None
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    info = dict(kind="decode", model=name, weight_type=wt, engine=engine_name, tokens=n)
    if engine_name.startswith("tinyloop"):
        draft = SPEC if engine_name == "tinyloop-spec" else None
        run = lambda: len(engine.generate(prompt, params, loops=LOOPS, draft=draft).tokens)  # noqa: E731
    elif engine is None:
        llm = _llama(gguf)
        run = lambda: len(_llama_greedy(llm, prompt, n))  # noqa: E731
    else:
        greedy, text = _mistralrs(gguf), engine.decode(prompt)
        run = lambda: greedy(text, n)[1]  # noqa: E731
        info["greedy_match"] = greedy(text, n)[0] == engine.generate(prompt, params, loops=LOOPS).text
    produced = benchmark.pedantic(run, rounds=2, iterations=1, warmup_rounds=1)
    assert produced == n
    benchmark.extra_info.update(info)


@pytest.mark.parametrize("engine_name", ["tinyloop", "llama.cpp"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(c))
def test_prefill(benchmark, case, engine_name):
    name, wt = case
    src, gguf = _files(name, wt)
    prompt = [(17 * i) % 50000 for i in range(512)]
    if engine_name == "tinyloop":
        engine = _engine(src)
        params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
        run = lambda: engine.generate(prompt, params, loops=LOOPS).tokens  # noqa: E731
    else:
        llm = _llama(gguf)
        run = lambda: _llama_greedy(llm, prompt, 1)  # noqa: E731
    benchmark.pedantic(run, rounds=2, iterations=1, warmup_rounds=1)
    benchmark.extra_info.update(kind="prefill", model=name, weight_type=wt, engine=engine_name, tokens=512)


_RSS_SCRIPT = """
import sys
src, gguf, engine, n = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
prompt = [(17 * i) % 50000 for i in range(256)]
if engine == "tinyloop":
    import tinyloop
    e = tinyloop.Engine(src, max_seq_len=1024)
    e.generate(prompt, tinyloop.SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True), loops=8)
else:
    import llama_cpp
    llm = llama_cpp.Llama(model_path=gguf, n_ctx=1024, n_threads=2, n_threads_batch=2, verbose=False)
    for i, _ in enumerate(llm.generate(prompt, top_k=1, temp=0.0, repeat_penalty=1.0)):
        if i + 1 == n:
            break
# VmHWM belongs to this process image (ru_maxrss would carry the forking pytest's peak across exec).
print(next(l.split()[1] for l in open('/proc/self/status') if l.startswith('VmHWM:')))
"""


@pytest.mark.parametrize("engine_name", ["tinyloop", "llama.cpp"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(c))
def test_peak_rss(benchmark, case, engine_name):
    """Peak resident memory of a fresh process that loads the model, prefills 256 tokens and decodes a few."""
    import subprocess

    name, wt = case
    src, gguf = _files(name, wt)
    out = subprocess.run(
        [sys.executable, "-c", _RSS_SCRIPT, str(src), str(gguf), engine_name, "4"],
        capture_output=True,
        text=True,
        check=True,
    )
    kib = int(out.stdout.split()[-1])
    benchmark.pedantic(lambda: None, rounds=1, iterations=1)
    benchmark.extra_info.update(kind="peak_rss", model=name, weight_type=wt, engine=engine_name, rss_mib=kib / 1024)
