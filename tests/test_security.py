"""Who may use the server and how much: API keys (several, from a file, either header), every route guarded but
/health, the loopback default, limits on tokens and wall time, and no request ever seeing another's tokens."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

import tinyloop
from serverutil import running_server
from tinyloop import SamplingParams
from tinyloop.server import cli

GUARDED = [
    ("GET", "/metrics"),
    ("GET", "/metrics/json"),
    ("GET", "/openapi.json"),
    ("GET", "/docs"),
    ("GET", "/v1/models"),
    ("GET", "/api/v0/models"),
    ("POST", "/v1/completions"),
    ("POST", "/generate"),
    ("GET", "/no/such/route"),
]


def test_several_keys_from_flags_and_a_file_guard_every_route_but_health(tiny, tmp_path):
    keys = tmp_path / "keys"
    keys.write_text("# team keys\nfile-key-1\n\n  file-key-2  \n")
    with running_server(
        tiny.path,
        "--api-key",
        "flag-a",
        "--api-key",
        "flag-b",
        "--api-key-file",
        str(keys),
        env={"TINYLOOP_API_KEY": "env-key"},
    ) as base:
        assert httpx.get(f"{base}/health").json() == {"status": "ok", "device": "cpu"}
        for method, path in GUARDED:
            for headers in (
                {},
                {"authorization": "Bearer wrong"},
                {"authorization": "Bearer flag-a-"},
                {"authorization": "flag-a"},
                {"x-api-key": "nope"},
            ):
                r = httpx.request(method, f"{base}{path}", headers=headers, json={}, timeout=10)
                assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", (path, headers)
        # Flags win over the environment; each flag key, each file key, either header form.
        assert httpx.get(f"{base}/v1/models", headers={"authorization": "Bearer env-key"}).status_code == 401
        for headers in (
            {"authorization": "Bearer flag-a"},
            {"authorization": "bearer flag-b"},
            {"authorization": "Bearer file-key-1"},
            {"x-api-key": "file-key-2"},
        ):
            assert httpx.get(f"{base}/openapi.json", headers=headers, timeout=10).status_code == 200
        r = httpx.post(
            f"{base}/generate",
            json={"prompt": "x", "max_tokens": 2},
            headers={"authorization": "Bearer file-key-2"},
            timeout=30,
        )
        assert len(r.json()["tokens"]) == 2


@pytest.fixture
def own_environ(monkeypatch):
    """`cli.main` writes its flags into the environment: give it a copy, without TINYLOOP_ variables."""
    import os

    monkeypatch.setattr(os, "environ", {k: v for k, v in os.environ.items() if not k.startswith("TINYLOOP_")})


def test_an_unreadable_key_file_refuses_to_start(tmp_path, caplog, own_environ):
    assert cli.main(["--api-key-file", str(tmp_path / "missing")]) == 2
    assert "API key file" in caplog.text


class FakeGranian:
    def __init__(self, *args, **kwargs):
        FakeGranian.kwargs = kwargs

    def serve(self):
        pass


@pytest.mark.parametrize(
    "host,key,warns",
    [
        ("127.0.0.1", None, False),
        ("::1", None, False),
        ("localhost", None, False),
        ("0.0.0.0", None, True),
        ("192.0.2.7", None, True),
        ("0.0.0.0", "k", False),
    ],
)
def test_binding_beyond_loopback_without_a_key_warns(monkeypatch, caplog, own_environ, host, key, warns):
    import granian

    monkeypatch.setattr(granian, "Granian", FakeGranian)  # nothing is bound: only the decision is tested
    argv = ["--host", host] + (["--api-key", key] if key else [])
    assert cli.main(argv) == 0
    assert FakeGranian.kwargs["address"] == host
    assert ("without an API key" in caplog.text) == warns


def test_default_bind_is_loopback():
    assert cli.parse([]).host == "127.0.0.1"


def test_max_tokens_ceiling_and_wall_time_limit(tiny_long):
    with running_server(tiny_long.path, "--max-tokens-limit", "64", "--request-timeout", "0.5") as base:
        r = httpx.post(f"{base}/v1/completions", json={"model": "m", "prompt": "x", "max_tokens": 65}, timeout=10)
        assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens" and "64" in r.text
        assert (
            httpx.post(f"{base}/generate", json={"prompt": "x", "max_tokens": 65}).json()["error"]["param"]
            == "max_tokens"
        )
    with running_server(tiny_long.path, "--request-timeout", "0.5") as base:
        r = httpx.post(f"{base}/generate", json={"prompt": "x", "max_tokens": 8000, "loops": 64}, timeout=30).json()
        assert r["finish_reason"] == "aborted" and 0 < len(r["tokens"]) < 8000
        deadline = time.monotonic() + 10  # the engine thread updates its gauges just after handing out the end
        while httpx.get(f"{base}/metrics/json").json()["tinyloop_requests_running"] != 0:
            assert time.monotonic() < deadline, "the aborted request still counts as running"
            time.sleep(0.01)


def test_batched_requests_never_see_each_others_tokens(tiny):
    """Sixteen concurrent streams, sampled with their own seeds and penalties, batched step by step: each one's
    tokens are exactly those of the same request run alone in a fresh engine."""
    engine = tinyloop.Engine(tiny.path)
    bodies = [
        {
            "prompt": f"secret {i} " * (1 + i % 3),
            "max_tokens": 24,
            "temperature": 0.9,
            "sample_seed": 100 + i,
            "top_k": 0,
            "top_p": 1.0,
            "repetition_penalty": 1.0 + 0.05 * (i % 4),
            "loops": 2 + i % 4,
        }
        for i in range(16)
    ]
    want = [
        engine.generate(
            b["prompt"],
            SamplingParams(
                temperature=b["temperature"],
                seed=b["sample_seed"],
                top_k=0,
                top_p=1.0,
                max_tokens=24,
                repetition_penalty=b["repetition_penalty"],
            ),
            loops=b["loops"],
        ).tokens
        for b in bodies
    ]
    got: dict[int, list[int]] = {}
    with running_server(tiny.path) as base:
        barrier = threading.Barrier(len(bodies))

        def call(i: int) -> None:
            barrier.wait()
            got[i] = httpx.post(f"{base}/generate", json=bodies[i], timeout=60).json()["tokens"]

        threads = [threading.Thread(target=call, args=(i,)) for i in range(len(bodies))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert [got[i] for i in range(len(bodies))] == want
