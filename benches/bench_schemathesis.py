"""The schemathesis run of `tests/test_schemathesis.py` at length: TINYLOOP_FUZZ_EXAMPLES generated cases (default
400) per operation and mode, positive and negative, against the server on a tiny random model and on the shipped
default model. The figures (cases, statuses, failures) are printed and written to .benchmarks/schemathesis.json.

    pytest benches/bench_schemathesis.py -s
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from api_fuzz import fuzz  # noqa: E402
from serverutil import running_server  # noqa: E402
from shapes import TINY  # noqa: E402

EXAMPLES = int(os.environ.get("TINYLOOP_FUZZ_EXAMPLES", "400"))
DEFAULT_MODEL = ROOT / "python" / "tinyloop" / "models" / "default.tinyloop"


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    from tinyloop.modelfile.format import random_weights, write_model

    tiny = dataclasses.replace(TINY, name="fuzz-tiny")
    path = tmp_path_factory.mktemp("fuzz") / "tiny.tinyloop"
    write_model(path, tiny, random_weights(tiny, seed=0))
    return path


@pytest.mark.parametrize("which", ["tiny", "default"])
def test_schemathesis_at_length(which, tiny_model):
    model = tiny_model if which == "tiny" else DEFAULT_MODEL
    with running_server(model, "--max-tokens-limit", "16") as base:
        report = fuzz(base, examples=EXAMPLES, seed=1)
        healthy = httpx.get(f"{base}/health", timeout=5).json() == {"status": "ok"}
    figures = {
        "model": which,
        "examples_per_operation_and_mode": EXAMPLES,
        "cases": report.cases,
        "statuses": {op: dict(c) for op, c in report.statuses.items()},
        "failures": report.failures,
        "healthy_after": healthy,
    }
    out = ROOT / ".benchmarks" / f"schemathesis-{which}.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(figures, indent=1))
    print(json.dumps({k: v for k, v in figures.items() if k != "statuses"}, indent=1))
    assert report.failures == [] and healthy
