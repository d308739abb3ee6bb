"""`tinyloop convert HF_DIR OUT.tinyloop`: a Hugging Face checkpoint directory as a `.tinyloop` file.

Llama (`LlamaForCausalLM`) and Qwen2 (`Qwen2ForCausalLM`) checkpoints become looped models with one loop: every
decoder layer in the looped block (k = all layers), no prelude, loops 1 by default — the same computation, so they
serve like any model (speculative modes aside: they draft from shallower loops, and one loop has none).

Ouro (`OuroForCausalLM`, ByteDance's looped models) is a looped model already: all its layers are the block, run
`total_ut_steps` times (the default loops). Its layers norm each sublayer's output before the residual add (the
`input_layernorm_2` / `post_attention_layernorm_2` tensors become `attn_post_norm` / `ffn_post_norm`), and every
recurrent step ends with the final norm, whose output the next step reads (`tinyloop.loop_norm`). Its early-exit
gate is carried in the file (`exit_gate.*`) and is what `loops: "auto"` follows on it, with the config's
`early_exit_threshold` as the default threshold (`tinyloop.exit_threshold`).

What changes on the way: Hugging Face's RoPE rotates the two halves of each head (`rotate_half`) where tinyloop
rotates adjacent pairs, so the rows of each head's Q and K projections (and Qwen2's Q and K biases) are interleaved —
dimension `i` of the first half and `i` of the second become rows `2i` and `2i + 1` — which gives every attention
score exactly the value it had. Everything else is copied under llama.cpp's tensor names.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from .._core import MAX_LOOPS
from . import safetensors_read
from .format import ModelConfig, write_model
from .hf_tokenizer import chat_template, read_vocabulary

ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "OuroForCausalLM")
# --outtype -> (matrices, embedding and head)
OUTTYPES = {"f32": ("F32", "F32"), "f16": ("F16", "F16"), "q8_0": ("Q8_0", "Q8_0"), "q4_0": ("Q4_0", "Q8_0")}
LAYER_PARTS = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "input_layernorm_2.weight": "attn_post_norm.weight",
    "post_attention_layernorm_2.weight": "ffn_post_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


class ConvertError(ValueError):
    """The checkpoint is not one tinyloop can convert; the message says why."""


def _refuse_unless(ok: bool, message: str) -> None:
    if not ok:
        raise ConvertError(message)


def rope(hf: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """θ and the `tinyloop.rope.scaling.*` keys of a config (`rope_parameters`, or `rope_theta` + `rope_scaling`)."""
    params = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    theta = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        return theta, None
    if kind == "linear":
        return theta, {"type": "linear", "factor": float(params["factor"])}
    if kind == "llama3":
        keys = ("factor", "low_freq_factor", "high_freq_factor")
        scaling: dict[str, Any] = {"type": "llama3", **{k: float(params[k]) for k in keys}}
        scaling["original_context_length"] = int(params["original_max_position_embeddings"])
        return theta, scaling
    raise ConvertError(f"RoPE scaling {kind!r} is not supported (supported: linear, llama3)")


def model_config(hf: dict[str, Any], rows: int, name: str, loops: int | None) -> ModelConfig:
    """The tinyloop shape of a Llama / Qwen2 / Ouro `config.json`; ConvertError for anything it cannot express.
    `loops`: the file's default depth (None: the checkpoint's — Ouro's `total_ut_steps`, else 1)."""
    arch = (hf.get("architectures") or ["?"])[0]
    _refuse_unless(
        arch in ARCHITECTURES, f"architecture {arch!r} is not supported; supported: {', '.join(ARCHITECTURES)}"
    )
    dim, heads = int(hf["hidden_size"]), int(hf["num_attention_heads"])
    _refuse_unless(hf.get("hidden_act", "silu") == "silu", f"hidden_act {hf.get('hidden_act')!r}: only silu")
    _refuse_unless(not hf.get("mlp_bias"), "mlp_bias: feed-forward biases are not supported")
    _refuse_unless(not hf.get("attention_bias"), "attention_bias: Llama's output-projection bias is not supported")
    _refuse_unless(not hf.get("use_sliding_window"), "use_sliding_window: sliding-window layers are not supported")
    _refuse_unless(
        hf.get("head_dim") in (None, dim // heads) and dim % heads == 0,
        f"head_dim {hf.get('head_dim')} with hidden_size {dim} and {heads} heads: only hidden_size / heads",
    )
    _refuse_unless(loops is None or 1 <= loops <= MAX_LOOPS, f"--loops {loops}: must be in 1..{MAX_LOOPS}")
    theta, scaling = rope(hf)
    ouro = arch == "OuroForCausalLM"
    steps = int(hf.get("total_ut_steps", 4)) if ouro else 1
    return ModelConfig(
        dim=dim,
        n_heads=heads,
        n_kv_heads=int(hf.get("num_key_value_heads") or heads),
        ffn_dim=int(hf["intermediate_size"]),
        block_count=int(hf["num_hidden_layers"]),
        prelude_count=0,
        default_loops=steps if loops is None else loops,
        max_trained_loops=steps,
        context_length=int(hf.get("max_position_embeddings", 2048)),
        rms_eps=float(hf.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        vocab_size=rows,
        tied_head=bool(hf.get("tie_word_embeddings", False)),
        name=name,
        attn_bias=arch == "Qwen2ForCausalLM",
        post_norms=ouro,
        loop_norm=ouro,
        exit_gate=ouro,
        # Ouro's Q-exit: a token stops once the gate's cumulative exit probability reaches this (1.0: never early).
        exit_threshold=float(hf.get("early_exit_threshold", 1.0)) if ouro else None,
        rope_scaling=scaling,
    )


def interleave_heads(w: np.ndarray, heads: int) -> np.ndarray:
    """Rows of each head reordered from halves (`rotate_half`) to adjacent pairs; `w` is `(heads·hd, …)` or a bias."""
    hd = w.shape[0] // heads
    return w.reshape(heads, 2, hd // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def tinyloop_name(name: str) -> str | None:
    """The tinyloop tensor a checkpoint tensor becomes (None: not part of the model, e.g. rotary buffers)."""
    fixed = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "model.early_exit_gate.weight": "exit_gate.weight",
        "model.early_exit_gate.bias": "exit_gate.bias",
    }
    if name in fixed:
        return fixed[name]
    if name == "lm_head.weight":
        return "output.weight"
    parts = name.split(".", 3)
    if len(parts) == 4 and parts[:2] == ["model", "layers"] and parts[3] in LAYER_PARTS:
        return f"blk.{int(parts[2])}.{LAYER_PARTS[parts[3]]}"
    return None


def weights(directory: Path, cfg: ModelConfig, progress: bool) -> dict[str, np.ndarray]:
    """Every tensor of the model, renamed, with Q and K rows interleaved per head."""
    names = safetensors_read.tensor_names(directory)
    wanted = cfg.tensor_shapes()
    by_shard: dict[Path, list[str]] = {}
    for name, shard in names.items():
        target = tinyloop_name(name)
        if target is None or target not in wanted:
            if target is None and "rotary_emb" not in name:
                raise ConvertError(f"tensor {name} has no place in a {cfg.name} model")
            continue
        by_shard.setdefault(shard, []).append(name)
    out: dict[str, np.ndarray] = {}
    bar = tqdm(total=sum(map(len, by_shard.values())), desc="tensors", unit="", disable=not progress)
    for shard, shard_names in by_shard.items():
        for name, array in safetensors_read.read(shard, shard_names):
            target = tinyloop_name(name)
            assert target is not None
            if ".attn_q." in target:
                array = interleave_heads(array, cfg.n_heads)
            elif ".attn_k." in target:
                array = interleave_heads(array, cfg.n_kv_heads)
            out[target] = array
            bar.update()
    bar.close()
    missing = sorted(set(wanted) - set(out))
    _refuse_unless(not missing, f"the checkpoint lacks {', '.join(missing[:4])}")
    return out


SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "repetition_penalty")


def generation_defaults(directory: Path) -> dict[str, float]:
    """The sampling settings `generation_config.json` recommends; `do_sample: false` is greedy (temperature 0)."""
    path = directory / "generation_config.json"
    config = json.loads(path.read_text(encoding="utf-8")) if path.exists() else {}
    if config.get("do_sample") is False:
        return {"temperature": 0.0}
    return {k: float(config[k]) for k in SAMPLING_FIELDS if config.get(k) is not None}


def convert(
    directory: Path, out: Path, outtype: str = "f16", loops: int | None = None, progress: bool = True
) -> ModelConfig:
    """Write `out` from the checkpoint in `directory`; returns the model's shape."""
    _refuse_unless(outtype in OUTTYPES, f"--outtype {outtype!r}: one of {', '.join(OUTTYPES)}")
    hf = json.loads((directory / "config.json").read_text(encoding="utf-8"))
    rows = int(hf["vocab_size"])
    cfg = model_config(hf, rows, name=directory.resolve().name, loops=loops)
    vocab = read_vocabulary(directory, rows)
    tensors = weights(directory, cfg, progress)
    matrices, embedding = OUTTYPES[outtype]
    write_model(
        out,
        cfg,
        tensors,
        weight_type=matrices,
        embedding_type=embedding,
        vocab=vocab,
        chat_template=chat_template(directory),
        generation=generation_defaults(directory),
    )
    return cfg
