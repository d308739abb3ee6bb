"""The looped transformer (docs/architecture.md) in PyTorch, for training only (the engine never imports this).

Same function as the engine: RMSNorm pre-norm layers, adjacent-pair RoPE, SwiGLU, no biases, a block of k layers
applied `loops` times, shared final norm and tied head that may read the residual stream after any loop.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

# `.tinyloop` tensor name part -> attribute of a layer (docs/format.md names the tensors).
TENSOR_PARTS = {
    "attn_norm": "attn_norm",
    "attn_q": "wq",
    "attn_k": "wk",
    "attn_v": "wv",
    "attn_output": "wo",
    "ffn_norm": "ffn_norm",
    "ffn_gate": "gate",
    "ffn_up": "up",
    "ffn_down": "down",
}


@dataclass
class TrainConfig:
    dim: int = 256
    n_heads: int = 4
    n_kv_heads: int = 4
    ffn_dim: int = 704
    block_count: int = 2
    prelude_count: int = 0
    vocab_size: int = 50257
    context: int = 512
    rms_eps: float = 1e-5
    rope_theta: float = 10000.0


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) * self.weight


def rope_tables(cfg: TrainConfig, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    hd = cfg.dim // cfg.n_heads
    inv = cfg.rope_theta ** (-torch.arange(0, hd, 2, dtype=torch.float64) / hd)
    ang = torch.arange(cfg.context, dtype=torch.float64)[:, None] * inv[None, :]  # (T, hd/2)
    return ang.cos().float().to(device), ang.sin().float().to(device)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (B, H, T, hd); rotate adjacent pairs (2i, 2i+1)."""
    T = x.shape[-2]
    a, b = x[..., 0::2].float(), x[..., 1::2].float()
    c, s = cos[:T], sin[:T]
    out = torch.stack((a * c - b * s, a * s + b * c), dim=-1)  # (B, H, T, hd/2, 2)
    return out.flatten(-2).type_as(x)


class Layer(nn.Module):
    def __init__(self, cfg: TrainConfig):
        super().__init__()
        hd = cfg.dim // cfg.n_heads
        self.cfg, self.hd = cfg, hd
        self.attn_norm = RMSNorm(cfg.dim, cfg.rms_eps)
        self.wq = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * hd, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * hd, bias=False)
        self.wo = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.rms_eps)
        self.gate = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.up = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.down = nn.Linear(cfg.ffn_dim, cfg.dim, bias=False)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, past: KV | None = None
    ) -> tuple[torch.Tensor, KV]:
        """The layer over `x (B, T, dim)`; also returns its K and V `(B, KV, T, hd)`. With `past`, each position
        attends to the earlier positions through `past`'s K/V and to itself through its own (`shared_attention`)."""
        B, T, D = x.shape
        H, KV, hd = self.cfg.n_heads, self.cfg.n_kv_heads, self.hd
        h = self.attn_norm(x)
        q = apply_rope(self.wq(h).view(B, T, H, hd).transpose(1, 2), cos, sin)  # (B, H, T, hd)
        k = apply_rope(self.wk(h).view(B, T, KV, hd).transpose(1, 2), cos, sin)
        v = self.wv(h).view(B, T, KV, hd).transpose(1, 2)
        if past is None:
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=KV != H)
        else:
            a = shared_attention(q, (k, v), past, gqa=KV != H)
        x = x + self.wo(a.transpose(1, 2).reshape(B, T, D))
        h = self.ffn_norm(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h)), (k, v)


KV = tuple[torch.Tensor, torch.Tensor]


def shared_attention(q: torch.Tensor, own: KV, past: KV, gqa: bool) -> torch.Tensor:
    """Attention as decoding with `kv_share="last"` computes it: position t sees the positions before it through
    `past` (the last loop's K/V, as the shared cache holds them) and itself through `own` (this loop's)."""
    T = q.shape[-2]
    k, v = torch.cat([past[0], own[0]], dim=2), torch.cat([past[1], own[1]], dim=2)  # (B, KV, 2T, hd)
    before = torch.ones(T, T, dtype=torch.bool, device=q.device).tril(-1)
    mask = torch.cat([before, torch.eye(T, dtype=torch.bool, device=q.device)], dim=1)  # (T, 2T)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)


def kv_drift(trace: list[list[KV]]) -> torch.Tensor:
    """How far each loop's K and V (`hidden_states`' `kv_trace`) are from the last loop's: the squared distance
    relative to the last loop's squared norm, averaged over the earlier loops, the block layers, K and V. Zero
    exactly when every loop's K/V equal the last's — where decoding with `kv_share="last"` reads what the per-loop
    cache holds, so the shared cache costs nothing."""
    last, terms = trace[-1], []
    for loop in trace[:-1]:
        for (k, v), (k_last, v_last) in zip(loop, last, strict=True):
            for a, b in ((k, k_last), (v, v_last)):
                terms.append((a.float() - b.float()).pow(2).mean() / b.float().pow(2).mean().clamp_min(1e-12))
    return torch.stack(terms).mean()


class LoopedLM(nn.Module):
    def __init__(self, cfg: TrainConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.prelude = nn.ModuleList(Layer(cfg) for _ in range(cfg.prelude_count))
        self.block = nn.ModuleList(Layer(cfg) for _ in range(cfg.block_count))
        self.out_norm = RMSNorm(cfg.dim, cfg.rms_eps)
        cos, sin = rope_tables(cfg)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)
        nn.init.normal_(self.embed.weight, std=0.02)
        for layer in [*self.prelude, *self.block]:
            for lin in (layer.wq, layer.wk, layer.wv, layer.gate, layer.up):
                nn.init.normal_(lin.weight, std=0.02)
            # Residual writers start small, scaled for the deepest unrolled depth we train at.
            for lin in (layer.wo, layer.down):
                nn.init.normal_(lin.weight, std=0.02 / math.sqrt(2 * cfg.block_count * 8))

    def hidden_states(
        self,
        idx: torch.Tensor,
        loops: int,
        exits: set[int],
        kv_share: int = 0,
        kv_trace: list[list[KV]] | None = None,
    ) -> dict[int, torch.Tensor]:
        """Residual stream after each loop in `exits` (1-based). With `kv_share` > 0, the block's layers attend to
        past positions through the last loop's K/V, as decoding with `kv_share="last"` does. Decoding's shared K/V
        are a fixed point: a position's last-loop K/V come from loops that read the earlier positions' shared K/V.
        `kv_share` passes without gradients approach it: the first a plain forward pass (what a prompt leaves in the
        shared cache), each next one run against the K/V of the pass before; the pass with gradients runs every loop
        against the last of them."""
        past: list[KV | None] = [None] * len(self.block)
        with torch.no_grad():
            for _ in range(kv_share):
                past = self._last_kv(idx, loops, past)
        x = self._prelude(idx)
        out = {}
        for d in range(1, loops + 1):
            kv = []
            for j, layer in enumerate(self.block):
                x, kv_j = layer(x, self.cos, self.sin, past[j])
                kv.append(kv_j)
            if kv_trace is not None:
                kv_trace.append(kv)
            if d in exits:
                out[d] = x
        return out

    def _last_kv(self, idx: torch.Tensor, loops: int, past: list[KV | None]) -> list[KV | None]:
        """Each block layer's K/V at the last of `loops`, every loop attending to the earlier positions via `past`."""
        x = self._prelude(idx)
        last: list[KV | None] = [None] * len(self.block)
        for _ in range(loops):
            for j, layer in enumerate(self.block):
                x, last[j] = layer(x, self.cos, self.sin, past[j])
        return last

    def _prelude(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx)
        for layer in self.prelude:
            x, _ = layer(x, self.cos, self.sin)
        return x

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.out_norm(h) @ self.embed.weight.T

    def export_weights(self) -> dict:
        """Weights under the `.tinyloop` tensor names, as float32 NumPy arrays."""
        w = {"token_embd.weight": self.embed.weight, "output_norm.weight": self.out_norm.weight}
        parts = TENSOR_PARTS
        for prefix, layers in (("pre", self.prelude), ("blk", self.block)):
            for i, layer in enumerate(layers):
                for name, attr in parts.items():
                    w[f"{prefix}.{i}.{name}.weight"] = getattr(layer, attr).weight
        return {k: v.detach().float().cpu().numpy() for k, v in w.items()}


def file_config(c: TrainConfig, default_loops: int, max_trained_loops: int, name: str = "tinyloop"):
    """The `.tinyloop` file's shape (`tinyloop.modelfile.format.ModelConfig`) of a model trained with `c`."""
    from tinyloop.modelfile.format import ModelConfig

    return ModelConfig(
        dim=c.dim,
        n_heads=c.n_heads,
        n_kv_heads=c.n_kv_heads,
        ffn_dim=c.ffn_dim,
        block_count=c.block_count,
        prelude_count=c.prelude_count,
        default_loops=default_loops,
        max_trained_loops=max_trained_loops,
        context_length=c.context,
        rms_eps=c.rms_eps,
        rope_theta=c.rope_theta,
        name=name,
    )
