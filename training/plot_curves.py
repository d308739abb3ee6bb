"""Plot a training run's loss curves (per exit depth) and held-out evaluations from its log.json; several logs
(consecutive phases, e.g. a run continued with --resume) are drawn end to end.

    python training/plot_curves.py data/run/log.json [data/run2/log.json ...] docs/model_training.png
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def _joined(paths: list[str]) -> dict:
    """One log of consecutive phases: later steps' times and tokens offset by what came before."""
    steps, evals, t0, tok0, starts, tok_starts = [], [], 0.0, 0, [], []
    for path in paths:
        log = json.loads(Path(path).read_text())
        starts.append(t0)
        tok_starts.append(tok0)
        steps += [s | {"t": s["t"] + t0} for s in log["steps"]]
        evals += [e | {"tokens": e["tokens"] + tok0} for e in log["evals"]]
        t0 = steps[-1]["t"] if steps else t0
        tok0 += log.get("final", {}).get("tokens", 0)
    return {"steps": steps, "evals": evals, "phase_starts": starts[1:], "phase_token_starts": tok_starts[1:]}


def main(*args: str) -> int:
    *logs, out = args
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    log = _joined(logs)
    steps = log["steps"]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    t = np.array([s["t"] / 60 for s in steps])
    for key, label in [("loss@1", "exit 1"), ("loss@2", "exit 2")]:
        y = np.array([s.get(key, np.nan) for s in steps], dtype=float)
        a.plot(t, _smooth(y), label=label)
    final = np.array([s[f"loss@{s['L']}"] for s in steps], dtype=float)
    a.plot(t, _smooth(final), label="final exit (loop L)")
    for t in log["phase_starts"]:
        a.axvline(t / 60, color="gray", ls=":", lw=1)
    a.set_xlabel("minutes (dotted: the next run)")
    a.set_ylabel("training loss (smoothed)")
    a.set_ylim(top=min(10, np.nanmax(final)))
    a.legend()
    a.grid(alpha=0.3)
    # Held-out checks against tokens seen: the shallowest and the deepest checked depth, one line each (a legend
    # entry per check stopped being readable after a few phases).
    evals = log["evals"]
    tokens = np.array([ev["tokens"] / 1e6 for ev in evals])
    for depth, style in [(1, "o-"), (8, "s-")]:
        ys = np.array([ev["ppl"].get(str(depth), ev["ppl"].get(depth, np.nan)) for ev in evals], dtype=float)
        b.plot(tokens, ys, style, ms=3, label=f"loops {depth}")
    shared = np.array([ev.get("kv_share_ppl", {}).get("8", np.nan) for ev in evals], dtype=float)
    if not np.isnan(shared).all():  # a run trained for kv_share="last" also checks loops 8 read through it
        b.plot(tokens, shared, "^--", ms=3, label="loops 8, shared KV")
    for tok in log["phase_token_starts"]:
        b.axvline(tok / 1e6, color="gray", ls=":", lw=1)
    b.set_xlabel("tokens seen, millions (dotted: a new phase)")
    b.set_ylabel("held-out perplexity (PyTorch's check)")
    b.set_yscale("log")
    b.legend()
    b.grid(alpha=0.3, which="both")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    return 0


def _smooth(y, k: int = 25):
    import numpy as np

    y = np.asarray(y, dtype=float)
    out = np.full_like(y, np.nan)
    for i in range(len(y)):
        w = y[max(0, i - k + 1) : i + 1]
        w = w[~np.isnan(w)]
        if len(w) >= min(5, k):
            out[i] = w.mean()
    return out


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
