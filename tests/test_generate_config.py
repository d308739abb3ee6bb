"""`--generate-config`: server-side defaults for the sampling fields and loops a request leaves out, on every API
family; a request's own value wins, `stop: []` clears a default stop, and a bad file stops the server from
starting with a message naming the field."""

from __future__ import annotations

import json

import httpx
import pytest

from serverutil import running_server
from tinyloop import SamplingParams
from tinyloop.server import cli

PROMPT = "The sea and the boat"


@pytest.fixture(scope="module")
def greedy(tiny_engine):
    return tiny_engine.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True), loops=3)


@pytest.fixture(scope="module")
def server(tiny, greedy, tmp_path_factory):
    stop = greedy.text[len(greedy.text) // 3 :][:3]  # three characters from the middle of the greedy answer
    config = tmp_path_factory.mktemp("config") / "generate.json"
    config.write_text(json.dumps({"temperature": 0, "max_tokens": 12, "loops": 3, "stop": [stop], "seed": 11}))
    with running_server(tiny.path, "--generate-config", str(config)) as base:
        yield base, stop


def completion(base, **fields) -> dict:
    r = httpx.post(f"{base}/v1/completions", json={"model": "m", "prompt": PROMPT, "ignore_eos": True} | fields)
    assert r.status_code == 200, r.text
    return r.json()


def test_defaults_fill_what_a_request_leaves_out(server, greedy):
    base, stop = server
    cut = greedy.text[: greedy.text.index(stop)]
    out = completion(base)  # temperature 0, loops 3, max_tokens 12 and the stop, all from the file
    assert out["choices"][0]["text"] == cut and out["choices"][0]["finish_reason"] == "stop"
    full = completion(base, stop=[])  # an empty stop list clears the default
    assert full["choices"][0]["text"] == greedy.text and full["usage"]["completion_tokens"] == 12
    assert completion(base, stop=None)["choices"][0]["text"] == cut  # null is "not sent": the default applies
    assert completion(base, stop=[], max_tokens=5)["usage"]["completion_tokens"] == 5  # the request's value wins
    shallow = completion(base, stop=[], loops=1)["choices"][0]["text"]
    assert shallow == explicit_generate(base, loops=1)


def explicit_generate(base, loops: int) -> str:
    """The same prompt through /generate with every field explicit (no default involved)."""
    body = {"prompt": PROMPT, "max_tokens": 12, "loops": loops, "temperature": 0, "stop": [], "ignore_eos": True}
    return httpx.post(f"{base}/generate", json=body).json()["text"]


def test_every_family_takes_the_defaults_under_its_own_names(server, greedy):
    base, stop = server
    cut = greedy.text[: greedy.text.index(stop)]
    native = httpx.post(f"{base}/generate", json={"prompt": PROMPT, "ignore_eos": True}).json()
    assert native["text"] == cut and native["finish_reason"] == "stop"
    messages = [{"role": "user", "content": PROMPT}]
    anthropic = httpx.post(f"{base}/v1/messages", json={"model": "m", "max_tokens": 12, "messages": messages}).json()
    explicit = httpx.post(
        f"{base}/v1/messages",
        json={
            "model": "m",
            "max_tokens": 12,
            "messages": messages,
            "temperature": 0,
            "loops": 3,
            "stop_sequences": [stop],
        },
    ).json()
    assert anthropic["content"] == explicit["content"] and anthropic["stop_reason"] == explicit["stop_reason"]
    responses = httpx.post(f"{base}/v1/responses", json={"model": "m", "input": PROMPT}).json()
    assert responses["usage"]["output_tokens"] <= 12  # max_tokens arrives as max_output_tokens
    sampled = {"prompt": PROMPT, "temperature": 0.9, "max_tokens": 12, "stop": [], "ignore_eos": True}
    seeded = httpx.post(f"{base}/generate", json=sampled).json()["tokens"]
    assert seeded == httpx.post(f"{base}/generate", json=sampled | {"sample_seed": 11}).json()["tokens"]


@pytest.mark.parametrize(
    "body,words",
    [
        ({"temp": 1}, ["temp", "is not a generation default", "temperature"]),
        ({"temperature": 3}, ["temperature", "between"]),
        ({"top_k": "5"}, ["top_k", "integer"]),
        ("not json", ["not JSON"]),
    ],
)
def test_a_bad_config_stops_the_server_from_starting(tmp_path, monkeypatch, caplog, body, words):
    path = tmp_path / "bad.json"
    path.write_text(body if isinstance(body, str) else json.dumps(body))
    monkeypatch.setenv("TINYLOOP_GENERATE_CONFIG", "")  # restored after the test: main() sets it
    assert cli.main(["--generate-config", str(path)]) == 2
    assert all(w in caplog.text for w in words), caplog.text


def test_defaults_apply_where_a_family_has_no_field_for_them(tiny, tmp_path):
    """A model file's (or the server's) penalties shape every family, those without the field included: chat,
    Responses and Messages give the text /api/v0 gives with the same values sent explicitly."""
    config = tmp_path / "penalties.json"
    config.write_text(json.dumps({"temperature": 0, "frequency_penalty": 2.0, "repetition_penalty": 1.8}))
    ask = "Tell me about the sea"
    messages = [{"role": "user", "content": ask}]
    explicit = {"model": "m", "messages": messages, "max_tokens": 16, "temperature": 0}
    with running_server(tiny.path, "--generate-config", str(config)) as base:

        def post(path: str, body: dict) -> dict:
            r = httpx.post(f"{base}{path}", json=body, timeout=60)
            assert r.status_code == 200, r.text
            return r.json()

        want = post("/api/v0/chat/completions", explicit | {"frequency_penalty": 2.0, "repetition_penalty": 1.8})
        plain = post("/api/v0/chat/completions", explicit | {"frequency_penalty": 0.0, "repetition_penalty": 1.0})
        want, plain = want["choices"][0]["message"]["content"], plain["choices"][0]["message"]["content"]
        assert want != plain  # the penalties change this answer: the comparison below can fail
        chat = post("/v1/chat/completions", {"model": "m", "messages": messages, "max_tokens": 16})
        responses = post("/v1/responses", {"model": "m", "input": ask, "max_output_tokens": 16})
        claude = post("/v1/messages", {"model": "m", "messages": messages, "max_tokens": 16})
        assert chat["choices"][0]["message"]["content"] == want
        assert responses["output"][0]["content"][0]["text"] == want
        assert claude["content"][0]["text"] == want
        # A request's own value still wins where its family has the field.
        own = post("/v1/chat/completions", explicit | {"frequency_penalty": 0.0})
        mixed = post("/api/v0/chat/completions", explicit | {"frequency_penalty": 0.0, "repetition_penalty": 1.8})
        assert own["choices"][0]["message"]["content"] == mixed["choices"][0]["message"]["content"]
