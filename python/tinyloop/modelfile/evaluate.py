"""Measure a `.tinyloop` model through the tinyloop engine itself (not PyTorch): held-out perplexity at each loop
depth and greedy next-token agreement of shallow depths with depth 8 (the draft acceptance rate).

    python -m tinyloop.modelfile.evaluate python/tinyloop/models/default.tinyloop data/corpus/heldout.txt \
        --tokens 32768 --json docs/model_eval.json --plot docs/model_depth.png
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from ..extras import require_or_exit

DEPTHS = [1, 2, 3, 4, 6, 8, 12, 16]
REFERENCE_DEPTH = 8


def held_out_ids(engine, text: str, limit: int) -> list[int]:
    ids: list[int] = []
    for passage in text.split("\n<|endoftext|>\n"):
        if passage.strip():
            ids.extend(engine.encode(passage))
            ids.append(engine.eos_token_id)
        if len(ids) >= limit + 1:
            break
    return ids[: limit + 1]


def evaluate(engine, ids: list[int], window: int, depths: list[int] = DEPTHS, progress: bool = True) -> dict:
    """Perplexity per depth over non-overlapping windows, and argmax agreement with REFERENCE_DEPTH."""
    from tqdm import tqdm

    nll = {d: 0.0 for d in depths}
    agree = {d: 0 for d in depths}
    count = 0
    starts = range(0, len(ids) - 1, window)
    for s in tqdm(starts, desc="windows", disable=not progress):
        chunk = ids[s : s + window + 1]
        if len(chunk) < 2:
            break
        scored = dict(zip(depths, engine.score(chunk, depths), strict=True))
        ref = scored[REFERENCE_DEPTH][1]
        for d, (logp, argmax) in scored.items():
            nll[d] -= sum(logp)
            agree[d] += sum(a == b for a, b in zip(argmax, ref, strict=True))
        count += len(chunk) - 1
    return {
        "tokens": count,
        "window": window,
        "perplexity": {d: math.exp(nll[d] / count) for d in depths},
        "agreement_with_8": {d: agree[d] / count for d in depths},
    }


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    depths = sorted(int(d) for d in result["perplexity"])
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    a.plot(depths, [result["perplexity"][d] for d in depths], "o-")
    a.set_xlabel("loops")
    a.set_ylabel("held-out perplexity")
    a.set_xscale("log", base=2)
    a.set_xticks(depths, [str(d) for d in depths])
    a.grid(alpha=0.3)
    shallow = [d for d in depths if d <= 4]
    b.bar([str(d) for d in shallow], [result["agreement_with_8"][d] for d in shallow])
    b.set_xlabel("draft loops d")
    b.set_ylabel("greedy agreement with loops 8")
    b.set_ylim(0, 1)
    b.grid(alpha=0.3, axis="y")
    fig.suptitle(f"default model, {result['tokens']:,} held-out tokens (measured by the tinyloop engine)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", type=Path)
    ap.add_argument("heldout", type=Path)
    ap.add_argument("--tokens", type=int, default=32768, help="held-out tokens to score (0: the whole file)")
    ap.add_argument(
        "--depths",
        default=None,
        help="comma-separated loop depths (default: 1,2,3,4,6,8,12,16; 8 is always scored, as the agreement reference)",
    )
    ap.add_argument("--window", type=int, default=None, help="tokens per scored window (default: max_seq_len - 1)")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--plot", type=Path, default=None)
    args = ap.parse_args()
    if args.plot:
        require_or_exit("train", "--plot", "matplotlib")
    from .. import Engine

    engine = Engine(args.model)
    window = args.window or engine.info.max_seq_len - 1
    text = args.heldout.read_text()
    ids = held_out_ids(engine, text, args.tokens or len(text))
    depths = sorted({int(d) for d in args.depths.split(",")} | {REFERENCE_DEPTH}) if args.depths else DEPTHS
    result = evaluate(engine, ids, window, depths)
    for d in depths:
        print(
            f"loops {d:2d}: perplexity {result['perplexity'][d]:8.2f}   "
            f"agreement with 8: {result['agreement_with_8'][d]:.3f}"
        )
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    if args.plot:
        plot(result, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
