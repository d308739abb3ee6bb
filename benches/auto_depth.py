"""Adaptive depth on the default model: for each exit threshold, the mean loops per token, the decode speed and the
held-out perplexity scored under the same exit rule (`Engine.score_auto`) — next to fixed depths measured the same
way, in one run.

    python benches/auto_depth.py --json docs/auto_depth.json --plot docs/auto_depth.png   # docs/model.md's curve
    python benches/auto_depth.py --tokens 0 --rounds 0 --thresholds 0.0025   # perplexity only, whole split
    python benches/auto_depth.py --tokens 32768 --rounds 0 --max-loops 6      # the same rules, capped at 6 loops

Perplexity: windows of `--window` held-out tokens, each read as a generation reads its output — the first token
through every loop, each later one through the loops its rule runs (fixed depths: every token through that many,
`Engine.score`, which a one-token-at-a-time decode reproduces). Speed: greedy decoding of `--new` tokens after each
of four prompts in `--rounds` interleaved rounds; each setting's best round, and the median over rounds of its
speed over fixed 8's in the same round (a shared machine's speed drifts by 10-30% within a minute; a ratio taken
within one round is what drifts least).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))

import tinyloop
from quant_models import DEFAULT, HELDOUT
from reporting import cpu_name
from tinyloop import AutoDepth, SamplingParams
from tinyloop.modelfile.evaluate import held_out_ids

FIXED = [2, 3, 4, 5, 6, 8]
THRESHOLDS = [0.1, 0.03, 0.01, 0.005, 0.003, 0.0025, 0.002, 0.001, 0.0003]
DRAFT = (2, 4)  # (draft_loops, draft_ahead) of the speculative rows
DRAFTED_THRESHOLD = 0.0025
PROMPTS = ["The king said unto his servants", "User: What is the sea?\nAssistant:", "In the beginning", "Q: Why"]


def windows(ids: list[int], window: int) -> list[list[int]]:
    return [ids[s : s + window + 1] for s in range(0, len(ids) - window, window)]


def fixed_ppl(engine, wins: list[list[int]]) -> dict[int, float]:
    nll = {d: 0.0 for d in FIXED}
    for w in tqdm(wins, desc="fixed depths", leave=False):
        for d, (logp, _) in zip(FIXED, engine.score(w, FIXED), strict=True):
            nll[d] -= sum(logp)
    count = sum(len(w) - 1 for w in wins)
    return {d: math.exp(v / count) for d, v in nll.items()}


def auto_ppl(engine, wins: list[list[int]], rule: AutoDepth) -> tuple[float, float]:
    """(perplexity, mean loops of the tokens the rule decided)."""
    nll, count, loops, decided = 0.0, 0, 0, 0
    for w in tqdm(wins, desc=f"threshold {rule.threshold}", leave=False):
        logp, depths = engine.score_auto(w, rule)
        nll -= sum(logp)
        count += len(logp)
        loops, decided = loops + sum(depths[1:]), decided + len(depths) - 1
    return math.exp(nll / count), loops / decided


def speed(engine, settings: list[dict], new: int, rounds: int) -> list[list[float]]:
    """Tokens per second of each setting (`generate`'s keywords: loops, draft) in each of `rounds` interleaved
    rounds."""
    params = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
    prompts = [engine.encode(p) for p in PROMPTS]
    tps: list[list[float]] = [[] for _ in settings]
    for _ in tqdm(range(rounds), desc="speed rounds", leave=False):
        for i, kw in enumerate(settings):
            start = time.perf_counter()
            for p in prompts:
                engine.generate(p, params, **kw)
            tps[i].append(len(prompts) * new / (time.perf_counter() - start))
    return tps


def median_ratio(rounds: list[float], base: list[float]) -> float:
    """The median over rounds of a setting's speed over the base setting's in the same round."""
    return statistics.median(a / b for a, b in zip(rounds, base, strict=True))


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    auto_label = f'loops "auto" (threshold; max_loops {result["max_loops"]})'
    for rows, style, label, name in (
        (result["fixed"], "o-", "fixed loops", lambda r: str(r["loops"])),
        (result["auto"], "s-", auto_label, lambda r: f"{r['threshold']:g}"),
    ):
        ax.plot([r["x_fixed_8"] for r in rows], [r["perplexity"] for r in rows], style, label=label)
        for r in rows:
            xy = (r["x_fixed_8"], r["perplexity"])
            ax.annotate(name(r), xy, textcoords="offset points", xytext=(4, 4), fontsize=7)
    base = next(r for r in result["fixed"] if r["loops"] == 8)["perplexity"]
    ax.axhline(base * 1.01, color="grey", lw=0.8, ls="--", label="loops 8 perplexity + 1%")
    ax.axvline(1.5, color="grey", lw=0.8, ls=":", label="1.5× loops 8's speed")
    ax.set_xlabel("greedy decode speed / loops 8's (median of interleaved rounds)")
    ax.set_ylabel("held-out perplexity")
    ax.set_title(f"Adaptive vs fixed depth, {result['model']} ({result['machine']})", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def tabulate(
    fixed: dict[int, float], thresholds: list[float], autos: list[tuple[float, float]], tps: list[list[float]]
) -> dict:
    """The result's rows: perplexities, mean loops, each setting's best round (`tokens_per_second`) and its median
    per-round ratio to fixed 8 (`x_fixed_8`), in `main`'s order of settings."""
    base = tps[FIXED.index(8)]

    def speed_of(i: int) -> dict:
        return {"tokens_per_second": max(tps[i]), "x_fixed_8": median_ratio(tps[i], base)}

    n = len(FIXED) + len(thresholds)
    drafted_ppl, drafted_loops = autos[-1]
    return {
        "fixed": [{"loops": d, "perplexity": fixed[d], **speed_of(i)} for i, d in enumerate(FIXED)],
        "auto": [
            {"threshold": th, "mean_loops": m, "perplexity": p, **speed_of(len(FIXED) + i)}
            for i, (th, (p, m)) in enumerate(zip(thresholds, autos, strict=False))
        ],
        "speculative": {
            "draft": list(DRAFT),
            "fixed_8": {"perplexity": fixed[8], **speed_of(n)},
            "auto_min_loops_3": {
                "threshold": DRAFTED_THRESHOLD,
                "perplexity": drafted_ppl,
                "mean_loops": drafted_loops,
                "plain": speed_of(n + 1),
                "drafted": speed_of(n + 2),
            },
        },
    }


def report(result: dict) -> None:
    base = next(r for r in result["fixed"] if r["loops"] == 8)
    print(f"{result['machine']}; {result['tokens']} held-out tokens; fixed 8: ppl {base['perplexity']:.2f}")
    print(f"auto rows: max_loops {result['max_loops']}")
    print(f"{'depth':>16} {'mean loops':>10} {'ppl':>8} {'vs 8':>7} {'best tok/s':>10} {'x 8 (median)':>12}")
    rows = [(f"fixed {r['loops']}", r["loops"], r) for r in result["fixed"]]
    rows += [(f"auto {r['threshold']:g}", r["mean_loops"], r) for r in result["auto"]]
    for name, loops, r in rows:
        rel = r["perplexity"] / base["perplexity"] - 1
        print(
            f"{name:>16} {loops:10.2f} {r['perplexity']:8.2f} {rel:+7.2%} {r['tokens_per_second']:10.1f} "
            f"{r['x_fixed_8']:12.2f}"
        )
    spec = result["speculative"]
    f8, auto = spec["fixed_8"], spec["auto_min_loops_3"]
    print(f"drafts {DRAFT}: fixed 8 {f8['tokens_per_second']:.1f} tok/s ({f8['x_fixed_8']:.2f} x 8)")
    print(
        f"auto {DRAFTED_THRESHOLD:g}, min_loops 3: {auto['mean_loops']:.2f} loops, ppl {auto['perplexity']:.2f} "
        f"({auto['perplexity'] / base['perplexity'] - 1:+.2%}); plain {auto['plain']['x_fixed_8']:.2f} x 8, "
        f"drafted {auto['drafted']['x_fixed_8']:.2f} x 8"
    )


def report_quality(
    fixed: dict[int, float], thresholds: list[float], autos: list[tuple[float, float]], tokens: int
) -> None:
    """Perplexity and mean loops alone (`--rounds 0`)."""
    base = fixed[8]
    print(f"{tokens} held-out tokens")
    for d, p in fixed.items():
        print(f"fixed {d}: ppl {p:.3f} ({p / base - 1:+.2%})")
    for th, (p, m) in zip(thresholds, autos, strict=True):
        print(f"auto {th:g}: {m:.3f} loops, ppl {p:.3f} ({p / base - 1:+.2%})")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, default=DEFAULT)
    ap.add_argument("--heldout", type=Path, default=HELDOUT)
    ap.add_argument("--tokens", type=int, default=8192, help="held-out tokens to score (0: the whole file)")
    ap.add_argument("--window", type=int, default=256)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3, help="speed rounds (0: perplexity and mean loops only)")
    ap.add_argument("--thresholds", default=None, help="comma-separated exit thresholds (default: the curve's)")
    ap.add_argument("--min-loops", type=int, default=2, help="the exit rules' min_loops (with --rounds 0)")
    ap.add_argument("--max-loops", type=int, default=8, help="the exit rules' max_loops, drafted rows' too")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--plot", type=Path, default=None)
    args = ap.parse_args()
    if args.rounds > 0 and args.min_loops != 2:
        ap.error("--min-loops chooses the rules of a perplexity-only run (--rounds 0); drafted rows use 3")
    engine = tinyloop.Engine(str(args.model))
    text = args.heldout.read_text(encoding="utf-8")
    wins = windows(held_out_ids(engine, text, args.tokens or len(text)), args.window)
    chosen = [float(t) for t in args.thresholds.split(",")] if args.thresholds else THRESHOLDS
    rules = [AutoDepth(min_loops=args.min_loops, max_loops=args.max_loops, threshold=t) for t in chosen]
    if args.rounds == 0:
        autos = [auto_ppl(engine, wins, r) for r in rules]
        report_quality(fixed_ppl(engine, wins), chosen, autos, sum(len(w) - 1 for w in wins))
        return 0
    # drafts need draft_loops < min_loops
    drafted = AutoDepth(min_loops=3, max_loops=args.max_loops, threshold=DRAFTED_THRESHOLD)
    fixed = fixed_ppl(engine, wins)
    autos = [auto_ppl(engine, wins, r) for r in [*rules, drafted]]
    settings = [{"loops": d} for d in FIXED] + [{"loops": r} for r in rules]
    settings += [{"loops": 8, "draft": DRAFT}, {"loops": drafted}, {"loops": drafted, "draft": DRAFT}]
    tps = speed(engine, settings, args.new, args.rounds)
    result = {
        "machine": f"{cpu_name()}, {len(__import__('os').sched_getaffinity(0))} threads",
        "model": args.model.name,
        "tokens": sum(len(w) - 1 for w in wins),
        "window": args.window,
        "rounds": args.rounds,
        "max_loops": args.max_loops,
        **tabulate(fixed, chosen, autos, tps),
    }
    report(result)
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    if args.plot:
        plot(result, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
