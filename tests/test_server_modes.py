"""Server start-up variants: API key, a model that fails to load."""

from __future__ import annotations

import httpx
import openai
import pytest

from serverutil import running_server


def test_api_key_guards_every_route_but_health(tiny):
    with running_server(tiny.path, "--api-key", "sekret") as base:
        assert httpx.get(f"{base}/health").json() == {"status": "ok"}
        bad = openai.OpenAI(base_url=f"{base}/v1", api_key="wrong")
        with pytest.raises(openai.AuthenticationError) as e:
            bad.models.list()
        assert e.value.status_code == 401 and "API key" in e.value.message
        assert httpx.get(f"{base}/metrics").status_code == 401
        good = openai.OpenAI(base_url=f"{base}/v1", api_key="sekret")
        assert good.completions.create(model="m", prompt="x", max_tokens=2).usage.completion_tokens == 2


def test_failed_model_load_still_serves_503(tmp_path):
    bad = tmp_path / "broken.tinyloop"
    bad.write_bytes(b"not a model")
    with running_server(bad, expect_health=503) as base:
        health = httpx.get(f"{base}/health")
        assert health.status_code == 503 and "not a GGUF file" in health.json()["reason"]
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0)
        with pytest.raises(openai.InternalServerError) as e:
            client.completions.create(model="m", prompt="x")
        assert e.value.status_code == 503 and "Engine not loaded" in e.value.message
        assert client.models.list().data[0].id == str(bad)


def test_int8_kv_mode_from_the_environment(tiny):
    with running_server(tiny.path, env={"TINYLOOP_KV_INT8": "1"}) as base:
        r = httpx.post(f"{base}/api/v0/completions", json={"model": "m", "prompt": "x", "max_tokens": 4}, timeout=30)
        assert r.json()["model_info"]["kv_cache_mode"] == "int8" and r.json()["usage"]["completion_tokens"] == 4


def test_unavailable_kv_mode_is_a_clear_load_error(tiny):
    with running_server(tiny.path, env={"TINYLOOP_KV_INT4": "1"}, expect_health=503) as base:
        assert "int4" in httpx.get(f"{base}/health").json()["reason"]
    with running_server(tiny.path, env={"TINYLOOP_KV_H_MODE": "1"}, expect_health=503) as base:
        assert "TINYLOOP_KV_INT4" in httpx.get(f"{base}/health").json()["reason"]
