"""Turn a pytest-benchmark JSON of benches/bench_engine.py into the markdown table in docs/performance.md."""

from __future__ import annotations

import json
import sys


def main(path: str) -> None:
    rows: dict[tuple, dict[str, float]] = {}
    for b in json.load(open(path))["benchmarks"]:
        e = b["extra_info"]
        key = (e["shape"], e["weight_type"], e["loops"])
        rows.setdefault(key, {})[e["kind"]] = e["tokens"] / b["stats"]["min"]
    print("| model | weights | loops | decode tok/s | prefill tok/s (128-token prompt) |")
    print("|---|---|---|---|---|")
    for (shape, wt, loops), r in sorted(rows.items()):
        print(
            f"| {shape} | {wt} | {loops} | {r.get('decode', float('nan')):.1f} | {r.get('prefill', float('nan')):.1f} |"
        )


if __name__ == "__main__":
    main(sys.argv[1])
