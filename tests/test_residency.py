"""Dynamic residency: `--lazy-load` loads the model on the first request that needs it, `--idle-unload-seconds`
unloads it when idle, `POST /v1/models/unload` unloads it at once; `/health` and `/metrics` say whether it is
loaded, and the answers are the same as a model loaded at start-up."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from serverutil import running_server
from tinyloop import SamplingParams
from tinyloop.server.gate import InFlight
from tinyloop.server.metrics import Metrics
from tinyloop.server.residency import Residency

PROMPT = "Residency"


def resident_gauge(base: str) -> float:
    return httpx.get(f"{base}/metrics/json").json()["tinyloop_model_resident"]


def completion_text(base: str) -> str:
    body = {"model": "m", "prompt": PROMPT, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    r = httpx.post(f"{base}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def test_lazy_load_loads_on_demand_and_unload_frees_it(tiny, tiny_engine):
    want = tiny_engine.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)).text
    with running_server(tiny.path, "--lazy-load") as base:
        assert httpx.get(f"{base}/health").json() == {"status": "ok", "device": "cpu", "resident": False}
        assert [m["id"] for m in httpx.get(f"{base}/v1/models").json()["data"]] == [tiny.path.stem]
        assert resident_gauge(base) == 0  # probes, metrics and the model list do not load it
        assert completion_text(base) == want
        assert httpx.get(f"{base}/health").json() == {"status": "ok", "device": "cpu", "resident": True}
        assert resident_gauge(base) == 1
        r = httpx.post(f"{base}/v1/models/unload")
        assert r.json() == {"id": tiny.path.stem, "resident": False, "unloaded": True}
        assert httpx.get(f"{base}/health").json()["resident"] is False and resident_gauge(base) == 0
        assert httpx.post(f"{base}/v1/models/unload").json()["unloaded"] is False  # nothing to unload
        assert completion_text(base) == want  # loaded again, same answer


def test_idle_unload_after_the_given_seconds(tiny):
    with running_server(tiny.path, "--idle-unload-seconds", "0.5") as base:
        first = completion_text(base)  # answered, so loaded (whether it is still resident depends on how long since)
        assert first
        deadline = time.monotonic() + 20  # health probes every 50 ms must not keep the model loaded
        while httpx.get(f"{base}/health").json()["resident"] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert httpx.get(f"{base}/health").json() == {"status": "ok", "device": "cpu", "resident": False}
        assert completion_text(base) == first


def test_a_static_model_cannot_be_unloaded(tiny):
    with running_server(tiny.path) as base:
        r = httpx.post(f"{base}/v1/models/unload")
        assert r.status_code == 409 and "--lazy-load" in r.json()["error"]["message"]
        assert httpx.get(f"{base}/health").json() == {"status": "ok", "device": "cpu"}


def test_a_lazy_model_that_fails_to_load_answers_503_with_the_reason(tmp_path):
    bad = tmp_path / "broken.tinyloop"
    bad.write_bytes(b"not a model")
    with running_server(bad, "--lazy-load") as base:  # nothing is loaded yet: healthy
        r = httpx.post(f"{base}/v1/completions", json={"model": "m", "prompt": "x", "max_tokens": 2})
        assert r.status_code == 503 and "not a GGUF file" in r.json()["error"]["message"]
        health = httpx.get(f"{base}/health")
        assert health.status_code == 503 and "not a GGUF file" in health.json()["reason"]


class _Runner:
    def __init__(self, idle: bool):
        self._idle, self.closed = idle, False

    def idle(self) -> bool:
        return self._idle

    def close(self) -> None:
        self.closed = True


class _State:
    def __init__(self, runner):
        self.engine, self.runner, self.model_id = object(), runner, "m"


@pytest.mark.parametrize("in_flight,idle,unloads", [(0, True, True), (1, True, False), (0, False, False)])
def test_unload_never_takes_the_model_from_a_request(in_flight, idle, unloads, monkeypatch):
    """The unload decision itself: only with no request in flight and an idle engine thread."""
    monkeypatch.setattr("tinyloop.server.residency.release_all_memory", lambda: None)
    inflight = InFlight()
    inflight.count = in_flight
    residency = Residency(lambda _: (object(), object()), {}, "m", Metrics(), inflight)  # type: ignore[arg-type, return-value]
    runner = _Runner(idle)
    state = _State(runner)
    assert asyncio.run(residency.unload(state)) is unloads  # type: ignore[arg-type]
    assert (state.engine is None) is unloads and runner.closed is unloads
