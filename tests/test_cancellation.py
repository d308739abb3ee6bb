"""200 clients leave at random points while the server is under load; each departure cancels its generation.

The points: while the request waits in the queue (no byte answered yet), during a long prompt's prefill, mid-stream
after a random number of events, during self-speculative rounds, and while a non-streamed answer is being made.
Each close is timed by the server's own gauges, not by sleeps, so the test does not depend on the machine's speed.
Afterwards: every cancelled request left the engine within 2 steps of the server seeing the client go, the gauges
are back to idle, and a greedy request gives the same tokens as a fresh engine.
"""

from __future__ import annotations

import json
import random
import socket
import time

import httpx
import pytest

import tinyloop
from serverutil import running_server
from tinyloop import SamplingParams

LOAD = 3  # long streams that keep the engine busy throughout
# No trial may end by itself before the client leaves: no end-of-text, no stop string (the chat trial's are off).
LONG = {"max_tokens": 8000, "loops": 16, "ignore_eos": True}
# The streamed trials (path, body, the body's seed field): a sampled chat stream and a speculative one, each request
# seeded by its trial.
STREAMED = {
    "stream": (
        "/v1/chat/completions",
        {"model": "m", "stream": True, "temperature": 0.8, "stop": [], "messages": [{"role": "user", "content": "hi"}]}
        | LONG,
        "seed",
    ),
    "speculative": (
        "/generate/speculative",
        {
            "prompt": "spec",
            "stream": True,
            "draft_loops": 2,
            "verify_loops": 16,
            "max_tokens": 8000,
            "ignore_eos": True,
        },
        "sample_seed",
    ),
}


def metrics(base: str) -> dict:
    return httpx.get(f"{base}/metrics/json", timeout=10).json()


def wait_for(base: str, what: str, cond, seconds: float = 30.0) -> dict:
    deadline = time.time() + seconds
    while True:
        m = metrics(base)
        if cond(m):
            return m
        assert time.time() < deadline, (
            f"{what}: {m['tinyloop_requests_running']} running, {m['tinyloop_requests_waiting']} waiting"
        )
        time.sleep(0.01)


def open_request(base: str, path: str, body: dict) -> socket.socket:
    host, port = base.removeprefix("http://").split(":")
    data = json.dumps(body).encode()
    s = socket.create_connection((host, int(port)), timeout=30)
    s.sendall(
        f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(data)}\r\n\r\n".encode()
        + data
    )
    return s


def read_events(s: socket.socket, n: int) -> None:
    """Read until `n` SSE events have arrived."""
    seen = b""
    while seen.count(b"data: ") < n:
        chunk = s.recv(65536)
        assert chunk, "the server closed the stream early"
        seen += chunk


def running(n: int):
    return lambda m: m["tinyloop_requests_running"] == n and m["tinyloop_requests_waiting"] == 0


@pytest.fixture(scope="module")
def server(tiny_long):
    with running_server(tiny_long.path, "--max-running", str(LOAD + 1)) as base:
        yield base


def test_200_disconnects_at_random_points_under_load(server, tiny_long):
    opened: list[socket.socket] = []  # closed at the end, whatever happens: no socket outlives the test

    def request(path: str, body: dict) -> socket.socket:
        opened.append(open_request(server, path, body))
        return opened[-1]

    try:
        rng = random.Random(1234)
        load = [request("/generate", {"prompt": f"load {i}", "stream": True, **LONG}) for i in range(LOAD)]
        for s in load:
            read_events(s, 1)
        wait_for(server, "load running", running(LOAD))
        start = metrics(server)
        closes = 0
        kinds = ["queued", "prefill", "stream", "speculative", "whole"]
        for trial in range(200):
            kind = kinds[trial % len(kinds)]
            if kind == "queued":  # a fourth stream takes the last slot, so the trial waits; neither is answered yet
                blocker = request("/generate", {"prompt": "block", "stream": True, **LONG})
                wait_for(server, "blocker running", running(LOAD + 1))
                s = request("/v1/completions", {"model": "m", "prompt": "queued", **LONG})
                wait_for(server, "trial queued", lambda m: m["tinyloop_requests_waiting"] == 1)
                s.close()
                wait_for(server, "queued trial dropped", lambda m: m["tinyloop_requests_waiting"] == 0)
                blocker.close()
                closes += 2
            else:
                if kind == "prefill":  # 1,000 prompt tokens: four prefill chunks
                    prompt = [rng.randrange(50000) for _ in range(1000)]
                    s = request("/generate", {"prompt": prompt, **LONG, "max_tokens": 6000})
                    wait_for(server, "prefill running", running(LOAD + 1))
                elif kind in STREAMED:  # closed after 1..19 events of its stream
                    path, body, seed = STREAMED[kind]
                    s = request(path, body | {seed: trial})
                    read_events(s, rng.randrange(1, 20))
                else:  # non-streamed: nothing is answered until the whole generation is done
                    s = request("/generate", {"prompt": "whole", **LONG})
                    wait_for(server, "whole running", running(LOAD + 1))
                s.close()
                closes += 1
            wait_for(server, f"trial {trial} ({kind}) still running", running(LOAD))
        end = metrics(server)
        assert end["tinyloop_client_disconnects_total"] - start["tinyloop_client_disconnects_total"] == closes
        steps = {
            k: end["tinyloop_cancel_steps_bucket"][k] - start["tinyloop_cancel_steps_bucket"].get(k, 0.0)
            for k in end["tinyloop_cancel_steps_bucket"]
        }
        # Every close reached the engine, which dropped the request within 2 steps (a waiting one at once: 0 steps).
        assert steps["+Inf"] == closes and steps["2.0"] == closes and steps["0.0"] >= 200 // len(kinds), steps
        for s in load:
            s.close()
        idle = wait_for(server, "load still running", running(0))
        assert idle["tinyloop_kv_cache_bytes"] == 0
        engine = tinyloop.Engine(tiny_long.path)
        want = engine.generate("after", SamplingParams(temperature=0.0, max_tokens=16), loops=8).tokens
        got = httpx.post(f"{server}/generate", json={"prompt": "after", "max_tokens": 16}, timeout=30).json()["tokens"]
        assert got == want
    finally:
        for s in opened:
            s.close()
