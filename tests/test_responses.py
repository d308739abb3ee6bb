"""The Responses family through the official `openai` SDK: text, the streamed event sequence, structured output,
function-call round trips, and the fields it refuses."""

from __future__ import annotations

import json
import typing

import httpx
import jsonschema
import pytest
from openai.types.responses import response_create_params
from pydantic import BaseModel, Field

from tinyloop import SamplingParams
from tinyloop.server.responses import ResponsesRequest
from tinyloop.server.template import render_chat

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 12}},
        "required": ["city"],
        "additionalProperties": False,
    },
}


def prompt_ids(tiny_engine, body: dict) -> list[int]:
    req = ResponsesRequest.model_validate({"model": "m", **body})
    return tiny_engine.encode(render_chat(req.conversation(), req.tool_use()))


def test_text_streamed_or_not(client, tiny_engine):
    kw = dict(model="m", input="Once upon a time", instructions="Be brief.", max_output_tokens=16, temperature=0)
    r = client.responses.create(**kw)
    ids = prompt_ids(tiny_engine, {"input": "Once upon a time", "instructions": "Be brief."})
    want = tiny_engine.generate(ids, SamplingParams(temperature=0.0, max_tokens=16)).text.lstrip()
    assert r.output_text == want and r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert (r.usage.input_tokens, r.usage.output_tokens, r.usage.total_tokens) == (len(ids), 16, len(ids) + 16)
    assert r.usage.input_tokens_details.cached_tokens == 0 and r.usage.output_tokens_details.reasoning_tokens == 0
    events = list(client.responses.create(stream=True, **kw))
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",
    ]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == want
    assert events[-1].response.output[0].content[0].text == want and events[-1].response.usage.output_tokens == 16


class Pet(BaseModel):
    name: str = Field(max_length=10)
    legs: int = Field(ge=0, le=8)


def test_structured_output_with_parse_and_stream(client):
    p = client.responses.parse(model="m", input="A pet?", text_format=Pet, max_output_tokens=80, temperature=0)
    assert p.status == "completed" and isinstance(p.output_parsed, Pet)
    with client.responses.stream(model="m", input="A pet?", text_format=Pet, max_output_tokens=80, temperature=0) as s:
        final = s.get_final_response()
    assert final.output_parsed == p.output_parsed and final.output_text == p.output_text


@pytest.mark.parametrize("stream", [False, True])
def test_function_call_round_trip(client, tiny_engine, stream):
    kw = dict(model="m", input="Weather in Oslo?", tools=[WEATHER], max_output_tokens=60, temperature=0)
    if stream:
        with client.responses.stream(tool_choice={"type": "function", "name": "get_weather"}, **kw) as s:
            seen = list(s)
            r = s.get_final_response()
        kinds = [e.type for e in seen]
        deltas = kinds.count("response.function_call_arguments.delta")
        # The arguments stream as they are written, not in one delta at the end.
        assert deltas >= 4 and kinds[2:] == [
            "response.output_item.added",
            *["response.function_call_arguments.delta"] * deltas,
            "response.function_call_arguments.done",
            "response.output_item.done",
            "response.completed",
        ]
        fragments = "".join(e.delta for e in seen if e.type == "response.function_call_arguments.delta")
        assert fragments == r.output[0].arguments
    else:
        r = client.responses.create(tool_choice="required", **kw)
    assert r.status == "completed" and [o.type for o in r.output] == ["function_call"]
    call = r.output[0]
    assert call.name == "get_weather" and call.call_id.startswith("call_")
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    items = [
        {"role": "user", "content": "Weather in Oslo?"},
        {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny"},
    ]
    follow = client.responses.create(**{**kw, "input": items, "max_output_tokens": 4})
    assert follow.usage.input_tokens == len(prompt_ids(tiny_engine, {"input": items, "tools": [WEATHER]}))
    assert follow.usage.input_tokens > r.usage.input_tokens


@pytest.mark.parametrize(
    "change,param",
    [
        ({"store": True}, "store"),
        ({"reasoning": {"effort": "high"}}, "reasoning.effort"),
        ({"previous_response_id": "resp_1"}, "previous_response_id"),
        ({"tools": [{**WEATHER, "type": "web_search"}]}, "tools.0.type"),
    ],
)
def test_refused_by_name(server, change, param):
    r = httpx.post(
        f"{server}/v1/responses", json={"model": "m", "input": "x", "max_output_tokens": 2, **change}, timeout=10
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_every_sdk_field_is_implemented_refused_or_documented(server):
    declared = set(ResponsesRequest.model_fields)
    for name in sorted(set(typing.get_type_hints(response_create_params.ResponseCreateParamsBase)) - declared):
        r = httpx.post(f"{server}/v1/responses", json={"model": "m", "input": "x", name: {"probe": True}}, timeout=10)
        assert r.status_code == 400 and r.json()["error"]["param"] == name, (name, r.text)


def test_compaction_keeps_the_latest_turns_within_the_budget(client, server):
    words = "the quick brown fox jumps over the lazy dog".split()
    items: list[dict] = []
    for i in range(12):
        items.append(
            {"role": "user" if i % 2 == 0 else "assistant", "content": f"turn {i}: " + " ".join(words[i % 4 :])}
        )
        if i == 5:
            items.append(
                {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Oslo"}'}
            )
            items.append({"type": "function_call_output", "call_id": "call_1", "output": "Sunny"})
    body = {"model": "m", "input": items, "instructions": "Be brief.", "max_input_tokens": 120}
    out = httpx.post(f"{server}/v1/responses/compact", json=body, timeout=30).json()
    assert (
        out["object"] == "response.compaction" and out["usage"]["input_tokens"] > 120 >= out["usage"]["output_tokens"]
    )
    window = out["output"]
    assert window[0]["role"] == "developer" and window[0]["content"].startswith("Summary of the earlier conversation")
    kept = window[1:]
    assert kept == items[len(items) - len(kept) :] and len(kept) >= 2  # the latest items, verbatim
    assert kept[0].get("type") != "function_call_output"
    # The digest: one line per dropped item, the newest kept when not all fit.
    lines = window[0]["content"].splitlines()[1:]
    dropped = items[: len(items) - len(kept)]
    last = dropped[-1]
    said = f"a function returned: {last['output']}" if "output" in last else f"{last['role']}: {last['content']}"
    assert 1 <= len(lines) <= len(dropped) and lines[-1] == said
    # The next response takes the window as its input: its prompt is exactly the window's count.
    r = client.responses.create(model="m", input=window, instructions="Be brief.", max_output_tokens=2)
    assert r.usage.input_tokens == out["usage"]["output_tokens"]
    small = httpx.post(f"{server}/v1/responses/compact", json={**body, "input": items[-2:]}, timeout=30).json()
    assert small["output"] == items[-2:] and small["usage"]["input_tokens"] == small["usage"]["output_tokens"]
    r = httpx.post(f"{server}/v1/responses/compact", json={**body, "max_input_tokens": 5}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_input_tokens"


def test_loop_knobs_and_speculative_drafting_give_the_plain_greedy_text(client, server):
    kw = dict(model="m", input="Knobs", max_output_tokens=12, temperature=0)
    deep = client.responses.create(**kw, extra_body={"loops": 5}).output_text
    assert deep != client.responses.create(**kw, extra_body={"loops": 1}).output_text  # the depth is honoured
    drafted = client.responses.create(**kw, extra_body={"loops": 5, "draft_loops": 2, "draft_ahead": 3}).output_text
    assert drafted == deep
    r = httpx.post(f"{server}/v1/responses", json={**kw, "loops": 2, "draft_loops": 2}, timeout=10)
    assert r.status_code == 400 and r.json()["error"]["param"] == "draft_loops"
