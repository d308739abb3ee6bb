"""A deterministic, messy test corpus (> 1 MB of UTF-8) for tokenizer parity, built from what any Python has."""

from __future__ import annotations

import random
import sys
from pathlib import Path

CONTRACTIONS = ["don't", "I'm", "we'll", "they've", "she'd", "it's", "you're", "DON'T", "O'Neil's", "rock'n'roll"]
EMOJI = ["😀", "👍🏽", "👨‍👩‍👧‍👦", "🏳️‍🌈", "🧑🏿‍🚀", "❤️", "🇫🇷", "🫠", "👩‍❤️‍💋‍👨", "1️⃣"]
WHITESPACE = [" ", "  ", "\t", "\n", "\r\n", "\n\n\n", " \t ", "\u00a0", "\u3000", "\u2028", "\x0b", "\x0c"]
SCRIPTS = [
    (0x4E00, 0x9FFF),
    (0x3040, 0x30FF),
    (0xAC00, 0xD7A3),
    (0x0400, 0x04FF),
    (0x0590, 0x05FF),
    (0x0600, 0x06FF),
    (0x0900, 0x097F),
    (0x0E00, 0x0E7F),
    (0x0370, 0x03FF),
    (0x1F300, 0x1FAFF),
]
COMBINING = [chr(c) for c in range(0x0300, 0x036F)] + ["\u20dd", "\u0e49", "\u093f"]


def _prose() -> str:
    """English prose and code from the standard library (docs topics, source files)."""
    lib = Path(sys.modules["os"].__file__).parent
    parts = []
    topics = lib / "pydoc_data" / "topics.py"
    if topics.exists():
        parts.append(topics.read_text(encoding="utf-8")[:400_000])
    for name in ["argparse.py", "textwrap.py", "json/decoder.py", "difflib.py", "inspect.py"]:
        p = lib / name
        if p.exists():
            parts.append(p.read_text(encoding="utf-8")[:60_000])
    return "\n".join(parts)


def _random_codepoint(rng: random.Random) -> str:
    while True:
        c = rng.randrange(0x110000)
        if not 0xD800 <= c <= 0xDFFF:  # surrogates cannot be encoded as UTF-8
            return chr(c)


def _messy(rng: random.Random, n: int) -> str:
    out = []
    size = 0
    while size < n:
        kind = rng.randrange(9)
        if kind == 0:
            s = "".join(chr(rng.randint(*rng.choice(SCRIPTS))) for _ in range(rng.randint(1, 40)))
        elif kind == 1:
            s = "".join(rng.choice(EMOJI) for _ in range(rng.randint(1, 8)))
        elif kind == 2:
            base = rng.choice("aeiouAEIOUnNcC")
            s = base + "".join(rng.choice(COMBINING) for _ in range(rng.randint(1, 5)))
        elif kind == 3:
            s = "".join(rng.choice(WHITESPACE) for _ in range(rng.randint(1, 30)))
        elif kind == 4:
            s = str(rng.randint(0, 10 ** rng.randint(1, 30))) + rng.choice([".", ",", "", " ", "e-7", "%"])
        elif kind == 5:
            s = rng.choice(CONTRACTIONS) + rng.choice([" ", "", "'s", "'", "''"])
        elif kind == 6:
            s = "".join(_random_codepoint(rng) for _ in range(rng.randint(1, 12)))
        elif kind == 7:
            s = rng.choice(["<|endoftext|>", "<|endoftext", "|>", "<|", "\\u0000", "\x00", "\ufeff", "\ufffd"])
        else:
            s = " " * rng.randint(1, 200) + rng.choice(["x", "\n", "", "1", "!"])
        out.append(s)
        size += len(s.encode("utf-8"))
    return "".join(out)


def documents(seed: int = 1234) -> list[str]:
    """Documents totalling > 1 MB: prose/code pieces, messy pieces and mixtures of both."""
    rng = random.Random(seed)
    prose = _prose()
    docs = []
    for i in range(0, len(prose), 4000):
        docs.append(prose[i : i + 4000])
    for _ in range(200):
        docs.append(_messy(rng, 1500))
    for _ in range(100):
        a = rng.randrange(max(1, len(prose) - 800))
        docs.append(prose[a : a + 400] + _messy(rng, 300) + prose[a + 400 : a + 800])
    return docs
