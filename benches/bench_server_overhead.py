"""What the server adds to one stream: `/v1/chat/completions` streamed through the official openai SDK against
`Engine.stream` on the same prompt and generation, loops 8, greedy and `temperature 1` (seeded), on the shipped
default model.

    pytest benches/bench_server_overhead.py --benchmark-json=.benchmarks/server-overhead.json
    python benches/report_server_overhead.py .benchmarks/server-overhead.json

The engine side feeds the chat template's text (`template.render_chat`, as the server renders it for a file without
its own template) to `Engine.stream` in this process and reads every event; the server side (`tinyloop-serve` in its
own process, loopback) adds the HTTP layer, the chat stop strings, the streaming detokenizer, SSE framing and the
SDK's parsing. Both decode `TOKENS` tokens with `ignore_eos` (a case fails if a stop string ends the answer early,
so the counts match). Each round runs the engine stream first (pytest-benchmark's untimed `setup`, timed here) and
then the request, so the two best times come from the same stretch of the run: this machine's speed drifts by 10-30%
over a minute.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import openai
import pytest

import tinyloop
from tinyloop import Generation, SamplingParams
from tinyloop.server.protocol import ChatMessage
from tinyloop.server.template import render_chat

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from serverutil import server_process  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from quant_models import DEFAULT  # noqa: E402

TOKENS, LOOPS = 128, 8
MESSAGES = [{"role": "user", "content": "Tell me a story about the sea and a little boat."}]
SAMPLING = {"greedy": dict(temperature=0.0), "temperature 1": dict(temperature=1.0, seed=7)}


@pytest.fixture(scope="module")
def server():
    with server_process(DEFAULT) as (base, _proc, _output):
        yield openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def engine():
    return tinyloop.Engine(DEFAULT)


def _engine_stream(engine, sampling: dict) -> int:
    prompt = engine.encode(render_chat([ChatMessage.model_validate(m) for m in MESSAGES]))
    params = SamplingParams(max_tokens=TOKENS, ignore_eos=True, **sampling)
    return sum(ev.token_id >= 0 for ev in engine.stream(prompt, Generation(params, loops=LOOPS)))


def _sdk_stream(client, sampling: dict) -> int:
    stream = client.chat.completions.create(
        model="default",
        messages=MESSAGES,
        max_tokens=TOKENS,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True, "loops": LOOPS},
        **sampling,
    )
    usage = None
    for chunk in stream:
        usage = chunk.usage or usage
    assert usage is not None, "the stream ended without its usage chunk"
    return usage.completion_tokens


@pytest.mark.parametrize("name", list(SAMPLING))
def test_server_overhead(benchmark, server, engine, name):
    engine_s: list[float] = []

    def engine_first():
        start = time.perf_counter()
        assert _engine_stream(engine, SAMPLING[name]) == TOKENS
        engine_s.append(time.perf_counter() - start)

    produced = benchmark.pedantic(
        lambda: _sdk_stream(server, SAMPLING[name]), setup=engine_first, rounds=10, iterations=1, warmup_rounds=1
    )
    assert produced == TOKENS, f"the server's answer ended after {produced} tokens (a chat stop string?)"
    benchmark.extra_info.update(sampling=name, loops=LOOPS, tokens=TOKENS, engine_min_s=min(engine_s))
