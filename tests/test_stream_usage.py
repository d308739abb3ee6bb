"""The usage chunk of `/v1` and `/api/v0` streams: sent only when `stream_options.include_usage` asks for it (as
OpenAI does), so the loop most clients write — `chunk.choices[0].delta` for every chunk — never meets an empty
`choices`; `--always-include-usage` sends it on every stream, for clients that expect it unasked."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from serverutil import running_server

CHAT = {"model": "m", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 6, "temperature": 0}
COMPLETION = {"model": "m", "prompt": "Hi", "max_tokens": 6, "temperature": 0}
ROUTES = [(prefix, kind) for prefix in ("/v1", "/api/v0") for kind in ("chat", "completion")]


@pytest.fixture(scope="module")
def always(tiny):
    with running_server(tiny.path, env={"TINYLOOP_ALWAYS_INCLUDE_USAGE": "1"}) as base:
        yield base


def raw_chunks(base: str, path: str, body: dict) -> list[dict]:
    """Every `data:` event of the stream but `[DONE]`, which must come last; each chunk's `choices[0]` is read."""
    text = httpx.post(f"{base}{path}", json={**body, "stream": True}, timeout=60).text
    events = [e.removeprefix("data: ") for e in text.split("\n\n") if e]
    assert events[-1] == "[DONE]" and "[DONE]" not in events[:-1]
    return [json.loads(e) for e in events[:-1]]


def sdk_text(base: str, prefix: str, kind: str, **kw) -> tuple[str, list]:
    """The text the most common streaming loop prints, and the chunks. Unless usage was asked for, the loop indexes
    `choices[0]` of every chunk."""
    with openai.OpenAI(base_url=f"{base}{prefix}", api_key="unused") as client:
        if kind == "chat":
            chunks = list(client.chat.completions.create(stream=True, **CHAT, **kw))
        else:
            chunks = list(client.completions.create(stream=True, **COMPLETION, **kw))
    chosen = [c for c in chunks if c.choices] if "stream_options" in kw else chunks
    pieces = [c.choices[0].delta.content or "" if kind == "chat" else c.choices[0].text for c in chosen]
    return "".join(pieces), chunks


def full_text(base: str, prefix: str, kind: str) -> str:
    path, body = (f"{prefix}/chat/completions", CHAT) if kind == "chat" else (f"{prefix}/completions", COMPLETION)
    choice = httpx.post(f"{base}{path}", json=body, timeout=60).json()["choices"][0]
    return choice["message"]["content"] if kind == "chat" else choice["text"]


@pytest.mark.parametrize("prefix,kind", ROUTES)
def test_unasked_the_finish_chunk_is_last(server, prefix, kind):
    text, chunks = sdk_text(server, prefix, kind)
    assert text == full_text(server, prefix, kind) and chunks[-1].choices[0].finish_reason == "length"
    assert all(c.choices and c.usage is None for c in chunks)
    path, body = (f"{prefix}/chat/completions", CHAT) if kind == "chat" else (f"{prefix}/completions", COMPLETION)
    raw = raw_chunks(server, path, body)
    assert all(c["choices"][0]["index"] == 0 and "usage" not in c for c in raw)
    assert raw[-1]["choices"][0]["finish_reason"] == "length"
    if prefix == "/api/v0":  # LM Studio's sections ride on the last chunk
        assert raw[-1]["stats"]["completion_tokens"] == 6 and "model_info" in raw[-1]


@pytest.mark.parametrize("prefix,kind", ROUTES)
def test_include_usage_adds_the_usage_chunk(server, prefix, kind):
    _, chunks = sdk_text(server, prefix, kind, stream_options={"include_usage": True})
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6
    assert chunks[-2].choices[0].finish_reason == "length" and all(c.usage is None for c in chunks[:-1])


@pytest.mark.parametrize("prefix,kind", ROUTES)
def test_always_include_usage_sends_it_unasked(always, prefix, kind):
    path, body = (f"{prefix}/chat/completions", CHAT) if kind == "chat" else (f"{prefix}/completions", COMPLETION)
    raw = raw_chunks(always, path, body)
    assert raw[-1]["choices"] == [] and raw[-1]["usage"]["completion_tokens"] == 6
    assert raw[-2]["choices"][0]["finish_reason"] == "length"
    assert all(c["usage"] is None for c in raw[:-1])
    if prefix == "/api/v0":
        assert raw[-1]["stats"]["completion_tokens"] == 6 and all("stats" not in c for c in raw[:-1])
    _, chunks = sdk_text(always, prefix, kind, stream_options={"include_usage": False})
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6  # the server's setting wins


def test_the_flag_and_its_variable(tiny):
    from tinyloop.server import cli
    from tinyloop.server.config import ServerConfig

    assert cli.parse(["--always-include-usage"]).always_include_usage
    assert not cli.parse([]).always_include_usage and "TINYLOOP_ALWAYS_INCLUDE_USAGE" in cli.env_help()
    with running_server(tiny.path, "--always-include-usage") as base:
        assert raw_chunks(base, "/v1/chat/completions", CHAT)[-1]["choices"] == []
    assert not ServerConfig().always_include_usage


def test_a_chunk_goes_out_before_the_next_is_made():
    """Only a finish_reason chunk waits (it may be the stream's last, which carries LM Studio's sections): a content
    chunk is sent before the generation makes the next one, so framing adds no token of latency."""
    import asyncio

    from tinyloop.server.openai import Framing
    from tinyloop.server.protocol import ChatCompletionRequest

    req = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "x"}])
    sent: list[bytes] = []

    class Ended:
        def error(self) -> None:
            return None

    async def chunks():
        yield [{"index": 0, "delta": {"content": "a"}, "finish_reason": None}]
        assert len(sent) == 1, "the content chunk waited for the next one"
        yield [{"index": 0, "delta": {}, "finish_reason": "length"}]
        assert len(sent) == 1  # the finish chunk is held until the end is known

    async def main():
        async for event in Framing().frame(req, "chat.completion.chunk", "chatcmpl-", Ended(), chunks()):
            sent.append(event)

    asyncio.run(main())
    assert [json.loads(e.removeprefix(b"data: "))["choices"][0]["finish_reason"] for e in sent[:2]] == [None, "length"]
    assert sent[-1] == b"data: [DONE]\n\n" and len(sent) == 3
