"""Table for docs/performance.md from benches/bench_serve.py (one run): aggregate streamed tokens/s, time to first
token, peak RSS, per server and client count.

    python benches/report_serve.py .benchmarks/serve.json
"""

from __future__ import annotations

import json
import sys


def main(path: str) -> int:
    print("| server | clients | streams completed | aggregate tok/s | TTFT p50 (s) | TTFT p99 (s) | peak RSS (MB) |")
    print("|---|---|---|---|---|---|---|")
    for b in json.load(open(path))["benchmarks"]:
        e = b["extra_info"]
        tps = e["received_chunks"] / b["stats"]["min"]
        p50 = f"{e['ttft_p50']:.2f}" if e["ttft_p50"] is not None else "–"
        p99 = f"{e['ttft_p99']:.2f}" if e["ttft_p99"] is not None else "–"
        print(
            f"| {e['server']} | {e['clients']} | {e['completed_streams']}/{e['clients']} | {tps:.1f} | {p50} | {p99} | "
            f"{e['peak_rss_mb']:.0f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
