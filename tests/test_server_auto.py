"""`loops: "auto"` served: every family takes it (with `min_loops`, `max_loops`, `exit_threshold`), produces what
`Engine.generate` produces under the same rule, reports the mean loops in `stats`, and refuses what does not go
with it by name."""

from __future__ import annotations

import anthropic
import httpx
import openai
import pytest

import tinyloop
from serverutil import running_server
from tinyloop import AutoDepth, SamplingParams

RULE = {"loops": "auto", "min_loops": 2, "max_loops": 5, "exit_threshold": 0.02}
ENGINE_RULE = AutoDepth(min_loops=2, max_loops=5, threshold=0.02)


@pytest.fixture(scope="module")
def server(tiny):
    with running_server(tiny.path) as base:
        yield base


@pytest.fixture(scope="module")
def engine(tiny):
    return tinyloop.Engine(tiny.path)


def _want(engine, prompt: str, n: int):
    return engine.generate(prompt, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True), loops=ENGINE_RULE)


def test_completions_and_native_match_the_engine(server, engine):
    want = _want(engine, "The capital of France", 12)
    assert want.auto_loops[0] == 11 and want.auto_loops[1] < 11 * 5  # some tokens stopped before max_loops
    body = {"model": "m", "prompt": "The capital of France", "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    v1 = httpx.post(f"{server}/v1/completions", json=body | RULE, timeout=60).json()
    assert v1["choices"][0]["text"] == want.text
    v0 = httpx.post(f"{server}/api/v0/completions", json=body | RULE, timeout=60).json()
    assert v0["choices"][0]["text"] == want.text
    tokens, loops = want.auto_loops
    assert v0["stats"]["mean_loops"] == round(loops / tokens, 3) and v0["stats"]["adaptive_tokens"] == tokens
    assert v0["stats"]["loops_used"] == 5
    native = {"prompt": "The capital of France", "max_tokens": 12, "ignore_eos": True} | RULE
    out = httpx.post(f"{server}/generate", json=native, timeout=60).json()
    assert out["text"] == want.text


def test_chat_families_agree(server):
    chat = openai.OpenAI(base_url=f"{server}/v1", api_key="x").chat.completions.create(
        model="m", messages=[{"role": "user", "content": "Hello"}], max_tokens=10, temperature=0, extra_body=RULE
    )
    messages = anthropic.Anthropic(base_url=server, api_key="x").messages.create(
        model="m", messages=[{"role": "user", "content": "Hello"}], max_tokens=10, extra_body=RULE | {"temperature": 0}
    )
    responses = openai.OpenAI(base_url=f"{server}/v1", api_key="x").responses.create(
        model="m", input="Hello", max_output_tokens=10, temperature=0, extra_body=RULE
    )
    text = chat.choices[0].message.content
    assert text and messages.content[0].text == text and responses.output_text == text


@pytest.mark.parametrize(
    "path,body,param",
    [
        ("/v1/completions", {"prompt": "x", "min_loops": 2}, "min_loops"),
        ("/v1/completions", {"prompt": "x", "loops": 4, "exit_threshold": 0.1}, "exit_threshold"),
        ("/v1/completions", {"prompt": "x", "loops": "auto", "min_loops": 6, "max_loops": 3}, "min_loops"),
        ("/v1/completions", {"prompt": "x", "loops": "auto", "exit_threshold": -1}, "exit_threshold"),
        ("/api/v0/completions", {"prompt": "x", "loops": "auto", "mode": "speculative"}, "draft_loops"),
        (
            "/api/v0/completions",
            {"prompt": "x", "loops": "auto", "mode": "tree_speculative", "temperature": 0},
            "loops",
        ),
        ("/api/v0/completions", {"prompt": "x", "loops": "auto", "mode": "speculative", "max_loops": 4}, "max_loops"),
        ("/generate/tree_speculative", {"prompt": "x", "loops": "auto"}, "loops"),
        ("/v1/responses", {"input": "x", "loops": "auto", "draft_loops": 2}, "draft_loops"),
    ],
)
def test_what_does_not_go_with_auto_is_refused_by_name(server, path, body, param):
    native = path.startswith("/generate")  # the native shape has no `model`
    r = httpx.post(f"{server}{path}", json=body if native else {"model": "m"} | body, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_speculative_under_auto_gives_the_plain_auto_output(server):
    """Drafts below the first loop a token may stop at, verified row by row under the rule: the same greedy tokens
    (and loops) as plain adaptive decoding, with the draft counters."""
    rule = {"loops": "auto", "min_loops": 3, "exit_threshold": 0.02}
    body = {"model": "m", "prompt": "The capital of France", "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    plain = httpx.post(f"{server}/api/v0/completions", json=body | rule | {"max_loops": 5}, timeout=60).json()
    spec = body | rule | {"mode": "speculative", "draft_loops": 2, "verify_loops": 5, "draft_ahead": 3}
    drafted = httpx.post(f"{server}/api/v0/completions", json=spec, timeout=60).json()
    assert drafted["choices"][0]["text"] == plain["choices"][0]["text"]
    assert drafted["stats"]["mean_loops"] == plain["stats"]["mean_loops"]
    assert drafted["stats"]["mode"] == "speculative" and drafted["stats"]["total_draft_tokens_count"] > 0
    messages = {"model": "m", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 10, "temperature": 0}
    with_drafts = messages | rule | {"max_loops": 5, "draft_loops": 2}
    a = httpx.post(f"{server}/v1/messages", json=messages | rule | {"max_loops": 5}, timeout=60).json()
    b = httpx.post(f"{server}/v1/messages", json=with_drafts, timeout=60).json()
    assert a["content"] == b["content"] and a["content"][0]["text"]


def test_a_word_other_than_auto_is_a_schema_error(server):
    r = httpx.post(f"{server}/v1/completions", json={"model": "m", "prompt": "x", "loops": "deep"}, timeout=30)
    assert r.status_code == 422 and "loops" in r.text
