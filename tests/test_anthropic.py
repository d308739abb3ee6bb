"""The Anthropic Messages family through the official `anthropic` SDK: text, streaming, tool use round trips,
structured output, stop sequences, token counting, and errors in Anthropic's shape."""

from __future__ import annotations

import json
import typing

import anthropic
import httpx
import jsonschema
import pytest
from anthropic.types import message_create_params

from serverutil import running_server
from tinyloop import SamplingParams
from tinyloop.server.anthropic import MessagesRequest
from tinyloop.server.template import render_chat

GREEDY = {"temperature": 0}
HELLO = [{"role": "user", "content": "Hello there"}]
WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 12}},
        "required": ["city"],
        "additionalProperties": False,
    },
}


@pytest.fixture(scope="module")
def client(server):
    with anthropic.Anthropic(base_url=server, api_key="unused") as c:
        yield c


def prompt_ids(tiny_engine, body: dict) -> list[int]:
    req = MessagesRequest.model_validate({"model": "m", "max_tokens": 1, **body})
    return tiny_engine.encode(render_chat(req.conversation(), req.tool_use()))


def test_text_streamed_or_not_is_the_engines_greedy_text(client, tiny_engine):
    m = client.messages.create(model="m", max_tokens=16, messages=HELLO, extra_body=GREEDY)
    ids = prompt_ids(tiny_engine, {"messages": HELLO})
    want = tiny_engine.generate(ids, SamplingParams(temperature=0.0, max_tokens=16)).text.lstrip()
    assert m.type == "message" and m.role == "assistant" and m.content[0].type == "text"
    assert m.content[0].text == want and m.stop_reason == "max_tokens" and m.stop_sequence is None
    assert (m.usage.input_tokens, m.usage.output_tokens) == (len(ids), 16)
    with client.messages.stream(model="m", max_tokens=16, messages=HELLO, extra_body=GREEDY) as s:
        text = "".join(s.text_stream)
        final = s.get_final_message()
    assert text == want and final.content[0].text == want and final.stop_reason == "max_tokens"
    assert final.usage.output_tokens == 16
    counted = client.messages.count_tokens(model="m", messages=HELLO)
    assert counted.input_tokens == m.usage.input_tokens == len(ids)


def test_stream_event_sequence(server):
    body = {"model": "m", "max_tokens": 6, "messages": HELLO, "stream": True, **GREEDY}
    raw = httpx.post(f"{server}/v1/messages", json=body, timeout=60).text
    names = [line[len("event: ") :] for line in raw.splitlines() if line.startswith("event: ")]
    assert names[:3] == ["message_start", "ping", "content_block_start"]
    assert set(names[3:-3]) == {"content_block_delta"} and names[-3:] == [
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    datas = [json.loads(line[len("data: ") :]) for line in raw.splitlines() if line.startswith("data: ")]
    assert [d["type"] for d in datas] == names
    assert datas[-2]["delta"]["stop_reason"] == "max_tokens" and datas[-2]["usage"]["output_tokens"] == 6


def test_stop_sequences_end_the_text_and_are_named(client):
    free = client.messages.create(model="m", max_tokens=30, messages=HELLO, extra_body=GREEDY).content[0].text
    stop = free[8:11]
    m = client.messages.create(model="m", max_tokens=30, messages=HELLO, stop_sequences=[stop], extra_body=GREEDY)
    assert m.content[0].text == free[: free.index(stop)]
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == stop


@pytest.mark.parametrize("stream", [False, True])
def test_tool_use_round_trip(client, tiny_engine, stream):
    kw = dict(model="m", max_tokens=40, messages=[{"role": "user", "content": "Weather in Oslo?"}], tools=[WEATHER])
    forced = {"type": "tool", "name": "get_weather"}
    if stream:
        with client.messages.stream(tool_choice=forced, **kw) as s:
            m = s.get_final_message()
    else:
        m = client.messages.create(tool_choice=forced, **kw)
    assert m.stop_reason == "tool_use" and [b.type for b in m.content] == ["tool_use"]
    use = m.content[0]
    assert use.name == "get_weather" and use.id.startswith("toolu_")
    jsonschema.validate(use.input, WEATHER["input_schema"])
    result = [{"type": "tool_result", "tool_use_id": use.id, "content": "Sunny"}]
    turn = [b.model_dump(exclude_none=True) for b in m.content]
    messages = [*kw["messages"], {"role": "assistant", "content": turn}, {"role": "user", "content": result}]
    follow = client.messages.create(**{**kw, "messages": messages, "max_tokens": 4})
    # Anthropic's split: prefilled input plus what the prompt cache supplied (the first turn's tokens) is the prompt.
    total = follow.usage.input_tokens + follow.usage.cache_read_input_tokens
    assert total == len(prompt_ids(tiny_engine, {"messages": messages, "tools": [WEATHER]}))
    assert follow.usage.cache_read_input_tokens > 0 and follow.usage.cache_creation_input_tokens == 0
    first = m.usage.input_tokens + (m.usage.cache_read_input_tokens or 0)
    assert total > first and follow.stop_reason in (
        "max_tokens",
        "end_turn",
        "tool_use",
    )


def test_structured_output(client):
    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["n"],
        "additionalProperties": False,
    }
    m = client.messages.create(
        model="m", max_tokens=30, messages=HELLO, output_config={"format": {"type": "json_schema", "schema": schema}}
    )
    assert m.stop_reason == "end_turn"
    jsonschema.validate(json.loads(m.content[0].text), schema)


def test_errors_have_anthropics_shape(client, server):
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(
            model="m", max_tokens=8, messages=HELLO, thinking={"type": "enabled", "budget_tokens": 1024}
        )
    assert e.value.body == {
        "type": "error",
        "error": {"type": "invalid_request_error", "message": e.value.body["error"]["message"]},
    }
    assert "thinking" in e.value.body["error"]["message"]
    assert (
        client.messages.create(
            model="m", max_tokens=2, messages=HELLO, thinking={"type": "disabled"}
        ).usage.output_tokens
        == 2
    )
    r = httpx.post(
        f"{server}/v1/messages", json={"model": "m", "messages": HELLO}, timeout=10
    )  # max_tokens is required
    assert r.status_code == 400 and r.json()["type"] == "error" and "max_tokens" in r.json()["error"]["message"]
    r = httpx.post(f"{server}/v1/messages", content=b"{", headers={"content-type": "application/json"}, timeout=10)
    assert r.status_code == 400 and r.json()["type"] == "error"


def test_every_sdk_field_is_implemented_refused_or_documented(server):
    declared = set(MessagesRequest.model_fields)
    base = {"model": "m", "max_tokens": 2, "messages": HELLO}
    for name in sorted(set(typing.get_type_hints(message_create_params.MessageCreateParamsBase)) - declared):
        r = httpx.post(f"{server}/v1/messages", json={**base, name: {"probe": True}}, timeout=10)
        assert r.status_code == 400 and f"unsupported parameter: {name}" in r.json()["error"]["message"], (name, r.text)


def test_loop_knobs_and_speculative_drafting_give_the_plain_greedy_text(client):
    kw = dict(model="m", max_tokens=12, messages=HELLO)
    deep = client.messages.create(**kw, extra_body={**GREEDY, "loops": 5}).content[0].text
    assert deep != client.messages.create(**kw, extra_body={**GREEDY, "loops": 1}).content[0].text
    drafted = client.messages.create(**kw, extra_body={**GREEDY, "loops": 5, "draft_loops": 1}).content[0].text
    assert drafted == deep


def test_api_keys_by_x_api_key_and_errors_in_anthropics_shape(tiny):
    with running_server(tiny.path, "--api-key", "sk-anthropic-test") as base:
        body = {"model": "m", "max_tokens": 2, "messages": HELLO}
        r = httpx.post(f"{base}/v1/messages", json=body, timeout=10)
        assert r.status_code == 401 and r.json()["type"] == "error"
        assert r.json()["error"]["type"] == "authentication_error"
        with anthropic.Anthropic(base_url=base, api_key="sk-anthropic-test") as keyed:  # sends x-api-key
            assert keyed.messages.create(**body).usage.output_tokens == 2
        with anthropic.Anthropic(base_url=base, api_key="wrong") as wrong, pytest.raises(anthropic.AuthenticationError):
            wrong.messages.create(**body)
