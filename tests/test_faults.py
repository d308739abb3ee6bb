"""Faults: an engine failure inside one request, and SIGTERM with requests in flight.

The engine failure is forced in-process: the application's runner gets an engine whose steps fail for one marked
prompt (either that stream's slot holds the exception, or the whole batched step raises). That request ends with
`finish_reason: "error"` — streams with a final error event, then `[DONE]` — and every other request's output is
the engine's own.
"""

from __future__ import annotations

import asyncio
import json
import signal
import threading
import time

import httpx
import pytest

import tinyloop
from serverutil import server_process
from tinyloop import SamplingParams

POISON = [11, 22, 33]  # the prompt whose generation fails at its third step


class FailingEngine:
    """The real engine, except that streams of the POISON prompt fail at their third step."""

    def __init__(self, engine, how: str):
        self.engine, self.how, self.marked, self.steps = engine, how, set(), {}

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def stream(self, prompt, *args, **kwargs):
        s = self.engine.stream(prompt, *args, **kwargs)
        if list(prompt) == POISON:
            self.marked.add(id(s))
        return s

    def step_many(self, streams):
        due = [s for s in streams if id(s) in self.marked and self.steps.get(id(s), 0) >= 2]
        if due and self.how == "batch":
            raise tinyloop.EngineError("forced failure of the whole batched step")
        out = self.engine.step_many(streams)
        for i, s in enumerate(streams):
            if id(s) in self.marked:
                self.steps[id(s)] = self.steps.get(id(s), 0) + 1
                if s in due:
                    out[i] = tinyloop.EngineError("forced failure of one stream")
        return out


def sse(raw: bytes) -> list:
    parts = raw.decode().split("\n\n")
    assert parts[-2:] == ["data: [DONE]", ""], raw[-200:]
    return [json.loads(p[len("data: ") :]) for p in parts[:-2]]


@pytest.mark.parametrize("how", ["slot", "batch"])
def test_an_engine_error_ends_only_its_own_request(tiny, tiny_engine, how):
    from tinyloop.server.app import create_app
    from tinyloop.server.config import ServerConfig

    app = create_app(ServerConfig(model_path=tiny.path))
    state = app.state.tinyloop
    state.runner.engine = FailingEngine(state.engine, how)
    others = [[5, 6, 7], [8, 9], [100, 200, 300, 400]]
    want = [tiny_engine.generate(p, SamplingParams(temperature=0.0, max_tokens=12), loops=8).tokens for p in others]

    async def main():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t", timeout=60) as c:
            calls = [c.post("/generate", json={"prompt": p, "max_tokens": 12}) for p in others]
            calls += [
                c.post("/generate", json={"prompt": POISON, "max_tokens": 12}),
                c.post("/generate", json={"prompt": POISON, "max_tokens": 12, "stream": True}),
                c.post(
                    "/v1/completions",
                    json={"model": "m", "prompt": POISON, "max_tokens": 12, "temperature": 0, "stream": True},
                ),
                c.post(
                    "/v1/chat/completions",
                    json={
                        "model": "m",
                        "max_tokens": 12,
                        "temperature": 0,
                        "messages": [{"role": "user", "content": "x"}],
                    },
                ),
            ]
            return await asyncio.gather(*calls)

    *plain, failed, native, completion, chat = asyncio.run(main())
    assert [r.json()["tokens"] for r in plain] == want
    assert failed.status_code == 200
    body = failed.json()
    assert body["finish_reason"] == "error" and len(body["tokens"]) == 2
    events = sse(native.content)
    assert events[-2]["token_id"] == -1 and events[-2]["finish_reason"] == "error"
    assert events[-1]["error"]["code"] == "engine_error" and "forced failure" in events[-1]["error"]["message"]
    events = sse(completion.content)  # the choice's end, then the error event
    assert events[-2]["choices"][0]["finish_reason"] == "error" and "usage" not in events[-2]
    assert "forced failure" in events[-1]["error"]["message"]
    assert chat.status_code == 200 and chat.json()["choices"][0]["finish_reason"] in ("length", "stop")
    # The engine thread updates its gauges after handing out a step's events: wait for it, do not race it.
    deadline = time.monotonic() + 10
    while state.runner.metrics.requests_running._value.get() != 0:
        assert time.monotonic() < deadline, "the failed requests still count as running"
        time.sleep(0.01)


def test_sigterm_ends_every_request_in_flight_and_exits_cleanly(tiny_long):
    long = {"max_tokens": 4000, "loops": 64}
    with server_process(tiny_long.path) as (base, proc, output):
        results: dict[str, object] = {}

        def call(name: str, path: str, body: dict) -> None:
            try:
                r = httpx.post(f"{base}{path}", json=body, timeout=30)
                results[name] = (r.status_code, r.content)
            except httpx.HTTPError as e:
                results[name] = e

        calls = {
            "chat": (
                "/v1/chat/completions",
                {"model": "m", "messages": [{"role": "user", "content": "x"}], "stream": True, **long},
            ),
            "native": ("/generate", {"prompt": "y", "stream": True, **long}),
            "plain": ("/v1/completions", {"model": "m", "prompt": "z", **long}),
        }
        threads = [threading.Thread(target=call, args=(n, *c)) for n, c in calls.items()]
        for t in threads:
            t.start()
        deadline = time.time() + 20
        while httpx.get(f"{base}/metrics/json", timeout=5).json()["tinyloop_requests_running"] < 3:
            assert time.time() < deadline, "the three requests never ran together"
            time.sleep(0.02)
        sent = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=10)
        elapsed = time.monotonic() - sent
        for t in threads:
            t.join(timeout=10)
        log = output()
    assert code == 0 and elapsed < 5, (code, elapsed, log)
    assert "Traceback" not in log and "SIGTERM: ending 3 request(s) in flight" in log, log
    status, raw = results["chat"]
    assert status == 200 and sse(raw)[-1]["choices"][0]["finish_reason"] == "aborted"
    status, raw = results["native"]
    assert status == 200 and sse(raw)[-1]["finish_reason"] == "aborted"
    status, raw = results["plain"]
    assert status == 200 and json.loads(raw)["choices"][0]["finish_reason"] == "aborted"
