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
- logits: `lm_head` on the last step's normed state (vLLM's choice; the checkpoint's code can exit earlier through
  `early_exit_gate`, a linear map of the normed state to one logit per token).
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


def forward(cfg: dict, w: dict[str, torch.Tensor], ids: list[int], steps: int | None = None) -> torch.Tensor:
    """Logits (T, vocab) after `steps` recurrent steps (default: the config's `total_ut_steps`)."""
    d, heads, kv = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd, eps, T = d // heads, cfg["rms_norm_eps"], len(ids)
    inv = 1.0 / cfg["rope_theta"] ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd)
    ang = torch.arange(T, dtype=torch.float64)[:, None] * inv[None, :]
    cos, sin = torch.cat([ang.cos()] * 2, -1).float(), torch.cat([ang.sin()] * 2, -1).float()
    mask = torch.full((T, T), float("-inf")).triu(1)
    h = w["model.embed_tokens.weight"][torch.tensor(ids)]
    for _ in range(steps or cfg["total_ut_steps"]):
        for i in range(cfg["num_hidden_layers"]):
            p = f"model.layers.{i}."
            x = rms_norm(h, w[p + "input_layernorm.weight"], eps)
            q = (x @ w[p + "self_attn.q_proj.weight"].T).view(T, heads, hd).transpose(0, 1)
            k = (x @ w[p + "self_attn.k_proj.weight"].T).view(T, kv, hd).transpose(0, 1)
            v = (x @ w[p + "self_attn.v_proj.weight"].T).view(T, kv, hd).transpose(0, 1)
            q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
            k, v = k.repeat_interleave(heads // kv, 0), v.repeat_interleave(heads // kv, 0)
            att = torch.softmax(q @ k.transpose(1, 2) / hd**0.5 + mask, -1) @ v
            a = att.transpose(0, 1).reshape(T, d) @ w[p + "self_attn.o_proj.weight"].T
            h = h + rms_norm(a, w[p + "input_layernorm_2.weight"], eps)
            x = rms_norm(h, w[p + "post_attention_layernorm.weight"], eps)
            m = torch.nn.functional.silu(x @ w[p + "mlp.gate_proj.weight"].T) * (x @ w[p + "mlp.up_proj.weight"].T)
            h = h + rms_norm(m @ w[p + "mlp.down_proj.weight"].T, w[p + "post_attention_layernorm_2.weight"], eps)
        h = rms_norm(h, w["model.norm.weight"], eps)
    return h @ w["lm_head.weight"].T


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
