"""Turn a pytest-benchmark JSON of benches/bench_prompt_cache.py into the table in docs/performance.md: time to the
first token of a conversation's next turn with the prompt cache (hit) and without (miss), best rounds, and their
ratio."""

from __future__ import annotations

import sys

from reporting import header, load


def main(path: str) -> None:
    data = load(path)
    header("loops", "prompt tokens", "reused", "miss TTFT (prefill tok/s)", "hit TTFT", "miss / hit")
    rows = [b for b in data["benchmarks"] if "miss_min_s" in b["extra_info"]]
    for b in sorted(rows, key=lambda b: -b["extra_info"]["loops"]):
        e = b["extra_info"]
        hit, miss = b["stats"]["min"], e["miss_min_s"]
        rate = e["prompt_tokens"] / miss
        cells = [
            e["loops"],
            e["prompt_tokens"],
            e["cached_tokens"],
            f"{miss * 1e3:.1f} ms ({rate:,.0f})",
            f"{hit * 1e3:.1f} ms",
        ]
        print("| " + " | ".join(str(c) for c in cells) + f" | **{miss / hit:.1f}×** |")


if __name__ == "__main__":
    main(sys.argv[1])
