"""What sharing the last loop's KV across loops costs on the default model (`kv_share="last"`): held-out perplexity
of decoded positions, scored token by token as generation reads them, and KV bytes per position — against the
per-loop cache, in the same windows.

    python benches/kv_share.py --json docs/kv_share.json      # prints the table in docs/quantization.md

Each window prefills `--prompt` tokens (every loop's own KV, in both modes) and then feeds the next `--decode`
tokens one at a time, scoring each; in the shared mode the cache keeps only the last loop's KV from the end of the
prompt on, so every scored position reads earlier positions through it. The per-loop rows are scored the same way
(token by token), so the two columns differ only by the cache.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import numpy as np
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))

import tinyloop
from quant_models import DEFAULT, HELDOUT, ROOT
from tinyloop.modelfile.evaluate import held_out_ids

# Each KV type per-loop and shared, so the table gives sharing's own cost beside the quantized cache's.
ROWS = [(kv, share) for kv in ("fp16", "int8", "int4-h") for share in ("none", "last")]


def score(engine: tinyloop.Engine, ids: list[int], loops: int, prompt: int, decode: int) -> tuple[float, int, float]:
    """(summed NLL of the decoded positions, how many, KV bytes per position at the end of a window)."""
    vocab = engine.info.vocab_size
    nll, count, per_pos = 0.0, 0, 0.0
    windows = range(0, len(ids) - prompt - decode, prompt + decode)
    for s in tqdm(windows, desc=f"kv {engine.info.kv_cache_mode}, share {engine.info.kv_share}", leave=False):
        seq = engine.sequence(capacity=prompt + decode)
        logits = np.frombuffer(seq.feed(ids[s : s + prompt], loops), dtype=np.float32).reshape(-1, vocab)[-1]
        seq.share_loops(loops)
        for i in range(s + prompt, s + prompt + decode):
            z = logits.astype(np.float64)
            nll += math.log(np.exp(z - z.max()).sum()) + z.max() - z[ids[i]]
            count += 1
            logits = np.frombuffer(seq.feed([ids[i]], loops), dtype=np.float32)
        per_pos = seq.kv_bytes / len(seq)
    return nll, count, per_pos


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, default=DEFAULT)
    ap.add_argument("--heldout", type=Path, default=HELDOUT)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--loops", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--decode", type=int, default=192)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    rows = []
    ids: list[int] = []
    for kv, share in ROWS:
        engine = tinyloop.Engine(args.model, kv_cache_mode=kv, kv_share=share)
        ids = ids or held_out_ids(engine, args.heldout.read_text(), args.tokens)
        nll, count, per_pos = score(engine, ids, args.loops, args.prompt, args.decode)
        rows.append({"kv": kv, "share": share, "perplexity": math.exp(nll / count), "scored": count, "bytes": per_pos})
    base = rows[0]
    unshared = {r["kv"]: r for r in rows if r["share"] == "none"}
    print(
        f"| KV cache | kv_share | perplexity of decoded positions (loops {args.loops}) | Δ vs fp16 per-loop "
        "| Δ of sharing (same KV type) | KV bytes / position |"
    )
    print("|---|---|---|---|---|---|")
    for r in rows:
        r["delta_pct"] = 100 * (r["perplexity"] / base["perplexity"] - 1)
        r["sharing_pct"] = 100 * (r["perplexity"] / unshared[r["kv"]]["perplexity"] - 1)
        print(
            f"| {r['kv']} | {r['share']} | {r['perplexity']:.2f} | {r['delta_pct']:+.2f}% | {r['sharing_pct']:+.2f}% "
            f"| {r['bytes']:,.0f} ({r['bytes'] / base['bytes']:.3f}×) |"
        )
    if args.json:
        meta = {
            "model": args.model.name,
            "heldout": str(args.heldout.resolve().relative_to(ROOT)),
            **{k: getattr(args, k) for k in ("loops", "prompt", "decode")},
        }
        args.json.write_text(json.dumps({**meta, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
