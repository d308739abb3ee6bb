"""Where a speculative round's time goes on the default model: the cost of one plain decode step at verify depth,
one draft step, and one verification pass of k rows, each timed through the engine's raw sequence API.

    python benches/profile_speculative.py [--draft-loops 2] [--verify-loops 8] [--ahead 4]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import tinyloop


def timed(fn, repeat: int = 20) -> float:
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--draft-loops", type=int, default=2)
    ap.add_argument("--verify-loops", type=int, default=8)
    ap.add_argument("--ahead", type=int, default=4)
    args = ap.parse_args()
    engine = tinyloop.Engine(Path(tinyloop.__file__).parent / "models" / "default.tinyloop")
    prompt = engine.encode("In the beginning God created the heaven and the earth. And the earth was without form")
    d, L, k = args.draft_loops, args.verify_loops, args.ahead

    def step(loops: int, rows: int):
        seq = engine.sequence()
        seq.feed(prompt, L)  # a full-depth prefix, as in generation
        return lambda: (seq.feed(prompt[:rows], loops), seq.truncate(len(prompt)))

    plain = timed(step(L, 1))
    draft = timed(step(d, 1))
    one_loop = timed(step(1, 1))
    verify_rows = timed(step(L, k))
    print(f"plain decode step (1 row, loops {L} + head):  {plain * 1e3:7.2f} ms")
    print(f"draft step       (1 row, loops {d} + head):  {draft * 1e3:7.2f} ms")
    print(f"one loop + head  (1 row):                  {one_loop * 1e3:7.2f} ms")
    print(f"{k}-row pass       (loops {L} + head, upper bound of a verify pass): {verify_rows * 1e3:7.2f} ms")
    round_cost = k * draft + verify_rows
    print(
        f"round of {k} drafts + verify ≈ {round_cost * 1e3:.2f} ms = {round_cost / plain:.2f} plain steps; "
        f"break-even needs {round_cost / plain:.2f} tokens per round (at most {k})"
    )


if __name__ == "__main__":
    main()
