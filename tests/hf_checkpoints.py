"""Tiny Hugging Face checkpoints built with `transformers` and `tokenizers` themselves: a byte-level BPE trained on
the tokenizer corpus with Qwen2's or Llama 3's pre-tokenizer, and a random `Qwen2ForCausalLM` / `LlamaForCausalLM`
saved with `save_pretrained` (safetensors), with every weight — norms and biases too — drawn at a scale that makes
the logits differ by whole units, so a wrong permutation or a missing bias cannot hide under a tolerance."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from corpus import documents
from tinyloop.modelfile.hf_tokenizer import SPLIT_PATTERNS

PATTERN = {pre: pattern for pattern, (_, pre) in SPLIT_PATTERNS.items()}
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@dataclass(frozen=True)
class Flavour:
    arch: str  # "qwen2" | "llama"
    vocab: int = 700  # BPE vocabulary the trainer aims at
    rows: int = 736  # embedding rows (> vocab: the unused ids are padding, as in Qwen2's checkpoints)
    tied: bool = False
    dtype: str = "float32"  # the checkpoint's stored type ("bfloat16" too)
    shard: str | None = None  # save_pretrained's max_shard_size
    rope_scaling: dict | None = None
    pre: str | None = None  # the tokenizer's pre-tokenizer: qwen2 / llama-bpe (the architecture's) or smollm


def build_tokenizer(flavour: Flavour) -> Tokenizer:
    pre = flavour.pre or ("qwen2" if flavour.arch == "qwen2" else "llama-bpe")
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"] + (["<|begin_of_text|>"] if pre == "llama-bpe" else [])
    tok = Tokenizer(models.BPE())
    if pre == "qwen2":
        tok.normalizer = normalizers.NFC()
    if pre == "smollm":  # SmolLM's (Ouro's): each digit apart, then GPT-2's byte-level regex
        steps = [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    else:
        steps = [
            pre_tokenizers.Split(Regex(PATTERN[pre]), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    tok.pre_tokenizer = pre_tokenizers.Sequence(steps)
    tok.decoder = decoders.ByteLevel()
    if pre == "llama-bpe":
        tok.post_processor = processors.TemplateProcessing(
            single="<|begin_of_text|> $A", special_tokens=[("<|begin_of_text|>", 3)]
        )
    trainer = trainers.BpeTrainer(
        vocab_size=flavour.vocab,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(documents(), trainer)
    return tok


def _randomize(model: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=gen))
            elif p.ndim == 1:  # Qwen2's q/k/v biases
                p.copy_(0.5 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)


def build_checkpoint(directory: Path, flavour: Flavour, seed: int = 0) -> Path:
    """Write tokenizer files and a random model for `flavour` into `directory`."""
    directory.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(flavour)
    tok.save(str(directory / "tokenizer.json"))
    ids = {t: tok.token_to_id(t) for t in ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|begin_of_text|>"]}
    shape = dict(
        vocab_size=flavour.rows,
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=flavour.tied,
        rms_norm_eps=1e-6,
    )
    if flavour.arch == "qwen2":
        config = Qwen2Config(**shape, rope_theta=1e6, bos_token_id=None, eos_token_id=ids["<|im_end|>"])
        model: torch.nn.Module = Qwen2ForCausalLM(config)
        tok_config = {"eos_token": "<|im_end|>", "bos_token": None, "chat_template": CHATML}
        ends = [ids["<|im_end|>"], ids["<|endoftext|>"]]
    else:
        rope = {"rope_type": "default", "rope_theta": 5e5} if flavour.rope_scaling is None else flavour.rope_scaling
        config = LlamaConfig(**shape, rope_parameters=rope, bos_token_id=ids["<|begin_of_text|>"])
        config.eos_token_id = ids["<|endoftext|>"]
        model = LlamaForCausalLM(config)
        tok_config = {"eos_token": "<|endoftext|>", "bos_token": "<|begin_of_text|>"}
        ends = [ids["<|endoftext|>"], ids["<|im_end|>"]]
    _randomize(model, seed)
    model = model.to(getattr(torch, flavour.dtype))
    model.save_pretrained(directory, max_shard_size=flavour.shard or "5GB")
    (directory / "tokenizer_config.json").write_text(json.dumps(tok_config), encoding="utf-8")
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": ends}), encoding="utf-8")
    return directory


def reference_model(directory: Path) -> torch.nn.Module:
    """The checkpoint through `transformers`, in float32 (a bfloat16 checkpoint's values widened exactly)."""
    config = json.loads((directory / "config.json").read_text(encoding="utf-8"))
    cls = Qwen2ForCausalLM if config["architectures"][0] == "Qwen2ForCausalLM" else LlamaForCausalLM
    return cls.from_pretrained(directory, dtype=torch.float32).eval()


def greedy(model: torch.nn.Module, ids: list[int], n: int) -> list[int]:
    """`n` tokens of `transformers`' forward, argmax, fed back."""
    out = list(ids)
    with torch.no_grad():
        for _ in range(n):
            out.append(int(model(torch.tensor([out])).logits[0, -1].argmax()))
    return out[len(ids) :]


def end_within(directory: Path, prompt: list[int], end: int, lo: int, hi: int) -> list[int]:
    """Make the checkpoint's greedy continuation of `prompt` end at token `end` after `lo`..`hi` tokens: the head's
    row for `end` becomes (1 + 1e-3) × the row of a token that first wins at such a step (with a positive logit),
    so `end` wins exactly where that token would have. Rewrites the checkpoint; returns the continuation up to and
    including `end`."""
    model = reference_model(directory)
    plain = greedy(model, prompt, hi)
    firsts = [t for i, t in enumerate(plain) if i >= lo and t not in plain[:i] and t != end]
    for t in firsts:
        model.lm_head.weight.data[end] = model.lm_head.weight.data[t] * (1 + 1e-3)
        out = greedy(model, prompt, hi)
        if end in out and lo <= out.index(end) < hi:
            model.save_pretrained(directory)
            return out[: out.index(end) + 1]
    raise AssertionError("no token of the greedy continuation could stand in for the end token")


def tokenization_mismatches(engine, tok: Tokenizer) -> list[int]:
    """Indices of the tokenizer corpus's documents the engine encodes differently from `tokenizers`, which splits
    out added tokens' text wherever it appears (the engine does where asked: `allow_special`)."""
    docs = documents()
    return [
        i
        for i, d in enumerate(docs)
        if engine.encode(d, allow_special=True) != tok.encode(d, add_special_tokens=False).ids
    ]
