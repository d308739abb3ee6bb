"""Tensors of a Hugging Face checkpoint's `*.safetensors` files (one file, or shards listed by
`model.safetensors.index.json`), as float32 NumPy arrays.

`safetensors.safe_open` lists the tensors and reads F32 / F16 ones; NumPy has no bfloat16, which is what most
checkpoints ship, so BF16 tensors are read through the file's documented layout (an 8-byte header length, a JSON
header of dtypes, shapes and data offsets, then the data) and widened to float32 by a 16-bit shift — exact.
"""

from __future__ import annotations

import json
import mmap
import struct
from collections.abc import Iterator
from pathlib import Path

import numpy as np
from safetensors import safe_open

INDEX = "model.safetensors.index.json"


def shards(directory: Path) -> list[Path]:
    """The checkpoint's safetensors files, in a stable order."""
    index = directory / INDEX
    if index.exists():
        names = sorted(set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values()))
        return [directory / n for n in names]
    found = sorted(directory.glob("*.safetensors"))
    if not found:
        raise FileNotFoundError(f"{directory}: no *.safetensors files (PyTorch .bin checkpoints are not read)")
    return found


def _header(path: Path) -> tuple[dict, int]:
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(n)), 8 + n


def tensor_names(directory: Path) -> dict[str, Path]:
    """Every tensor's name, with the shard holding it."""
    out: dict[str, Path] = {}
    for path in shards(directory):
        with safe_open(str(path), framework="numpy") as f:
            out.update({name: path for name in f.keys()})
    return out


def read(path: Path, names: list[str]) -> Iterator[tuple[str, np.ndarray]]:
    """`names` from one shard, each as float32."""
    header, start = _header(path)
    with open(path, "rb") as raw, mmap.mmap(raw.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        with safe_open(str(path), framework="numpy") as f:
            for name in names:
                info = header[name]
                if info["dtype"] == "BF16":
                    lo, hi = info["data_offsets"]
                    bits = np.frombuffer(buf[start + lo : start + hi], dtype="<u2")  # a copy: the map closes
                    array = (bits.astype(np.uint32) << 16).view(np.float32).reshape(info["shape"])
                else:
                    array = f.get_tensor(name).astype(np.float32)
                yield name, array
