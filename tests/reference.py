"""An independent NumPy forward pass of the looped transformer, written from the model's description in
docs/architecture.md and docs/format.md (not from the Rust code).

x = embed[tokens]; prelude layers once; the k block layers `loops` times; rms_norm; head (tied unless output.weight).
A layer: x += Wo·attn(rope(Wq·n(x)), rope(Wk·n(x)), Wv·n(x)); x += Wdown·(silu(Wgate·n(x)) * Wup·n(x)), n = rms_norm.
RoPE rotates adjacent pairs (2i, 2i+1) by pos·θ^(-2i/head_dim). GQA: query head h reads K/V head h // (H / H_kv).
Computed in float64; K and V are rounded to `kv_dtype` before use, as the engine's cache stores them.
With `act_q8=True` every input of a weight matmul (and of the head) is rounded through Q8_0 blocks first: that is
what ggml-style integer kernels do with quantized weights (activations are quantized to 8 bits per 32-value block).
"""

from __future__ import annotations

import numpy as np

from tinyloop.modelfile.format import ModelConfig


def rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def rope(x: np.ndarray, positions: np.ndarray, theta: float) -> np.ndarray:
    """x: (T, heads, hd). Rotate each adjacent pair by pos * theta^(-2i/hd)."""
    hd = x.shape[-1]
    freqs = theta ** (-np.arange(0, hd, 2, dtype=np.float64) / hd)  # (hd/2,)
    ang = positions[:, None].astype(np.float64) * freqs[None, :]  # (T, hd/2)
    cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
    a, b = x[..., 0::2], x[..., 1::2]
    out = np.empty_like(x)
    out[..., 0::2] = a * cos - b * sin
    out[..., 1::2] = a * sin + b * cos
    return out


def hadamard_matrix(n: int) -> np.ndarray:
    """Orthonormal Sylvester Hadamard matrix (symmetric, its own inverse)."""
    h = np.ones((1, 1))
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return h / np.sqrt(n)


def int4_round(x: np.ndarray) -> np.ndarray:
    """Asymmetric 4-bit codes per row (last axis): min and step (max - min) / 15, both held as float16."""
    lo = x.min(axis=-1, keepdims=True).astype(np.float16).astype(np.float64)
    step = ((x.max(axis=-1, keepdims=True) - lo) / 15.0).astype(np.float16).astype(np.float64)
    inv = np.divide(1.0, step, out=np.zeros_like(step), where=step != 0)
    q = np.clip(np.floor((x - lo) * inv + 0.5), 0, 15)
    return lo + q * step


def kv_round(x: np.ndarray, kv_dtype) -> np.ndarray:
    """K/V (..., head_dim) as the cache stores them: a float dtype; "int8" (symmetric, one scale per token and head);
    "int4" (asymmetric per token and head); "int4-h" (int4 of the Hadamard-rotated row, rotated back)."""
    if isinstance(kv_dtype, str) and kv_dtype == "int8":
        scale = (np.abs(x).max(axis=-1, keepdims=True) / 127.0).astype(np.float32).astype(np.float64)
        inv = np.divide(1.0, scale, out=np.zeros_like(scale), where=scale != 0)
        q = np.clip(np.trunc(x * inv + np.copysign(0.5, x)), -127, 127)
        return q * scale
    if isinstance(kv_dtype, str) and kv_dtype == "int4":
        return int4_round(x)
    if isinstance(kv_dtype, str) and kv_dtype == "int4-h":
        h = hadamard_matrix(x.shape[-1])
        return int4_round(x @ h) @ h
    return x.astype(kv_dtype).astype(np.float64)


def q8_0_roundtrip(x: np.ndarray) -> np.ndarray:
    """Quantize rows to Q8_0 (per 32 values: scale = max|x|/127 stored as f16, round half away from zero)."""
    blocks = x.reshape(-1, 32)
    d = np.abs(blocks).max(axis=1, keepdims=True) / 127.0
    inv = np.divide(1.0, d, out=np.zeros_like(d), where=d != 0)
    q = np.trunc(blocks * inv + np.copysign(0.5, blocks))
    return (q * d.astype(np.float16).astype(np.float64)).reshape(x.shape)


def silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


def layer(
    cfg: ModelConfig, w: dict[str, np.ndarray], p: str, x: np.ndarray, kv_dtype, aq, window: int = 0
) -> np.ndarray:
    T = x.shape[0]
    H, KV, hd = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    pos = np.arange(T)
    h = aq(rms_norm(x, w[f"{p}.attn_norm.weight"], cfg.rms_eps))
    q = rope((h @ w[f"{p}.attn_q.weight"].T).reshape(T, H, hd), pos, cfg.rope_theta)
    k = rope((h @ w[f"{p}.attn_k.weight"].T).reshape(T, KV, hd), pos, cfg.rope_theta)
    v = (h @ w[f"{p}.attn_v.weight"].T).reshape(T, KV, hd)
    k, v = kv_round(k, kv_dtype), kv_round(v, kv_dtype)
    group = H // KV
    out = np.empty((T, H, hd))
    causal = np.tril(np.ones((T, T), dtype=bool))
    if window:  # row i sees rows i-window+1..i
        causal &= ~np.tril(np.ones((T, T), dtype=bool), -window)
    for head in range(H):
        g = head // group
        s = (q[:, head, :] @ k[:, g, :].T) / np.sqrt(hd)
        s = np.where(causal, s, -np.inf)
        s = np.exp(s - s.max(axis=1, keepdims=True))
        s /= s.sum(axis=1, keepdims=True)
        out[:, head, :] = s @ v[:, g, :]
    x = x + aq(out.reshape(T, H * hd)) @ w[f"{p}.attn_output.weight"].T
    h = aq(rms_norm(x, w[f"{p}.ffn_norm.weight"], cfg.rms_eps))
    m = aq(silu(h @ w[f"{p}.ffn_gate.weight"].T) * (h @ w[f"{p}.ffn_up.weight"].T))
    return x + m @ w[f"{p}.ffn_down.weight"].T


def layer_over_past(
    cfg: ModelConfig, w: dict[str, np.ndarray], p: str, x: np.ndarray, start: int, past: tuple | None, kv_dtype
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Layer `p` over rows `x` at positions `start..`, attending to `past` (K, V of the positions before) and
    causally to themselves; returns the output and the rows' own (K, V)."""
    T, H, KV, hd = x.shape[0], cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    pos = np.arange(start, start + T)
    h = rms_norm(x, w[f"{p}.attn_norm.weight"], cfg.rms_eps)
    q = rope((h @ w[f"{p}.attn_q.weight"].T).reshape(T, H, hd), pos, cfg.rope_theta)
    k = kv_round(rope((h @ w[f"{p}.attn_k.weight"].T).reshape(T, KV, hd), pos, cfg.rope_theta), kv_dtype)
    v = kv_round((h @ w[f"{p}.attn_v.weight"].T).reshape(T, KV, hd), kv_dtype)
    pk, pv = past if past is not None else (np.zeros((0, KV, hd)), np.zeros((0, KV, hd)))
    keys, values = np.concatenate([pk, k]), np.concatenate([pv, v])
    visible = np.arange(len(keys))[None, :] <= (len(pk) + np.arange(T))[:, None]
    out = np.empty((T, H, hd))
    for head in range(H):
        g = head // (H // KV)
        s = np.where(visible, q[:, head] @ keys[:, g].T / np.sqrt(hd), -np.inf)
        s = np.exp(s - s.max(axis=1, keepdims=True))
        out[:, head] = (s / s.sum(axis=1, keepdims=True)) @ values[:, g]
    x = x + out.reshape(T, H * hd) @ w[f"{p}.attn_output.weight"].T
    h = rms_norm(x, w[f"{p}.ffn_norm.weight"], cfg.rms_eps)
    m = silu(h @ w[f"{p}.ffn_gate.weight"].T) * (h @ w[f"{p}.ffn_up.weight"].T)
    return x + m @ w[f"{p}.ffn_down.weight"].T, k, v


def head_logits(cfg: ModelConfig, w: dict[str, np.ndarray], x: np.ndarray) -> np.ndarray:
    """The final norm and head over rows `x`."""
    return rms_norm(x, w["output_norm.weight"], cfg.rms_eps) @ w.get("output.weight", w["token_embd.weight"]).T


def forward(
    cfg: ModelConfig,
    weights: dict[str, np.ndarray],
    tokens: list[int],
    loops: int,
    kv_dtype=np.float32,
    act_q8: bool = False,
    window: int = 0,
) -> np.ndarray:
    """Logits (T, vocab) for every position of `tokens` at depth `loops` (`window > 0`: sliding-window attention)."""
    w = {k: v.astype(np.float64) for k, v in weights.items()}
    aq = q8_0_roundtrip if act_q8 else (lambda a: a)
    x = w["token_embd.weight"][np.asarray(tokens)]
    for i in range(cfg.prelude_count):
        x = layer(cfg, w, f"pre.{i}", x, kv_dtype, aq, window)
    for _ in range(loops):
        for j in range(cfg.block_count):
            x = layer(cfg, w, f"blk.{j}", x, kv_dtype, aq, window)
    x = aq(rms_norm(x, w["output_norm.weight"], cfg.rms_eps))
    head = w.get("output.weight", w["token_embd.weight"])
    return x @ head.T
