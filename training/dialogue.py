"""Build the chat fine-tuning data: the plays' alternating speeches as `User:` / `Assistant:` turns — the form the
server's chat template writes (`python/tinyloop/server/template.py`) — mixed with plain passages of the training
corpus so that plain text does not regress.

    python training/dialogue.py --corpus data/corpus --out data/chat      # after training/corpus.py

Only the corpus's training split is read (`train.txt`), so no held-out passage becomes dialogue; `heldout.txt` is
copied as it is, so `train.py --data data/chat` reports the same held-out perplexity as before. A speech is a speaker
heading (`HAMLET.`) and the lines under it; two consecutive speeches by different speakers become one exchange, the
second one the assistant's answer (verse lines joined into one paragraph, answers of at most `--max-words`), and
1 to 3 consecutive exchanges make a conversation. Every answer ends with the end-of-text token, as the model's chat
template (`training/chat_template.jinja`) closes every assistant turn, so the model learns to end its turn there.
"""

from __future__ import annotations

import argparse
import random
import re
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

EOT = "<|endoftext|>"
SEP = f"\n{EOT}\n"
SPEECH = re.compile(r"^([A-Z][A-Z0-9 ,.'&-]{0,40}[A-Z])\.\n(.+?)(?=\n\n|\Z)", re.M | re.S)


def speeches(passage: str) -> list[tuple[str, str]]:
    """(speaker, speech as one paragraph) for every speaker-headed speech in a passage, in order."""
    out = []
    for m in SPEECH.finditer(passage):
        text = " ".join(line.strip() for line in m.group(2).splitlines() if line.strip())
        if text:
            out.append((m.group(1), text))
    return out


def conversations(passage: str, max_words: int, rng: random.Random) -> Iterator[str]:
    """User/Assistant conversations of 1-3 exchanges from a passage's consecutive speeches."""
    said = speeches(passage)
    i = 0
    while i + 1 < len(said):
        exchanges: list[str] = []
        for _ in range(rng.randint(1, 3)):
            if i + 1 >= len(said):
                break
            (who_a, a), (who_b, b) = said[i], said[i + 1]
            if who_a == who_b or len(b.split()) > max_words:
                i += 1
                break
            exchanges.append(f"User: {a}\nAssistant: {b}")
            i += 2
        if exchanges:
            yield (EOT + "\n").join(exchanges)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--corpus", type=Path, default=Path("data/corpus"))
    ap.add_argument("--out", type=Path, default=Path("data/chat"))
    ap.add_argument("--plain-share", type=float, default=0.5, help="share of the output's passages that are plain")
    ap.add_argument("--max-words", type=int, default=60)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    rng = random.Random(args.seed)
    passages = [p for p in (args.corpus / "train.txt").read_text().split(SEP) if p.strip()]
    chats = [c for p in passages for c in conversations(p, args.max_words, rng)]
    plain_count = int(len(chats) * args.plain_share / (1 - args.plain_share))
    plain = rng.sample(passages, min(plain_count, len(passages)))
    mixed = chats + plain
    rng.shuffle(mixed)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "train.txt").write_text("".join(p + SEP for p in mixed))
    shutil.copy(args.corpus / "heldout.txt", args.out / "heldout.txt")
    print(f"{len(chats)} conversations + {len(plain)} plain passages -> {args.out / 'train.txt'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
