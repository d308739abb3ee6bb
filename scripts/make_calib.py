"""Write the default GPTQ calibration text, python/tinyloop/assets/calib.txt, from the corpus's TRAINING split.

    python scripts/make_calib.py [--corpus data/corpus] [--chars-per-source 8500]

train.txt holds each source's passages in turn (counts in stats.json), separated by "\\n<|endoftext|>\\n". From every
source this takes passages at evenly spaced positions, as many as make about --chars-per-source characters at the
source's average passage length, so every source is represented across its whole length. heldout.txt is never read.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

SEP = "\n<|endoftext|>\n"
OUT = Path(__file__).resolve().parents[1] / "python" / "tinyloop" / "assets" / "calib.txt"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--corpus", type=Path, default=Path("data/corpus"))
    ap.add_argument("--chars-per-source", type=int, default=8500)
    args = ap.parse_args()
    passages = [p for p in (args.corpus / "train.txt").read_text().split(SEP) if p.strip()]
    stats = json.loads((args.corpus / "stats.json").read_text())
    if sum(s["passages"] for s in stats.values()) != len(passages):
        raise SystemExit("train.txt does not match stats.json's passage counts")
    chosen: list[str] = []
    start = 0
    for source, s in stats.items():
        count = s["passages"]
        mean_chars = sum(map(len, passages[start : start + count])) / count
        n = max(1, round(args.chars_per_source / mean_chars))
        taken = [passages[start + int((k + 0.5) * count / n)] for k in range(n)]
        chars = sum(map(len, taken))
        print(f"{source:12s} {len(taken):4d} passages {chars:7,d} chars")
        chosen += taken
        start += count
    OUT.write_text(SEP.join(chosen) + SEP)
    print(f"wrote {OUT} ({OUT.stat().st_size:,} bytes)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
