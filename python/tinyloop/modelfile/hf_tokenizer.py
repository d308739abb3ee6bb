"""A Hugging Face checkpoint's tokenizer (`tokenizer.json`, `tokenizer_config.json`, `generation_config.json`) as a
tinyloop `Vocabulary` and chat template.

Only byte-level BPE is read — the tokenizers of GPT-2, Qwen2, Llama 3 and SmolLM (Ouro's) — and only with a
pre-tokenizer the engine knows (`tokenizer.ggml.pre`): GPT-2's byte-level regex, Qwen2's split (after NFC), Llama 3's,
or SmolLM's (each digit apart, then GPT-2's regex). The vocabulary is
written as GGUF tokens in GPT-2's byte spelling, which is how these `tokenizer.json` files already spell them.
Added tokens (`<|im_start|>`, `<|begin_of_text|>` …) become control tokens: the engine parses their text only where
asked (a chat template's output, `/tokenize` with `parse_special`), where `tokenizers` parses the non-special ones
everywhere. Ids the tokenizer leaves unused below the embedding's row count become control tokens that no text
spells (`<|unused_N|>`), as llama.cpp pads such vocabularies.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .vocab import Vocabulary, byte_to_unicode

# tokenizer.json pre-tokenizer regexes (as Hugging Face writes them) -> (normalizer, tokenizer.ggml.pre).
_WORDS = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|"
_REST = r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
SPLIT_PATTERNS = {
    _WORDS + r"\p{N}" + _REST: ("NFC", "qwen2"),
    _WORDS + r"\p{N}{1,3}" + _REST: (None, "llama-bpe"),
}
CONTROL, NORMAL = 3, 1


class TokenizerError(ValueError):
    """The checkpoint's tokenizer is not one tinyloop can reproduce; the message says what it is."""


def _load(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text(encoding="utf-8")) if path.exists() else {}


def pre_tokenizer(tok: dict[str, Any]) -> str:
    """The `tokenizer.ggml.pre` name of a tokenizer.json's normalizer and pre-tokenizer, or TokenizerError."""
    norm = (tok.get("normalizer") or {}).get("type")
    pre = tok.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else [pre]
    kinds = [s.get("type") for s in steps]
    if kinds == ["ByteLevel"] and steps[0].get("use_regex", True) and not steps[0].get("add_prefix_space"):
        if norm is None:
            return "gpt-2"
    elif kinds == ["Digits", "ByteLevel"] and steps[0].get("individual_digits") and norm is None:
        if steps[1].get("use_regex", True) and not steps[1].get("add_prefix_space"):
            return "smollm"
    elif kinds == ["Split", "ByteLevel"] and not steps[1].get("use_regex", True):
        pattern = (steps[0].get("pattern") or {}).get("Regex")
        want = SPLIT_PATTERNS.get(pattern or "")
        if want is not None and want[0] == norm and steps[0].get("behavior") == "Isolated":
            return want[1]
    raise TokenizerError(
        f"unsupported pre-tokenizer {json.dumps(pre)[:300]} with normalizer {norm!r}: tinyloop reads byte-level BPE "
        "with GPT-2's, Qwen2's, Llama 3's or SmolLM's pre-tokenizer"
    )


def _token_text(value: Any) -> str | None:
    """A tokenizer_config special-token entry: a string, an AddedToken dict, or None."""
    if isinstance(value, dict):
        return value.get("content")
    return value


def _ids(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in (value if isinstance(value, list) else [value])]


def _adds_bos(tok: dict[str, Any], config: dict[str, Any], bos: str | None) -> bool:
    """tokenizer_config's `add_bos_token`, else whether the post-processor puts the BOS token first."""
    if "add_bos_token" in config:
        return bool(config["add_bos_token"])
    post = tok.get("post_processor") or {}
    steps = post.get("processors", []) if post.get("type") == "Sequence" else [post]
    for step in steps:
        if step.get("type") == "TemplateProcessing":
            first = (step.get("single") or [{}])[0]
            return "SpecialToken" in first and first["SpecialToken"].get("id") == bos
    return False


def chat_template(directory: Path) -> str | None:
    """The checkpoint's chat template: tokenizer_config's (the "default" one of a list), or chat_template.jinja."""
    value = _load(directory / "tokenizer_config.json").get("chat_template")
    if isinstance(value, list):
        value = next((t.get("template") for t in value if t.get("name") == "default"), None)
    if value is None and (directory / "chat_template.jinja").exists():
        value = (directory / "chat_template.jinja").read_text(encoding="utf-8")
    return value


def read_vocabulary(directory: Path, rows: int) -> Vocabulary:
    """The tokenizer of the checkpoint in `directory`, padded to `rows` tokens (the embedding's rows)."""
    tok = _load(directory / "tokenizer.json")
    if not tok:
        raise TokenizerError(f"{directory / 'tokenizer.json'} is missing")
    model = tok.get("model", {})
    if model.get("type") != "BPE" or model.get("byte_fallback"):
        raise TokenizerError(f"tokenizer model {model.get('type')!r}: tinyloop reads byte-level BPE only")
    pre = pre_tokenizer(tok)
    vocab: dict[str, int] = model["vocab"]
    added = {t["id"]: t["content"] for t in tok.get("added_tokens", [])}
    size = max([rows, *(i + 1 for i in vocab.values()), *(i + 1 for i in added)])
    if size > rows:
        raise TokenizerError(f"the tokenizer has ids up to {size - 1} but the embedding has {rows} rows")
    tokens: list[str | None] = [None] * size
    types = [CONTROL] * size
    alphabet = set(byte_to_unicode().values())
    for text, i in vocab.items():
        if i not in added and not set(text) <= alphabet:
            raise TokenizerError(f"token {i} {text!r} is not spelled in GPT-2's byte alphabet (not byte-level BPE)")
        tokens[i], types[i] = text, NORMAL
    for i, text in added.items():
        tokens[i], types[i] = text, CONTROL
    names = [t if t is not None else f"<|unused_{i}|>" for i, t in enumerate(tokens)]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]

    config = _load(directory / "tokenizer_config.json")
    generation = _load(directory / "generation_config.json")
    ids = {t: i for i, t in enumerate(names)}

    def special(name: str) -> int | None:
        text = _token_text(config.get(name))
        if text is not None and text not in ids:
            raise TokenizerError(f"tokenizer_config's {name} {text!r} is not a token")
        return ids.get(text) if text is not None else None

    ends = _ids(generation.get("eos_token_id"))
    eos = special("eos_token")
    eos = eos if eos is not None else (ends[0] if ends else None)
    if eos is None:
        raise TokenizerError("no end-of-sequence token: tokenizer_config has no eos_token, generation_config none")
    bos = special("bos_token")
    bos_text = _token_text(config.get("bos_token"))
    return Vocabulary(
        names,
        types,
        merges,
        eos_token_id=eos,
        bos_token_id=bos if bos is not None else eos,
        pre=pre,
        add_bos_token=bos is not None and _adds_bos(tok, config, bos_text),
        end_token_ids=tuple(i for i in dict.fromkeys(ends) if i != eos and 0 <= i < size),
    )
