"""The default model in every weight type the quantizer writes, built once with `tinyloop quantize` and cached
under `.benchmarks/quant/` (rebuilt when the shipped model changes); and random models of the benches' shapes,
cached there too."""

from __future__ import annotations

from pathlib import Path

import gguf

import tinyloop
from tinyloop.modelfile.format import ModelConfig, random_weights, write_model

ROOT = Path(__file__).resolve().parents[1]
DEFAULT = Path(tinyloop.__file__).parent / "models" / "default.tinyloop"
CACHE = ROOT / ".benchmarks" / "quant"
# The held-out split when the training corpus has been built here (training/README.md), else the sample tests ship.
_CORPUS_HELDOUT = ROOT / "data" / "corpus" / "heldout.txt"
HELDOUT = _CORPUS_HELDOUT if _CORPUS_HELDOUT.exists() else ROOT / "tests" / "data" / "heldout_sample.txt"

# The 407M seed shape (dim 2048, 16 heads, ffn 8192, k = 4): its weights do not fit any cache, so a decode step
# streams them from memory.
SEED = ModelConfig(dim=2048, n_heads=16, n_kv_heads=16, ffn_dim=8192, block_count=4, context_length=1024, name="seed")


def random_model(cfg: ModelConfig, weight_type: str) -> Path:
    """A model of shape `cfg` with random weights stored as `weight_type`, built on first use."""
    CACHE.mkdir(parents=True, exist_ok=True)
    path = CACHE / f"{cfg.name}-{weight_type}.tinyloop"
    if not path.exists():
        write_model(path, cfg, random_weights(cfg, seed=0), weight_type=weight_type)
    return path


# name -> `tinyloop quantize` arguments (None: the shipped all-F16 file itself).
WEIGHTS: dict[str, list[str] | None] = {
    "fp16": None,
    "int8": ["--bits", "8"],
    "int4 RTN": ["--bits", "4"],
    "int4 GPTQ (Q4_0)": ["--bits", "4", "--method", "gptq", "--act-order"],
    "int4 GPTQ (Q4_1)": ["--bits", "4", "--method", "gptq", "--act-order", "--format", "q4_1"],
    "int2": ["--bits", "2"],
}


def model_path(name: str) -> Path:
    """The default model quantized as `name`, built on first use."""
    args = WEIGHTS[name]
    if args is None:
        return DEFAULT
    slug = "".join(c if c.isalnum() else "-" for c in name.lower())
    out = CACHE / f"default-{slug}.tinyloop"
    if not out.exists() or out.stat().st_mtime < DEFAULT.stat().st_mtime:
        from tinyloop.__main__ import main

        CACHE.mkdir(parents=True, exist_ok=True)
        if main(["quantize", str(DEFAULT), str(out), *args]) != 0:
            raise RuntimeError(f"tinyloop quantize {args} failed")
    return out


def weight_bytes(path: Path) -> dict[str, int]:
    """Bytes of the prelude layers, the looped block, and the head (the embedding table when tied)."""
    sizes = {t.name: int(t.n_bytes) for t in gguf.GGUFReader(str(path)).tensors}
    head = sizes.get("output.weight", sizes["token_embd.weight"])
    return {
        "prelude": sum(n for name, n in sizes.items() if name.startswith("pre.")),
        "block": sum(n for name, n in sizes.items() if name.startswith("blk.")),
        "head": head + sizes["output_norm.weight"],
    }
