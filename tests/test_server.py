"""End to end: the real `tinyloop-serve` process, driven by the official openai SDK and by httpx for exact bytes."""

from __future__ import annotations

import json
import os
import socket
import threading
import time

import httpx
import openai
import pytest

import tinyloop
from serverutil import running_server
from tinyloop import SamplingParams


@pytest.fixture(scope="module")
def server(tiny):
    with running_server(tiny.path, "--served-model-name", "tiny") as base:
        yield base


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused")


def greedy(engine, prompt, n=16, loops=None):
    return engine.generate(prompt, SamplingParams(temperature=0.0, max_tokens=n), loops=loops)


def sse_events(raw: bytes) -> list:
    assert raw.endswith(b"data: [DONE]\n\n")
    parts = raw.decode().split("\n\n")
    assert parts[-1] == "" and parts[-2] == "data: [DONE]"
    return [json.loads(p[len("data: ") :]) for p in parts[:-2]]


def test_models(client):
    models = client.models.list()
    assert [m.id for m in models.data] == ["tiny"]
    assert models.data[0].owned_by == "tinyloop" and models.data[0].object == "model"


def test_completion_matches_the_engine(client, tiny_engine):
    want = greedy(tiny_engine, "The capital of France", 16)
    out = client.completions.create(model="x", prompt="The capital of France", max_tokens=16, temperature=0)
    assert out.object == "text_completion" and out.model == "x"
    assert out.choices[0].text == want.text
    assert out.choices[0].finish_reason == want.finish_reason == "length"
    assert (out.usage.prompt_tokens, out.usage.completion_tokens, out.usage.total_tokens) == (
        want.prompt_tokens,
        16,
        want.prompt_tokens + 16,
    )


def test_chat_uses_the_documented_template(client, tiny_engine):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}]
    want = greedy(tiny_engine, "System: Be brief.\nUser: Hello\nAssistant:", 12)
    out = client.chat.completions.create(model="m", messages=messages, max_tokens=12, temperature=0, stop=[])
    assert out.object == "chat.completion"
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content == want.text.lstrip()
    assert out.usage.prompt_tokens == want.prompt_tokens


def test_chat_stream_bytes(server, client):
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": "Hi"}],
        "max_tokens": 10,
        "temperature": 0,
        "stream": True,
        "stop": [],
    }
    raw = httpx.post(f"{server}/v1/chat/completions", json=body, timeout=60).content
    events = sse_events(raw)
    assert events[0]["choices"] == [{"index": 0, "delta": {"role": "assistant"}, "finish_reason": None}]
    # Unasked, no usage chunk: the finish_reason chunk is the last, and every chunk has a choice to index.
    assert events[-1]["choices"] == [{"index": 0, "delta": {}, "finish_reason": "length"}]
    assert all(e["object"] == "chat.completion.chunk" and e["id"] == events[0]["id"] for e in events)
    assert all("usage" not in e and e["choices"][0]["index"] == 0 for e in events)
    content = [e["choices"][0]["delta"]["content"] for e in events[1:-1]]
    assert all(content)  # empty deltas are dropped
    full = client.chat.completions.create(model="m", messages=body["messages"], max_tokens=10, temperature=0, stop=[])
    assert "".join(content) == full.choices[0].message.content
    assert b'"object":"chat.completion.chunk"' in raw  # compact JSON, as in the documented examples


@pytest.mark.parametrize("seed", [1, 2, 3, 4])
def test_streamed_text_equals_non_streamed_and_never_splits_characters(client, seed):
    kw = dict(model="m", prompt="日本語 and emoji 👍🏽 text:", max_tokens=40, temperature=1.0, seed=seed)
    full = client.completions.create(**kw).choices[0].text
    deltas = [c.choices[0].text for c in client.completions.create(stream=True, **kw) if c.choices]
    assert "".join(deltas) == full
    assert all("\ufffd" not in d for d in deltas) or "\ufffd" in full


def test_stream_include_usage(client):
    chunks = list(
        client.chat.completions.create(
            model="m",
            messages=[{"role": "user", "content": "x"}],
            max_tokens=5,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 5
    assert all(c.usage is None for c in chunks[:-1])


def test_n_samples_and_seed(client):
    kw = dict(model="m", prompt="Once", max_tokens=12, temperature=1.0, seed=7, n=4)
    a = client.completions.create(**kw)
    b = client.completions.create(**kw)
    assert [c.index for c in a.choices] == [0, 1, 2, 3]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    assert len({c.text for c in a.choices}) > 1
    assert a.usage.completion_tokens == 48


def test_exact_stop_strings(client, server):
    free = client.completions.create(model="m", prompt="Stop test", max_tokens=30, temperature=0).choices[0].text
    stop = free[10:14]
    assert len(stop) == 4 and stop in free
    out = client.completions.create(
        model="m", prompt="Stop test", max_tokens=30, temperature=0, stop=[stop, "\x00never"]
    )
    assert out.choices[0].text == free[: free.index(stop)] and out.choices[0].finish_reason == "stop"
    body = {"model": "m", "prompt": "Stop test", "max_tokens": 30, "temperature": 0, "stop": stop, "stream": True}
    events = sse_events(httpx.post(f"{server}/v1/completions", json=body, timeout=60).content)
    texts = [e["choices"][0]["text"] for e in events]
    assert "".join(texts) == free[: free.index(stop)] and all(stop not in t for t in texts)
    assert events[-1]["choices"][0]["finish_reason"] == "stop"


def test_prompt_array_answers_every_prompt(client, tiny_engine):
    out = client.completions.create(model="m", prompt=["one", "two words", "three"], max_tokens=6, temperature=0)
    assert [c.text for c in out.choices] == [greedy(tiny_engine, p, 6).text for p in ["one", "two words", "three"]]
    assert out.usage.prompt_tokens == sum(len(tiny_engine.encode(p)) for p in ["one", "two words", "three"])


def test_penalties_change_output(client):
    kw = dict(model="m", prompt="a a a a", max_tokens=24, temperature=0)
    plain = client.completions.create(**kw).choices[0].text
    penalised = client.completions.create(frequency_penalty=2.0, presence_penalty=2.0, **kw).choices[0].text
    assert plain != penalised


@pytest.mark.parametrize(
    "field,value,param",
    [
        ("temperature", 2.5, "temperature"),
        ("n", 9, "n"),
        ("top_p", 1.5, "top_p"),
        ("max_tokens", 0, "max_tokens"),
        ("presence_penalty", -3, "presence_penalty"),
        ("loops", 65, "loops"),
    ],
)
def test_out_of_range_is_400(client, field, value, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="m", prompt="x", extra_body={field: value})
    assert e.value.status_code == 400
    assert e.value.body["param"] == param and str(value) in e.value.body["message"]


def test_context_overflow_names_both_numbers(client, tiny_engine):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="m", prompt="hello " * 100, max_tokens=200)
    n = len(tiny_engine.encode("hello " * 100))
    assert f"prompt has {n} tokens and max_tokens is 200" in e.value.message and "256" in e.value.message


def test_schema_errors_are_422_in_openai_shape(server):
    r = httpx.post(f"{server}/v1/chat/completions", json={"model": "m"}, timeout=10)
    assert r.status_code == 422
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and "messages" in err["message"]
    r = httpx.post(f"{server}/v1/completions", json={"model": "m", "prompt": "x", "max_tokens": "many"}, timeout=10)
    assert r.status_code == 422 and "max_tokens" in r.json()["error"]["message"]


def test_api_v0_sections(server, tiny):
    body = {"model": "m", "prompt": "Hello", "max_tokens": 8, "temperature": 0, "repetition_penalty": 1.3}
    r = httpx.post(f"{server}/api/v0/completions", json=body, timeout=60).json()
    s = r["stats"]
    assert (s["prompt_tokens"], s["completion_tokens"], s["mode"], s["loops_used"]) == (1, 8, "generate", 3)
    assert s["wall_ms"] > 0 and s["tokens_per_second"] > 0 and s["stop_reason"] == "maxPredictedTokensReached"
    assert 0 < s["time_to_first_token"] * 1000 <= s["wall_ms"]
    assert r["model_info"] == {
        "arch": "weight-shared-looped-transformer",
        "dim": 64,
        "n_heads": 4,
        "ffn_dim": 96,
        "vocab_size": 50257,
        "default_loops": 3,
        "quant": "fp16",
        "kv_cache_mode": "fp16",
        "kv_share": "none",
        "device": "cpu",
    }
    assert r["runtime"]["device"] == "cpu"
    assert r["runtime"]["name"] == "tinyloop" and r["runtime"]["version"] == tinyloop.__version__
    # The server process runs at the best level (test servers get no TINYLOOP_ variables).
    assert r["runtime"]["isa"] in ("avx512+vnni", "avx512", "avx2", "scalar")
    assert "TINYLOOP_ISA" in os.environ or r["runtime"]["isa"] == tinyloop._core.isa()
    refused = httpx.post(f"{server}/v1/completions", json=body, timeout=60)  # an /api/v0 field, not an OpenAI one
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "repetition_penalty"
    del body["repetition_penalty"]
    plain = httpx.post(f"{server}/v1/completions", json=body, timeout=60).json()
    assert "stats" not in plain and plain["choices"][0]["text"] != r["choices"][0]["text"]  # penalty honoured on v0
    r = httpx.post(
        f"{server}/api/v0/chat/completions",
        json={
            **{k: v for k, v in body.items() if k != "prompt"},
            "mode": "tree_speculative",
            "K_branches": 16,
            "draft_ahead": 8,
            "messages": [{"role": "user", "content": "x"}],
        },
        timeout=10,
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "K_branches"


def test_native_generate(server, tiny_engine):
    r = httpx.post(f"{server}/generate", json={"prompt": "Hello there", "max_tokens": 10}, timeout=60).json()
    # Native defaults: temperature 0 (greedy), loops 8.
    want = greedy(tiny_engine, "Hello there", 10, loops=8)
    assert r["tokens"] == want.tokens and r["text"] == want.text and r["finish_reason"] == "length"
    assert r["stats"]["loops_used"] == 8 and r["stats"]["mode"] == "generate"
    ids = tiny_engine.encode("Hello there")
    by_ids = httpx.post(f"{server}/generate", json={"prompt": ids, "max_tokens": 10}, timeout=60).json()
    assert by_ids["tokens"] == want.tokens
    stop_id = want.tokens[3]
    r = httpx.post(f"{server}/generate", json={"prompt": ids, "max_tokens": 10, "stop": [stop_id]}, timeout=60).json()
    assert r["tokens"] == want.tokens[: want.tokens.index(stop_id)] and r["finish_reason"] == "stop"


def test_native_stream(server, tiny_engine):
    raw = httpx.post(
        f"{server}/generate", json={"prompt": "Hello there", "max_tokens": 10, "stream": True}, timeout=60
    ).content
    events = sse_events(raw)
    want = greedy(tiny_engine, "Hello there", 10, loops=8)
    assert [e["token_id"] for e in events[:-1]] == want.tokens and events[-1]["token_id"] == -1
    assert "".join(e["text"] for e in events) == want.text


def test_health_answers_while_streaming(server):
    body = {"prompt": "x", "max_tokens": 200, "stream": True, "loops": 16}
    latencies = []
    probe = httpx.Client(timeout=5)  # one client: a new one per call spends ~100 ms building its SSL context
    probe.get(f"{server}/health")
    with httpx.stream("POST", f"{server}/generate", json=body, timeout=120) as r:
        lines = r.iter_lines()
        next(lines)
        for _ in range(5):
            t = time.perf_counter()
            assert probe.get(f"{server}/health").json() == {"status": "ok", "device": "cpu"}
            latencies.append(time.perf_counter() - t)
        still_streaming = any(line.startswith("data: {") for line in lines)
    assert still_streaming
    probe.close()
    assert sorted(latencies)[2] < 0.05, latencies


def gauge(server, name):
    return httpx.get(f"{server}/metrics/json", timeout=5).json()[name]


def wait_until(cond, what: str, seconds: float = 10.0) -> None:
    deadline = time.time() + seconds
    while not cond():
        assert time.time() < deadline, what
        time.sleep(0.05)


def histogram(server, name) -> dict[str, float]:
    return gauge(server, f"{name}_bucket")


# A generation that runs for seconds, so a request that is not cancelled shows it by its token count.
LONG = {"prompt": "x", "max_tokens": 8000, "loops": 64}


@pytest.fixture(scope="module")
def long_server(tiny_long):
    with running_server(tiny_long.path) as base:
        yield base


def post_then_leave(server: str, path: str, body: dict) -> None:
    """Send a non-streamed request on a bare socket, wait until the engine runs it, then close the connection
    without reading: the client leaves while the route is still waiting for the whole answer."""
    host, port = server.removeprefix("http://").split(":")
    data = json.dumps(body).encode()
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(
            f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\n\r\n".encode()
            + data
        )
        wait_until(lambda: gauge(server, "tinyloop_requests_running") == 1, "the request never started")


def test_disconnect_cancels_the_generation(long_server):
    server = long_server
    # Several times over, streaming and not: a disconnect that reaches the route only some of the time must fail
    # this test, not pass it by luck; and one a server notices only when a write fails never reaches a route that
    # is still waiting for its whole answer. Each client leaves only once its request is running, so every trial
    # is a cancellation the engine must observe.
    for trial in range(8):
        before = gauge(server, "tinyloop_generation_tokens_total")
        disconnects = gauge(server, "tinyloop_client_disconnects_total")
        if trial % 2 == 0:
            with httpx.stream("POST", f"{server}/generate", json={**LONG, "stream": True}, timeout=60) as r:
                assert r.status_code == 200
                lines = r.iter_lines()
                for _ in range(3):
                    next(lines)
        else:
            post_then_leave(server, "/generate", LONG)
        wait_until(
            lambda: gauge(server, "tinyloop_requests_running") == 0, "generation kept running after the client left"
        )
        assert gauge(server, "tinyloop_client_disconnects_total") == disconnects + 1
        assert gauge(server, "tinyloop_generation_tokens_total") - before < LONG["max_tokens"] / 2
    # Once the server saw the client leave, the engine dropped the request within 2 steps, every time.
    steps = histogram(server, "tinyloop_cancel_steps")
    assert steps["+Inf"] >= 8 and steps["2.0"] == steps["+Inf"], steps
    assert gauge(server, "tinyloop_kv_cache_bytes") == 0
    after = httpx.post(f"{server}/generate", json={"prompt": "next", "max_tokens": 3}, timeout=30).json()
    assert len(after["tokens"]) == 3


def test_concurrent_requests_each_get_their_own_output(client, tiny_engine):
    prompts = [f"prompt number {i}" for i in range(6)]
    results: dict[str, str] = {}

    def call(p):
        results[p] = client.completions.create(model="m", prompt=p, max_tokens=12, temperature=0).choices[0].text

    threads = [threading.Thread(target=call, args=(p,)) for p in prompts]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == {p: greedy(tiny_engine, p, 12).text for p in prompts}


def test_metrics(server):
    text = httpx.get(f"{server}/metrics", timeout=5).text
    for name in [
        "tinyloop_requests_total",
        "tinyloop_prompt_tokens_total",
        "tinyloop_generation_tokens_total",
        "tinyloop_time_to_first_token_seconds_bucket",
        "tinyloop_inter_token_latency_seconds_bucket",
        "tinyloop_requests_running",
        "tinyloop_requests_waiting",
        "tinyloop_kv_cache_bytes",
    ]:
        assert name in text
    assert 'tinyloop_requests_total{endpoint="/v1/completions",status="200"}' in text
    snap = httpx.get(f"{server}/metrics/json", timeout=5).json()
    assert snap["tinyloop_generation_tokens_total"] > 0
    assert any(s["labels"] == {"endpoint": "/v1/completions", "status": "400"} for s in snap["tinyloop_requests_total"])


def test_streamed_characters_spanning_tokens(cycle_model, tiny_engine):
    from conftest import CYCLE_TEXT

    path, ids = cycle_model
    pieces = [tiny_engine.token_bytes(t) for t in ids]
    split = [p for p in pieces if not _is_utf8(p)]
    assert len(split) >= 4  # emoji, CJK and the combining mark really are cut across tokens
    with running_server(path) as base:
        c = openai.OpenAI(base_url=f"{base}/v1", api_key="x")
        kw = dict(model="m", prompt=ids[:1], max_tokens=len(ids) - 1, temperature=0)
        full = c.completions.create(**kw).choices[0].text
        assert full == CYCLE_TEXT[1:]
        deltas = [ch.choices[0].text for ch in c.completions.create(stream=True, **kw) if ch.choices]
        assert "".join(deltas) == full
        assert all(d and "\ufffd" not in d for d in deltas[:-1])
        native = sse_events(
            httpx.post(
                f"{base}/generate", json={"prompt": ids[:1], "max_tokens": len(ids) - 1, "stream": True}, timeout=30
            ).content
        )
        assert [e["token_id"] for e in native[:-1]] == ids[1:]
        assert "".join(e["text"] for e in native) == full and all("\ufffd" not in e["text"] for e in native)


def _is_utf8(b: bytes) -> bool:
    try:
        b.decode("utf-8")
        return True
    except UnicodeDecodeError:
        return False


def test_speculative_endpoints_equal_plain_generation(server):
    prompt = {"prompt": "Speculate about this", "max_tokens": 24}
    plain = httpx.post(f"{server}/generate", json={**prompt, "loops": 6}, timeout=60).json()
    spec = httpx.post(
        f"{server}/generate/speculative",
        json={**prompt, "verify_loops": 6, "draft_loops": 2, "draft_ahead": 3},
        timeout=60,
    ).json()
    assert spec["tokens"] == plain["tokens"] and spec["text"] == plain["text"]
    s = spec["stats"]
    assert (s["mode"], s["loops_used"]) == ("speculative", 6)
    assert s["accepted_draft_tokens_count"] + s["rejected_draft_tokens_count"] == s["total_draft_tokens_count"] > 0
    tree = httpx.post(
        f"{server}/generate/tree_speculative",
        json={**prompt, "verify_loops": 6, "draft_loops": 2, "draft_ahead": 3, "K_branches": 1},
        timeout=60,
    ).json()
    assert tree["tokens"] == plain["tokens"] and tree["stats"]["mode"] == "tree_speculative"
    wide = httpx.post(
        f"{server}/generate/tree_speculative",
        json={**prompt, "verify_loops": 6, "draft_loops": 2, "draft_ahead": 4, "K_branches": 3},
        timeout=60,
    ).json()
    assert wide["tokens"] == plain["tokens"] and wide["stats"]["total_draft_tokens_count"] > 0
    raw = httpx.post(
        f"{server}/generate/speculative", json={**prompt, "verify_loops": 6, "stream": True}, timeout=60
    ).content
    events = sse_events(raw)
    assert [e["token_id"] for e in events[:-1]] == plain["tokens"] and events[-1]["token_id"] == -1
    text = httpx.get(f"{server}/metrics", timeout=5).text
    assert 'tinyloop_draft_tokens_proposed_total{mode="speculative"}' in text


@pytest.mark.parametrize(
    "path,body,param",
    [
        ("/generate/tree_speculative", {"K_branches": 16, "draft_ahead": 8}, "K_branches"),
        ("/generate/tree_speculative", {"K_branches": 17}, "K_branches"),
        ("/generate/speculative", {"draft_ahead": 17}, "draft_ahead"),
        ("/generate/speculative", {"draft_loops": 33}, "draft_loops"),
    ],
)
def test_speculative_ranges(server, path, body, param):
    r = httpx.post(f"{server}{path}", json={"prompt": "x", **body}, timeout=10)
    assert r.status_code == 400 and r.json()["error"]["param"] == param


def test_speculative_sampling_is_reproducible_and_tree_needs_greedy(server):
    body = {"prompt": "x", "temperature": 0.7, "sample_seed": 3, "max_tokens": 10}
    a = httpx.post(f"{server}/generate/speculative", json=body, timeout=30).json()
    b = httpx.post(f"{server}/generate/speculative", json=body, timeout=30).json()
    assert a["tokens"] == b["tokens"] and len(a["tokens"]) == 10
    r = httpx.post(f"{server}/generate/tree_speculative", json=body, timeout=10)
    assert r.status_code == 400 and r.json()["error"]["param"] == "temperature"
    # The same rule on /api/v0, where sampled chain speculation is allowed and a sampled tree is not.
    v0 = {"model": "m", "prompt": "x", "max_tokens": 6, "temperature": 0.7, "seed": 3, "verify_loops": 5}
    chain = httpx.post(f"{server}/api/v0/completions", json={**v0, "mode": "speculative"}, timeout=30)
    assert chain.status_code == 200 and chain.json()["stats"]["mode"] == "speculative"
    tree = httpx.post(
        f"{server}/api/v0/completions", json={**v0, "mode": "tree_speculative", "K_branches": 2}, timeout=10
    )
    assert tree.status_code == 400 and tree.json()["error"]["param"] == "temperature"


def test_api_v0_routes_modes(server):
    body = {"model": "m", "prompt": "Route me", "max_tokens": 12, "temperature": 0}
    plain = httpx.post(f"{server}/api/v0/completions", json={**body, "loops": 5}, timeout=60).json()
    spec = httpx.post(
        f"{server}/api/v0/completions",
        json={**body, "mode": "speculative", "verify_loops": 5, "draft_loops": 1},
        timeout=60,
    ).json()
    assert spec["choices"][0]["text"] == plain["choices"][0]["text"]
    assert spec["stats"]["mode"] == "speculative" and spec["stats"]["loops_used"] == 5
    assert spec["stats"]["total_draft_tokens_count"] > 0 and "mean_accepted_length" in spec["stats"]


def test_stop_strings_cut_tokens_and_text_alike(server, tiny_engine):
    """A matched stop string ends `text` where it begins, and `tokens` after the last token wholly before it —
    streamed or not; LM Studio's stats say stopStringFound."""
    free = greedy(tiny_engine, "Stop here", 30, loops=8)
    pieces = [tiny_engine.token_bytes(t).decode("utf-8", "replace") for t in free.tokens]
    assert "".join(pieces) == free.text
    # A stop string that begins inside a token: from the 2nd character of the 6th token to the 3rd of the 7th.
    i = next(k for k in range(5, 20) if len(pieces[k]) >= 2 and len(pieces[k + 1]) >= 3)
    start = len("".join(pieces[:i])) + 1
    stop = free.text[start : start + len(pieces[i]) - 1 + 3]
    assert free.text.index(stop) == start
    body = {"prompt": "Stop here", "max_tokens": 30, "stop": [stop]}
    r = httpx.post(f"{server}/generate", json=body, timeout=30).json()
    assert r["text"] == free.text[:start] and r["tokens"] == free.tokens[:i] and r["finish_reason"] == "stop"
    assert r["stats"]["stop_reason"] == "stopStringFound" and r["stats"]["completion_tokens"] >= i + 2
    events = sse_events(httpx.post(f"{server}/generate", json={**body, "stream": True}, timeout=30).content)
    assert [e["token_id"] for e in events[:-1]] == r["tokens"] and "".join(e["text"] for e in events) == r["text"]
    assert events[-1] == {"token_id": -1, "text": events[-1]["text"], "finish_reason": "stop"}
    lm = httpx.post(
        f"{server}/api/v0/completions",
        json={"model": "m", "prompt": "Stop here", "max_tokens": 30, "temperature": 0, "loops": 8, "stop": stop},
        timeout=30,
    ).json()
    assert lm["choices"][0]["text"] == free.text[:start] and lm["stats"]["stop_reason"] == "stopStringFound"


def test_native_stop_mixes_strings_and_token_ids(server, tiny_engine):
    free = greedy(tiny_engine, "Mixed stops", 20, loops=8)
    by_id = free.tokens[8]
    late_text = tiny_engine.decode(free.tokens[12:14])
    r = httpx.post(
        f"{server}/generate", json={"prompt": "Mixed stops", "max_tokens": 20, "stop": [late_text, by_id]}, timeout=30
    ).json()
    first = free.tokens.index(by_id)
    assert r["tokens"] == free.tokens[:first] and r["finish_reason"] == "stop"
    assert r["stats"]["stop_reason"] == "eosFound"  # a stop token ends it as EOS would (LM Studio has no other name)


TOKENIZE_TEXT = "Unicode 媽 and emoji 🤗 <|endoftext|> end"


def test_tokenize_is_tiktokens_gpt2_in_llama_cpps_shapes(server):
    from tinyloop.modelfile.vocab import tiktoken_gpt2

    enc = tiktoken_gpt2()
    r = httpx.post(f"{server}/tokenize", json={"content": TOKENIZE_TEXT})
    assert r.status_code == 200 and r.json() == {"tokens": enc.encode(TOKENIZE_TEXT, allowed_special="all")}
    assert 50256 in r.json()["tokens"]  # parse_special defaults to true, as in llama.cpp
    plain = httpx.post(f"{server}/tokenize", json={"content": TOKENIZE_TEXT, "parse_special": False}).json()
    assert plain["tokens"] == enc.encode_ordinary(TOKENIZE_TEXT) and 50256 not in plain["tokens"]
    # GPT-2's tokenizer puts no special token before a text: add_special changes nothing.
    assert httpx.post(f"{server}/tokenize", json={"content": "x", "add_special": True}).json()["tokens"] == [87]
    pieces = httpx.post(f"{server}/tokenize", json={"content": TOKENIZE_TEXT, "with_pieces": True}).json()["tokens"]
    assert [p["id"] for p in pieces] == r.json()["tokens"]
    for p in pieces:
        raw = enc.decode_single_token_bytes(p["id"])
        try:
            assert p["piece"] == raw.decode("utf-8")
        except UnicodeDecodeError:
            assert p["piece"] == list(raw)  # part of a character: its bytes, as llama.cpp gives them
    assert any(isinstance(p["piece"], list) for p in pieces)  # the emoji's bytes are split across tokens


def test_detokenize_round_trips_and_refuses_ids_outside_the_vocabulary(server):
    ids = httpx.post(f"{server}/tokenize", json={"content": TOKENIZE_TEXT}).json()["tokens"]
    # the text under both servers' names: llama.cpp's `content` and vLLM's `prompt`
    both = {"content": TOKENIZE_TEXT, "prompt": TOKENIZE_TEXT}
    assert httpx.post(f"{server}/detokenize", json={"tokens": ids}).json() == both
    assert httpx.post(f"{server}/detokenize", json={"tokens": ids, "model": "tiny"}).json() == both  # vLLM's body
    assert httpx.post(f"{server}/detokenize", json={"tokens": []}).json() == {"content": "", "prompt": ""}
    for bad in (50257, -1, 2**40):
        r = httpx.post(f"{server}/detokenize", json={"tokens": [1, bad]})
        assert (
            r.status_code == 400 and r.json()["error"]["param"] == "tokens" and str(bad) in r.json()["error"]["message"]
        )
    r = httpx.post(f"{server}/detokenize", json={"tokens": ["1"]})
    assert r.status_code == 422  # strict types: a string is not a token id
    r = httpx.post(f"{server}/tokenize", json={"content": "x", "n_probs": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "n_probs"  # unimplemented fields are refused


def test_tokenize_in_vllms_shape(server, tiny_engine):
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    from tinyloop.modelfile.vocab import tiktoken_gpt2

    enc = tiktoken_gpt2()
    ids = enc.encode(TOKENIZE_TEXT, allowed_special="all")  # control tokens' text is read as those tokens, as HF's
    r = httpx.post(f"{server}/tokenize", json={"prompt": TOKENIZE_TEXT})
    assert r.status_code == 200 and 50256 in ids
    assert r.json() == {
        "count": len(ids),
        "max_model_len": tiny_engine.info.max_seq_len,
        "tokens": ids,
        "token_strs": None,
    }
    # lm-eval's body; GPT-2's tokenizer puts no special token before a text, so add_special_tokens changes nothing
    body = {"prompt": TOKENIZE_TEXT, "add_special_tokens": False, "model": "tiny"}
    assert httpx.post(f"{server}/tokenize", json=body).json()["tokens"] == ids
    strs = httpx.post(f"{server}/tokenize", json={"prompt": TOKENIZE_TEXT, "return_token_strs": True}).json()
    # each token's vocabulary entry, as Hugging Face's convert_ids_to_tokens gives it: its bytes in GPT-2's alphabet
    alphabet = bytes_to_unicode()
    want = ["".join(alphabet[b] for b in enc.decode_single_token_bytes(t)) for t in ids]
    assert strs["tokens"] == ids and strs["token_strs"] == want
    assert "Ġend" in want and not all(_is_utf8(enc.decode_single_token_bytes(t)) for t in ids)  # the emoji's pieces


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"content": "a", "prompt": "a"}, "prompt"),  # both texts
        ({}, "content"),  # neither
        ({"add_special_tokens": False}, "content"),
        ({"prompt": "a", "with_pieces": True}, "with_pieces"),  # llama.cpp's fields with vLLM's text
        ({"prompt": "a", "parse_special": False}, "parse_special"),
        ({"prompt": "a", "add_special": True}, "add_special"),
        ({"content": "a", "return_token_strs": True}, "return_token_strs"),  # and the other way round
        ({"content": "a", "add_special_tokens": True}, "add_special_tokens"),
        ({"content": "a", "model": "tiny"}, "model"),
        ({"prompt": "a", "messages": []}, "messages"),  # vLLM's chat form is not implemented
    ],
)
def test_tokenize_refuses_an_ambiguous_body(server, body, param):
    r = httpx.post(f"{server}/tokenize", json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param and r.json()["error"]["type"] == "invalid_request_error"


def test_tokenizer_info_is_what_lm_eval_reads(server, tiny_engine):
    info = httpx.get(f"{server}/tokenizer_info").json()
    assert info["eos_token"] == info["bos_token"] == "<|endoftext|>"  # GPT-2's, as its tokenizer_config.json has
    assert info["pad_token"] is None and info["add_bos_token"] is False and info["add_eos_token"] is False
    assert info["model_max_length"] == tiny_engine.info.max_seq_len and isinstance(info["tokenizer_class"], str)
    assert info.get("chat_template") == (tiny_engine.chat_template or None)
    # lm-eval finds the end-of-text id by tokenizing eos_token
    eos = httpx.post(f"{server}/tokenize", json={"prompt": info["eos_token"]}).json()["tokens"]
    assert eos == [tiny_engine.eos_token_id] == [50256]
