"""Turn a pytest-benchmark JSON of benches/bench_sampling.py into the table in docs/performance.md: tokens/s of
each kind of sampling (best round), greedy decoding's in the same rounds (best), and their ratio."""

from __future__ import annotations

import sys

from reporting import load


def main(path: str) -> None:
    data = load(path)
    rate: dict[tuple[str, int, int], float] = {}
    greedy: dict[tuple[str, int, int], float] = {}
    for b in data["benchmarks"]:
        e = b["extra_info"]
        key = (e["sampling"], e["streams"], e["loops"])
        rate[key] = e["tokens"] / b["stats"]["min"]
        greedy[key] = e["tokens"] / e["greedy_min_s"]
    loops = sorted({k[2] for k in rate})
    for streams in sorted({k[1] for k in rate}):
        label = "single stream" if streams == 1 else f"{streams} streams, aggregate"
        print(f"| sampling ({label}) | " + " | ".join(f"loops {n}: tok/s, greedy tok/s, ratio" for n in loops) + " |")
        print("|---|" + "---|" * len(loops))
        for name in dict.fromkeys(k[0] for k in rate):
            keys = [(name, streams, n) for n in loops]
            cells = [f"{rate[k]:.0f} / {greedy[k]:.0f} = **{rate[k] / greedy[k]:.2f}×**" for k in keys]
            print(f"| {name} | " + " | ".join(cells) + " |")
        print()


if __name__ == "__main__":
    main(sys.argv[1])
