"""Structured output, function tools and the field policy on `/v1`, through the official `openai` SDK: documents
the schema allows, calls whose arguments match their function's parameters, and every field either implemented,
refused by name, or on the documented list of accepted-and-ignored fields."""

from __future__ import annotations

import json
import re
import typing
from pathlib import Path

import httpx
import jsonschema
import pytest
from openai.types import completion_create_params
from openai.types.chat import completion_create_params as chat_create_params
from pydantic import BaseModel, Field

from tinyloop import SamplingParams
from tinyloop.server.protocol import ChatCompletionRequest, ChatMessage, CompletionRequest
from tinyloop.server.template import render_chat
from tinyloop.server.tools import CallReader, ToolUse

DOCS = Path(__file__).resolve().parents[1] / "docs"
CHAT = {"model": "m", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "temperature": 0}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 12},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"enum": ["UTC", "CET"]}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}


def post(server: str, body: dict, path: str = "/v1/chat/completions") -> httpx.Response:
    return httpx.post(f"{server}{path}", json=body, timeout=60)


class Pet(BaseModel):
    name: str = Field(max_length=10)
    legs: int = Field(ge=0, le=8)
    kind: typing.Literal["cat", "dog", "bird"]


@pytest.mark.parametrize("seed", [None, 1, 2])
def test_parse_with_a_pydantic_model(client, seed):
    kw = {"temperature": 0} if seed is None else {"temperature": 1.0, "seed": seed}
    out = client.chat.completions.parse(
        model="m", messages=[{"role": "user", "content": "A pet?"}], response_format=Pet, max_tokens=80, **kw
    )
    choice = out.choices[0]
    assert choice.finish_reason == "stop" and isinstance(choice.message.parsed, Pet)
    assert choice.message.parsed == Pet.model_validate_json(choice.message.content)


def test_json_schema_streams_the_same_document_and_completions_take_it_too(client):
    schema = {**Pet.model_json_schema(), "additionalProperties": False}  # as OpenAI's strict mode asks
    fmt = {"type": "json_schema", "json_schema": {"name": "pet", "schema": schema, "strict": True}}
    kw = dict(model="m", max_tokens=80, temperature=0, response_format=fmt)
    full = client.chat.completions.create(messages=[{"role": "user", "content": "A pet?"}], **kw)
    chunks = list(client.chat.completions.create(messages=[{"role": "user", "content": "A pet?"}], stream=True, **kw))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == full.choices[0].message.content
    Pet.model_validate_json(streamed)
    text = client.completions.create(
        model="m", prompt="A pet:", max_tokens=80, temperature=0, extra_body={"response_format": fmt}
    )
    assert text.choices[0].finish_reason == "stop"
    Pet.model_validate_json(text.choices[0].text)


def test_json_object_is_an_object_and_a_cut_one_says_length(server):
    r = post(server, {**CHAT, "max_tokens": 6, "response_format": {"type": "json_object"}}).json()
    choice = r["choices"][0]
    assert choice["finish_reason"] == "length" and choice["message"]["content"].startswith("{")


def test_bad_formats_are_refused_naming_the_cause(server):
    bad_schema = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "array", "uniqueItems": True}}}
    err = post(server, {**CHAT, "response_format": bad_schema}).json()["error"]
    assert err["param"] == "response_format" and "uniqueItems" in err["message"]
    err = post(server, {**CHAT, "response_format": {"type": "json_schema"}}).json()["error"]
    assert err["param"] == "response_format" and "json_schema is required" in err["message"]
    r = post(server, {**CHAT, "response_format": {"type": "json_object"}, "min_tokens": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "min_tokens"


def arguments_of(call, tool):
    assert call.type == "function" and call.id.startswith("call_")
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, tool["function"]["parameters"])
    return args


@pytest.mark.parametrize("stream", [False, True])
def test_required_tool_call_round_trip(client, stream):
    messages = [{"role": "user", "content": "Weather in Oslo?"}]
    kw = dict(model="m", tools=[WEATHER, TIME], tool_choice="required", max_tokens=60, temperature=0)
    full = client.chat.completions.create(messages=messages, **kw)
    choice = full.choices[0]
    assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
    call = choice.message.tool_calls[0]
    arguments_of(call, WEATHER if call.function.name == "get_weather" else TIME)
    if stream:
        chunks = list(
            client.chat.completions.create(messages=messages, stream=True, stream_options={"include_usage": True}, **kw)
        )
        deltas = [d for c in chunks if c.choices for d in (c.choices[0].delta.tool_calls or [])]
        # The name comes first, then the arguments as they are written: they add up to the call's arguments.
        first, rest = deltas[0], deltas[1:]
        assert (first.index, first.id, first.function.name, first.function.arguments) == (
            0,
            first.id,
            call.function.name,
            "",
        ) and first.id.startswith("call_")
        assert len(rest) >= 4 and all(d.index == 0 and d.function.name is None and d.id is None for d in rest)
        assert "".join(d.function.arguments for d in rest) == call.function.arguments
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    # The call and its result go back into the conversation; the model then answers.
    messages += [
        choice.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "Sunny"},
    ]
    answer = client.chat.completions.create(
        model="m", messages=messages, tools=[WEATHER, TIME], max_tokens=8, temperature=0
    )
    assert answer.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert answer.usage.prompt_tokens > full.usage.prompt_tokens


def test_a_named_function_is_the_one_called(client):
    named = {"type": "function", "function": {"name": "get_time"}}
    out = client.chat.completions.create(
        model="m",
        messages=[{"role": "user", "content": "Time?"}],
        tools=[WEATHER, TIME],
        tool_choice=named,
        max_tokens=40,
    )
    call = out.choices[0].message.tool_calls[0]
    assert call.function.name == "get_time" and arguments_of(call, TIME)["zone"] in ("UTC", "CET")


def test_tool_prompt_and_auto_mode_parsing(server, tiny_engine):
    """With `auto` the model writes freely; whatever it writes is content unless it is a well-formed call."""
    req = ChatCompletionRequest.model_validate({**CHAT, "tools": [WEATHER]})
    prompt = render_chat(req.messages, req.tool_use())
    assert prompt.startswith("System: You can call these functions: {") and prompt.endswith("User: Hi\nAssistant:")
    r = post(server, {**CHAT, "tools": [WEATHER], "max_tokens": 12}).json()
    want = tiny_engine.generate(tiny_engine.encode(prompt), SamplingParams(temperature=0.0, max_tokens=12)).text
    assert r["choices"][0]["message"]["content"] == want.lstrip() and "tool_calls" not in r["choices"][0]["message"]
    # The reader, fed a stream cut anywhere, finds the calls; no block of tool-call markup is ever content.
    text = (
        'Sure. <tool_call>{"name": "get_weather", "arguments": {"city": "Os}lo\\"", "days": 2}}</tool_call> <tool'
        '<tool_call>{bad</tool_call><tool_call>{"arguments": {}, "name": "f"}</tool_call>'
        '<tool_call>{"name": "cut", "arguments": {"a": [1, '
    )
    for cut in range(1, len(text)):
        reader = CallReader()
        events = reader.feed(text[:cut]) + reader.feed(text[cut:]) + reader.finish()
        assert "".join(e.text for e in events if e.kind == "text") == "Sure.  <tool"
        assert [(c.name, c.arguments, c.complete) for c in reader.calls] == [
            ("get_weather", '{"city": "Os}lo\\"", "days": 2}', True),
            ("f", "{}", True),
            ("cut", '{"a": [1, ', False),
        ]
        fragments = ["".join(e.text for e in events if e.kind == "args" and e.call is c) for c in reader.calls]
        assert fragments == [c.arguments for c in reader.calls]
    calls = [{"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}]
    turn = ChatMessage.model_validate({"role": "assistant", "content": None, "tool_calls": calls})
    assert render_chat([turn]) == 'Assistant: <tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>\nAssistant:'
    assert ToolUse.of(None, "none", None) is None


@pytest.mark.parametrize(
    "change,param",
    [
        ({"tools": [{"type": "web_search", "function": {"name": "x"}}]}, "tools.0.type"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"messages": [{"role": "tool", "content": "x"}]}, "messages.0.tool_call_id"),
        ({"messages": [{"role": "user", "content": "x", "tool_call_id": "c"}]}, "messages.0.tool_call_id"),
        ({"reasoning_effort": "high"}, "reasoning_effort"),
        ({"include_reasoning": True}, "include_reasoning"),
        ({"chat_template_kwargs": {"foo": 1}}, "chat_template_kwargs.foo"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"top_k": -1}, "top_k"),
    ],
)
def test_unsupported_or_inconsistent_values_are_refused_by_name(server, change, param):
    r = post(server, {**CHAT, **change})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_accepted_values_that_ask_for_nothing(server):
    base = post(server, CHAT).json()["choices"][0]["message"]["content"]
    for change in (
        {"reasoning_effort": "none", "include_reasoning": False, "chat_template_kwargs": {"enable_thinking": False}},
        {"user": "u1", "metadata": {"k": "v"}, "store": False, "safety_identifier": "s", "prompt_cache_key": "k"},
        {"service_tier": "auto", "parallel_tool_calls": True, "tool_choice": "none"},
        {"temperature": None, "top_p": None, "seed": None, "stop": None, "min_tokens": None, "ignore_eos": None},
    ):
        body = {**CHAT, **change}
        if body["temperature"] is None:
            body["top_k"] = 1  # null temperature is the default 1.0; top_k 1 keeps it greedy
        r = post(server, body)
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == base, (change, r.text)


def test_top_k_is_honoured(server):
    texts = {
        post(server, {**CHAT, "max_tokens": 12, "temperature": 1.0, "top_k": 1, "seed": s}).json()["choices"][0][
            "message"
        ]["content"]
        for s in (1, 2, 3)
    }
    assert texts == {post(server, {**CHAT, "max_tokens": 12}).json()["choices"][0]["message"]["content"]}


def _sdk_fields(params_type) -> set[str]:
    return set(typing.get_type_hints(params_type)) | {"stream"}


@pytest.mark.parametrize(
    "path,params_type,model",
    [
        ("/v1/chat/completions", chat_create_params.CompletionCreateParamsBase, ChatCompletionRequest),
        ("/v1/completions", completion_create_params.CompletionCreateParamsBase, CompletionRequest),
    ],
)
def test_every_sdk_field_is_implemented_refused_or_documented(server, path, params_type, model):
    """Walk the openai SDK's request type: a field the schema does not declare is refused with 400 naming it; the
    declared ones that change nothing are listed in docs/api.md."""
    body = {**CHAT} if "chat" in path else {"model": "m", "prompt": "Hi", "max_tokens": 4}
    declared = set(model.model_fields)
    for name in sorted(_sdk_fields(params_type) - declared):
        r = post(server, {**body, name: {"probe": True}}, path)
        assert r.status_code == 400 and r.json()["error"]["param"] == name, (name, r.text)
    api = (DOCS / "api.md").read_text()
    for name in ("user", "metadata", "store", "safety_identifier", "prompt_cache_key", "service_tier"):
        assert name in declared and f"`{name}`" in api.split("Accepted and ignored")[1].split("\n\n")[0]


def test_chat_logprobs_equal_the_engines_scores_streamed_or_not(client, tiny_engine):
    kw = dict(model="m", messages=[{"role": "user", "content": "Hi"}], max_tokens=12, temperature=0, stop=[])
    full = client.chat.completions.create(logprobs=True, top_logprobs=2, **kw)
    content = full.choices[0].logprobs.content
    prompt = tiny_engine.encode(render_chat([ChatMessage(role="user", content="Hi")]))
    out = tiny_engine.generate(prompt, SamplingParams(temperature=0.0, max_tokens=12))
    want = tiny_engine.score(prompt + out.tokens, [3])[0][0][len(prompt) - 1 :]
    assert len(content) == 12 and [c.logprob for c in content] == pytest.approx(want, abs=1e-4)
    assert [bytes(c.bytes) for c in content] == [tiny_engine.token_bytes(t) for t in out.tokens]
    assert all(len(c.top_logprobs) == 2 and c.top_logprobs[0].logprob == pytest.approx(c.logprob) for c in content)
    chunks = list(client.chat.completions.create(logprobs=True, top_logprobs=2, stream=True, **kw))
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in content]
    plain = client.chat.completions.create(**kw).choices[0]
    assert plain.logprobs is None and plain.message.content == full.choices[0].message.content


def test_completion_logprobs_in_openais_lists(client, tiny_engine):
    out = client.completions.create(model="m", prompt="Hello", max_tokens=6, temperature=0, logprobs=1)
    lp = out.choices[0].logprobs
    assert "".join(lp.tokens) == out.choices[0].text and len(lp.token_logprobs) == 6
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(6)]
    assert all(
        len(top) == 1 and max(top.values()) >= lp.token_logprobs[i] - 1e-6 for i, top in enumerate(lp.top_logprobs)
    )
    chunks = list(
        client.completions.create(model="m", prompt="Hello", max_tokens=6, temperature=0, logprobs=1, stream=True)
    )
    streamed = [v for c in chunks if c.choices and c.choices[0].logprobs for v in c.choices[0].logprobs.token_logprobs]
    assert streamed == lp.token_logprobs


@pytest.mark.parametrize("stream", [False, True])
def test_echo_returns_the_prompt_and_its_log_probabilities(client, tiny_engine, stream):
    kw = dict(model="m", prompt="Echo this prompt", max_tokens=5, temperature=0)
    plain = client.completions.create(**kw).choices[0].text
    if stream:
        chunks = list(client.completions.create(echo=True, logprobs=2, stream=True, **kw))
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        lists = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs]
        token_logprobs = [v for lp in lists for v in lp.token_logprobs]
        offsets = [v for lp in lists for v in lp.text_offset]
    else:
        choice = client.completions.create(echo=True, logprobs=2, **kw).choices[0]
        text, token_logprobs, offsets = choice.text, choice.logprobs.token_logprobs, choice.logprobs.text_offset
    assert text == "Echo this prompt" + plain
    ids = tiny_engine.encode("Echo this prompt")
    out = tiny_engine.generate(ids, SamplingParams(temperature=0.0, max_tokens=5))
    want = tiny_engine.score(ids + out.tokens, [3])[0][0]
    assert token_logprobs[0] is None and len(token_logprobs) == len(ids) + 5
    assert token_logprobs[1:] == pytest.approx(want, abs=1e-4)
    assert offsets[0] == 0 and offsets[len(ids)] == len("Echo this prompt")
    echoed = client.completions.create(echo=True, **kw).choices[0]
    assert echoed.text == "Echo this prompt" + plain and echoed.logprobs is None


def test_a_schema_without_additional_properties_is_closed():
    """As llama.cpp's schema-to-grammar and xgrammar's strict mode read it: listed properties mean those keys only,
    at every depth; `true` keeps free keys, a bare object stays any object, values are not schemas."""
    from tinyloop.server.structured import closed

    item = {"type": "object", "properties": {"x": {"type": "integer"}}}
    schema = {
        "type": "object",
        "properties": {
            "items": {"type": "array", "items": item},
            "pair": {"type": "array", "prefixItems": [item, {"type": "string"}]},
            "either": {"anyOf": [item, {"type": "null"}]},
            "free": {"type": "object", "properties": {"a": {}}, "additionalProperties": True},
            "map": {"type": "object", "additionalProperties": item},
            "any": {"type": "object"},
            "ref": {"$ref": "#/$defs/D"},
            "merged": {"allOf": [item, {"properties": {"y": {}}}]},
            "const": {"const": {"properties": {"k": 1}}},
        },
        "$defs": {"D": {"properties": {"d": {}}}},
    }
    out = closed(schema)
    p = out["properties"]
    assert out["additionalProperties"] is False and out["$defs"]["D"]["additionalProperties"] is False
    assert p["items"]["items"]["additionalProperties"] is False
    assert p["pair"]["prefixItems"][0]["additionalProperties"] is False
    assert p["either"]["anyOf"][0]["additionalProperties"] is False
    assert (
        p["free"]["additionalProperties"] is True and p["map"]["additionalProperties"]["additionalProperties"] is False
    )
    assert p["any"] == {"type": "object"} and p["ref"] == {"$ref": "#/$defs/D"}
    assert "additionalProperties" not in p["merged"] and "additionalProperties" not in p["merged"]["allOf"][0]
    assert p["const"] == schema["properties"]["const"]
    assert "additionalProperties" not in schema  # the request's own schema is left as it was


@pytest.mark.parametrize("where", ["response_format", "tools"])
def test_listed_properties_are_the_only_keys(client, where):
    """Sampled outputs under a schema that leaves out `additionalProperties`: never a key it does not list."""
    params = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "boolean"}}, "required": []}
    kw: dict = dict(model="m", messages=[{"role": "user", "content": "Hi"}], max_tokens=40, temperature=1.5)
    if where == "response_format":
        kw["response_format"] = {"type": "json_schema", "json_schema": {"name": "o", "schema": params}}
    else:
        kw |= dict(
            tools=[{"type": "function", "function": {"name": "f", "parameters": params}}], tool_choice="required"
        )
    keys: set[str] = set()
    for seed in range(12):
        m = client.chat.completions.create(seed=seed, **kw).choices[0]
        text = m.message.content if where == "response_format" else m.message.tool_calls[0].function.arguments
        keys |= set(re.findall(r'"((?:[^"\\]|\\.)*)": ', text))  # complete or cut by max_tokens
    assert keys and keys <= {"a", "b"}
