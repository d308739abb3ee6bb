"""Table of tinyloop vs llama.cpp from a pytest-benchmark JSON of benches/bench_llama.py (one run, same machine):
tokens/s of each and the ratio tinyloop / llama.cpp.

    python benches/report_llama.py .benchmarks/llama.json
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict


def main(path: str) -> int:
    rows: dict[tuple[str, str, str], dict[str, float]] = defaultdict(dict)
    rss: dict[tuple[str, str], dict[str, float]] = defaultdict(dict)
    for b in json.load(open(path))["benchmarks"]:
        e = b["extra_info"]
        if "engine" not in e:
            continue
        if e["kind"] == "peak_rss":
            rss[(e["model"], e["weight_type"])][e["engine"]] = e["rss_mib"]
            continue
        rows[(e["kind"], e["model"], e["weight_type"])][e["engine"]] = e["tokens"] / b["stats"]["min"]
    print("| measure | model | weights | tinyloop tok/s | llama.cpp tok/s | tinyloop / llama.cpp |")
    print("|---|---|---|---|---|---|")
    for (kind, model, wt), r in sorted(rows.items()):
        for ours, label in (("tinyloop", kind), ("tinyloop-spec", f"{kind}, self-speculative (2, 4) vs plain")):
            if ours in r and "llama.cpp" in r:
                print(
                    f"| {label} | {model} | {wt} | {r[ours]:.1f} | {r['llama.cpp']:.1f} | "
                    f"{r[ours] / r['llama.cpp']:.2f}× |"
                )
    if rss:
        print()
        print("| model | weights | tinyloop peak RSS (MiB) | llama.cpp peak RSS (MiB) |")
        print("|---|---|---|---|")
        for (model, wt), r in sorted(rss.items()):
            print(
                f"| {model} | {wt} | {r.get('tinyloop', float('nan')):.0f} | {r.get('llama.cpp', float('nan')):.0f} |"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
