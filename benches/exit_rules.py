"""Which exit rule could make adaptive depth pay on the default model: each held-out token's exit loop chosen by a
rule from what the model computes at each loop, and the perplexity of the tokens read at those exits — for the
settling rule `loops: "auto"` runs (successive loops' KL divergence over the file's exit vocabulary, else its draft
vocabulary, as the engine compares), an exit gate of Ouro's form trained for this model, confidence (top
probability), fixed depths, and two bounds: rules that know the last loop's full distribution at every loop (the
most any rule could learn to predict from the model's states), and an oracle that sees the target.

    python benches/exit_rules.py --json docs/exit_rules.json      # the table in docs/model.md

The model is the file's weights in the training code's PyTorch model (`training/model.py`). Every token's loops
read the earlier positions' full-depth K/V here, where decoding fills a stopped token's skipped loops from its exit
loop; `benches/auto_depth.py` measures the settling rule with that fill, within a few hundredths of a point of this.
The gate — `λ = σ(w · h + b)` on loop `j`'s normed state, the form `exit_gate.*` takes in a file, stopping once
`1 − Π (1 − λ_j)` reaches the threshold — is fitted by logistic regression (the model frozen) on the bundled
calibration text (training split) to say "loop `j` is within `--gate-delta` nats of the last loop's loss".

The bound: with `D_j` = KL(last loop ‖ loop `j`) over the full vocabulary — a token's expected extra loss at loop `j`
if the last loop's distribution were the truth — "stop once `D_j` < t" is the threshold form, and "stop at the loop
that minimizes `D_j + λ · j`" puts each loop where it removes the most expected loss: no assignment of exits with as
many loops in total has a smaller total `D`.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import sys
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "training"))

import tinyloop
from model import LoopedLM, TrainConfig
from quant_models import DEFAULT, HELDOUT, ROOT
from tinyloop.modelfile.draft_vocab import EXIT_KEY
from tinyloop.modelfile.draft_vocab import KEY as DRAFT_KEY
from tinyloop.modelfile.evaluate import held_out_ids
from train import load_tinyloop

CALIB = ROOT / "python" / "tinyloop" / "assets" / "calib.txt"
SETTLING = [0.03, 0.01, 0.005, 0.003, 0.002, 0.001]
GATE = [0.5, 0.8, 0.9, 0.95, 0.98, 0.99]
CONFIDENCE = [0.2, 0.3, 0.5, 0.7]
ORACLE = [0.02, 0.1]
LAST_KL = [0.05, 0.03, 0.02, 0.01, 0.005]
LAST_KL_PRICE = [0.03, 0.02, 0.015, 0.01, 0.007, 0.005]


def load(path: Path) -> tuple[LoopedLM, tinyloop.Engine, torch.Tensor | None]:
    """The file's weights in the PyTorch model, the engine (for its tokenizer), and the ids the settling rule compares
    over: the exit vocabulary, else the draft vocabulary, else none (the full head)."""
    import gguf

    engine = tinyloop.Engine(str(path))
    i = engine.info
    cfg = TrainConfig(
        dim=i.dim,
        n_heads=i.n_heads,
        n_kv_heads=i.n_kv_heads,
        ffn_dim=i.ffn_dim,
        block_count=i.block_count,
        prelude_count=i.prelude_count,
    )
    model = LoopedLM(cfg)
    load_tinyloop(model, path)
    reader = gguf.GGUFReader(path)
    field = next((f for f in map(reader.get_field, (EXIT_KEY, DRAFT_KEY)) if f is not None), None)
    settle_ids = torch.tensor([int(field.parts[j][0]) for j in field.data]) if field else None
    return model.eval(), engine, settle_ids


def read_out(model: LoopedLM, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A loop's normed state and its log-probabilities over the full vocabulary."""
    h = model.out_norm(state)[0]
    return h, F.log_softmax(h @ model.embed.weight.T, -1)


@torch.no_grad()
def per_loop(model: LoopedLM, ids: list[int], window: int, loops: int, settle_ids: torch.Tensor | None) -> dict:
    """For every predicted token and loop 1..`loops`: the normed state, the target's NLL, the KL divergence of the
    exit distribution from the previous loop's (inf at loop 1), the top probability, and the KL divergence of the
    full distribution from the last loop's."""
    out: dict[str, list] = {"h": [], "nll": [], "kl": [], "top": [], "kl_last": []}
    for s in tqdm(range(0, len(ids) - window, window), desc="per-loop states", leave=False):
        x = torch.tensor([ids[s : s + window]])
        y = torch.tensor(ids[s + 1 : s + window + 1])
        hs = model.hidden_states(x, loops, set(range(1, loops + 1)))
        rows: dict[str, list] = {k: [] for k in out}
        prev = None
        h_last, last = read_out(model, hs[loops])
        for d in range(1, loops + 1):
            h, logp = read_out(model, hs[d]) if d < loops else (h_last, last)
            small = F.log_softmax(h @ model.embed.weight[settle_ids].T, -1) if settle_ids is not None else logp
            kl = (small.exp() * (small - prev)).sum(-1) if prev is not None else torch.full((window,), math.inf)
            prev = small
            kl_last = (last.exp() * (last - logp)).sum(-1)
            values = (h, -logp.gather(1, y[:, None])[:, 0], kl, logp.max(-1).values.exp(), kl_last)
            for k, v in zip(rows, values, strict=True):
                rows[k].append(v)
        for k in out:
            out[k].append(torch.stack(rows[k], 1))
    return {k: torch.cat(v).numpy() for k, v in out.items()}


def fit_gate(h: np.ndarray, nll: np.ndarray, delta: float, steps: int = 400) -> tuple[torch.Tensor, torch.Tensor]:
    """Logistic regression of "loop j is within `delta` nats of the last loop" on loop j's normed state."""
    x = torch.from_numpy(h).reshape(-1, h.shape[-1])
    y = torch.from_numpy(nll - nll[:, -1:] < delta).float().reshape(-1)
    w, b = torch.zeros(h.shape[-1], requires_grad=True), torch.zeros(1, requires_grad=True)
    opt = torch.optim.Adam([w, b], lr=1e-2)
    for _ in range(steps):
        loss = F.binary_cross_entropy_with_logits(x @ w + b, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return w.detach(), b.detach()


def apply(stop: np.ndarray, nll: np.ndarray, min_loops: int) -> tuple[float, float]:
    """(mean loops, perplexity) when each token exits at its first loop ≥ `min_loops` where `stop` holds, else at
    the last."""
    stop = stop.copy()
    stop[:, : min_loops - 1] = False
    stop[:, -1] = True
    exit_ = stop.argmax(1)
    return float(exit_.mean() + 1), math.exp(float(nll[np.arange(len(exit_)), exit_].mean()))


def cheapest(cost: np.ndarray, price: float, nll: np.ndarray, min_loops: int) -> tuple[float, float]:
    """(mean loops, perplexity) when each token exits at the loop ≥ `min_loops` minimizing `cost + price · loop`."""
    total = cost[:, min_loops - 1 :] + price * np.arange(min_loops, cost.shape[1] + 1)
    exit_ = total.argmin(1) + min_loops - 1
    return float(exit_.mean() + 1), math.exp(float(nll[np.arange(len(exit_)), exit_].mean()))


def at_one_percent(rows: list[dict], rule: str) -> float | None:
    """The rule's mean loops where its perplexity is 1% over the last loop's, interpolated linearly between the two
    settings on either side (None when its settings do not straddle 1%)."""
    points = sorted((r["vs_last_pct"], r["mean_loops"]) for r in rows if r["rule"] == rule)
    for (p0, m0), (p1, m1) in itertools.pairwise(points):
        if p0 <= 1.0 <= p1:
            return m0 + (m1 - m0) * (1.0 - p0) / (p1 - p0) if p1 > p0 else m0
    return None


def rules(held: dict, gate: tuple[torch.Tensor, torch.Tensor], min_loops: int) -> list[dict]:
    nll, loops = held["nll"], held["nll"].shape[1]
    lam = torch.sigmoid(torch.from_numpy(held["h"]) @ gate[0] + gate[1]).numpy()
    reached = 1 - np.cumprod(1 - lam, axis=1)
    target_gap = nll - nll[:, -1:]
    rows = [("fixed", d, d, math.exp(float(nll[:, d - 1].mean()))) for d in range(1, loops + 1)]
    rows += [("settling (KL)", t, *apply(held["kl"] < t, nll, min_loops)) for t in SETTLING]
    rows += [("trained gate", t, *apply(reached >= t, nll, min_loops)) for t in GATE]
    rows += [("confidence", t, *apply(held["top"] > t, nll, min_loops)) for t in CONFIDENCE]
    rows += [("last-loop KL < t", t, *apply(held["kl_last"] < t, nll, min_loops)) for t in LAST_KL]
    rows += [("last-loop KL, priced", t, *cheapest(held["kl_last"], t, nll, min_loops)) for t in LAST_KL_PRICE]
    rows += [("oracle", t, *apply(target_gap < t, nll, min_loops)) for t in ORACLE]
    return [{"rule": r, "setting": s, "mean_loops": m, "perplexity": p} for r, s, m, p in rows]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, default=DEFAULT)
    ap.add_argument("--heldout", type=Path, default=HELDOUT)
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--window", type=int, default=256)
    ap.add_argument("--loops", type=int, default=8)
    ap.add_argument("--min-loops", type=int, default=2)
    ap.add_argument("--gate-delta", type=float, default=0.02)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    torch.set_flush_denormal(True)
    model, engine, settle_ids = load(args.model)
    calib = per_loop(model, engine.encode(CALIB.read_text(encoding="utf-8")), args.window, args.loops, settle_ids)
    gate = fit_gate(calib["h"], calib["nll"], args.gate_delta)
    ids = held_out_ids(engine, args.heldout.read_text(encoding="utf-8"), args.tokens)
    held = per_loop(model, ids, args.window, args.loops, settle_ids)
    result = rules(held, gate, args.min_loops)
    base = next(r["perplexity"] for r in result if r["rule"] == "fixed" and r["setting"] == args.loops)
    print(f"{len(held['nll'])} held-out tokens; gate fitted on {len(calib['nll'])} calibration tokens")
    print(f"{'rule':>14} {'setting':>8} {'mean loops':>10} {'ppl':>8} {'vs ' + str(args.loops):>7}")
    for r in result:
        r["vs_last_pct"] = 100 * (r["perplexity"] / base - 1)
        name, delta = f"{r['rule']:>14} {r['setting']:>8g}", f"{r['vs_last_pct']:+6.2f}%"
        print(f"{name} {r['mean_loops']:10.2f} {r['perplexity']:8.2f} {delta}")
    at_one = {rule: at_one_percent(result, rule) for rule in dict.fromkeys(r["rule"] for r in result)}
    print("mean loops at +1% (interpolated): " + ", ".join(f"{k} {v:.2f}" for k, v in at_one.items() if v))
    if args.json:
        meta = {k: getattr(args, k) for k in ("tokens", "window", "loops", "min_loops", "gate_delta")}
        meta["heldout_tokens"], meta["calibration_tokens"] = len(held["nll"]), len(calib["nll"])
        meta["loops_at_one_percent"] = at_one
        args.json.write_text(json.dumps({"model": args.model.name, **meta, "rows": result}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
