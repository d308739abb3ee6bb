"""The table of benches/bench_isa.py's pytest-benchmark JSON (run with benches/bench_machine.py): tokens/s at each
kernel level, best of the alternating rounds, as a ratio to the best level, and the memory-bound cases next to the
machine's read bandwidth."""

from __future__ import annotations

import sys

from reporting import header, load


def main(path: str) -> None:
    data = load(path)
    limits = {b["name"]: b["extra_info"] for b in data["benchmarks"]}
    bandwidth = limits.get("test_read_bandwidth", {}).get("gb_per_s")
    print(f"Read bandwidth: {bandwidth} GB/s (bench_machine.py, same run)\n")
    header("case", "level", "decode tok/s", "÷ best level", "weights GB/s", "÷ bandwidth", "prefill tok/s")
    for b in data["benchmarks"]:
        e = b["extra_info"]
        if "levels" not in e:
            continue
        best = max(v["decode_tok_s"] for v in e["levels"].values())
        for isa, v in e["levels"].items():
            gbs = v["decode_tok_s"] * e["bytes_per_token"] / 1e9
            share = f"{gbs / bandwidth:.0%}" if bandwidth else "?"
            prefill = f"{v['prefill_tok_s']:,.0f}" if "prefill_tok_s" in v else "—"
            print(
                f"| {e['case']} | {isa} | {v['decode_tok_s']:,.1f} | {v['decode_tok_s'] / best:.2f}× | {gbs:.1f} | "
                f"{share} | {prefill} |"
            )


if __name__ == "__main__":
    main(sys.argv[1])
