"""Table of tinyloop vs its peers from a pytest-benchmark JSON of benches/bench_llama.py (one run, same machine):
tokens/s of each and the ratios tinyloop / llama.cpp and tinyloop / mistral.rs (where mistral.rs ran).

    python benches/report_llama.py .benchmarks/llama.json
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict


def main(path: str) -> int:
    rows: dict[tuple[str, str, str], dict[str, float]] = defaultdict(dict)
    rss: dict[tuple[str, str], dict[str, float]] = defaultdict(dict)
    matches: dict[str, bool] = {}
    for b in json.load(open(path))["benchmarks"]:
        e = b["extra_info"]
        if "engine" not in e:
            continue
        if e["kind"] == "peak_rss":
            rss[(e["model"], e["weight_type"])][e["engine"]] = e["rss_mib"]
            continue
        rows[(e["kind"], e["model"], e["weight_type"])][e["engine"]] = e["tokens"] / b["stats"]["min"]
        if "greedy_match" in e:
            matches[f"{e['model']} {e['weight_type']}"] = e["greedy_match"]
    peers = [p for p in ("llama.cpp", "mistral.rs") if any(p in r for r in rows.values())]
    print(
        "| measure | model | weights | tinyloop tok/s | "
        + " | ".join(f"{p} tok/s | tinyloop / {p}" for p in peers)
        + " |"
    )
    print("|---|---|---|---|" + "---|---|" * len(peers))
    for (kind, model, wt), r in sorted(rows.items()):
        for ours, label in (("tinyloop", kind), ("tinyloop-spec", f"{kind}, self-speculative (2, 4) vs plain")):
            if ours in r:
                cells = [f"{r[p]:.1f} | {r[ours] / r[p]:.2f}×" if p in r else "— | —" for p in peers]
                print(f"| {label} | {model} | {wt} | {r[ours]:.1f} | " + " | ".join(cells) + " |")
    if matches:
        print("\nmistral.rs's greedy text equal to tinyloop's: " + ", ".join(f"{k} {v}" for k, v in matches.items()))
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
