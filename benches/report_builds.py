"""The table of benches/bench_builds.py's pytest-benchmark JSON: decode tokens/s of the installed build and the other
one, best of the alternating rounds, and their ratio."""

from __future__ import annotations

import sys

from reporting import header, load


def main(path: str) -> None:
    data = load(path)
    header("loops", "kernel level", "installed build tok/s", "other build tok/s", "installed ÷ other")
    for b in data["benchmarks"]:
        e = b["extra_info"]
        ratio = e["this_tok_s"] / e["other_tok_s"]
        print(f"| {e['loops']} | {e['isa']} | {e['this_tok_s']:.0f} | {e['other_tok_s']:.0f} | **{ratio:.2f}×** |")


if __name__ == "__main__":
    main(sys.argv[1])
