"""Tool calls on every family, through the official clients: the arguments stream as the model writes them (the
name first, then fragments that add up to the non-streamed call), a call cut short comes back in the family's own
shape for calls, the server's tool-call markup never reaches any text, and a forced call or a structured format
(or both) shape the output as OpenAI and Anthropic define them."""

from __future__ import annotations

import json

import anthropic
import jsonschema
import openai
import pytest

from tinyloop.server.tools import CLOSE, OPEN, CallReader

# A free string: a long call. No `additionalProperties`: the server closes the schema (docs/structured-output.md).
SAVE = {
    "name": "save",
    "description": "Save a note",
    "parameters": {"type": "object", "properties": {"text": {"type": "string", "maxLength": 40}}, "required": ["text"]},
}
ASK = [{"role": "user", "content": "Write me a note about the sea."}]
MARKUP = ("<tool", "tool_call", "</", '{"name"')


@pytest.fixture(scope="module")
def claude(server):
    with anthropic.Anthropic(base_url=server, api_key="unused") as c:
        yield c


def no_markup(text: str | None) -> bool:
    return not any(m in (text or "") for m in MARKUP)


def chat_call(client, max_tokens: int, stream: bool, **kw):
    """(content, [(id, name, arguments)], finish_reason, [argument fragments]) of a chat request forced to `save`."""
    body = dict(model="m", messages=ASK, tools=[{"type": "function", "function": SAVE}], temperature=0)
    body |= dict(tool_choice={"type": "function", "function": {"name": "save"}}, max_tokens=max_tokens) | kw
    if not stream:
        c = client.chat.completions.create(**body).choices[0]
        calls = [(t.id, t.function.name, t.function.arguments) for t in c.message.tool_calls or []]
        return c.message.content, calls, c.finish_reason, []
    content, calls, fragments, finish = "", [], [], None
    for chunk in client.chat.completions.create(stream=True, **body):
        choice = chunk.choices[0]  # every chunk has a choice: no usage chunk was asked for
        content += choice.delta.content or ""
        for d in choice.delta.tool_calls or []:
            if d.id is not None:
                assert d.function.name and d.function.arguments == "" and d.index == len(calls)
                calls.append([d.id, d.function.name, ""])
            else:
                assert d.function.name is None and d.index == len(calls) - 1
                calls[-1][2] += d.function.arguments
                fragments.append(d.function.arguments)
        finish = choice.finish_reason or finish
    return content or None, [tuple(c) for c in calls], finish, fragments


def responses_call(client, max_tokens: int, stream: bool, **kw):
    """(response, [argument fragments]) of a Responses request forced to `save`."""
    body = dict(model="m", input=ASK[0]["content"], tools=[{"type": "function", **SAVE}], temperature=0)
    body |= dict(tool_choice={"type": "function", "name": "save"}, max_output_tokens=max_tokens) | kw
    if not stream:
        return client.responses.create(**body), []
    fragments, final = [], None
    with client.responses.stream(**body) as s:
        for e in s:
            assert e.type != "response.output_text.delta" or no_markup(e.delta)
            if e.type == "response.function_call_arguments.delta":
                fragments.append(e.delta)
            if e.type in ("response.completed", "response.incomplete", "response.failed"):
                final = e.response  # the SDK's get_final_response() takes only a completed one
    return final, fragments


def messages_call(claude, max_tokens: int, stream: bool, **kw):
    """(message or its raw events, [input_json fragments]) of a Messages request forced to `save`."""
    tool = {"name": SAVE["name"], "description": SAVE["description"], "input_schema": SAVE["parameters"]}
    body = dict(model="m", messages=ASK, tools=[tool], tool_choice={"type": "tool", "name": "save"})
    body |= dict(max_tokens=max_tokens, extra_body={"temperature": 0}) | kw
    if not stream:
        return claude.messages.create(**body), []
    events = list(claude.messages.create(stream=True, **body))
    fragments = [
        e.delta.partial_json for e in events if e.type == "content_block_delta" and e.delta.type == "input_json_delta"
    ]
    return events, fragments


@pytest.fixture(scope="module")
def whole(client):
    """The forced call written to its end: its arguments, as the model writes them."""
    content, calls, finish, _ = chat_call(client, 120, stream=False)
    assert finish == "tool_calls" and content is None and [c[1] for c in calls] == ["save"]
    arguments = calls[0][2]
    assert set(json.loads(arguments)) == {"text"} and len(arguments) > 12
    return arguments


@pytest.mark.parametrize("family", ["chat", "responses", "messages"])
def test_arguments_stream_as_written_and_add_up_to_the_call(client, claude, whole, family):
    if family == "chat":
        content, calls, finish, fragments = chat_call(client, 120, stream=True)
        assert content is None and finish == "tool_calls" and calls[0][1:] == ("save", whole)
        assert calls[0][0].startswith("call_")
    elif family == "responses":
        r, fragments = responses_call(client, 120, stream=True)
        assert r.status == "completed" and [(o.type, o.name, o.arguments) for o in r.output] == [
            ("function_call", "save", whole)
        ]
    else:
        events, fragments = messages_call(claude, 120, stream=True)
        starts = [e.content_block for e in events if e.type == "content_block_start"]
        assert [(b.type, b.name, b.input) for b in starts] == [("tool_use", "save", {})]
        assert [e.delta.stop_reason for e in events if e.type == "message_delta"] == ["tool_use"]
    # One fragment per token or so, not one at the end; together, exactly the non-streamed call's arguments.
    assert len(fragments) >= 5 and "".join(fragments) == whole


@pytest.mark.parametrize("max_tokens", [1, 3, 6, 9, 12, 15, 18, 22])
def test_a_call_cut_by_max_tokens_is_the_familys_partial_call(client, claude, whole, max_tokens):
    plain = None
    for stream in (False, True):
        content, calls, finish, _ = chat_call(client, max_tokens, stream)
        assert finish == "length" and content is None, (stream, content)
        assert len(calls) <= 1 and all(name == "save" and whole.startswith(args) for _, name, args in calls)
        assert plain is None or [c[1:] for c in calls] == plain  # streamed: the same partial call
        plain = [c[1:] for c in calls]

        r, _ = responses_call(client, max_tokens, stream)
        assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
        assert [o.type for o in r.output] == ["function_call"] * len(calls)  # no message item: nothing was text
        assert [(o.name, o.arguments, o.status) for o in r.output] == [("save", a, "incomplete") for _, _, a in calls]

        m, fragments = messages_call(claude, max_tokens, stream)
        if not stream:  # a cut call has no tool_use block: its input is not a whole object
            assert m.stop_reason == "max_tokens" and m.content == []
        else:  # the stream sent what was written of the call, and then the stop reason
            assert "".join(fragments) == (calls[0][2] if calls else "")
            assert [e.delta.stop_reason for e in m if e.type == "message_delta"] == ["max_tokens"]
            assert all(e.delta.type != "text_delta" for e in m if e.type == "content_block_delta")


def test_a_stop_string_inside_a_call_leaves_no_markup(client, claude, whole):
    stop = whole[len(whole) // 2 :][:3]
    cut = whole[: whole.index(stop)]
    content, calls, finish, _ = chat_call(client, 120, stream=False, stop=[stop])
    # The call is cut short: not a call the client can make, so the turn did not end on one.
    assert content is None and finish == "stop" and [c[1:] for c in calls] == [("save", cut)]
    for stream in (False, True):
        m, fragments = messages_call(claude, 120, stream, stop_sequences=[stop])
        if not stream:
            assert m.content == [] and m.stop_reason == "stop_sequence" and m.stop_sequence == stop
        else:
            assert "".join(fragments) == cut


@pytest.mark.parametrize("family", ["chat", "responses", "messages"])
def test_a_forced_call_and_a_format_together_the_call_decides(client, claude, family):
    schema = {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]}
    if family == "chat":
        fmt = {"type": "json_schema", "json_schema": {"name": "out", "schema": schema}}
        content, calls, finish, _ = chat_call(client, 120, stream=False, response_format=fmt, tool_choice="required")
        assert content is None and finish == "tool_calls" and calls[0][1] == "save"
        arguments = json.loads(calls[0][2])
    elif family == "responses":
        fmt = {"format": {"type": "json_schema", "name": "out", "schema": schema}}
        r, _ = responses_call(client, 120, stream=False, text=fmt)
        assert r.status == "completed" and [o.type for o in r.output] == ["function_call"]
        arguments = json.loads(r.output[0].arguments)
    else:
        fmt = {"format": {"type": "json_schema", "schema": schema}}
        m, _ = messages_call(claude, 120, stream=False, output_config=fmt, tool_choice={"type": "any"})
        assert m.stop_reason == "tool_use" and [b.type for b in m.content] == ["tool_use"]
        arguments = m.content[0].input
    jsonschema.validate(arguments, {**SAVE["parameters"], "additionalProperties": False})


def test_auto_with_a_format_answers_with_a_call_or_the_document(client):
    """With tools the model may call (`auto`) and a structured format, the output is one call or the document."""
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    fmt = {"type": "json_schema", "json_schema": {"name": "out", "schema": schema}}
    seen = set()
    for seed in range(8):
        c = client.chat.completions.create(
            model="m",
            messages=ASK,
            tools=[{"type": "function", "function": SAVE}],
            response_format=fmt,
            max_tokens=60,
            temperature=1.0,
            seed=seed,
        ).choices[0]
        if c.message.tool_calls:
            assert c.finish_reason == "tool_calls" and c.message.content is None
            jsonschema.validate(json.loads(c.message.tool_calls[0].function.arguments), SAVE["parameters"])
            seen.add("call")
        elif c.finish_reason == "stop":
            jsonschema.validate(json.loads(c.message.content), {**schema, "additionalProperties": False})
            seen.add("document")
        assert no_markup(c.message.content)
    assert seen


def test_the_reader_drops_markup_whatever_ends_the_text():
    """Auto mode, where the model writes freely: a block that opens a call is never content, the held start of a
    marker is content only when the model itself ended there, and a block that is not a call is dropped."""
    cases = [
        ("Hi <tool_ca", False, "Hi <tool_ca", []),  # the model ended there: it wrote text
        ("Hi <tool_ca", True, "Hi ", []),  # max_tokens cut the marker
        (f"Hi {OPEN}" + '{"name": "sa', True, "Hi ", []),  # the head unfinished: no call
        (f"Hi {OPEN}" + '{"name": "save", "arguments": {"text": "a', True, "Hi ", [("save", '{"text": "a', False)]),
        (f"{OPEN}not a call{CLOSE} after", False, " after", []),
        (f"{OPEN}" + '{"name": "f", "arguments": {"a": 1} }' + f"{CLOSE}x{OPEN}", True, "x", [("f", '{"a": 1}', True)]),
    ]
    for text, cut, content, calls in cases:
        for at in range(len(text) + 1):
            reader = CallReader()
            events = reader.feed(text[:at]) + reader.feed(text[at:]) + reader.finish(cut=cut)
            assert "".join(e.text for e in events if e.kind == "text") == content, (text, at)
            assert [(c.name, c.arguments, c.complete) for c in reader.calls] == calls, (text, at)


def test_parallel_false_keeps_the_first_call_only():
    reader = CallReader(parallel=False)
    one = OPEN + '{"name": "a", "arguments": {}}' + CLOSE
    two = OPEN + '{"name": "b", "arguments": {"x": 1}}' + CLOSE
    events = reader.feed(one + " and " + two) + reader.finish()
    assert [c.name for c in reader.calls] == ["a"] and "".join(e.text for e in events if e.kind == "text") == " and "


def test_an_anthropic_custom_tool_with_cache_control(claude):
    """The anthropic SDK's own `ToolParam` shape (`type: "custom"`) and prompt-caching breakpoints (accepted: the
    prompt cache reuses prefixes unasked)."""
    tool = {
        "type": "custom",
        "name": "save",
        "input_schema": SAVE["parameters"],
        "cache_control": {"type": "ephemeral"},
        "strict": True,
    }
    system = [{"type": "text", "text": "You take notes.", "cache_control": {"type": "ephemeral", "ttl": "5m"}}]
    m = claude.messages.create(
        model="m",
        max_tokens=80,
        system=system,
        messages=ASK,
        tools=[tool],
        tool_choice={"type": "tool", "name": "save"},
    )
    assert m.stop_reason == "tool_use" and m.content[0].name == "save" and set(m.content[0].input) == {"text"}
    with pytest.raises(anthropic.BadRequestError) as e:
        claude.messages.create(
            model="m", max_tokens=8, messages=ASK, tools=[{**tool, "type": "bash_20250124", "name": "bash"}]
        )
    assert e.value.status_code == 400 and "tools.0" in e.value.body["error"]["message"]


def test_include_on_responses(client):
    """`include: []` (the Agents SDK sends it on every call) and null ask for nothing; reasoning.encrypted_content is
    empty for a model that does not reason; what the server cannot give is refused by name."""
    base = dict(model="m", input="Hi", max_output_tokens=4, temperature=0)
    want = client.responses.create(**base).output_text
    for include in ([], None, ["reasoning.encrypted_content"]):
        r = client.responses.create(**base, include=include)
        assert r.output_text == want and [o.type for o in r.output] == ["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(**base, include=["message.output_text.logprobs"])
    assert e.value.status_code == 400 and e.value.body["param"] == "include.0"
