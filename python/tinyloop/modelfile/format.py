"""Write `.tinyloop` model files (GGUF v3, ``general.architecture = "tinyloop"``) from NumPy arrays, and read them
back (``read_gguf``, ``model_config``) for tools such as the quantizer.

The layout is documented key by key in ``docs/format.md``; the Rust loader (``rust/loader.rs``) is its reader.
Weights are ``(out_features, in_features)`` arrays, as in ``y = x @ W.T``; embeddings are ``(vocab, dim)``.
"""

from __future__ import annotations

import mmap
from collections.abc import Mapping
from dataclasses import dataclass
from os import PathLike

import gguf
import numpy as np

from .vocab import Vocabulary, gpt2_vocabulary

ARCH = "tinyloop"
# Weight types a model file may use, by the names the API reports them under (model_info.quant).
WEIGHT_TYPES = {
    "F32": gguf.GGMLQuantizationType.F32,
    "F16": gguf.GGMLQuantizationType.F16,
    "BF16": gguf.GGMLQuantizationType.BF16,
    "Q8_0": gguf.GGMLQuantizationType.Q8_0,
    "Q4_0": gguf.GGMLQuantizationType.Q4_0,
    "Q4_1": gguf.GGMLQuantizationType.Q4_1,
    "Q2_K": gguf.GGMLQuantizationType.Q2_K,
}
# general.file_type (llama.cpp's LlamaFileType) for a file whose matrices are mostly of one type.
FILE_TYPES = {"F32": 0, "F16": 1, "Q4_0": 2, "Q4_1": 3, "Q8_0": 7, "Q2_K": 10, "BF16": 32}
LAYER_MATRICES = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
LAYER_NORMS = ("attn_norm", "ffn_norm")


@dataclass(frozen=True)
class ModelConfig:
    """Shape of a looped model (docs/architecture.md). Defaults describe a small but complete model."""

    dim: int = 256  # embedding_length
    n_heads: int = 4
    n_kv_heads: int = 4  # < n_heads means grouped-query attention
    ffn_dim: int = 704  # SwiGLU hidden width
    block_count: int = 2  # k: layers in the looped block
    prelude_count: int = 0  # unshared layers applied once before the loop
    default_loops: int = 8
    max_trained_loops: int = 8
    context_length: int = 1024
    rms_eps: float = 1e-5
    rope_theta: float = 10000.0
    vocab_size: int = 50257
    tied_head: bool = True  # False adds output.weight
    name: str = "tinyloop"
    attn_bias: bool = False  # True adds blk.N.attn_{q,k,v}.bias (Qwen2's layers)
    post_norms: bool = False  # True adds blk.N.attn_post_norm / ffn_post_norm (Ouro's sandwich layers)
    loop_norm: bool = False  # output_norm after every loop, its output carried (Ouro's recurrence)
    exit_threshold: float | None = None  # loops "auto"'s default threshold under the model's rule
    exit_gate: bool = False  # True adds exit_gate.weight (1, dim) and exit_gate.bias (1,) (Ouro's early-exit gate)
    # RoPE scaling, as tinyloop.rope.scaling.* keys without the prefix: {"type": "linear", "factor": 4.0} or
    # {"type": "llama3", "factor", "low_freq_factor", "high_freq_factor", "original_context_length"}
    rope_scaling: Mapping[str, str | float | int] | None = None

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    def tensor_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every tensor the file must hold, with its NumPy shape."""
        hd, kv = self.head_dim, self.n_kv_heads * self.head_dim
        layer = {
            "attn_norm": (self.dim,),
            "attn_q": (self.dim, self.dim),
            "attn_k": (kv, self.dim),
            "attn_v": (kv, self.dim),
            "attn_output": (self.dim, self.dim),
            "ffn_norm": (self.dim,),
            "ffn_gate": (self.ffn_dim, self.dim),
            "ffn_up": (self.ffn_dim, self.dim),
            "ffn_down": (self.dim, self.ffn_dim),
        }
        assert hd * self.n_heads == self.dim
        shapes: dict[str, tuple[int, ...]] = {"token_embd.weight": (self.vocab_size, self.dim)}
        for prefix, count in (("pre", self.prelude_count), ("blk", self.block_count)):
            for i in range(count):
                for part, shape in layer.items():
                    shapes[f"{prefix}.{i}.{part}.weight"] = shape
                if self.attn_bias:
                    for part in ("attn_q", "attn_k", "attn_v"):
                        shapes[f"{prefix}.{i}.{part}.bias"] = (layer[part][0],)
                if self.post_norms:
                    for part in ("attn_post_norm", "ffn_post_norm"):
                        shapes[f"{prefix}.{i}.{part}.weight"] = (self.dim,)
        shapes["output_norm.weight"] = (self.dim,)
        if not self.tied_head:
            shapes["output.weight"] = (self.vocab_size, self.dim)
        if self.exit_gate:
            shapes["exit_gate.weight"], shapes["exit_gate.bias"] = (1, self.dim), (1,)
        return shapes


def random_weights(cfg: ModelConfig, seed: int = 0, scale: float = 0.5) -> dict[str, np.ndarray]:
    """Random weights of the right shapes (for tests and benchmarks); norms near 1."""
    rng = np.random.default_rng(seed)
    out = {}
    for name, shape in cfg.tensor_shapes().items():
        if len(shape) == 1:
            out[name] = (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
        else:
            out[name] = (scale * rng.standard_normal(shape) / np.sqrt(shape[-1])).astype(np.float32)
    return out


def _tensor_type(name: str, shape: tuple[int, ...], weight_type: str, embedding_type: str | None) -> str:
    if len(shape) == 1 or name.startswith("exit_gate."):
        return "F32"  # norms, biases and the exit gate stay exact
    if name in ("token_embd.weight", "output.weight") and embedding_type is not None:
        return embedding_type
    return weight_type


V = gguf.GGUFValueType


@dataclass
class GGUFContents:
    """Everything a `.tinyloop` file holds, before it is written: `metadata[key] = (value, type[, item type])`,
    `tensors[name] = (float32 array, storage type name)`; with a quantized type the array may instead be uint8
    blocks already encoded in that type, `(rows, bytes per row)`, which are written as-is. Tests edit one to build
    invalid files."""

    metadata: dict[str, tuple]
    tensors: dict[str, tuple[np.ndarray, str]]


def model_contents(
    cfg: ModelConfig,
    weights: Mapping[str, np.ndarray],
    weight_type: str = "F32",
    embedding_type: str | None = None,
    vocab: Vocabulary | None = None,
    chat_template: str | None = None,
    generation: Mapping[str, float] | None = None,
) -> GGUFContents:
    vocab = vocab or gpt2_vocabulary()
    if len(vocab) != cfg.vocab_size:
        raise ValueError(f"vocabulary has {len(vocab)} tokens but cfg.vocab_size is {cfg.vocab_size}")
    for t in (weight_type, embedding_type or weight_type):
        if t not in WEIGHT_TYPES:
            raise ValueError(f"unsupported weight type {t!r}; one of {sorted(WEIGHT_TYPES)}")
    shapes = cfg.tensor_shapes()
    missing = sorted(set(shapes) - set(weights))
    if missing:
        raise ValueError(f"missing tensors: {missing[:5]}")
    meta: dict[str, tuple] = {
        "general.architecture": (ARCH, V.STRING),
        "general.name": (cfg.name, V.STRING),
        "general.file_type": (FILE_TYPES[weight_type], V.UINT32),
    }
    for key, value in _metadata(cfg):
        meta[f"{ARCH}.{key}"] = (value, V.FLOAT32 if isinstance(value, float) else V.UINT32)
    if cfg.loop_norm:
        meta[f"{ARCH}.loop_norm"] = (True, V.BOOL)
    if cfg.exit_threshold is not None:
        meta[f"{ARCH}.exit_threshold"] = (float(cfg.exit_threshold), V.FLOAT32)
    for key, scaling in (cfg.rope_scaling or {}).items():
        vtype = V.STRING if isinstance(scaling, str) else V.UINT32 if isinstance(scaling, int) else V.FLOAT32
        meta[f"{ARCH}.rope.scaling.{key}"] = (scaling, vtype)
    meta.update(
        {
            "tokenizer.ggml.model": ("gpt2", V.STRING),
            "tokenizer.ggml.pre": (vocab.pre, V.STRING),
            "tokenizer.ggml.tokens": (vocab.tokens, V.ARRAY, V.STRING),
            "tokenizer.ggml.token_type": (vocab.token_types, V.ARRAY, V.INT32),
            "tokenizer.ggml.merges": (vocab.merges, V.ARRAY, V.STRING),
            "tokenizer.ggml.bos_token_id": (vocab.bos_token_id, V.UINT32),
            "tokenizer.ggml.eos_token_id": (vocab.eos_token_id, V.UINT32),
            "tokenizer.ggml.add_bos_token": (vocab.add_bos_token, V.BOOL),
        }
    )
    if vocab.end_token_ids:
        meta[f"{ARCH}.end_token_ids"] = (list(vocab.end_token_ids), V.ARRAY, V.UINT32)
    if chat_template is not None:
        meta["tokenizer.chat_template"] = (chat_template, V.STRING)
    for key, value in (generation or {}).items():  # temperature, top_p, top_k, repetition_penalty
        meta[f"{ARCH}.generation.{key}"] = (int(value), V.UINT32) if key == "top_k" else (float(value), V.FLOAT32)
    tensors = {}
    for name, shape in shapes.items():
        array = np.asarray(weights[name], dtype=np.float32)
        if array.shape != shape:
            raise ValueError(f"{name}: shape {array.shape}, expected {shape}")
        tensors[name] = (array, _tensor_type(name, shape, weight_type, embedding_type))
    return GGUFContents(meta, tensors)


def write_gguf(path: str | PathLike[str], contents: GGUFContents) -> None:
    w = gguf.GGUFWriter(str(path), ARCH)
    w.kv_data[0].pop("general.architecture", None)  # written from `contents` like every other key
    for key, (value, vtype, *sub) in contents.metadata.items():
        w.add_key_value(key, value, vtype, sub[0] if sub else None)
    for name, (array, ttype) in contents.tensors.items():
        if ttype in ("F32", "F16"):
            w.add_tensor(name, np.ascontiguousarray(array, dtype=np.float32 if ttype == "F32" else np.float16))
        else:
            w.add_tensor(name, encoded(array, ttype), raw_dtype=gguf.GGMLQuantizationType[ttype])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def write_model(
    path: str | PathLike[str],
    cfg: ModelConfig,
    weights: Mapping[str, np.ndarray],
    weight_type: str = "F32",
    embedding_type: str | None = None,
    vocab: Vocabulary | None = None,
    chat_template: str | None = None,
    generation: Mapping[str, float] | None = None,
) -> None:
    """Write a `.tinyloop` file. `weight_type` applies to every matrix, `embedding_type` (default: the same) to
    token_embd/output; norms are always F32; `chat_template` (Jinja) is how chats are written for the model;
    `generation` the sampling settings the file recommends (temperature, top_p, top_k, repetition_penalty)."""
    write_gguf(path, model_contents(cfg, weights, weight_type, embedding_type, vocab, chat_template, generation))


# ModelConfig field -> its metadata key under "tinyloop.", in the order files list them.
_METADATA_KEYS = {
    "context_length": "context_length",
    "dim": "embedding_length",
    "ffn_dim": "feed_forward_length",
    "n_heads": "attention.head_count",
    "n_kv_heads": "attention.head_count_kv",
    "rms_eps": "attention.layer_norm_rms_epsilon",
    "rope_theta": "rope.freq_base",
    "block_count": "block_count",
    "prelude_count": "prelude_count",
    "default_loops": "loops.default",
    "max_trained_loops": "loops.max_trained",
}
_FLOAT_FIELDS = ("rms_eps", "rope_theta")


def _metadata(cfg: ModelConfig) -> list[tuple[str, int | float]]:
    return [
        (key, float(getattr(cfg, f)) if f in _FLOAT_FIELDS else getattr(cfg, f)) for f, key in _METADATA_KEYS.items()
    ]


def encoded(array: np.ndarray, weight_type: str) -> np.ndarray:
    """uint8 blocks of a quantized GGUF type: `array` itself when it is already encoded (uint8), else its
    round-to-nearest encoding (gguf's own encoders; Q2_K, which gguf cannot encode, by `tinyloop.modelfile.quants`)."""
    if array.dtype == np.uint8:
        return np.ascontiguousarray(array)
    data = np.ascontiguousarray(array, dtype=np.float32)
    if weight_type == "Q2_K":
        from .quants import rtn

        return rtn(data, weight_type)[0]
    return gguf.quants.quantize(data, gguf.GGMLQuantizationType[weight_type])


def dequantized(array: np.ndarray, weight_type: str) -> np.ndarray:
    """What the engine sees after a round trip through `weight_type` (for reference computations)."""
    data = np.ascontiguousarray(array, dtype=np.float32)
    if weight_type == "F32":
        return data
    if weight_type == "F16":
        return data.astype(np.float16).astype(np.float32)
    return gguf.quants.dequantize(encoded(data, weight_type), WEIGHT_TYPES[weight_type]).astype(np.float32)


# Bytes of one GGUF value of each scalar type (value type numbers as in the file).
_SCALAR_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY = 8, 9


class _Extents:
    """A cursor over a GGUF file that checks every length it is given against the bytes that remain."""

    def __init__(self, buf: mmap.mmap):
        self.buf, self.pos = buf, 0

    def skip(self, n: int, what: str) -> None:
        if n > len(self.buf) - self.pos:
            raise ValueError(f"{what} at offset {self.pos} declares {n} bytes, past the end of the file")
        self.pos += n

    def uint(self, size: int, what: str) -> int:
        self.skip(size, what)
        return int.from_bytes(self.buf[self.pos - size : self.pos], "little")

    def value(self, vtype: int, what: str) -> None:
        if vtype in _SCALAR_BYTES:
            self.skip(_SCALAR_BYTES[vtype], what)
        elif vtype == _STRING:
            self.skip(self.uint(8, what), what)
        elif vtype == _ARRAY:
            etype, n = self.uint(4, what), self.uint(8, what)
            if etype in _SCALAR_BYTES:
                self.skip(n * _SCALAR_BYTES[etype], what)
            elif etype == _STRING:
                if 8 * n > len(self.buf) - self.pos:  # each string takes at least its 8-byte length
                    raise ValueError(f"{what} at offset {self.pos} declares {n} strings, past the end of the file")
                for _ in range(n):
                    self.value(_STRING, what)
            else:
                raise ValueError(f"{what}: arrays of value type {etype} are not supported")
        else:
            raise ValueError(f"{what}: unknown value type {vtype}")


def _check_extents(path: str | PathLike[str]) -> None:
    """Check that every length and count in a GGUF file's header, metadata and tensor infos fits in the file.
    gguf's reader does not: past the end of the file it reads empty arrays, so one corrupt array count makes it
    loop, appending to a list, until memory runs out. Checks of everything else are left to it."""
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        c = _Extents(buf)
        c.skip(4, "the magic number")
        if c.uint(4, "the version") not in (2, 3):
            return  # gguf's reader names the problem
        n_tensors, n_kv = c.uint(8, "the tensor count"), c.uint(8, "the metadata count")
        for _ in range(n_kv):  # each entry takes at least 13 bytes: the loop ends by the end of the file
            key = c.uint(8, "a metadata key")
            c.skip(key, "a metadata key")
            c.value(c.uint(4, "a value type"), f"the value at offset {c.pos}")
        for _ in range(n_tensors):
            c.skip(c.uint(8, "a tensor name"), "a tensor name")
            c.skip(8 * c.uint(4, "a tensor's dimension count"), "a tensor's dimensions")
            c.skip(4 + 8, "a tensor's type and offset")


def read_gguf(path: str | PathLike[str], raw: bool = False) -> GGUFContents:
    """A `.tinyloop` file's metadata (every key, as written) and tensors (dequantized to float32, with their stored
    type names; with `raw`, as stored: F32/F16 arrays, quantized types as uint8 blocks, so that writing them back
    copies them bit for bit). Raises ValueError for a file that is not GGUF or not a tinyloop model."""
    try:
        _check_extents(path)
        reader = gguf.GGUFReader(str(path))
    except (ValueError, OSError, IndexError, KeyError, OverflowError) as e:  # how gguf's reader meets a malformed file
        raise ValueError(f"{path}: not a GGUF file ({e})") from e
    meta: dict[str, tuple] = {}
    for key, field in reader.fields.items():
        if not key.startswith("GGUF."):  # the header's own fields (version, counts), not key-value pairs
            meta[key] = (field.contents(), *field.types)
    arch = meta.get("general.architecture", (None,))[0]
    if arch != ARCH:
        raise ValueError(f"{path}: not a tinyloop model (general.architecture = {arch!r})")
    tensors = {}
    for t in reader.tensors:
        if t.tensor_type.name not in WEIGHT_TYPES:
            raise ValueError(f"{path}: tensor {t.name} has unsupported type {t.tensor_type.name}")
        if raw:
            tensors[t.name] = (np.array(t.data), t.tensor_type.name)  # a copy: no view of the file
            continue
        array = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type)
        tensors[t.name] = (np.array(array, dtype=np.float32), t.tensor_type.name)
    return GGUFContents(meta, tensors)


def model_config(contents: GGUFContents) -> ModelConfig:
    """The ModelConfig a file's metadata describes (keys as docs/format.md lists them)."""
    meta = contents.metadata
    missing = [key for key in _METADATA_KEYS.values() if f"{ARCH}.{key}" not in meta]
    if missing:
        raise ValueError(f"metadata key {ARCH}.{missing[0]} is missing")
    values = {f: meta[f"{ARCH}.{key}"][0] for f, key in _METADATA_KEYS.items()}
    if "tokenizer.ggml.tokens" not in meta:
        raise ValueError("metadata key tokenizer.ggml.tokens is missing")
    name = meta.get("general.name", (ModelConfig.name,))[0]
    scaling = {k.removeprefix(f"{ARCH}.rope.scaling."): v[0] for k, v in meta.items() if ".rope.scaling." in k}
    return ModelConfig(
        **values,
        vocab_size=len(meta["tokenizer.ggml.tokens"][0]),
        tied_head="output.weight" not in contents.tensors,
        name=name,
        attn_bias="blk.0.attn_q.bias" in contents.tensors,
        post_norms="blk.0.attn_post_norm.weight" in contents.tensors,
        loop_norm=bool(meta.get(f"{ARCH}.loop_norm", (False,))[0]),
        exit_threshold=meta.get(f"{ARCH}.exit_threshold", (None,))[0],
        exit_gate="exit_gate.weight" in contents.tensors,
        rope_scaling=scaling or None,
    )
