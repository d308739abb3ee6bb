"""Schemathesis against the server's own `/openapi.json`: cases generated from every operation's schema, valid
(positive) and schema-violating (negative). Each answer must be below 500, and every 4xx must be in the documented
error shape. Shared by `tests/test_schemathesis.py` (a fixed number of cases per operation) and
`benches/bench_schemathesis.py` (many more)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis.errors import Unsatisfiable
from tqdm import tqdm


@dataclass
class FuzzReport:
    statuses: dict[str, Counter] = field(default_factory=dict)  # "METHOD /path" -> status -> count
    failures: list[str] = field(default_factory=list)  # what went wrong, one line each

    @property
    def cases(self) -> int:
        return sum(sum(c.values()) for c in self.statuses.values())


def _problem(status: int, body: bytes, content_type: str, path: str = "") -> str | None:
    if status >= 500:
        return f"status {status}"
    if status < 400:
        return None
    if not content_type.startswith("application/json"):
        return f"status {status} answered as {content_type!r}"
    import json

    try:
        whole = json.loads(body)
        err = whole["error"]
    except (ValueError, KeyError, TypeError):
        return f"status {status} without the error shape: {body[:200]!r}"
    # The Anthropic Messages routes answer in Anthropic's shape, every other route in OpenAI's (docs/api.md).
    keys = {"message", "type"} if path.startswith("/v1/messages") else {"message", "type", "param", "code"}
    if path.startswith("/v1/messages") and whole.get("type") != "error":
        return f"status {status} without Anthropic's outer type: {body[:200]!r}"
    if set(err) != keys or not isinstance(err["message"], str):
        return f"status {status} with error keys {sorted(err)}"
    return None


def fuzz(base: str, examples: int, seed: int = 0) -> FuzzReport:
    schema = schemathesis.openapi.from_url(f"{base}/openapi.json")
    operations = [r.ok() for r in schema.get_all_operations()]
    report = FuzzReport()
    runs = [(op, mode) for op in operations for mode in schemathesis.GenerationMode]
    for op, mode in tqdm(runs, desc="schemathesis", unit="operation"):
        name = f"{op.method.upper()} {op.path}"
        counts = report.statuses.setdefault(name, Counter())

        @settings(
            max_examples=examples,
            deadline=None,
            database=None,
            derandomize=False,
            suppress_health_check=list(HealthCheck),
            phases=[Phase.generate],
        )
        @given(case=op.as_strategy(generation_mode=mode))
        def run(case) -> None:  # called within this iteration only, so the loop variables it reads are current
            r = case.call(base_url=base, timeout=60)
            counts[r.status_code] += 1  # noqa: B023
            ctype = r.headers.get("content-type") or [""]  # schemathesis keeps each header as a list
            problem = _problem(r.status_code, r.content, ctype[0] if isinstance(ctype, list) else ctype, op.path)  # noqa: B023
            if problem:
                report.failures.append(f"{name} ({mode.value}): {problem}; body sent: {case.body!r:.300}")  # noqa: B023

        run._hypothesis_internal_use_seed = seed  # reproducible case streams
        try:
            run()
        except Unsatisfiable:
            if mode is not schemathesis.GenerationMode.NEGATIVE:
                raise  # an operation without inputs has no invalid requests to generate; every other must run
    return report
