"""Server start-up variants: API key, a model that fails to load."""

from __future__ import annotations

import os
import subprocess
import sys

import httpx
import openai
import pytest

from serverutil import running_server


def test_api_key_guards_every_route_but_health(tiny):
    with running_server(tiny.path, "--api-key", "sekret") as base:
        assert httpx.get(f"{base}/health").json() == {"status": "ok", "device": "cpu"}
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
        assert client.models.list().data[0].id == "broken"  # the file's stem: no filesystem path in an id


def test_the_model_id_is_the_file_stem(tiny):
    with running_server(tiny.path) as base:
        ids = [m["id"] for m in httpx.get(f"{base}/v1/models").json()["data"]]
        assert ids == [tiny.path.stem] and "/" not in ids[0]
        body = {"model": "anything", "prompt": "x", "max_tokens": 2}
        assert httpx.post(f"{base}/v1/completions", json=body, timeout=30).json()["model"] == "anything"


@pytest.mark.parametrize(
    "args,env,mode",
    [
        ([], {"TINYLOOP_KV_INT8": "1"}, "int8"),
        ([], {"TINYLOOP_KV_INT4": "1"}, "int4"),
        ([], {"TINYLOOP_KV_INT4": "1", "TINYLOOP_KV_H_MODE": "1"}, "int4-h"),
        ([], {"TINYLOOP_KV_CACHE": "int8"}, "int8"),
        (["--kv-cache", "int4-h"], {}, "int4-h"),
        (["--kv-cache", "int4"], {"TINYLOOP_KV_CACHE": "int8"}, "int4"),  # the flag wins
    ],
)
def test_kv_mode_from_the_flag_or_the_environment(tiny, args, env, mode):
    """The KV-cache modes, served: the reported mode, and the same greedy tokens as the engine in that mode."""
    import tinyloop

    want = (
        tinyloop.Engine(tiny.path, kv_cache_mode=mode)
        .generate("x", tinyloop.SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True), loops=3)
        .tokens
    )
    with running_server(tiny.path, *args, env=env) as base:
        r = httpx.post(f"{base}/generate", json={"prompt": "x", "max_tokens": 6, "loops": 3}, timeout=30).json()
        assert r["tokens"][: len(want)] == want[: len(r["tokens"])] and len(r["tokens"]) >= 1
        info = httpx.post(
            f"{base}/api/v0/completions", json={"model": "m", "prompt": "x", "max_tokens": 2}, timeout=30
        ).json()["model_info"]
        assert info["kv_cache_mode"] == mode


@pytest.mark.parametrize(
    "env,words",
    [
        ({"TINYLOOP_KV_H_MODE": "1"}, ["--kv-h-mode", "TINYLOOP_KV_INT4"]),
        ({"TINYLOOP_KV_INT4": "1", "TINYLOOP_KV_INT8": "1"}, ["choose one"]),
        ({"TINYLOOP_KV_CACHE": "int3"}, ["--kv-cache / TINYLOOP_KV_CACHE", "'int3'", "int4-h"]),
        ({"TINYLOOP_KV_CACHE": "int8", "TINYLOOP_KV_INT4": "1"}, ["--kv-cache alone"]),
    ],
)
def test_bad_kv_settings_stop_the_server_naming_them(tiny, env, words):
    """A KV-cache mode that cannot be, from the variables as from the flags: exit 2 with one line naming them."""
    out = subprocess.run(
        [sys.executable, "-m", "tinyloop.server.cli", "--model", str(tiny.path)],
        env={k: v for k, v in os.environ.items() if not k.startswith("TINYLOOP_")} | env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2 and all(w in out.stderr for w in words), out.stderr
    assert "Traceback" not in out.stderr


def test_every_flag_has_an_environment_variable(monkeypatch):
    from tinyloop.server.cli import parse

    monkeypatch.setenv("TINYLOOP_HOST", "127.0.0.2")
    monkeypatch.setenv("TINYLOOP_PORT", "8123")
    monkeypatch.setenv("TINYLOOP_LOG_LEVEL", "warning")
    args = parse([])
    assert (args.host, args.port, args.log_level) == ("127.0.0.2", 8123, "warning")
    args = parse(["--host", "127.0.0.3", "--port", "9000", "--log-level", "debug"])
    assert (args.host, args.port, args.log_level) == ("127.0.0.3", 9000, "debug")


@pytest.mark.parametrize(
    "env,word", [({"TINYLOOP_PORT": "80000"}, "TINYLOOP_PORT"), ({"TINYLOOP_LOG_LEVEL": "loud"}, "TINYLOOP_LOG_LEVEL")]
)
def test_bad_environment_values_are_usage_errors(env, word, monkeypatch, capsys):
    from tinyloop.server.cli import parse

    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(SystemExit) as e:
        parse([])
    assert e.value.code == 2 and word in capsys.readouterr().err


def test_cache_window_is_served(tiny):
    """cache_window reaches the engine on /generate and /api/v0: the tokens are the engine's with that window."""
    import tinyloop

    prompt = [(i * 131 + 7) % 50000 for i in range(30)]
    engine = tinyloop.Engine(tiny.path)
    params = tinyloop.SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    windowed = engine.generate(prompt, params, loops=3, cache_window=3).tokens
    assert windowed != engine.generate(prompt, params, loops=3).tokens
    with running_server(tiny.path) as base:
        native = httpx.post(
            f"{base}/generate",
            json={"prompt": prompt, "max_tokens": 8, "loops": 3, "top_k": 0, "top_p": 1.0, "cache_window": 3},
            timeout=30,
        ).json()
        assert native["tokens"][: len(windowed)] == windowed[: len(native["tokens"])]
        lm = httpx.post(
            f"{base}/api/v0/completions",
            json={"model": "m", "prompt": prompt, "max_tokens": 8, "temperature": 0, "loops": 3, "cache_window": 3},
            timeout=30,
        ).json()
        assert lm["choices"][0]["text"] == engine.decode(windowed[: lm["usage"]["completion_tokens"]])
        bad = httpx.post(f"{base}/api/v0/completions", json={"model": "m", "prompt": "x", "cache_window": -1})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "cache_window"


def test_threads_flag_sets_the_engine_threads_and_not_the_tokens(tiny, tiny_engine):
    from tinyloop import SamplingParams

    want = tiny_engine.generate("Threads", SamplingParams(temperature=0.0, max_tokens=12), loops=4).text
    for threads in ("1", "3"):
        with running_server(tiny.path, "--threads", threads) as base:
            assert httpx.get(f"{base}/metrics/json").json()["tinyloop_threads"] == int(threads)
            body = {"prompt": "Threads", "max_tokens": 12, "temperature": 0, "loops": 4}
            assert httpx.post(f"{base}/generate", json=body, timeout=60).json()["text"] == want


@pytest.mark.parametrize(
    "args,env", [(["--threads", "0"], {}), (["--threads", "two"], {}), ([], {"TINYLOOP_THREADS": "-1"})]
)
def test_bad_thread_counts_are_usage_errors(args, env, monkeypatch, capsys):
    from tinyloop.server.cli import parse

    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(SystemExit) as e:
        parse(args)
    assert e.value.code == 2 and "threads" in capsys.readouterr().err.lower()
