"""The client-library cases (`tests/client_cases_*.py`) as a table: `python benches/clients.py [--base URL] [-v]`.

Starts the default model's server (or uses the one at `--base`), runs every case whose client is installed through
the recording proxy, and prints `client  case  pass/fail  reason`, then `N of M pass`. `-v` prints each failure's
traceback and the exact requests its client sent with the server's answers; `--only TEXT` runs the cases whose id
contains TEXT. Exits 1 when a case fails.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import tempfile
from pathlib import Path

from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from client_harness import Outcome, all_cases, run_case, serving


def cut(text: str, width: int = 110) -> str:
    return text if len(text) <= width else text[: width - 1] + "…"


def table(outcomes: list[Outcome]) -> str:
    rows = [("client", "case", "result", "reason / what the client got", "s")]
    rows += [
        (o.case.client, o.case.name, "pass" if o.passed else "FAIL", cut(o.note), f"{o.seconds:.1f}") for o in outcomes
    ]
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    return "\n".join(
        "  ".join(cell.ljust(w) for cell, w in zip(r[:4], widths, strict=True)) + f"  {r[4]}" for r in rows
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", help="a running server's root URL (default: start the default model's)")
    ap.add_argument("--only", default="", help="run only the cases whose id contains this")
    ap.add_argument("-v", "--verbose", action="store_true", help="each failure's traceback and exchanges")
    ap.add_argument("--json", type=Path, help="also write each case's outcome here (tests/test_clients.py reads it)")
    args = ap.parse_args()
    cases = [c for c in all_cases() if args.only in c.id]
    missing = sorted({c.client for c in cases if importlib.util.find_spec(c.module) is None})
    cases = [c for c in cases if importlib.util.find_spec(c.module) is not None]
    outcomes: list[Outcome] = []
    with tempfile.TemporaryDirectory() as tmp, serving(Path(tmp), args.base) as env:
        for c in (bar := tqdm(cases, unit="case")):
            bar.set_description(c.id[:40])
            outcomes.append(run_case(c, env))
    print(table(outcomes))
    if args.json:
        rows = [{"id": o.case.id, "passed": o.passed, "report": o.report()} for o in outcomes]
        args.json.write_text(json.dumps(rows, indent=1))
    if missing:
        print(f"not installed (skipped): {', '.join(missing)}")
    passed = sum(o.passed for o in outcomes)
    print(f"{passed} of {len(outcomes)} pass")
    if args.verbose:
        for o in outcomes:
            if not o.passed:
                print(f"\n=== {o.report()}")
    return 0 if passed == len(outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())
