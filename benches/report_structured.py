"""Turn a pytest-benchmark JSON of benches/bench_structured.py into the table in docs/structured-output.md: decode
tokens/s under each schema (best round), unconstrained decoding of as many tokens in the same rounds (best), and
their ratio; then the same constrained decode with every mask computed inline (no grammar threads), and how much
computing masks during the forward pass gains."""

from __future__ import annotations

import sys

from reporting import header, load


def main(path: str) -> None:
    data = load(path)
    header(
        "schema",
        "sampling",
        "streams",
        "tokens per round",
        "with schema tok/s",
        "without tok/s",
        "ratio",
        "masks inline tok/s",
        "ahead ÷ inline",
    )
    for b in data["benchmarks"]:
        e = b["extra_info"]
        ratio = e["constrained_tok_s"] / e["plain_tok_s"]
        gain = e["constrained_tok_s"] / e["inline_tok_s"]
        print(
            f"| {e['schema']} | {e['sampling']} | {e['streams']} | {e['tokens']} | {e['constrained_tok_s']:.0f} | "
            f"{e['plain_tok_s']:.0f} | **{ratio:.2f}×** | {e['inline_tok_s']:.0f} | {gain:.2f}× |"
        )


if __name__ == "__main__":
    main(sys.argv[1])
