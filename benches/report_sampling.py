"""Turn a pytest-benchmark JSON of benches/bench_sampling.py into the table in docs/performance.md: tokens/s of
each kind of sampling (best round) and its ratio to greedy decoding at the same loops, from the same run."""

from __future__ import annotations

import json
import sys


def main(path: str) -> None:
    data = json.load(open(path))
    rate: dict[tuple[str, int], float] = {}
    for b in data["benchmarks"]:
        e = b["extra_info"]
        rate[(e["sampling"], e["loops"])] = e["tokens"] / b["stats"]["min"]
    loops = sorted({k[1] for k in rate})
    print(f"Machine: {data['machine_info'].get('cpu', {}).get('brand_raw', '?')}\n")
    print("| sampling | " + " | ".join(f"loops {n} tok/s (× greedy)" for n in loops) + " |")
    print("|---|" + "---|" * len(loops))
    for name in dict.fromkeys(k[0] for k in rate):
        cells = [f"{rate[(name, n)]:.0f} ({rate[(name, n)] / rate[('greedy', n)]:.2f}×)" for n in loops]
        print(f"| {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main(sys.argv[1])
