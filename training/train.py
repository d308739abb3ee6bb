"""Train the default looped model on the corpus, on this CPU (or a GPU when there is one), within a time budget.

    python training/corpus.py --out data/corpus
    python training/train.py --data data/corpus --out data/run --minutes 70
    python training/export.py data/run/model.pt python/tinyloop/models/default.tinyloop

The loop knob is trained on purpose (LayerSkip / Ouro style): each step samples the loop count L and takes the loss
at several exits through the shared norm and head: loops 1 and 2 (the drafts), L/2 and L. The final exit carries
most of the weight so that depth keeps paying; the shallow exits are scored on a random eighth of the positions,
which keeps the 50,257-wide head from dominating the step (`--exit-weights` names other exits and weights). With
`--distill-from`, the last exit is also pulled toward a frozen teacher's distribution, and `--exit-distill` pulls the
shallow exits toward it too, so that the early loops give the last one's answer where they can — what lets adaptive
depth (`loops="auto"`) stop sooner. The learning rate follows warmup + cosine over the *time* budget, so a run
always ends annealed.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import shutil
import sys
import time
from pathlib import Path

import numpy as np

from tinyloop.extras import require_or_exit

try:
    import torch
    import torch.nn.functional as F
except ModuleNotFoundError:
    require_or_exit("train", "training", "torch")  # one line naming the extra, exit 2
    raise

sys.path.insert(0, str(Path(__file__).resolve().parent))
from model import TENSOR_PARTS, LoopedLM, TrainConfig, kv_drift

EOT = 50256


def tokenize(path: Path) -> np.ndarray:
    """Token ids of a corpus split (cached next to it as .bin, which is read alone where the text is absent):
    passages separated by end-of-text, which may also appear inside a passage (a chat's closed assistant turns)."""
    cache = path.with_suffix(".bin")
    if cache.exists() and (not path.exists() or cache.stat().st_mtime > path.stat().st_mtime):
        return np.fromfile(cache, dtype=np.uint16)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))
    from tinyloop.modelfile.vocab import tiktoken_gpt2

    enc = tiktoken_gpt2()
    ids: list[int] = []
    for passage in path.read_text().split("\n<|endoftext|>\n"):
        if passage.strip():
            for piece in passage.split("<|endoftext|>"):
                ids.extend(enc.encode_ordinary(piece))
                ids.append(EOT)
    arr = np.asarray(ids, dtype=np.uint16)
    arr.tofile(cache)
    return arr


def batches(data: np.ndarray, batch: int, ctx: int, rng: np.random.Generator):
    while True:
        starts = rng.integers(0, len(data) - ctx - 1, size=batch)
        x = np.stack([data[s : s + ctx] for s in starts]).astype(np.int64)
        y = np.stack([data[s + 1 : s + ctx + 1] for s in starts]).astype(np.int64)
        yield torch.from_numpy(x), torch.from_numpy(y)


def head_loss(
    model: LoopedLM, h: torch.Tensor, y: torch.Tensor, target: torch.Tensor | None = None, weight: float = 0.0
) -> torch.Tensor:
    """Cross-entropy of the head at states `h` against `y`; with `target` (log-probabilities per position), plus
    `weight` times KL(target ‖ head), from the same logits."""
    logits = model.logits(h).float()
    loss = F.cross_entropy(logits, y)
    if target is not None:
        loss = loss + weight * F.kl_div(logits.log_softmax(-1), target, log_target=True, reduction="batchmean")
    return loss


def exit_loss(
    model: LoopedLM,
    h: torch.Tensor,
    y: torch.Tensor,
    frac: float,
    gen: torch.Generator,
    loss_fn=head_loss,
    target: torch.Tensor | None = None,
    weight: float = 0.0,
) -> torch.Tensor:
    """`loss_fn` at one exit, on a random `frac` of its positions (the same positions of `target`, when given)."""
    h, y = h.reshape(-1, h.shape[-1]), y.reshape(-1)
    target = None if target is None else target.reshape(-1, target.shape[-1])
    if frac < 1.0:
        keep = torch.randperm(h.shape[0], generator=gen)[: int(h.shape[0] * frac)]
        h, y = h[keep], y[keep]
        target = None if target is None else target[keep]
    return loss_fn(model, h, y) if target is None else loss_fn(model, h, y, target, weight)


@torch.no_grad()
def teacher_logprobs(teacher: LoopedLM, x: torch.Tensor, loops: int) -> torch.Tensor:
    """The teacher's (a frozen copy of the starting weights) next-token log-probabilities at `loops`, reading `x`
    with its per-loop cache."""
    return teacher.logits(teacher.hidden_states(x, loops, {loops})[loops]).float().log_softmax(-1)


def distill_loss(model: LoopedLM, target: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """KL(teacher ‖ model) of the next-token distributions, per position: `target` from `teacher_logprobs`, the
    model's states `h` however this step read them — so shared-cache steps learn to give what the per-loop model
    gives, and the others keep giving it."""
    logp = model.logits(h).float().log_softmax(-1)
    return F.kl_div(logp.flatten(0, -2), target.flatten(0, -2), log_target=True, reduction="batchmean")


def exit_depths(weights: dict[str, float], loops: int) -> dict[int, float]:
    """The exits of a step `loops` deep and their weights, from `--exit-weights`: its keys are loop numbers, `half`
    (loops // 2) and `last` (loops itself); a loop number at or past `loops` has no exit in that step, and keys that
    name the same loop add their weights."""
    exits: dict[int, float] = {}
    for key, w in weights.items():
        d = loops if key == "last" else max(1, loops // 2) if key == "half" else int(key)
        if d < loops or key == "last":
            exits[d] = exits.get(d, 0.0) + w
    return exits


def parse_exit_weights(text: str) -> dict[str, float]:
    """`--exit-weights` as {key: weight}: keys `last` (required), `half` or loop numbers ≥ 1, weights ≥ 0."""
    try:
        weights = {k.strip(): float(v) for k, v in (kv.split(":") for kv in text.split(","))}
    except ValueError:
        raise SystemExit(f"--exit-weights {text!r}: expected KEY:WEIGHT pairs separated by commas") from None
    bad = [k for k in weights if k not in ("half", "last") and not (k.isdigit() and int(k) >= 1)]
    if bad or "last" not in weights or any(w < 0 for w in weights.values()):
        raise SystemExit(f"--exit-weights {text!r}: keys are loop numbers, half or last (required), weights ≥ 0")
    return weights


def compile_hot_paths(model: LoopedLM):
    """torch.compile the shared layers and the norm + head + loss (1.5x the eager step on these CPUs: it fuses the
    elementwise work around the matmuls). Shapes are static per exit, so each compiles once or twice."""
    for layer in [*model.prelude, *model.block]:
        layer.forward = torch.compile(layer.forward, dynamic=False)
    return torch.compile(head_loss, dynamic=False)


@torch.no_grad()
def evaluate(
    model: LoopedLM, data: np.ndarray, ctx: int, depths: list[int], max_tokens: int, kv_share: int = 0
) -> dict[int, float]:
    """Held-out perplexity at each depth (non-overlapping windows); with `kv_share` (passes, see
    `LoopedLM.hidden_states`), each depth as decoding with `kv_share="last"` at that depth reads it."""
    model.eval()
    device = model.embed.weight.device
    n = min(len(data) - 1, max_tokens) // ctx
    x = torch.from_numpy(data[: n * ctx].astype(np.int64)).view(n, ctx).to(device)
    y = torch.from_numpy(data[1 : n * ctx + 1].astype(np.int64)).view(n, ctx).to(device)
    totals = {d: 0.0 for d in depths}
    for i in range(0, n, 8):
        if kv_share:
            hs = {d: model.hidden_states(x[i : i + 8], d, {d}, kv_share)[d] for d in depths}
        else:
            hs = model.hidden_states(x[i : i + 8], max(depths), set(depths))
        for d in depths:
            logits = model.logits(hs[d].float())
            totals[d] += F.cross_entropy(
                logits.view(-1, logits.shape[-1]), y[i : i + 8].reshape(-1), reduction="sum"
            ).item()
    model.train()
    return {d: math.exp(t / (n * ctx)) for d, t in totals.items()}


def record_eval(args, model, held, log, step: int, tokens: int, depths: list[int], max_tokens: int, shared: bool):
    """Evaluate per loop at `depths` (and at loops 8 through the shared cache when the run trains for it), append the
    figures to the log and return them as one printable line."""
    ppl = evaluate(model, held, args.context, depths, max_tokens)
    kv = evaluate(model, held, args.context, [8], max_tokens, args.kv_share_passes) if shared else {}
    log["evals"].append({"step": step, "tokens": tokens, "ppl": ppl, "kv_share_ppl": kv})
    return f"held-out ppl {ppl}" + (f", with kv_share {kv}" if kv else "")


def load_tinyloop(model: LoopedLM, path: Path) -> None:
    """Copy the weights of a `.tinyloop` file into `model` (dequantizing quantized tensors)."""
    import gguf

    reader = gguf.GGUFReader(path)
    arrays = {}
    for t in reader.tensors:
        shape = tuple(int(x) for x in reversed(t.shape))
        data = gguf.quants.dequantize(t.data, t.tensor_type) if t.tensor_type not in (0, 1) else t.data
        arrays[t.name] = torch.from_numpy(np.asarray(data, dtype=np.float32).reshape(shape).copy())
    own = {k: v for k, v in model.export_weights().items()}
    missing = set(own) - set(arrays)
    if missing or any(tuple(arrays[k].shape) != own[k].shape for k in own):
        raise SystemExit(f"{path} does not match the model being trained (missing {sorted(missing)[:3]})")
    parts = TENSOR_PARTS
    with torch.no_grad():
        model.embed.weight.copy_(arrays["token_embd.weight"])
        model.out_norm.weight.copy_(arrays["output_norm.weight"])
        for prefix, layers in (("pre", model.prelude), ("blk", model.block)):
            for i, layer in enumerate(layers):
                for name, attr in parts.items():
                    getattr(layer, attr).weight.copy_(arrays[f"{prefix}.{i}.{name}.weight"])


def save(path: Path, cfg: TrainConfig, model: LoopedLM, opt: torch.optim.Optimizer, tokens: int) -> None:
    torch.save({"cfg": cfg.__dict__, "state": model.state_dict(), "opt": opt.state_dict(), "tokens": tokens}, path)


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", type=Path, default=Path("data/corpus"))
    ap.add_argument("--out", type=Path, default=Path("data/run"))
    ap.add_argument("--minutes", type=float, default=70.0)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--ffn", type=int, default=704)
    ap.add_argument("--k", type=int, default=2)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--loops-min", type=int, default=4)
    ap.add_argument("--loops-max", type=int, default=10)
    ap.add_argument(
        "--exit-weights",
        type=str,
        default="1:0.1,2:0.2,half:0.2,last:1.0",
        help="KEY:WEIGHT pairs: the exits each step scores (loop numbers, half = L // 2, last = L) and their weights",
    )
    ap.add_argument("--shallow-frac", type=float, default=0.125)
    ap.add_argument(
        "--kv-share-frac",
        type=float,
        default=0.0,
        help="share of steps trained as kv_share='last' decoding reads the model (final exit only)",
    )
    ap.add_argument(
        "--kv-share-passes",
        type=int,
        default=2,
        help="passes that approach decoding's shared K/V in those steps and in the evaluation (1: a plain forward's)",
    )
    ap.add_argument(
        "--kv-match-weight",
        type=float,
        default=0.0,
        help="weight of the K/V drift across loops (model.kv_drift) in the other steps' loss: pulls every loop's "
        "K/V toward the last loop's, which the shared cache reads",
    )
    ap.add_argument(
        "--distill-from",
        type=Path,
        default=None,
        help="a .tinyloop file whose per-loop next-token distributions the final exit is also pulled toward",
    )
    ap.add_argument("--distill-weight", type=float, default=1.0, help="weight of that KL term in the loss")
    ap.add_argument(
        "--exit-distill",
        type=float,
        default=0.0,
        help="with --distill-from: each shallow exit also adds this weight times KL from the teacher's distribution "
        "at the step's depth, pulling the early loops toward the answer the last one gives (an exit settles sooner)",
    )
    ap.add_argument("--eval-every", type=float, default=10.0, help="minutes between held-out evaluations")
    ap.add_argument(
        "--keep-checkpoints",
        action="store_true",
        help="also keep each periodic evaluation's checkpoint, as model.step<N>.pt beside model.pt",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--resume", type=Path, default=None, help="continue from a model.pt (weights and optimizer)")
    ap.add_argument(
        "--init-from",
        type=Path,
        default=None,
        help="start from the weights of a .tinyloop file (e.g. the shipped default model)",
    )
    ap.add_argument("--no-compile", action="store_true", help="run eagerly (torch.compile needs a C++ compiler)")
    ap.add_argument("--cpu-bf16", action="store_true", help="bf16 autocast on CPU (fast only with AMX)")
    return ap.parse_args()


def build(args: argparse.Namespace, device: str):
    """The model (fresh, resumed or initialised from a .tinyloop file), its optimizer, and the tokens the resumed
    checkpoint had already seen."""
    cfg = TrainConfig(
        dim=args.dim,
        n_heads=args.heads,
        n_kv_heads=args.heads,
        ffn_dim=args.ffn,
        block_count=args.k,
        context=args.context,
    )
    model = LoopedLM(cfg).to(device)
    resumed = torch.load(args.resume, map_location=device) if args.resume else None
    if resumed:
        if resumed["cfg"] != cfg.__dict__:
            raise SystemExit(f"--resume checkpoint has config {resumed['cfg']}, not {cfg.__dict__}")
        model.load_state_dict(resumed["state"])
    if args.init_from:
        load_tinyloop(model, args.init_from)
    decay, no_decay = [], []
    for p in model.parameters():
        (no_decay if p.ndim < 2 else decay).append(p)
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr,
        betas=(0.9, 0.95),
    )
    if resumed and "opt" in resumed:
        opt.load_state_dict(resumed["opt"])
    prior = resumed.get("tokens", 0) if resumed else 0
    return cfg, model, opt, prior


def train_step(args, model, opt, x, y, lr: float, weights: dict[str, float], amp, gen, loss_fn, teacher=None):
    """One optimizer step at a random depth L, with losses at the exits `exit_depths` gives (and the teacher's KL
    at the last exit, at the shallow ones with `--exit-distill`, and the K/V drift, when asked for); returns
    (L, losses)."""
    for g in opt.param_groups:
        g["lr"] = lr
    L = random.randint(args.loops_min, args.loops_max)
    shared = random.random() < args.kv_share_frac
    exits = exit_depths(weights, L)
    if shared:  # the shallow exits read the deeper loops' K/V here, which no decoding does: the final exit only
        exits = {L: exits[L]}
    trace = [] if args.kv_match_weight and not shared else None
    with amp:
        target = teacher_logprobs(teacher, x, L) if teacher is not None else None
        hs = model.hidden_states(x, L, set(exits), args.kv_share_passes if shared else 0, trace)
        losses = {}
        for d in exits:
            shallow = args.exit_distill if d < L else 0.0
            frac = 1.0 if d == L else args.shallow_frac
            losses[d] = exit_loss(model, hs[d], y, frac, gen, loss_fn, target if shallow else None, shallow)
        loss = sum(exits[d] * losses[d] for d in exits) / sum(exits.values())
        if target is not None:
            losses["distill"] = distill_loss(model, target, hs[L])
            loss = loss + args.distill_weight * losses["distill"]
        if trace:
            losses["kv_drift"] = kv_drift(trace)
            loss = loss + args.kv_match_weight * losses["kv_drift"]
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    return L, losses


def main() -> int:
    args = parse_args()
    weights = parse_exit_weights(args.exit_weights)
    if args.exit_distill and not args.distill_from:
        raise SystemExit("--exit-distill needs --distill-from (the teacher whose distribution the exits learn)")
    torch.manual_seed(args.seed)
    random.seed(args.seed)
    torch.set_flush_denormal(True)  # tiny softmax tails otherwise turn CPU matmuls 10x slower
    device = "cuda" if torch.cuda.is_available() else "cpu"
    # bf16 autocast only where it is fast: on CPUs without AMX / AVX512-BF16 (like these) it is 3x slower than f32.
    amp = torch.autocast(device, dtype=torch.bfloat16, enabled=device == "cuda" or args.cpu_bf16)
    cfg, model, opt, prior = build(args, device)
    loss_fn = head_loss if args.no_compile else compile_hot_paths(model)
    teacher = None
    if args.distill_from:
        teacher = LoopedLM(cfg).to(device).eval().requires_grad_(False)
        load_tinyloop(teacher, args.distill_from)
    train = tokenize(args.data / "train.txt")
    held = tokenize(args.data / "heldout.txt")
    n_params = sum(p.numel() for p in model.parameters())
    print(f"train {len(train):,} tokens, held-out {len(held):,}; {n_params:,} params", flush=True)
    sharing = bool(args.kv_share_frac or args.kv_match_weight)
    gen = torch.Generator().manual_seed(args.seed)
    # A resumed run draws fresh windows: seeded by the seed alone, it would draw the first run's windows again, in
    # the same order.
    data = batches(
        train, args.batch, args.context, np.random.default_rng(args.seed if prior == 0 else [args.seed, prior])
    )
    args.out.mkdir(parents=True, exist_ok=True)
    log = {"args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}, "steps": [], "evals": []}
    if prior or args.init_from:  # where the run starts from, on the same windows as its later evaluations
        print(f"  at the start: {record_eval(args, model, held, log, 0, 0, [1, 2, 4, 8], 16384, sharing)}", flush=True)
    budget = args.minutes * 60
    start = last_eval = time.time()
    step, tokens, ema = 0, 0, None
    while (elapsed := time.time() - start) < budget:
        lr = args.lr * min(1.0, (step + 1) / 100) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * elapsed / budget)))
        x, y = (t.to(device) for t in next(data))
        L, losses = train_step(args, model, opt, x, y, lr, weights, amp, gen, loss_fn, teacher)
        step, tokens = step + 1, tokens + x.numel()
        final = losses[L].item()
        ema = final if ema is None else 0.98 * ema + 0.02 * final
        losses_at = {f"loss@{d}" if isinstance(d, int) else d: round(v.item(), 4) for d, v in losses.items()}
        log["steps"].append({"step": step, "t": round(elapsed, 1), "L": L, "lr": lr, **losses_at})
        if step % 20 == 0:
            print(
                f"step {step:5d}  {elapsed / 60:5.1f}/{args.minutes:.0f} min  {tokens / elapsed:6.0f} tok/s  "
                f"L={L:2d}  loss@L {final:.3f} (ema {ema:.3f})  loss@1 {losses.get(1, losses[L]).item():.3f}  "
                + "".join(f"{k} {losses[k].item():.3f}  " for k in ("distill", "kv_drift") if k in losses)
                + f"lr {lr:.2e}",
                flush=True,
            )
        if time.time() - last_eval > args.eval_every * 60:
            print(f"  {record_eval(args, model, held, log, step, tokens, [1, 2, 4, 8], 16384, sharing)}", flush=True)
            last_eval = time.time()
            save(args.out / "model.pt", cfg, model, opt, prior + tokens)
            if args.keep_checkpoints:
                shutil.copyfile(args.out / "model.pt", args.out / f"model.step{step}.pt")  # not serialized twice
    line = record_eval(args, model, held, log, step, tokens, [1, 2, 3, 4, 6, 8, 12, 16], 65536, sharing)
    ppl = log["evals"][-1]["ppl"]
    minutes = (time.time() - start) / 60
    log["final"] = {"steps": step, "tokens": tokens, "total_tokens": prior + tokens, "minutes": minutes, "ppl": ppl}
    print(f"done: {step} steps, {tokens:,} tokens; {line}", flush=True)
    save(args.out / "model.pt", cfg, model, opt, prior + tokens)
    (args.out / "log.json").write_text(json.dumps(log))
    return 0


if __name__ == "__main__":
    sys.exit(main())
