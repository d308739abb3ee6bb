"""A PyTorch reference of Ouro (`OuroForCausalLM`, ByteDance's looped language models), written from the
architecture as its public descriptions give it (vLLM's `ouro.py`, the checkpoint's `modeling_ouro.py`), and tiny
random checkpoints of it in the Hugging Face layout (`config.json`, `model.safetensors` with the checkpoint's tensor
names) — `transformers` has no Ouro class; its modeling code ships with each checkpoint.

The architecture, as this reference computes it:
- embedding, no scale; then `total_ut_steps` recurrent steps, each running every decoder layer in order with shared
  weights, and ending with `model.norm`, whose (normed) output the next step starts from;
- a decoder layer: h = h + input_layernorm_2(attn(input_layernorm(h))); h = h + post_attention_layernorm_2(
  mlp(post_attention_layernorm(h))) — RMSNorm (fp32, x · rsqrt(mean(x²) + ε) · w), SwiGLU, no biases;
- attention: causal, scale head_dim^-½, grouped K/V heads, RoPE in `rotate_half` form (dimension i paired with
  i + head_dim/2), θ from the config, positions the same in every step; each (step, layer) has its own K/V;
- logits: `lm_head` on the last step's normed state (vLLM's choice); the checkpoint's code can exit earlier through
  `early_exit_gate`, a linear map of the normed state to one logit per token: λ = σ(logit) is the probability of
  exiting at that step given the earlier steps did not, and "Q-exit" (the Ouro paper) stops a token at the first
  step whose cumulative exit probability 1 − Π(1 − λ_j) reaches a threshold q.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from hf_checkpoints import Flavour, build_tokenizer


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat([-b, a], dim=-1)


def _rope(cfg: dict, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    hd = cfg["hidden_size"] // cfg["num_attention_heads"]
    inv = 1.0 / cfg["rope_theta"] ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd)
    ang = positions.double()[:, None] * inv[None, :]
    return torch.cat([ang.cos()] * 2, -1).float(), torch.cat([ang.sin()] * 2, -1).float()


def _layer(cfg: dict, w: dict, i: int, h: torch.Tensor, start: int, past: tuple | None) -> tuple[torch.Tensor, tuple]:
    """Decoder layer `i` over rows `h (n, d)` at positions `start..start + n`, attending to `past` (K, V) of the
    earlier positions and causally to themselves; returns the new rows and the (K, V) of all positions so far."""
    d, heads, kv = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd, eps, n = d // heads, cfg["rms_norm_eps"], h.shape[0]
    cos, sin = _rope(cfg, torch.arange(start, start + n))
    p = f"model.layers.{i}."
    x = rms_norm(h, w[p + "input_layernorm.weight"], eps)
    q = (x @ w[p + "self_attn.q_proj.weight"].T).view(n, heads, hd).transpose(0, 1)
    k = (x @ w[p + "self_attn.k_proj.weight"].T).view(n, kv, hd).transpose(0, 1)
    v = (x @ w[p + "self_attn.v_proj.weight"].T).view(n, kv, hd).transpose(0, 1)
    q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
    if past is not None:
        k, v = torch.cat([past[0], k], 1), torch.cat([past[1], v], 1)
    mask = torch.full((n, start + n), float("-inf")).triu(start + 1)
    kr, vr = k.repeat_interleave(heads // kv, 0), v.repeat_interleave(heads // kv, 0)
    att = torch.softmax(q @ kr.transpose(1, 2) / hd**0.5 + mask, -1) @ vr
    a = att.transpose(0, 1).reshape(n, d) @ w[p + "self_attn.o_proj.weight"].T
    h = h + rms_norm(a, w[p + "input_layernorm_2.weight"], eps)
    x = rms_norm(h, w[p + "post_attention_layernorm.weight"], eps)
    m = torch.nn.functional.silu(x @ w[p + "mlp.gate_proj.weight"].T) * (x @ w[p + "mlp.up_proj.weight"].T)
    h = h + rms_norm(m @ w[p + "mlp.down_proj.weight"].T, w[p + "post_attention_layernorm_2.weight"], eps)
    return h, (k, v)


def _step(cfg: dict, w: dict, h: torch.Tensor, start: int, past: list) -> tuple[torch.Tensor, list]:
    """One recurrent step (every layer, then the final norm) with each layer's `past` K/V (None: no past)."""
    kvs = []
    for i in range(cfg["num_hidden_layers"]):
        h, kv = _layer(cfg, w, i, h, start, past[i])
        kvs.append(kv)
    return rms_norm(h, w["model.norm.weight"], cfg["rms_norm_eps"]), kvs


def forward(cfg: dict, w: dict[str, torch.Tensor], ids: list[int], steps: int | None = None) -> torch.Tensor:
    """Logits (T, vocab) after `steps` recurrent steps (default: the config's `total_ut_steps`)."""
    h = w["model.embed_tokens.weight"][torch.tensor(ids)]
    for _ in range(steps or cfg["total_ut_steps"]):
        h, _ = _step(cfg, w, h, 0, [None] * cfg["num_hidden_layers"])
    return h @ w["lm_head.weight"].T


def exit_gate(w: dict, h: torch.Tensor) -> float:
    """The gate's exit probability λ for one normed state `h (1, d)`."""
    return float(torch.sigmoid(h @ w["model.early_exit_gate.weight"].T + w["model.early_exit_gate.bias"]))


def score_gated(cfg: dict, w: dict, ids: list[int], steps: int, min_steps: int, q: float) -> tuple[list, list, list]:
    """`ids` decoded one token at a time under Ouro's Q-exit: the first token runs every step, each later one stops
    after step `t >= min_steps` once the cumulative exit probability `1 - prod_{j<=t} (1 - λ_j)` reaches `q` (at
    `steps` at the latest); the steps a token skipped hold, at its position, the K/V of the last step it ran.
    Returns the log-probability of each of `ids[1:]`, the steps each predecessor ran, and each token's cumulative
    exit probability at every step it ran (for choosing `q` away from them)."""
    layers = cfg["num_hidden_layers"]
    cache: list[list] = [[None] * layers for _ in range(steps)]  # (K, V) per (step, layer), all positions so far
    logps, depths, cdfs = [], [], []
    for t, tok in enumerate(ids[:-1]):
        h = w["model.embed_tokens.weight"][torch.tensor([tok])]
        survival, ran, seen = 1.0, steps, []
        for s in range(steps):
            h, cache[s] = _step(cfg, w, h, t, cache[s])
            survival *= 1.0 - exit_gate(w, h)
            seen.append(1.0 - survival)
            if t > 0 and s + 1 >= min_steps and 1.0 - survival >= q and s + 1 < steps:
                ran = s + 1
                break
        for s in range(ran, steps):  # the skipped steps: this position's K/V from the last step run (t > 0)
            cache[s] = [
                (torch.cat([k, last_k[:, -1:]], 1), torch.cat([v, last_v[:, -1:]], 1))
                for (k, v), (last_k, last_v) in zip(cache[s], cache[ran - 1], strict=True)
            ]
        logps.append(float(torch.log_softmax(h @ w["lm_head.weight"].T, -1)[0, ids[t + 1]]))
        depths.append(ran)
        cdfs.append(seen)
    return logps, depths, cdfs


def build_ouro_checkpoint(directory: Path, seed: int = 0) -> tuple[dict, dict[str, torch.Tensor]]:
    """A tiny random Ouro checkpoint (with a SmolLM-style tokenizer, as Ouro's) in `directory`; returns its config and
    weights."""
    directory.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(Flavour("qwen2", pre="smollm"))  # Ouro's tokenizer is SmolLM's
    tok.save(str(directory / "tokenizer.json"))
    rows, d, ffn, layers, heads, kv = 736, 64, 160, 2, 4, 2
    cfg = {
        "architectures": ["OuroForCausalLM"],
        "model_type": "ouro",
        "vocab_size": rows,
        "hidden_size": d,
        "intermediate_size": ffn,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "max_position_embeddings": 512,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1e6,
        "rope_scaling": None,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "use_sliding_window": False,
        "total_ut_steps": 4,
        "early_exit_threshold": 1.0,
    }
    gen = torch.Generator().manual_seed(seed)

    def matrix(rows: int, cols: int) -> torch.Tensor:
        return torch.randn(rows, cols, generator=gen) / cols**0.5

    def norm() -> torch.Tensor:
        return 1 + 0.2 * torch.randn(d, generator=gen)

    hd = d // heads
    w = {"model.embed_tokens.weight": torch.randn(rows, d, generator=gen), "lm_head.weight": matrix(rows, d)}
    for i in range(layers):
        p = f"model.layers.{i}."
        w |= {
            p + "self_attn.q_proj.weight": matrix(d, d),
            p + "self_attn.k_proj.weight": matrix(kv * hd, d),
            p + "self_attn.v_proj.weight": matrix(kv * hd, d),
            p + "self_attn.o_proj.weight": matrix(d, d),
            p + "mlp.gate_proj.weight": matrix(ffn, d),
            p + "mlp.up_proj.weight": matrix(ffn, d),
            p + "mlp.down_proj.weight": matrix(d, ffn),
        }
        for n in ["input_layernorm", "input_layernorm_2", "post_attention_layernorm", "post_attention_layernorm_2"]:
            w[p + n + ".weight"] = norm()
    w |= {"model.norm.weight": norm(), "model.early_exit_gate.weight": matrix(1, d)}
    w["model.early_exit_gate.bias"] = torch.zeros(1)
    save_file({k: v.contiguous() for k, v in w.items()}, str(directory / "model.safetensors"))
    (directory / "config.json").write_text(json.dumps(cfg), encoding="utf-8")
    ids = {t: tok.token_to_id(t) for t in ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]}
    tok_config = {"eos_token": "<|im_end|>", "bos_token": "<|im_start|>", "add_bos_token": False}
    (directory / "tokenizer_config.json").write_text(json.dumps(tok_config), encoding="utf-8")
    ends = [ids["<|im_end|>"], ids["<|endoftext|>"]]
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": ends}), encoding="utf-8")
    return cfg, w
