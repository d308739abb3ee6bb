"""The table of benches/bench_isa.py's pytest-benchmark JSON (run with benches/bench_machine.py and bench_llama.py's
llama.cpp decode): tokens/s at each kernel level, best of the alternating rounds, as a ratio to the best level, with
llama.cpp on the same model at loops 8, and the weights streamed per second next to the machine's read bandwidth."""

from __future__ import annotations

import sys

from reporting import header, load


def main(path: str) -> None:
    data = load(path)
    limits = {b["name"]: b["extra_info"] for b in data["benchmarks"]}
    bandwidth = limits.get("test_read_bandwidth", {}).get("gb_per_s")
    print(f"Read bandwidth: {bandwidth} GB/s (bench_machine.py, same run)\n")
    columns = ["model", "loops", "engine / level", "decode tok/s", "÷ best level", "weights GB/s", "÷ bandwidth"]
    header(*columns, "prefill tok/s")
    benches = data["benchmarks"]
    llama = {
        (e["model"], e["weight_type"]): e["tokens"] / b["stats"]["min"]
        for b in benches
        if (e := b["extra_info"]).get("engine") == "llama.cpp" and e.get("kind") == "decode"
    }
    for b in benches:
        e = b["extra_info"]
        if "levels" not in e:
            continue
        rows = {isa: (v["decode_tok_s"], v.get("prefill_tok_s")) for isa, v in e["levels"].items()}
        if e["loops"] == 8 and (e["model"], e["weight_type"]) in llama:
            rows["llama.cpp"] = (llama[e["model"], e["weight_type"]], None)
        best = max(tok_s for isa, (tok_s, _) in rows.items() if isa != "llama.cpp")
        for isa, (tok_s, prefill) in rows.items():
            gbs = tok_s * e["bytes_per_token"] / 1e9
            share = f"{gbs / bandwidth:.0%}" if bandwidth else "?"
            print(
                f"| {e['model']} {e['weight_type']} | {e['loops']} | {isa} | {tok_s:,.1f} | {tok_s / best:.2f}× | "
                f"{gbs:.1f} | {share} | {f'{prefill:,.0f}' if prefill else '—'} |"
            )


if __name__ == "__main__":
    main(sys.argv[1])
