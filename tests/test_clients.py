"""The client libraries people build agents with, against `tinyloop-serve` on the shipped default model, greedy:
every case of `client_cases_openai.py` and `client_cases_other.py`, run through `client_harness.py`'s recording
proxy, so that a failure shows the exact requests the client sent and what the server answered.

Each client is in the `test` extra but instructor (see `client_harness.OPTIONAL`), whose cases skip where it is not
installed."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from client_harness import OPTIONAL, Case, all_cases

CASES = all_cases()
BENCH = Path(__file__).resolve().parents[1] / "benches" / "clients.py"


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    """Every installed client's cases, run by `benches/clients.py` in a process of its own: the libraries keep
    event loops and pooled connections in their own globals, which this suite (warnings are errors) must not meet
    when they are collected during some later test."""
    out = tmp_path_factory.mktemp("clients") / "outcomes.json"
    run = subprocess.run([sys.executable, str(BENCH), "--json", str(out)], capture_output=True, text=True, timeout=900)
    assert out.exists(), f"benches/clients.py exited {run.returncode}:\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}"
    return {row["id"]: row for row in json.loads(out.read_text())}


@pytest.mark.parametrize("c", CASES, ids=[c.id for c in CASES])
def test_client(c: Case, outcomes: dict[str, dict]) -> None:
    if c.module in OPTIONAL and importlib.util.find_spec(c.module) is None:
        pytest.skip(f"{c.client} is not in the `test` extra (client_harness.OPTIONAL)")
    assert c.id in outcomes, f"{c.id} did not run"
    assert outcomes[c.id]["passed"], outcomes[c.id]["report"]
