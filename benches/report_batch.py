"""Table for docs/performance.md from benches/bench_batch.py: aggregate tokens/s at n streams and its ratio to one
stream of the same weights (same run).

    python benches/report_batch.py .benchmarks/batch.json
"""

from __future__ import annotations

import json
import sys


def main(path: str) -> int:
    runs = {}
    for b in json.load(open(path))["benchmarks"]:
        e = b["extra_info"]
        runs[(e["weights"], e["streams"])] = e["tokens"] / b["stats"]["min"]
    print("| weights | streams | aggregate tok/s | vs 1 stream |")
    print("|---|---|---|---|")
    for (weights, n), tps in sorted(runs.items()):
        print(f"| {weights} | {n} | {tps:.1f} | {tps / runs[(weights, 1)]:.2f}× |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
