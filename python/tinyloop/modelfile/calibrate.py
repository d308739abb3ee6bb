"""Calibration for GPTQ: a vectorized float32 NumPy forward pass of the looped model (docs/architecture.md) that sums
H = 2 XᵀX over the inputs X of every linear layer.

x = embed[tokens]; prelude layers once; the k block layers `loops` times (each time followed by the final norm in a
model with `loop_norm`); rms_norm (once, at the end, otherwise); head. A layer (pre-norm, llama style):
x += Wo·attn(rope(Wq·n(x) + bq), rope(Wk·n(x) + bk), Wv·n(x) + bv); x += Wdown·(silu(Wgate·n(x)) * Wup·n(x)), with
biases where the file has them and each sublayer's output normed first where it has post-norms. RoPE rotates
adjacent pairs (2i, 2i+1) by pos·θ^(-2i/head_dim), scaled as the file says; query head h reads K/V head
h // (H / H_kv); attention is causal.

The block's weights are shared by every loop, so their Hessians sum the inputs of all `loops` applications. Inputs
shared by several matrices give them one Hessian (the same array): q/k/v read attn_norm's output, gate/up read
ffn_norm's output. The head reads the final-normed hidden states at depth `loops`; with a tied head that is
`token_embd.weight`, whose rows the embedding lookup also reads (a lookup has no input to calibrate against).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from .format import ModelConfig

EOT_SEPARATOR = "\n<|endoftext|>\n"  # between passages in the corpus files and in assets/calib.txt


def rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def inv_freq(theta: float, hd: int, scaling: Mapping[str, Any] | None) -> np.ndarray:
    """RoPE's θ^(-2i/hd), stretched as a file's `rope_scaling` says (the engine's `RopeScaling`)."""
    f = theta ** (-np.arange(0, hd, 2) / hd)
    s = scaling or {}
    if s.get("type") == "linear":
        return f / s["factor"]
    if s.get("type") == "llama3":
        wavelen, original = 2 * np.pi / f, s["original_context_length"]
        low, high = original / s["low_freq_factor"], original / s["high_freq_factor"]
        smooth = (original / wavelen - s["low_freq_factor"]) / (s["high_freq_factor"] - s["low_freq_factor"])
        blended = (1 - smooth) * f / s["factor"] + smooth * f
        return np.where(wavelen < high, f, np.where(wavelen > low, f / s["factor"], blended))
    return f


def rope(x: np.ndarray, freqs: np.ndarray) -> np.ndarray:
    """x (B, heads, T, hd): rotate each adjacent pair i of the head dimension by position · freqs[i]."""
    T = x.shape[-2]
    ang = np.arange(T)[:, None] * freqs[None, :]  # (T, hd/2)
    cos, sin = np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)
    a, b = x[..., 0::2], x[..., 1::2]
    out = np.empty_like(x)
    out[..., 0::2] = a * cos - b * sin
    out[..., 1::2] = a * sin + b * cos
    return out


class Hessians(dict):
    """name of a weight matrix -> 2 XᵀX (float64) summed over the tokens its input saw."""

    def add(self, names: Sequence[str], x: np.ndarray) -> None:
        x2 = x.reshape(-1, x.shape[-1])
        h = 2.0 * (x2.T @ x2).astype(np.float64)
        if names[0] in self:
            self[names[0]] += h  # shared arrays: every name sees the sum
        else:
            for name in names:
                self[name] = h


def _layer(cfg: ModelConfig, w: dict[str, np.ndarray], p: str, x: np.ndarray, hs: Hessians | None) -> np.ndarray:
    B, T, _ = x.shape
    H, KV, hd = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim

    def heads(y: np.ndarray, n: int) -> np.ndarray:  # (B, T, n*hd) -> (B, n, T, hd)
        return y.reshape(B, T, n, hd).transpose(0, 2, 1, 3)

    h = rms_norm(x, w[f"{p}.attn_norm.weight"], cfg.rms_eps)
    if hs is not None:
        hs.add([f"{p}.attn_q.weight", f"{p}.attn_k.weight", f"{p}.attn_v.weight"], h)
    q, k, v = (h @ w[f"{p}.attn_{n}.weight"].T + w.get(f"{p}.attn_{n}.bias", 0) for n in "qkv")
    freqs = inv_freq(cfg.rope_theta, hd, cfg.rope_scaling)
    q = rope(heads(q, H), freqs)
    k = np.repeat(rope(heads(k, KV), freqs), H // KV, axis=1)
    v = np.repeat(heads(v, KV), H // KV, axis=1)
    s = (q @ k.transpose(0, 1, 3, 2)) / np.float32(np.sqrt(hd))  # (B, H, T, T)
    s = np.where(np.tril(np.ones((T, T), dtype=bool)), s, -np.inf)
    s = np.exp(s - s.max(axis=-1, keepdims=True))
    s /= s.sum(axis=-1, keepdims=True)
    a = (s @ v).transpose(0, 2, 1, 3).reshape(B, T, H * hd)
    if hs is not None:
        hs.add([f"{p}.attn_output.weight"], a)
    x = x + _post(cfg, w, f"{p}.attn_post_norm.weight", a @ w[f"{p}.attn_output.weight"].T)
    h = rms_norm(x, w[f"{p}.ffn_norm.weight"], cfg.rms_eps)
    if hs is not None:
        hs.add([f"{p}.ffn_gate.weight", f"{p}.ffn_up.weight"], h)
    g = h @ w[f"{p}.ffn_gate.weight"].T
    m = g * (0.5 + 0.5 * np.tanh(0.5 * g)) * (h @ w[f"{p}.ffn_up.weight"].T)  # silu, without exp overflow
    if hs is not None:
        hs.add([f"{p}.ffn_down.weight"], m)
    return x + _post(cfg, w, f"{p}.ffn_post_norm.weight", m @ w[f"{p}.ffn_down.weight"].T)


def _post(cfg: ModelConfig, w: dict[str, np.ndarray], name: str, y: np.ndarray) -> np.ndarray:
    """A sublayer's output as it joins the residual stream: normed where the layer has post-norms (Ouro's)."""
    return rms_norm(y, w[name], cfg.rms_eps) if cfg.post_norms else y


def head_name(cfg: ModelConfig) -> str:
    return "token_embd.weight" if cfg.tied_head else "output.weight"


def final_hidden(
    cfg: ModelConfig, weights: dict[str, np.ndarray], tokens: np.ndarray, loops: int, hs: Hessians | None = None
) -> np.ndarray:
    """Final-normed hidden states (B, T, dim) for token windows (B, T) at depth `loops`; adds to `hs` if given."""
    w = {k: np.asarray(v, dtype=np.float32) for k, v in weights.items()}
    x = w["token_embd.weight"][np.asarray(tokens)]
    for i in range(cfg.prelude_count):
        x = _layer(cfg, w, f"pre.{i}", x, hs)
    for _ in range(loops):
        for j in range(cfg.block_count):
            x = _layer(cfg, w, f"blk.{j}", x, hs)
        if cfg.loop_norm:  # Ouro's recurrence: every loop ends with the final norm, which the next one reads
            x = rms_norm(x, w["output_norm.weight"], cfg.rms_eps)
    if not cfg.loop_norm:
        x = rms_norm(x, w["output_norm.weight"], cfg.rms_eps)
    if hs is not None:
        hs.add([head_name(cfg)], x)
    return x


def logits(cfg: ModelConfig, weights: dict[str, np.ndarray], tokens: np.ndarray, loops: int) -> np.ndarray:
    """Logits (B, T, vocab) at depth `loops`."""
    return final_hidden(cfg, weights, tokens, loops) @ np.asarray(weights[head_name(cfg)], dtype=np.float32).T


def calibration_windows(text: str, encode: Callable[[str], list[int]], eos: int, n: int, length: int) -> np.ndarray:
    """Up to `n` windows (n, length) of token ids, spread evenly over `text`'s passages (each ended by `eos`)."""
    ids: list[int] = []
    for passage in text.split(EOT_SEPARATOR):
        if passage.strip():
            ids += [*encode(passage), eos]
    if len(ids) < 2:
        raise ValueError("calibration text is empty")
    length = min(length, len(ids))
    n = max(1, min(n, len(ids) // length))
    starts = np.linspace(0, len(ids) - length, n).astype(int)
    return np.array([ids[s : s + length] for s in starts])


def hessians(
    cfg: ModelConfig,
    weights: dict[str, np.ndarray],
    windows: np.ndarray,
    loops: int,
    batch: int = 4,
    progress: Callable[[], None] | None = None,
) -> Hessians:
    """2 XᵀX of every matrix's input over all calibration windows, at depth `loops`."""
    hs = Hessians()
    for b in range(0, len(windows), batch):
        final_hidden(cfg, weights, windows[b : b + batch], loops, hs)
        if progress is not None:
            progress()
    return hs
