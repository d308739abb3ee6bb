"""Table of benches/bench_server_overhead.py: tokens/s of one stream through the server and the openai SDK, of
`Engine.stream` in the same rounds, and their ratio.

    python benches/report_server_overhead.py .benchmarks/server-overhead.json
"""

from __future__ import annotations

import sys

from reporting import header, load


def main(path: str) -> None:
    data = load(path)
    header("sampling", "loops", "server + openai SDK tok/s", "`Engine.stream` tok/s", "server / engine")
    for b in data["benchmarks"]:
        e = b["extra_info"]
        server, engine = e["tokens"] / b["stats"]["min"], e["tokens"] / e["engine_min_s"]
        print(f"| {e['sampling']} | {e['loops']} | {server:.0f} | {engine:.0f} | **{server / engine:.2f}×** |")


if __name__ == "__main__":
    main(sys.argv[1])
