"""The GPU check, both halves: `refs` (here, on the CPU engine) records the greedy tokens a GPU must reproduce;
`device` (on the GPU machine) checks them on `Engine(device="cuda")`, measures tinyloop's speed, the same weights in
`transformers` and the device's copy bandwidth, and writes one JSON for `scripts/gpu_report.py`.

    python scripts/gpu_check.py refs --out target/gpu-carry/refs.json
    python scripts/gpu_check.py device --refs target/gpu-carry/refs.json --out $OUT/gpu.json [--budget 420]

`--quick` (either half) runs the same code on small shapes and few tokens, and `--device candle-cpu` on the host, so
the device half can be tried here end to end (scripts/gpu-check.sh does both).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benches"))

PROMPTS = ["Once upon a time, there was", "The capital of France is", "def fib(n):\n   "]
BATCH_LOOPS = [8, 3, 8]  # one batched step holds requests of different depths
DRAFT = (2, 4)  # self-speculative: draft 2 loops, 4 tokens ahead, verify at 8


def models(tmp: Path, quick: bool) -> dict[str, Path]:
    """The check's models: the default model (F16, and Q4_0 by round to nearest) and the seed-shaped random model
    (dim 2048, 16 heads, ffn 8192, k 4; `--quick`: the benches' small shape) in BF16 and Q4_0, written from seed 0,
    so both machines build the same bytes (each file's SHA-256 is recorded)."""
    from quant_models import DEFAULT
    from tinyloop.modelfile.format import random_weights, write_model
    from tinyloop.modelfile.quantize import Options, quantize_file

    out = {"default F16": DEFAULT, "default Q4_0": tmp / "default-q4_0.tinyloop"}
    quantize_file(DEFAULT, out["default Q4_0"], Options(bits=4, progress=False))
    shape = seed_shape(quick)
    weights = random_weights(shape, seed=0)
    for wt in ("BF16", "Q4_0"):
        out[f"seed {wt}"] = tmp / f"seed-{wt}.tinyloop"
        write_model(out[f"seed {wt}"], shape, weights, weight_type=wt)
    return out


def seed_shape(quick: bool):
    from quant_models import SEED

    small = dict(dim=384, n_heads=6, n_kv_heads=6, ffn_dim=1024, block_count=2, name="small")
    return dataclasses.replace(SEED, **small) if quick else SEED


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def greedy(n: int, logprobs: int | None = None):
    from tinyloop import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=logprobs)


def batched(engine, prompts: list[list[int]], loops: list[int], n: int) -> list[list[int]]:
    """Greedy tokens of `prompts` generated together, one batched step at a time (the server's continuous batching)."""
    streams = [engine.stream(p, greedy(n), loops=lp) for p, lp in zip(prompts, loops, strict=True)]
    out: list[list[int]] = [[] for _ in prompts]
    while True:
        events = engine.step_many(streams)
        if all(e is None for e in events):
            return out
        for i, e in enumerate(events):
            if isinstance(e, Exception):
                raise e
            if e is not None and e.token_id >= 0:
                out[i].append(e.token_id)


def sequences(engine, n: int) -> dict[str, list[list[int]]]:
    prompts = [engine.encode(t) for t in PROMPTS]
    return {
        "plain": [engine.generate(p, greedy(n), loops=8).tokens for p in prompts],
        "batched": batched(engine, prompts, BATCH_LOOPS, n),
        "speculative": [engine.generate(p, greedy(n), loops=8, draft=DRAFT).tokens for p in prompts],
    }


def refs(args) -> None:
    import tinyloop

    n = 8 if args.quick else 32
    out = {"tokens": n, "models": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for name, path in models(Path(tmp), args.quick).items():
            if name not in ("default F16", "seed Q4_0"):
                continue
            engine = tinyloop.Engine(path)
            plain = [engine.generate(engine.encode(t), greedy(n, 2), loops=8) for t in PROMPTS]
            margins = [[top[0][1] - top[1][1] for _, top in c.logprobs] for c in plain]
            out["models"][name] = {"sha256": sha256(path), "sequences": sequences(engine, n), "margins": margins}
            print(f"{name}: reference tokens recorded", file=sys.stderr)
    Path(args.out).write_text(json.dumps(out))


def agreement(want: dict, got: dict) -> dict:
    """Per mode: sequences identical, and each differing sequence's first differing token."""
    report = {}
    for mode, seqs in want["sequences"].items():
        pairs = zip(seqs, got[mode], strict=True)
        firsts = [next((i for i, (a, b) in enumerate(zip(w, g, strict=False)) if a != b), None) for w, g in pairs]
        report[mode] = {"identical": sum(f is None for f in firsts), "of": len(seqs), "first_difference": firsts}
    report["cpu_margin_at_difference"] = [
        want["margins"][i][f] if f is not None else None for i, f in enumerate(report["plain"]["first_difference"])
    ]
    return report


def timed(f) -> float:
    start = time.perf_counter()
    f()
    return time.perf_counter() - start


def speed(engine, n: int, prefill: int) -> dict:
    """tokens/s: one stream's decode, 16 streams', a `prefill`-token prompt's (at most the context allows), one
    self-speculative stream's."""
    prompt = engine.encode(PROMPTS[0])
    engine.generate(prompt, greedy(4), loops=8)  # warm-up: kernels loaded, buffers allocated
    one = timed(lambda: engine.generate(prompt, greedy(n), loops=8)) - timed(
        lambda: engine.generate(prompt, greedy(1), loops=8)
    )
    many = timed(lambda: batched(engine, [prompt] * 16, [8] * 16, n))
    prefill = min(prefill, engine.info.max_seq_len - 1)  # the default model's context is 512: 511 then
    long = (engine.encode(" ".join(PROMPTS)) * prefill)[:prefill]
    pre = timed(lambda: engine.generate(long, greedy(1), loops=8))
    spec = timed(lambda: engine.generate(prompt, greedy(n), loops=8, draft=DRAFT))
    return {
        "decode_1": (n - 1) / one,
        "decode_16": 16 * n / many,
        "prefill": prefill / pre,
        "prefill_tokens": prefill,
        "speculative_1": n / spec,
    }


def bytes_per_token(path: Path, loops: int) -> int:
    """Weight bytes a decode step reads: the looped block `loops` times, the prelude, the final norm and the head."""
    import gguf

    r = gguf.GGUFReader(path)
    size = {t.name: int(t.n_bytes) for t in r.tensors}
    block = sum(v for k, v in size.items() if k.startswith("blk."))
    rest = sum(v for k, v in size.items() if k.startswith(("pre.", "output")))  # output.weight, if untied
    tied_head = size["token_embd.weight"] if "output.weight" not in size else 0
    return loops * block + rest + tied_head


def copy_bandwidth(torch, device: str) -> float:
    """Bytes/s of device-to-device copies of 1 GiB (each copy reads and writes it)."""
    n = 1 << 30 if device == "cuda" else 1 << 26
    x, y = torch.empty(n, dtype=torch.uint8, device=device), torch.empty(n, dtype=torch.uint8, device=device)
    y.copy_(x)
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(10):
        y.copy_(x)
    if device == "cuda":
        torch.cuda.synchronize()
    return 10 * 2 * n / (time.perf_counter() - start)


def peer(torch, device: str, quick: bool, n: int) -> float:
    """Tokens/s of the seed-shaped weights unrolled (k·8 layers, layer j sharing block layer j mod k's tensors: the
    same bytes read per token) as a `transformers` Llama in bf16, greedy `generate` with its static cache."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from tinyloop.modelfile.format import random_weights

    s = seed_shape(quick)
    w = random_weights(s, seed=0)
    cfg = LlamaConfig(
        vocab_size=s.vocab_size, hidden_size=s.dim, intermediate_size=s.ffn_dim, num_hidden_layers=s.block_count * 8,
        num_attention_heads=s.n_heads, num_key_value_heads=s.n_kv_heads, rms_norm_eps=s.rms_eps,
        rope_theta=s.rope_theta, max_position_embeddings=s.context_length, tie_word_embeddings=True,
    )  # fmt: skip
    torch.set_default_dtype(torch.bfloat16)
    with torch.device(device):  # built where it runs: initialising k·8 layers on the host would take minutes
        model = LlamaForCausalLM(cfg)
    torch.set_default_dtype(torch.float32)
    t = {
        k: torch.nn.Parameter(torch.from_numpy(v).to(device, torch.bfloat16), requires_grad=False) for k, v in w.items()
    }
    names = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
             "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
             "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm",
             "ffn_norm": "post_attention_layernorm"}  # fmt: skip
    for i, layer in enumerate(model.model.layers):
        for ours, theirs in names.items():
            mod = layer.get_submodule(theirs)
            mod.weight = t[f"blk.{i % s.block_count}.{ours}.weight"]
    model.model.embed_tokens.weight = t["token_embd.weight"]
    model.model.norm.weight = t["output_norm.weight"]
    model.lm_head.weight = t["token_embd.weight"]
    model.eval()
    ids = torch.tensor([[464, 3139, 286, 4881, 318]], device=device)
    kw = dict(do_sample=False, cache_implementation="static", pad_token_id=0)
    with torch.inference_mode():
        model.generate(ids, max_new_tokens=4, min_new_tokens=4, **kw)
        sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
        sync()
        full = timed(lambda: (model.generate(ids, max_new_tokens=n, min_new_tokens=n, **kw), sync()))
        first = timed(lambda: (model.generate(ids, max_new_tokens=1, min_new_tokens=1, **kw), sync()))
    return (n - 1) / (full - first)


def device(args) -> None:
    import tinyloop

    deadline = time.monotonic() + args.budget
    want = json.loads(Path(args.refs).read_text())
    import torch

    torch_device = "cuda" if args.device.startswith("cuda") else "cpu"
    out: dict = {"device": args.device, "torch": torch.__version__, "torch_cuda": torch.version.cuda}
    if torch_device == "cuda":
        out["name"] = torch.cuda.get_device_name(0)
    n, prefill = (8, 32) if args.quick else (64, 512)

    def save() -> None:  # after every part, so that a run cut short still reports what it measured
        Path(args.out).write_text(json.dumps(out, indent=1))

    out["copy_bandwidth"] = copy_bandwidth(torch, torch_device)
    save()
    # The peer first: every tinyloop figure of the seed-shaped model is read against it.
    out["transformers"] = {"seed": {"decode_1": peer(torch, torch_device, args.quick, n)}}
    if torch_device == "cuda":
        torch.cuda.empty_cache()  # its weights and static cache, before tinyloop allocates its own
    out["models"] = {}
    save()
    with tempfile.TemporaryDirectory() as tmp:
        for name, path in models(Path(tmp), args.quick).items():
            if time.monotonic() > deadline:
                out["models"][name] = {"skipped": "out of time"}
                continue
            engine = tinyloop.Engine(path, device=args.device)
            entry: dict = {"bytes_per_token": bytes_per_token(path, 8)}
            if name in want["models"]:
                ref = want["models"][name]
                entry["sha256_matches"] = sha256(path) == ref["sha256"]
                entry["agreement"] = agreement(ref, sequences(engine, want["tokens"]))
            entry["tinyloop"] = speed(engine, n, prefill)
            out["models"][name] = entry
            save()
            print(f"{name}: {json.dumps(entry)}", file=sys.stderr)
            del engine


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("half", choices=["refs", "device"])
    p.add_argument("--out", required=True)
    p.add_argument("--refs", help="device: the JSON `refs` wrote")
    p.add_argument("--device", default="cuda", help="device: where tinyloop computes (candle-cpu to try it here)")
    p.add_argument("--budget", type=float, default=420.0, help="device: seconds after which the rest is skipped")
    p.add_argument("--quick", action="store_true", help="small shapes and few tokens")
    args = p.parse_args()
    refs(args) if args.half == "refs" else device(args)


if __name__ == "__main__":
    main()
