"""Quality and size of every weight type and KV-cache mode on the default model, measured through the engine:
held-out perplexity at loops 8 and its change vs fp16 weights + fp16 KV, file size, KV bytes per token, and
decode speed vs fp16 from a pytest-benchmark run of benches/bench_quant.py.

    pytest benches/bench_quant.py --benchmark-json=.benchmarks/quant.json
    python benches/quantization.py --bench .benchmarks/quant.json --json docs/quantization.json \
        --plot docs/quantization.png        # prints the table of docs/quantization.md
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import tinyloop
from quant_models import HELDOUT, ROOT, model_path
from tinyloop.modelfile.evaluate import evaluate, held_out_ids

LOOPS = 8
# (weights, KV mode): every weight type with the fp16 cache, every cache mode with fp16 weights, and the
# combination a memory-bound deployment would pick (GPTQ int4 weights, int4-h cache).
ROWS = [
    ("fp16", "fp16"),
    ("int8", "fp16"),
    ("int4 RTN", "fp16"),
    ("int4 GPTQ (Q4_0)", "fp16"),
    ("int4 GPTQ (Q4_1)", "fp16"),
    ("int2", "fp16"),
    ("fp16", "int8"),
    ("fp16", "int4"),
    ("fp16", "int4-h"),
    ("int4 GPTQ (Q4_0)", "int4-h"),
]


def kv_bytes_per_token(engine: tinyloop.Engine, ids: list[int]) -> float:
    seq = engine.sequence()
    seq.feed(ids[:64], LOOPS)
    return seq.kv_bytes / 64


def decode_ratios(bench_json: Path | None) -> dict[str, float]:
    """Decode tokens/s of each weight type divided by fp16's, from one benchmark run (best round each)."""
    if bench_json is None:
        return {}
    runs = {
        b["extra_info"]["weights"]: b["extra_info"]["tokens"] / b["stats"]["min"]
        for b in json.loads(bench_json.read_text())["benchmarks"]
    }
    return {name: tps / runs["fp16"] for name, tps in runs.items()} | {"_tok_s": runs}


def measure(heldout: Path, tokens: int, bench_json: Path | None) -> dict:
    results = []
    speed = decode_ratios(bench_json)
    ids: list[int] = []  # every file has the same vocabulary: tokenize the held-out text once
    for weights, kv in ROWS:
        path = model_path(weights)
        engine = tinyloop.Engine(path, kv_cache_mode=kv)
        ids = ids or held_out_ids(engine, heldout.read_text(), tokens)
        ev = evaluate(engine, ids, engine.info.max_seq_len - 1, depths=[LOOPS], progress=False)
        row = {
            "weights": weights,
            "kv": kv,
            "quant": engine.info.quant,
            "perplexity": ev["perplexity"][LOOPS],
            "tokens": ev["tokens"],
            "file_mb": path.stat().st_size / 1e6,
            "kv_bytes_per_token": kv_bytes_per_token(engine, ids),
        }
        if kv == "fp16" and weights in speed:
            row["decode_vs_fp16"] = speed[weights]
            row["decode_tok_s"] = speed["_tok_s"][weights]
        results.append(row)
        print(f"{weights:18s} {kv:6s} ppl {row['perplexity']:8.2f}", flush=True)
    base = results[0]["perplexity"]
    for r in results:
        r["delta_pct"] = 100 * (r["perplexity"] / base - 1)
    return {"loops": LOOPS, "heldout": str(heldout.resolve().relative_to(ROOT)), "rows": results}


def table(result: dict) -> str:
    lines = [
        "| weights | KV cache | perplexity (loops 8) | Δ vs fp16 | file MB | KV bytes / token | decode vs fp16 |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        speed = f"{r['decode_vs_fp16']:.2f}×" if "decode_vs_fp16" in r else ""
        lines.append(
            f"| {r['weights']} | {r['kv']} | {r['perplexity']:.2f} | {r['delta_pct']:+.2f}% | "
            f"{r['file_mb']:.1f} | {r['kv_bytes_per_token']:,.0f} | {speed} |"
        )
    return "\n".join(lines)


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    labels = [f"{r['weights']}\n+ {r['kv']} KV" for r in rows]
    fig, (a, b) = plt.subplots(1, 2, figsize=(13, 4.8))
    colors = ["tab:blue" if r["kv"] == "fp16" else "tab:orange" for r in rows]
    a.barh(labels, [r["delta_pct"] for r in rows], color=colors)
    a.set_xlabel(f"held-out perplexity change vs fp16 / fp16 (%), loops {result['loops']}")
    a.set_xscale("symlog", linthresh=1)
    a.invert_yaxis()
    a.grid(alpha=0.3, axis="x")
    b.scatter([r["file_mb"] for r in rows if r["kv"] == "fp16"], [r["delta_pct"] for r in rows if r["kv"] == "fp16"])
    for r in rows:
        if r["kv"] == "fp16":
            b.annotate(
                r["weights"], (r["file_mb"], r["delta_pct"]), fontsize=8, xytext=(4, 4), textcoords="offset points"
            )
    b.set_xlabel("file size (MB)")
    b.set_ylabel("perplexity change (%)")
    b.set_yscale("symlog", linthresh=1)
    b.grid(alpha=0.3)
    fig.suptitle("default model: quality vs weight type (blue) and KV-cache mode (orange), measured by the engine")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--heldout", type=Path, default=HELDOUT)
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--bench", type=Path, default=None, help="pytest-benchmark JSON of benches/bench_quant.py")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--plot", type=Path, default=None)
    args = ap.parse_args()
    result = measure(args.heldout, args.tokens, args.bench)
    print(table(result))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    if args.plot:
        plot(result, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
