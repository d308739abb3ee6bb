"""Table (markdown, stdout) and plot of benches/bench_speculative.py results: speed relative to plain decoding
measured in the same run."""

from __future__ import annotations

import json
import sys


def main(path: str, plot_path: str | None = None) -> None:
    rows, full = [], []  # drafts through the model's draft vocabulary / through the full head
    plain = None
    interleaved = []
    for b in json.load(open(path))["benchmarks"]:
        e = b["extra_info"]
        tps = e["tokens"] / b["stats"]["min"]
        if e.get("interleaved"):
            interleaved.append((e, tps, e["tokens"] / e["plain_min_s"]))
        elif e["draft_loops"] == 0:
            plain = tps
        else:
            row = (
                e["draft_loops"],
                e["draft_ahead"],
                e.get("k_branches", 1),
                tps,
                e["accepted"] / max(1, e["rounds"]),
                e["accepted"] / max(1, e["proposed"]),
            )
            (full if e.get("head") == "full" else rows).append(row)
    for e, tps, plain_tps in interleaved:
        print(
            f"At the server's defaults (draft_loops {e['draft_loops']}, draft_ahead {e['draft_ahead']}), interleaved "
            f"with plain decoding round by round: {tps:.1f} / {plain_tps:.1f} tok/s = **{tps / plain_tps:.2f}×** plain "
            f"({e['accepted'] / max(1, e['rounds']):.2f} accepted per round).\n"
        )
    if plain is None:
        print("(the run has no plain case: no table of settings)")
        return
    print(f"plain decoding at verify_loops 8: {plain:.1f} tok/s\n")
    print("| draft_loops | draft_ahead | K_branches | tok/s | × plain | accepted per round | acceptance rate |")
    print("|---|---|---|---|---|---|---|")
    for d, k, b, tps, per_round, rate in sorted(rows, key=lambda r: (r[2], r[0], r[1])):
        print(f"| {d} | {k} | {b} | {tps:.1f} | {tps / plain:.2f} | {per_round:.2f} | {rate:.2f} |")
    if full:
        print("\nThe same settings with drafts through the full head (`Engine(..., draft_vocab=False)`):\n")
        print(
            "| draft_loops | draft_ahead | K_branches | full head tok/s | × plain | draft head × plain "
            "| acceptance (full / draft) |"
        )
        print("|---|---|---|---|---|---|---|")
        by_key = {r[:3]: r for r in rows}
        for d, k, b, tps, _, rate in sorted(full, key=lambda r: (r[2], r[0], r[1])):
            mine = by_key.get((d, k, b))
            ours = f"{mine[3] / plain:.2f}" if mine else "-"
            ours_rate = f"{mine[5]:.2f}" if mine else "-"
            print(f"| {d} | {k} | {b} | {tps:.1f} | {tps / plain:.2f} | {ours} | {rate:.2f} / {ours_rate} |")
    if plot_path:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 4))
        for k in sorted({r[1] for r in rows}):
            pts = sorted((d, tps / plain) for d, kk, b, tps, _, _ in rows if kk == k and b == 1)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=f"chain, draft_ahead {k}")
        pts = sorted((d, tps / plain) for d, kk, b, tps, _, _ in full if kk == 4 and b == 1)
        if pts:
            ax.plot(
                [p[0] for p in pts], [p[1] for p in pts], "x--", color="gray", label="chain, draft_ahead 4, full head"
            )
        for b in sorted({r[2] for r in rows if r[2] > 1}):
            pts = sorted((d, tps / plain) for d, kk, bb, tps, _, _ in rows if bb == b and kk == 4)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], "s", label=f"tree K={b}, draft_ahead 4")
        ax.axhline(1.0, color="gray", lw=0.8)
        ax.set_xlabel("draft_loops")
        ax.set_ylabel("speed vs plain decoding (verify_loops 8)")
        ax.legend()
        ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(plot_path, dpi=110)


if __name__ == "__main__":
    main(*sys.argv[1:3])
