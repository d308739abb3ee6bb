"""`tinyloop export-llama IN.tinyloop OUT.gguf [--loops L]`: the unrolled model as a llama-architecture GGUF.

A looped model at depth L is, token for token, a plain transformer with `prelude + k·L` layers in which layer
`prelude + l·k + j` is block layer j (docs/architecture.md). llama.cpp's "llama" architecture is that transformer
(RMSNorm pre-norm, SwiGLU, adjacent-pair "norm" RoPE, GQA, optional Q/K/V biases, tied head when `output.weight` is
absent), so the export copies every tensor's bytes unchanged — same types, no requantization — and repeats the
block's tensors for each loop. The tokenizer keys are copied as they are; RoPE scaling becomes llama.cpp's (linear:
`rope.scaling.*` keys; Llama 3's: the `rope_freqs.weight` factors).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import gguf
import numpy as np

from .._core import MAX_LOOPS

_SCALARS = {  # tinyloop key -> llama key
    "context_length": "context_length",
    "embedding_length": "embedding_length",
    "feed_forward_length": "feed_forward_length",
    "attention.head_count": "attention.head_count",
    "attention.head_count_kv": "attention.head_count_kv",
    "attention.layer_norm_rms_epsilon": "attention.layer_norm_rms_epsilon",
    "rope.freq_base": "rope.freq_base",
}
_FILE_TYPE = "general.file_type"


class ExportError(ValueError):
    pass


def _value(field: gguf.ReaderField):
    """A scalar, string or array value of a GGUF field, as Python values."""
    types = field.types
    if types[0] == gguf.GGUFValueType.STRING:
        return bytes(field.parts[field.data[0]]).decode("utf-8")
    if types[0] == gguf.GGUFValueType.ARRAY:
        if types[1] == gguf.GGUFValueType.STRING:
            return [bytes(field.parts[i]).decode("utf-8", errors="surrogateescape") for i in field.data]
        return [field.parts[i].tolist()[0] for i in field.data]
    return field.parts[field.data[0]].tolist()[0]


def _open(path: Path) -> gguf.GGUFReader:
    if not path.is_file():
        raise ExportError(f"{path}: no such file")
    try:
        reader = gguf.GGUFReader(path)
    except Exception as e:  # the gguf reader raises bare ValueErrors / struct errors on foreign files
        raise ExportError(f"{path}: not a GGUF file ({e})") from e
    fields = reader.fields
    arch = _value(fields["general.architecture"]) if "general.architecture" in fields else None
    if arch != "tinyloop":
        raise ExportError(f"{path}: general.architecture is {arch!r}, not 'tinyloop'")
    return reader


def _write_keys(w: gguf.GGUFWriter, fields: dict, loops: int, n_layers: int) -> None:
    """The llama keys: the model's scalars under llama's names, the layer count, the tokenizer unchanged."""
    w.add_name(f"{_value(fields['general.name'])} (unrolled, {loops} loops)")
    if _FILE_TYPE in fields:
        w.add_file_type(int(_value(fields[_FILE_TYPE])))
    for ours, theirs in _SCALARS.items():
        value = _value(fields[f"tinyloop.{ours}"])
        vtype = gguf.GGUFValueType.FLOAT32 if isinstance(value, float) else gguf.GGUFValueType.UINT32
        w.add_key_value(f"llama.{theirs}", value, vtype)
    heads = int(_value(fields["tinyloop.attention.head_count"]))
    w.add_block_count(n_layers)
    w.add_rope_dimension_count(int(_value(fields["tinyloop.embedding_length"])) // heads)
    scaling = {n.rsplit(".", 1)[1]: _value(f) for n, f in fields.items() if n.startswith("tinyloop.rope.scaling.")}
    if scaling.get("type") == "linear":  # Llama 3's scaling travels as rope_freqs.weight (`_rope_factors`)
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(float(scaling["factor"]))
    for name, field in fields.items():
        if name.startswith("tokenizer."):
            sub = field.types[1] if len(field.types) > 1 else None
            w.add_key_value(name, _value(field), field.types[0], sub)
    w.add_vocab_size(len(_value(fields["tokenizer.ggml.tokens"])))


def _tensor_plan(tensors: dict, prelude: int, k: int, loops: int) -> list[tuple[str, str]]:
    """(llama tensor, tinyloop tensor) pairs: the prelude layers, then the block's k layers once per loop."""
    plan: list[tuple[str, str]] = [("token_embd.weight", "token_embd.weight")]
    for i in range(prelude):
        plan += [(f"blk.{i}.{n}", f"pre.{i}.{n}") for n in _layer_names(tensors, f"pre.{i}.")]
    for lp in range(loops):
        for j in range(k):
            plan += [(f"blk.{prelude + lp * k + j}.{n}", f"blk.{j}.{n}") for n in _layer_names(tensors, f"blk.{j}.")]
    plan.append(("output_norm.weight", "output_norm.weight"))
    if "output.weight" in tensors:
        plan.append(("output.weight", "output.weight"))
    return plan


def export_llama(
    src: str | os.PathLike[str], dst: str | os.PathLike[str], loops: int | None = None, progress: bool = True
) -> int:
    """Write the unrolled llama GGUF of `src` at depth `loops` (default: the model's); returns the layer count."""
    reader = _open(Path(src))
    fields = reader.fields
    loops = loops if loops is not None else int(_value(fields["tinyloop.loops.default"]))
    if not 1 <= loops <= MAX_LOOPS:
        raise ExportError(f"--loops must be in 1..{MAX_LOOPS}, got {loops}")
    looped_norms = "tinyloop.loop_norm" in fields and _value(fields["tinyloop.loop_norm"])
    if looped_norms or any(t.name.endswith("_post_norm.weight") for t in reader.tensors):
        raise ExportError(
            f"{src}: its layers' post-norms and per-loop final norm (Ouro's) have no form in llama.cpp's llama "
            "architecture"
        )
    k, prelude = int(_value(fields["tinyloop.block_count"])), int(_value(fields["tinyloop.prelude_count"]))
    n_layers = prelude + k * loops
    w = gguf.GGUFWriter(str(dst), "llama")
    _write_keys(w, fields, loops, n_layers)
    tensors = {t.name: t for t in reader.tensors}
    plan = _tensor_plan(tensors, prelude, k, loops)
    factors = _rope_factors(fields)
    if factors is not None:
        w.add_tensor("rope_freqs.weight", factors)
    for out_name, in_name in plan:
        t = tensors[in_name]
        # Quantized tensors come as (rows, bytes per row) uint8 and are written back as the same blocks.
        w.add_tensor(out_name, np.asarray(t.data), raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file(progress=progress)
    w.close()
    if progress:
        print(
            f"wrote {dst}: {n_layers} llama layers ({prelude} prelude + {k} x {loops} loops), {len(plan)} tensors",
            file=sys.stderr,
        )
    return n_layers


def _rope_factors(fields: dict) -> np.ndarray | None:
    """llama.cpp's `rope_freqs.weight` for Llama 3 RoPE scaling: per frequency, unscaled ÷ scaled (llama.cpp
    divides each frequency by it)."""
    from .calibrate import inv_freq

    scaling = {n.rsplit(".", 1)[1]: _value(f) for n, f in fields.items() if n.startswith("tinyloop.rope.scaling.")}
    if scaling.get("type") != "llama3":
        return None
    theta = float(_value(fields["tinyloop.rope.freq_base"]))
    hd = int(_value(fields["tinyloop.embedding_length"])) // int(_value(fields["tinyloop.attention.head_count"]))
    return (inv_freq(theta, hd, None) / inv_freq(theta, hd, scaling)).astype(np.float32)


def _layer_names(tensors: dict, prefix: str) -> list[str]:
    return sorted(n[len(prefix) :] for n in tensors if n.startswith(prefix))
