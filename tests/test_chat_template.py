"""A model file's own chat template (`tokenizer.chat_template`, Jinja): carried by the file, rendered by every chat
family as Hugging Face's `apply_chat_template` would render it (checked against Jinja itself), refused cleanly when
the template refuses a conversation, sandboxed; files without one keep the "Role: content" template."""

from __future__ import annotations

import httpx
import jinja2
import pytest

import tinyloop
from conftest import TINY
from serverutil import running_server
from tinyloop.modelfile.format import random_weights, write_model
from tinyloop.server.template import DEFAULT_STOP, ChatFormat

TEMPLATE = (
    "{% if messages[0]['role'] == 'assistant' %}{{ raise_exception('the first turn must not be the assistant') }}"
    "{% endif %}"
    "{% if tools %}<|tools|>{% for t in tools %}{{ t.function.name }};{% endfor %}\n{% endif %}"
    "{% for m in messages %}<|{{ m.role }}|>\n{{ m.content }}"
    "{% if m.tool_calls %}{% for c in m.tool_calls %}<call>{{ c.function.name }}"
    "({{ c.function.arguments.city }})</call>{% endfor %}{% endif %}<|end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
TOOL = {"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}


@pytest.fixture(scope="module")
def templated(tmp_path_factory):
    path = tmp_path_factory.mktemp("templated") / "templated.tinyloop"
    write_model(path, TINY, random_weights(TINY, seed=3), chat_template=TEMPLATE)
    return path


def _reference(messages: list[dict], tools: list[dict] | None = None) -> str:
    """The template rendered by Jinja directly, with apply_chat_template's settings."""
    env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)
    return env.from_string(TEMPLATE).render(messages=messages, tools=tools, add_generation_prompt=True)


def test_the_file_carries_its_template(templated, tiny):
    engine = tinyloop.Engine(templated)
    assert engine.chat_template == TEMPLATE
    assert tinyloop.Engine(tiny.path).chat_template is None
    assert ChatFormat(engine).stops == [] and ChatFormat(tinyloop.Engine(tiny.path)).stops == DEFAULT_STOP


def test_every_family_renders_the_files_template(templated):
    engine = tinyloop.Engine(templated)
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Oslo?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Oslo"}'}}
            ],
        },
        {"role": "tool", "content": "Sunny", "tool_call_id": "c1"},
    ]
    parsed = [dict(m) for m in messages]
    parsed[2] = {**messages[2], "tool_calls": [{**messages[2]["tool_calls"][0]}]}
    parsed[2]["tool_calls"][0]["function"] = {"name": "weather", "arguments": {"city": "Oslo"}}
    want = len(engine.encode(_reference(parsed, [TOOL])))
    with running_server(templated) as base:
        body = {"model": "m", "messages": messages, "tools": [TOOL], "max_tokens": 2, "temperature": 0}
        chat = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=30).json()
        assert chat["usage"]["prompt_tokens"] == want
        plain = [{"role": "user", "content": "Hello there"}]
        want_plain = len(engine.encode(_reference(plain)))
        msgs = {"model": "m", "messages": plain}
        counted = httpx.post(f"{base}/v1/messages/count_tokens", json=msgs, timeout=30).json()
        assert counted["input_tokens"] == want_plain
        resp = httpx.post(f"{base}/v1/responses", json={"model": "m", "input": "Hello there", "max_output_tokens": 2})
        assert resp.json()["usage"]["input_tokens"] == want_plain


def test_a_refusing_or_unsafe_template_is_a_400(templated, tmp_path):
    with running_server(templated) as base:
        body = {"model": "m", "messages": [{"role": "assistant", "content": "Hi"}], "max_tokens": 2}
        r = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=30)
        assert r.status_code == 400
        error = r.json()["error"]
        assert error["param"] == "messages" and "the first turn must not be the assistant" in error["message"]
        ok = {**body, "messages": [{"role": "user", "content": "Hi"}]}
        assert httpx.post(f"{base}/v1/chat/completions", json=ok, timeout=30).status_code == 200
    unsafe = tmp_path / "unsafe.tinyloop"
    write_model(
        unsafe, TINY, random_weights(TINY, seed=4), chat_template="{{ ''.__class__.__mro__[1].__subclasses__() }}"
    )
    with running_server(unsafe) as base:
        r = httpx.post(f"{base}/v1/chat/completions", json={**body, "messages": [{"role": "user", "content": "x"}]})
        assert r.status_code == 400 and "chat template" in r.json()["error"]["message"]


def test_control_tokens_the_template_writes_are_tokens(tmp_path):
    """A template that closes turns with `eos_token` puts the end-of-text token itself in the prompt, not the
    characters of its name, in every chat family."""
    path = tmp_path / "eos.tinyloop"
    source = "{% for m in messages %}{{ m.role }}: {{ m.content }}{{ eos_token }}\n{% endfor %}assistant:"
    write_model(path, TINY, random_weights(TINY, seed=5), chat_template=source)
    engine = tinyloop.Engine(path)
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]
    text = jinja2.Environment().from_string(source).render(messages=messages, eos_token="<|endoftext|>")
    ids = engine.encode(text, allow_special=True)
    assert ids.count(engine.eos_token_id) == 2 and len(ids) < len(engine.encode(text))
    with running_server(path) as base:
        body = {"model": "m", "messages": messages, "max_tokens": 1, "temperature": 0}
        chat = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=30).json()
        assert chat["usage"]["prompt_tokens"] == len(ids)
        counted = httpx.post(f"{base}/v1/messages/count_tokens", json={"model": "m", "messages": messages[:1]})
        assert counted.json()["input_tokens"] == len(engine.encode(text.split("\n")[0] + "\nassistant:", True))
        resp = httpx.post(f"{base}/v1/responses", json={"model": "m", "input": messages, "max_output_tokens": 1})
        assert resp.json()["usage"]["input_tokens"] == len(ids)
