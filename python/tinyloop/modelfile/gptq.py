"""GPTQ (Frantar et al. 2022, "Accurate Post-Training Quantization for Generative Pre-trained Transformers") onto the
exact grids of GGUF block formats (``quants.py``), so that its integer codes are written to the file as-is.

For a linear layer y = x Wᵀ with calibration inputs X (one row per token), GPTQ rounds W column by column and after
each column spreads the rounding error over the columns not yet rounded, to minimise ‖X Wᵀ − X Qᵀ‖². It needs only
H = 2 XᵀX. As in the paper: dead inputs (H_ii = 0) are zeroed, H is dampened by percdamp · mean(diag H), the error
feedback uses the upper Cholesky factor of H⁻¹, and updates outside the current block of columns are applied lazily,
once per block. Parameters (scales, minimums) of each stored block are fitted from the updated weights when GPTQ
reaches the block's first column; with act-order (columns by decreasing H_ii) they are fitted beforehand from the
original weights ("static groups"), so every stored block still holds 32 (or 256) contiguous values of a row.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from .quants import FORMATS, BlockFormat, Params, per_column


@dataclass
class GPTQResult:
    fmt: BlockFormat
    codes: np.ndarray  # (rows, cols) integer codes on the format's grid
    params: Params  # (rows, blocks, scales per block) each
    values: np.ndarray  # (rows, cols) float32: what the stored blocks dequantize to
    loss: float  # ½ Σ (err / U_ii)² = ‖X (W − Q)ᵀ‖² + λ/2 ‖W − Q‖² for H = 2 XᵀX, λ the dampening

    def raw(self) -> np.ndarray:
        """The tensor's blocks in ggml's byte layout, (rows, bytes per row)."""
        return self.fmt.pack(self.codes, self.params)


def column_blocks(cols: int, fmt: BlockFormat, block_size: int = 128) -> int:
    """How many lazy-update blocks GPTQ runs over `cols` columns (for progress bars)."""
    step = _step(fmt, block_size)
    return -(-cols // step)


def _step(fmt: BlockFormat, block_size: int) -> int:
    # A multiple of the stored block, so that a stored block's parameters are fitted from columns that have
    # received every earlier column's error (all of them lie inside one lazy-update block).
    return -(-block_size // fmt.block) * fmt.block


@dataclass(frozen=True)
class Prepared:
    """What GPTQ needs from a Hessian, computed once for all the matrices that share it (q/k/v, gate/up)."""

    dead: np.ndarray  # (cols,) bool: inputs that calibration never saw (H_ii = 0)
    perm: np.ndarray  # column order (decreasing H_ii with act-order, else the identity)
    U: np.ndarray  # upper Cholesky factor of the dampened, permuted H⁻¹ (H⁻¹ = Uᵀ U)
    act_order: bool


def prepare(hessian: np.ndarray, percdamp: float = 0.01, act_order: bool = False) -> Prepared:
    """Dead inputs, column order and the Cholesky factor of the dampened inverse, from H = 2 XᵀX."""
    H = np.array(hessian, dtype=np.float64)
    cols = H.shape[0]
    dead = np.diag(H) == 0
    H[dead, dead] = 1.0
    perm = np.argsort(-np.diag(H), kind="stable") if act_order else np.arange(cols)
    H = H[np.ix_(perm, perm)]
    H[np.diag_indices(cols)] += percdamp * np.mean(np.diag(H))
    inv_l = np.linalg.inv(np.linalg.cholesky(H))  # H⁻¹ = inv_lᵀ inv_l
    return Prepared(dead, perm, np.linalg.cholesky(inv_l.T @ inv_l).T, act_order)


def gptq(
    w: np.ndarray,
    hessian: np.ndarray | Prepared,
    type_name: str,
    percdamp: float = 0.01,
    act_order: bool = False,
    block_size: int = 128,
    progress: Callable[[], None] | None = None,
) -> GPTQResult:
    """Quantize `w` (rows, cols) onto `type_name`'s grid given `hessian` (cols, cols) = 2 XᵀX of its inputs, or
    its `prepare`d form (which then fixes percdamp and act_order)."""
    fmt = FORMATS[type_name]
    rows, cols = w.shape
    if cols % fmt.block:
        raise ValueError(f"{type_name} needs rows of a multiple of {fmt.block} values, got {cols}")
    prep = hessian if isinstance(hessian, Prepared) else prepare(hessian, percdamp, act_order)
    if prep.U.shape != (cols, cols):
        raise ValueError(f"hessian shape {prep.U.shape} does not match {cols} input columns")
    W = np.array(w, dtype=np.float64)
    W[:, prep.dead] = 0.0
    if prep.act_order:
        params = fmt.fit(W.astype(np.float32))  # static groups, from the original weights
    else:
        template = fmt.fit(np.zeros((rows, fmt.block), dtype=np.float32))
        params = {k: np.zeros((rows, cols // fmt.block, v.shape[2]), v.dtype) for k, v in template.items()}
    perm, U = prep.perm, prep.U
    W = W[:, perm]

    codes = np.zeros((rows, cols), dtype=np.int16)
    values = np.zeros((rows, cols), dtype=np.float32)
    loss = 0.0
    step = _step(fmt, block_size)
    for i1 in range(0, cols, step):
        i2 = min(i1 + step, cols)
        W1 = W[:, i1:i2].copy()
        err = np.zeros((rows, i2 - i1))
        for i in range(i2 - i1):
            c = i1 + i
            if not prep.act_order and c % fmt.block == 0:
                fitted = fmt.fit(W1[:, i : i + fmt.block].astype(np.float32))
                for k, v in fitted.items():
                    params[k][:, c // fmt.block] = v[:, 0]
            col = perm[c]
            q, val = fmt.quantize(W1[:, i].astype(np.float32), per_column(fmt, params, col))
            codes[:, col], values[:, col] = q, val
            e = (W1[:, i] - val) / U[c, c]
            loss += 0.5 * float(e @ e)
            W1[:, i:] -= np.outer(e, U[c, c:i2])
            err[:, i] = e
        W[:, i2:] -= err @ U[i1:i2, i2:]
        if progress is not None:
            progress()
    return GPTQResult(fmt, codes, params, values, loss)
