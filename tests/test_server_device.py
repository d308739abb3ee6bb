"""`tinyloop-serve --device`: the server on the device path (candle's CPU device standing in for a GPU), what it says
about where it computes, what it refuses there, and the start-up errors for devices it cannot use."""

from __future__ import annotations

import importlib.resources
import os
import subprocess
import sys

import httpx
import openai
import pytest

import tinyloop
from serverutil import running_server
from tinyloop import SamplingParams

DEFAULT = importlib.resources.files("tinyloop") / "models" / "default.tinyloop"


@pytest.fixture(scope="module")
def device_server():
    with running_server(DEFAULT, "--device", "candle-cpu") as base:
        yield base


def test_health_model_info_and_runtime_name_the_device(device_server):
    assert httpx.get(f"{device_server}/health", timeout=5).json() == {"status": "ok", "device": "candle-cpu"}
    body = {"model": "m", "prompt": "Hello", "max_tokens": 4, "temperature": 0}
    r = httpx.post(f"{device_server}/api/v0/completions", json=body, timeout=60).json()
    assert r["model_info"]["device"] == "candle-cpu" and r["runtime"]["device"] == "candle-cpu"


def test_completions_are_the_device_engines(device_server):
    engine = tinyloop.Engine(DEFAULT, device="candle-cpu")
    client = openai.OpenAI(base_url=f"{device_server}/v1", api_key="unused")
    for loops in (2, 8):
        # The file recommends a frequency penalty, which the server applies where a request says nothing.
        out = client.completions.create(
            model="m", prompt="Once upon a time", max_tokens=16, temperature=0, extra_body={"loops": loops}
        )
        params = SamplingParams(temperature=0.0, max_tokens=16, frequency_penalty=0.5)
        want = engine.generate(engine.encode("Once upon a time"), params, loops=loops)
        assert out.choices[0].text == want.text
        assert out.usage.completion_tokens == len(want.tokens)


def test_what_the_device_does_not_run_is_a_400_naming_it(device_server):
    tree = httpx.post(
        f"{device_server}/generate/tree_speculative",
        json={"prompt": "x", "max_tokens": 4, "verify_loops": 6, "draft_loops": 2, "draft_ahead": 3, "K_branches": 2},
        timeout=60,
    )
    assert tree.status_code == 400
    error = tree.json()["error"]
    assert "tree speculative" in error["message"] and "candle-cpu" in error["message"]
    assert error["type"] == "invalid_request_error"
    # The server keeps serving.
    ok = httpx.post(f"{device_server}/generate", json={"prompt": "x", "max_tokens": 3}, timeout=60)
    assert ok.status_code == 200 and len(ok.json()["tokens"]) == 3


@pytest.mark.parametrize(
    ("device", "says"),
    [("gpu", 'unknown device "gpu"'), ("cuda:999", 'device "cuda:999"')],  # no machine has a thousandth GPU
)
def test_an_unusable_device_stops_the_server_with_one_clear_line(device, says):
    with pytest.raises(tinyloop.TinyloopError) as e:
        tinyloop.check_device(device)
    expected = str(e.value)
    env = {k: v for k, v in os.environ.items() if not k.startswith("TINYLOOP_")}
    proc = subprocess.run(
        [sys.executable, "-m", "tinyloop.server.cli", "--device", device, "--port", "0"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert expected in proc.stderr and says in proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout
