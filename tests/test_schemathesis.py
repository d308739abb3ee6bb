"""Generated requests against every operation of `/openapi.json`: never a 5xx, every 4xx in the documented shape,
and the server still healthy afterwards (`tests/api_fuzz.py`; many more cases in `benches/`)."""

from __future__ import annotations

import httpx

from api_fuzz import fuzz
from serverutil import running_server


def test_generated_requests_never_get_a_server_error(tiny):
    # A low max_tokens ceiling keeps each generated request short; larger values are refused (400), as they must be.
    with running_server(tiny.path, "--max-tokens-limit", "8") as base:
        report = fuzz(base, examples=25)
        assert report.failures == []
        assert len(report.statuses) >= 12 and report.cases >= 12 * 25
        assert sum(c[200] for c in report.statuses.values()) > 20  # valid requests really were generated and served
        assert httpx.get(f"{base}/health", timeout=5).json() == {"status": "ok", "device": "cpu"}
