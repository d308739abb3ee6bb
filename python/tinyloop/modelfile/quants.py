"""GGUF weight block formats as quantization grids: fit a block's parameters, round values onto its grid, pack the
integer codes into ggml's exact byte layout.

Splitting a format into fit / quantize / pack is what lets GPTQ (``gptq.py``) round one column at a time onto the very
grid the file stores, and write its integer codes as-is. Rounding follows ``gguf.quants`` bit for bit for Q8_0, Q4_0
and Q4_1 (checked in tests); ``gguf.quants`` has no Q2_K encoder, so Q2_K's fit is ours (below) and its ground truth
is ``gguf.quants.dequantize``. Arrays of parameters are shaped ``(rows, blocks, scales per block)``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import gguf
import numpy as np

Params = dict[str, np.ndarray]
f16 = np.float16
f32 = np.float32


def _f16(a: np.ndarray) -> np.ndarray:
    """The value a float takes once stored as f16 (as f32)."""
    return np.asarray(a, dtype=f32).astype(f16).astype(f32)


def _inverse(d: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore"):
        return np.where(d == 0, f32(0), f32(1) / d).astype(f32)


def _f16_bytes(a: np.ndarray) -> np.ndarray:
    """(rows, blocks) floats -> (rows, blocks, 2) bytes of their f16."""
    return np.ascontiguousarray(a, dtype=f32).astype(f16).view(np.uint8).reshape(*a.shape, 2)


def _nibbles(q: np.ndarray) -> np.ndarray:
    """(..., 32) codes 0..15 -> (..., 16) bytes: low nibble value j, high nibble value j + 16 (ggml's order)."""
    q = q.astype(np.uint8)
    return q[..., :16] | (q[..., 16:] << np.uint8(4))


@dataclass(frozen=True)
class BlockFormat(ABC):
    """A ggml block type: `block` values per stored block, `sub` values per scale (GPTQ fits per stored block).
    Each format (Q8_0, Q4_0, Q4_1, Q2_K below) implements fit / quantize / pack."""

    name: str
    block: int
    sub: int

    def blocks(self, w: np.ndarray) -> np.ndarray:
        """(rows, n * block) -> (rows, n, block // sub, sub) as float32."""
        rows, cols = w.shape
        return np.asarray(w, dtype=f32).reshape(rows, cols // self.block, self.block // self.sub, self.sub)

    @abstractmethod
    def fit(self, w: np.ndarray) -> Params:
        """Parameters (scales, mins) of each block of `w` (rows, cols)."""

    @abstractmethod
    def quantize(self, x: np.ndarray, p: Params) -> tuple[np.ndarray, np.ndarray]:
        """Codes and their dequantized values for `x`, with parameters `p` broadcast to x's shape."""

    @abstractmethod
    def pack(self, codes: np.ndarray, p: Params) -> np.ndarray:
        """(rows, cols) codes + fitted params -> (rows, bytes per row) uint8, in ggml's block layout."""


class Q8_0(BlockFormat):
    def fit(self, w: np.ndarray) -> Params:
        return {"d": np.abs(self.blocks(w)).max(axis=-1) / f32(127)}

    def quantize(self, x, p):
        # gguf.quants' np_roundf: round half away from zero. GPTQ's updated weights may leave the range: clip.
        q = np.clip(gguf.quants.np_roundf(np.asarray(x, dtype=f32) * _inverse(p["d"])), -128, 127)
        return q.astype(np.int8), q.astype(f32) * _f16(p["d"])

    def pack(self, codes, p):
        rows = codes.shape[0]
        q = codes.astype(np.int8).view(np.uint8).reshape(rows, -1, 32)
        return np.concatenate([_f16_bytes(p["d"][..., 0]), q], axis=-1).reshape(rows, -1)


class Q4_0(BlockFormat):
    def fit(self, w: np.ndarray) -> Params:
        b = self.blocks(w)
        signed_max = np.take_along_axis(b, np.abs(b).argmax(axis=-1)[..., None], axis=-1)[..., 0]
        return {"d": signed_max / f32(-8)}  # the value of largest magnitude maps to code 0 (-8)

    def quantize(self, x, p):
        y = np.trunc(np.asarray(x, dtype=f32) * _inverse(p["d"]) + f32(8.5))
        q = np.clip(y, 0, 15).astype(np.uint8)
        return q, (q.astype(f32) - f32(8)) * _f16(p["d"])

    def pack(self, codes, p):
        rows = codes.shape[0]
        qs = _nibbles(codes.reshape(rows, -1, 32))
        return np.concatenate([_f16_bytes(p["d"][..., 0]), qs], axis=-1).reshape(rows, -1)


class Q4_1(BlockFormat):
    def fit(self, w: np.ndarray) -> Params:
        b = self.blocks(w)
        lo, hi = b.min(axis=-1), b.max(axis=-1)
        return {"d": (hi - lo) / f32(15), "m": lo}

    def quantize(self, x, p):
        y = np.trunc((np.asarray(x, dtype=f32) - p["m"]) * _inverse(p["d"]) + f32(0.5))
        q = np.clip(y, 0, 15).astype(np.uint8)
        return q, q.astype(f32) * _f16(p["d"]) + _f16(p["m"])

    def pack(self, codes, p):
        rows = codes.shape[0]
        qs = _nibbles(codes.reshape(rows, -1, 32))
        head = [_f16_bytes(p["d"][..., 0]), _f16_bytes(p["m"][..., 0])]
        return np.concatenate([*head, qs], axis=-1).reshape(rows, -1)


def fit_scale_min(x: np.ndarray, nmax: int, steps: int = 16) -> tuple[np.ndarray, np.ndarray]:
    """Per group of x (..., n): scale s >= 0 and offset m <= 0 so that x ≈ s * l + m with l in 0..nmax.

    The idea of ggml's make_qkx2_quants, in least squares: try grids spanning [min(x, 0), max(x)] stretched by
    `steps` factors around nmax, refit (s, m) to each grid's codes by least squares, keep the smallest error."""
    x = np.asarray(x, dtype=np.float64)
    lo, hi = np.minimum(x.min(axis=-1), 0.0), x.max(axis=-1)
    span = hi - lo
    live = span > 0
    best_s, best_m = np.where(live, span / nmax, 0.0), lo
    best_err = np.full(lo.shape, np.inf)
    n = x.shape[-1]
    for stretch in np.concatenate([[0.0], -0.5 + 0.1 * np.arange(steps)]):
        inv = np.where(live, (nmax + stretch) / np.where(live, span, 1.0), 0.0)
        ell = np.clip(np.rint((x - lo[..., None]) * inv[..., None]), 0, nmax)
        sl, sl2, sx, sxl = ell.sum(-1), (ell * ell).sum(-1), x.sum(-1), (x * ell).sum(-1)
        det = n * sl2 - sl * sl
        ok = det > 0
        safe = np.where(ok, det, 1.0)
        s = np.where(ok, (n * sxl - sx * sl) / safe, best_s)
        m = np.where(ok, (sl2 * sx - sl * sxl) / safe, lo)
        pos = m > 0  # the offset must stay <= 0 (Q2_K stores it as a non-negative minimum to subtract)
        s = np.where(pos, sxl / np.where(sl2 > 0, sl2, 1.0), s)
        m = np.where(pos, 0.0, m)
        s = np.maximum(s, 0.0)
        err = ((s[..., None] * ell + m[..., None] - x) ** 2).sum(-1)
        better = err < best_err
        best_s, best_m = np.where(better, s, best_s), np.where(better, m, best_m)
        best_err = np.where(better, err, best_err)
    return best_s, best_m


class Q2_K(BlockFormat):
    """256 values: 16 sub-blocks of 16 share a 4-bit scale and 4-bit min relative to f16 `d` and `dmin`;
    value = d * sc * q - dmin * mn, q in 0..3. Byte layout (ggml's block_q2_K): scales[16], qs[64], d, dmin."""

    def fit(self, w: np.ndarray) -> Params:
        s, m = fit_scale_min(self.blocks(w), nmax=3)  # (rows, n, 16) each, m <= 0
        params = {}
        for key, code, v in (("d", "sc", s), ("dmin", "mn", -m)):
            top = v.max(axis=-1, keepdims=True)
            inv = np.where(top > 0, 15.0 / np.where(top > 0, top, 1.0), 0.0)
            params[code] = np.clip(np.rint(v * inv), 0, 15).astype(np.uint8)
            params[key] = _f16(top / 15.0)  # (rows, n, 1)
        params["dl"] = params["d"] * params["sc"].astype(f32)
        params["ml"] = params["dmin"] * params["mn"].astype(f32)
        return params

    def quantize(self, x, p):
        dl, ml = p["dl"], p["ml"]
        y = (np.asarray(x, dtype=f32) + ml) * _inverse(dl)
        q = np.clip(np.rint(y), 0, 3).astype(np.uint8)
        return q, dl * q.astype(f32) - ml

    def pack(self, codes, p):
        rows = codes.shape[0]
        q = codes.astype(np.uint8).reshape(rows, -1, 2, 4, 32)  # value 128h + 32s + l -> byte 32h + l, bits 2s
        qs = q[..., 0, :] | (q[..., 1, :] << 2) | (q[..., 2, :] << 4) | (q[..., 3, :] << 6)
        scales = p["sc"] | (p["mn"] << np.uint8(4))
        parts = [scales, qs.reshape(rows, -1, 64), _f16_bytes(p["d"][..., 0]), _f16_bytes(p["dmin"][..., 0])]
        return np.concatenate(parts, axis=-1).reshape(rows, -1)


FORMATS: dict[str, BlockFormat] = {
    "Q8_0": Q8_0("Q8_0", 32, 32),
    "Q4_0": Q4_0("Q4_0", 32, 32),
    "Q4_1": Q4_1("Q4_1", 32, 32),
    "Q2_K": Q2_K("Q2_K", 256, 16),
}


def per_value(p: Params, cols: int) -> Params:
    """Parameters (rows, n, k) repeated to one per value (rows, cols)."""
    return {
        key: np.repeat(v, cols // (v.shape[1] * v.shape[2]), axis=-1).reshape(v.shape[0], cols) for key, v in p.items()
    }


def per_column(fmt: BlockFormat, p: Params, col: int) -> Params:
    """Parameters of column `col`, one per row."""
    b, s = divmod(col, fmt.block)
    return {key: v[:, b, min(s // fmt.sub, v.shape[2] - 1)] for key, v in p.items()}


def rtn(w: np.ndarray, type_name: str, chunk_rows: int = 4096) -> tuple[np.ndarray, np.ndarray]:
    """Round-to-nearest: (raw blocks (rows, bytes), dequantized values (rows, cols))."""
    fmt = FORMATS[type_name]
    w = np.asarray(w, dtype=f32)
    if w.ndim != 2 or w.shape[1] % fmt.block:
        raise ValueError(f"{type_name} needs rows of a multiple of {fmt.block} values, got shape {w.shape}")
    raw, values = [], []
    for r in range(0, w.shape[0], chunk_rows):
        part = w[r : r + chunk_rows]
        p = fmt.fit(part)
        codes, vals = fmt.quantize(part, per_value(p, part.shape[1]))
        raw.append(fmt.pack(codes, p))
        values.append(vals)
    return np.concatenate(raw), np.concatenate(values)
