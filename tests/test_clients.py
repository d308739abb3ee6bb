"""The client libraries people build agents with, against `tinyloop-serve` on the shipped default model, greedy:
every case of `client_cases_openai.py` and `client_cases_other.py`, run through `client_harness.py`'s recording
proxy, so that a failure shows the exact requests the client sent and what the server answered.

Each client is in the `test` extra but instructor (see `client_harness.OPTIONAL`), whose cases skip where it is not
installed."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from client_harness import OPTIONAL, Case, Env, all_cases, run_case, serving

CASES = all_cases()


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    with serving(tmp_path_factory.mktemp("clients")) as env:
        yield env


@pytest.mark.parametrize("c", CASES, ids=[c.id for c in CASES])
def test_client(c: Case, served: Env) -> None:
    if c.module in OPTIONAL:
        pytest.importorskip(c.module, reason=f"{c.client} is not in the `test` extra (client_harness.OPTIONAL)")
    outcome = run_case(c, served)
    assert outcome.passed, outcome.report()
