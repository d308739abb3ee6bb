"""Bad input gets a clear error in the documented shape — never a 500 — and the server keeps serving.

Every numeric field of every generation endpoint is tried at and just past its bounds, negative, as a float where
an integer goes, as a string, as a bool, beyond 64 bits and as NaN / ±Infinity; then bodies that are not JSON at
all. Each answer is 400 or 422 (413, 415, 404, 405 where those apply) with `{"error": {message, type, param,
code}}`, and a bad field is named.
"""

from __future__ import annotations

import json

import httpx
import pytest

from serverutil import running_server

# (path, the fields it needs, {numeric field: (low, high)}) — the documented ranges (docs/api.md).
OPENAI = {
    "max_tokens": (1, 8192),
    "max_completion_tokens": (1, 8192),
    "temperature": (0.0, 2.0),
    "top_p": (0.0, 1.0),
    "n": (1, 8),
    "seed": (0, 2**64 - 1),
    "presence_penalty": (-2.0, 2.0),
    "frequency_penalty": (-2.0, 2.0),
    "loops": (1, 64),
    "min_tokens": (0, 2),
}
LMSTUDIO = {
    **OPENAI,
    "draft_loops": (1, 32),
    "verify_loops": (1, 64),
    "draft_ahead": (1, 16),
    "K_branches": (1, 16),
    "cache_window": (0, 1 << 20),
    "repetition_penalty": (0.5, 2.0),
}
NATIVE = {
    "max_tokens": (1, 8192),
    "loops": (1, 64),
    "temperature": (0.0, 2.0),
    "top_k": (0, 1000),
    "top_p": (0.0, 1.0),
    "repetition_penalty": (0.5, 2.0),
    "sample_seed": (0, 2**64 - 1),
    "cache_window": (0, 1 << 20),
}
SPECULATIVE = {**NATIVE, "draft_loops": (1, 32), "verify_loops": (2, 64), "draft_ahead": (1, 16)}  # drafts at >= 1 loop
ENDPOINTS = [
    ("/v1/completions", {"model": "m", "prompt": "x", "max_tokens": 2}, OPENAI),
    ("/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": 2}, OPENAI),
    ("/api/v0/completions", {"model": "m", "prompt": "x", "max_tokens": 2}, LMSTUDIO),
    ("/generate", {"prompt": "x", "max_tokens": 2}, NATIVE),
    ("/generate/speculative", {"prompt": "x", "max_tokens": 2}, SPECULATIVE),
    ("/generate/tree_speculative", {"prompt": "x", "max_tokens": 2}, {**SPECULATIVE, "K_branches": (1, 16)}),
]
INT_FIELDS = {
    "max_tokens",
    "max_completion_tokens",
    "n",
    "seed",
    "loops",
    "min_tokens",
    "draft_loops",
    "verify_loops",
    "draft_ahead",
    "K_branches",
    "cache_window",
    "top_k",
    "sample_seed",
}
CASES = [(path, base, field, lo, hi) for path, base, fields in ENDPOINTS for field, (lo, hi) in fields.items()]


@pytest.fixture(scope="module")
def server(tiny):
    with running_server(tiny.path) as base:
        yield base


def post(server: str, path: str, body: dict | bytes | str, **headers: str) -> httpx.Response:
    if isinstance(body, dict):
        body = json.dumps(body)  # Python's json writes NaN and Infinity as the bare words a careless client sends
    return httpx.post(
        f"{server}{path}", content=body, headers={"content-type": "application/json", **headers}, timeout=60
    )


def assert_error(r: httpx.Response, statuses: tuple[int, ...], names: str | None = None) -> dict:
    assert r.status_code in statuses, (r.status_code, r.text)
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and isinstance(err["message"], str) and err["message"]
    if names is not None:
        assert err["param"] == names or names in err["message"], err
    return err


def _past(value: float, step: int) -> float:
    return value + step if isinstance(value, int) else value + step * 0.01


@pytest.mark.parametrize("path,base,field,lo,hi", CASES, ids=[f"{c[0]}:{c[2]}" for c in CASES])
def test_numeric_fields_at_and_past_their_bounds(server, path, base, field, lo, hi):
    if field == "temperature" and "tree" in path:
        hi = lo = 0.0  # tree speculation is greedy-only
    if field in ("draft_loops", "verify_loops"):  # drafts must be shallower than the verification
        base = {**base, "draft_loops": 1, "verify_loops": 64}
    for at in (lo, hi):
        r = post(server, path, {**base, field: at})
        # At a bound the request is valid; it may still be too long for this model's 256-token context.
        assert r.status_code == 200 or assert_error(r, (400,))["code"] == "context_length_exceeded", (at, r.text)
    for past in (_past(lo, -1), _past(hi, 1)):
        assert_error(post(server, path, {**base, field: past}), (400,), field)


@pytest.mark.parametrize("path,base,field,lo,hi", CASES, ids=[f"{c[0]}:{c[2]}" for c in CASES])
def test_numeric_fields_refuse_other_types(server, path, base, field, lo, hi):
    wrong = ["8", "", None, True, [1], {"v": 1}, float("nan"), float("inf"), float("-inf")]
    if field in INT_FIELDS:
        wrong += [1.5, 8.0, 2**64, 2**70, -(2**63) - 1]
    for value in wrong:
        r = post(server, path, {**base, field: value})
        if value is None and field in OPENAI and "generate" not in path:
            assert r.status_code == 200, r.text  # null means "the default" on the OpenAI family's fields
            continue
        assert_error(r, (400, 422), field)


@pytest.mark.parametrize("path", ["/v1/completions", "/api/v0/completions", "/generate"])
@pytest.mark.parametrize("bad", [-1, -(2**31), 50257, 2**32, 2**64])
def test_prompt_token_ids_outside_the_vocabulary(server, path, bad):
    body = (
        {"model": "m", "prompt": [1, bad, 2], "max_tokens": 2}
        if path != "/generate"
        else {"prompt": [1, bad], "max_tokens": 2}
    )
    err = assert_error(post(server, path, body), (400,), "prompt")
    assert str(bad) in err["message"]


def test_native_stop_token_ids_outside_the_vocabulary(server):
    for bad in (-1, 50257, 2**64):
        assert_error(post(server, "/generate", {"prompt": "x", "stop": ["a", bad]}), (400,), "stop")


@pytest.mark.parametrize(
    "body,status,code",
    [
        (b'{"model": "m", "prompt": "x"', 400, "invalid_json"),
        (b'{"model": "m", "prompt": "x",}', 400, "invalid_json"),
        (b"", 422, None),
        (b"[]", 422, None),
        (b'"just a string"', 422, None),
        (b'{"model": "m", "prompt": "\xff\xfe"}', 400, "invalid_body"),
        (b'{"model": "m", "prompt": "\xed\xa0\x80"}', 400, "invalid_body"),  # a surrogate in UTF-8 bytes
        (b'{"model": "m", "prompt": "a\\ud800b"}', 400, "invalid_json"),  # a lone surrogate as an escape
        (b'{"model": "m", "prompt": ["ok", "\\udfff"]}', 400, "invalid_json"),
        (b'{"model": "m", "prompt": "nul\x00byte"}', 400, "invalid_json"),  # raw control characters are not JSON
        (b"[" * 100_000 + b"]" * 100_000, 400, "invalid_json"),
        (b'{"model": "m", "prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}", 400, "invalid_json"),
    ],
)
def test_bodies_that_are_not_valid_requests(server, body, status, code):
    err = assert_error(post(server, "/v1/completions", body), (status,))
    if code is not None:
        assert err["code"] == code


def test_escaped_nul_and_surrogate_pairs_are_text(server):
    r = post(server, "/v1/completions", b'{"model": "m", "prompt": "nul \\u0000 and \\ud83d\\ude00", "max_tokens": 2}')
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2


def test_wrong_content_type_is_415(server):
    r = httpx.post(
        f"{server}/v1/completions",
        content=b"model=m&prompt=x",
        headers={"content-type": "application/x-www-form-urlencoded"},
        timeout=10,
    )
    assert "application/x-www-form-urlencoded" in assert_error(r, (415,))["message"]
    r = httpx.post(
        f"{server}/v1/completions",
        content=json.dumps({"model": "m", "prompt": "x", "max_tokens": 1}),
        headers={"content-type": "application/json; charset=utf-8"},
        timeout=10,
    )
    assert r.status_code == 200


def test_oversized_body_is_413(tiny):
    with running_server(tiny.path, "--max-body-bytes", "1000") as base:
        r = httpx.post(f"{base}/v1/completions", json={"model": "m", "prompt": "x" * 2000}, timeout=10)
        assert "1000 bytes" in assert_error(r, (413,))["message"]

        def chunks():  # no Content-Length: the limit holds while reading
            yield b'{"model": "m", "prompt": "'
            for _ in range(50):
                yield b"y" * 100
            yield b'"}'

        r = httpx.post(
            f"{base}/v1/completions", content=chunks(), headers={"content-type": "application/json"}, timeout=10
        )
        assert_error(r, (413,))
        ok = httpx.post(f"{base}/v1/completions", json={"model": "m", "prompt": "x", "max_tokens": 1}, timeout=10)
        assert ok.status_code == 200


def test_unknown_routes_and_wrong_methods(server):
    assert_error(httpx.get(f"{server}/v2/nothing", timeout=5), (404,))
    assert_error(httpx.post(f"{server}/v1/chat/completion", json={}, timeout=5), (404,))
    r = httpx.get(f"{server}/v1/completions", timeout=5)
    assert_error(r, (405,))
    assert r.headers["allow"] == "POST"
    assert_error(httpx.delete(f"{server}/health", timeout=5), (405,))


def test_strict_types_reach_every_nested_field(server):
    cases = [
        ({"messages": [{"role": "user", "content": 5}]}, "messages"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "messages"),
        ({"messages": [{"role": "user", "content": [{"type": "text", "text": 1}]}]}, "messages"),
        ({"messages": "hello"}, "messages"),
        ({"stream": "true"}, "stream"),
        ({"stream": 1}, "stream"),
        ({"stream_options": {"include_usage": "yes"}}, "stream_options"),
        ({"stop": 5}, "stop"),
        ({"stop": ["a", 5]}, "stop"),
        ({"model": 5}, "model"),
    ]
    base = {"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": 2}
    for change, name in cases:
        assert_error(post(server, "/v1/chat/completions", {**base, **change}), (422,), name)
    assert_error(post(server, "/api/v0/completions", {"model": "m", "prompt": "x", "mode": "sideways"}), (400,), "mode")


def test_the_server_still_serves_after_all_that(server, tiny_engine):
    import tinyloop

    want = tiny_engine.generate("still here", tinyloop.SamplingParams(temperature=0.0, max_tokens=5), loops=8)
    r = httpx.post(f"{server}/generate", json={"prompt": "still here", "max_tokens": 5}, timeout=30).json()
    assert r["tokens"] == want.tokens
    assert httpx.get(f"{server}/health", timeout=5).json() == {"status": "ok", "device": "cpu"}


# Anthropic's Messages routes answer the same bad input in Anthropic's statuses and shape: 400 invalid_request_error
# for every request the schema or a range refuses (where the OpenAI families say 400 or 422).
MESSAGES = {
    "max_tokens": (1, 8192),
    "temperature": (0.0, 1.0),
    "top_p": (0.0, 1.0),
    "top_k": (0, 1000),
    "loops": (1, 64),
    "draft_loops": (1, 32),
    "draft_ahead": (1, 16),
}
MESSAGES_BASE = {"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": 2}


def assert_anthropic_error(r: httpx.Response, status: int, kind: str, names: str | None = None) -> str:
    assert r.status_code == status, (r.status_code, r.text)
    body = r.json()
    assert set(body) == {"type", "error"} and body["type"] == "error" and set(body["error"]) == {"type", "message"}
    assert body["error"]["type"] == kind and body["error"]["message"], body
    if names is not None:
        assert names in body["error"]["message"], body
    return body["error"]["message"]


@pytest.mark.parametrize("field,lo,hi", [(f, lo, hi) for f, (lo, hi) in MESSAGES.items()])
def test_messages_numeric_fields_in_anthropics_statuses(server, field, lo, hi):
    base = {**MESSAGES_BASE, "loops": 64} if field == "draft_loops" else MESSAGES_BASE  # drafts below the depth
    for at in (lo, hi):
        r = post(server, "/v1/messages", {**base, field: at})
        # At a bound the request is valid; it may still be too long for this model's 256-token context.
        assert r.status_code == 200 or "maximum sequence length" in r.text, (at, r.text)
    wrong = [_past(lo, -1), _past(hi, 1), "8", "", True, [1], {"v": 1}, float("nan"), float("inf")]
    if field not in ("temperature", "top_p"):
        wrong += [1.5, 8.0, 2**64]
    for value in wrong:
        assert_anthropic_error(
            post(server, "/v1/messages", {**MESSAGES_BASE, field: value}), 400, "invalid_request_error", field
        )


@pytest.mark.parametrize(
    "body",
    [
        b'{"model": "m", "max_tokens": 2, "messages": [',
        b"",
        b"[]",
        b'{"model": "m", "messages": [{"role": "user", "content": "x"}]}',  # no max_tokens
        b'{"model": "m", "max_tokens": 2, "messages": [{"role": "robot", "content": "x"}]}',
        b'{"model": "m", "max_tokens": 2, "messages": []}',
        b'{"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": "\xff"}]}',
        b'{"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": "x"}], "bogus": 1}',
    ],
)
@pytest.mark.parametrize("path", ["/v1/messages", "/v1/messages/count_tokens"])
def test_messages_bodies_that_are_not_valid_requests(server, path, body):
    if path.endswith("count_tokens") and b"max_tokens" not in body and b'"user"' in body:
        body = body.replace(b"{", b'{"max_tokens": "2", ', 1)  # counting needs no max_tokens: give it a bad one
    assert_anthropic_error(post(server, path, body), 400, "invalid_request_error")


def test_messages_transport_errors_in_anthropics_statuses(server, tiny):
    r = httpx.post(f"{server}/v1/messages", content=b"x=1", headers={"content-type": "text/plain"}, timeout=10)
    assert_anthropic_error(r, 400, "invalid_request_error", "text/plain")
    assert_anthropic_error(httpx.post(f"{server}/v1/messages/nothing", json={}, timeout=5), 404, "not_found_error")
    with running_server(tiny.path, "--max-body-bytes", "1000", "--api-key", "k") as base:
        big = {**MESSAGES_BASE, "system": "x" * 2000}
        r = httpx.post(f"{base}/v1/messages", json=big, headers={"x-api-key": "k"}, timeout=10)
        assert_anthropic_error(r, 413, "request_too_large", "1000 bytes")
        r = httpx.post(f"{base}/v1/messages", json=MESSAGES_BASE, headers={"x-api-key": "no"}, timeout=10)
        assert_anthropic_error(r, 401, "authentication_error")
        ok = httpx.post(f"{base}/v1/messages", json=MESSAGES_BASE, headers={"x-api-key": "k"}, timeout=10)
        assert ok.status_code == 200 and ok.json()["usage"]["output_tokens"] == 2


def test_a_full_server_is_529_overloaded_on_messages(tiny):
    """A server that can take no more requests: 503 + Retry-After on the OpenAI routes, Anthropic's 529
    `overloaded_error` on the Messages routes (the anthropic SDK retries both)."""
    import asyncio

    from tinyloop.server.app import create_app
    from tinyloop.server.config import ServerConfig

    app = create_app(ServerConfig(model_path=tiny.path, max_running=0, max_waiting=0))

    async def main() -> tuple[httpx.Response, httpx.Response]:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
            full = await client.post("/v1/messages", json=MESSAGES_BASE)
            chat = {"model": "m", "messages": MESSAGES_BASE["messages"], "max_tokens": 2}
            return full, await client.post("/v1/chat/completions", json=chat)

    try:
        messages, chat = asyncio.run(main())
    finally:
        app.state.tinyloop.runner.close()
    assert_anthropic_error(messages, 529, "overloaded_error")
    assert messages.headers["retry-after"] == "1"
    assert chat.status_code == 503 and chat.json()["error"]["code"] == "server_overloaded"
