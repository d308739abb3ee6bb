"""How the model answers a chat: the 40 prompts in tests/data/chat_prompts.txt (questions, requests, greetings), each
as a one-message conversation in the model's chat template, answered greedily and at temperature 0.7 (seeded) at
loops 8 with at most 96 tokens — what a chat client of the server gets (`--repetition-penalty` and
`--frequency-penalty` apply to both; the latter defaults to the file's recommendation, as the server's does).

    python benches/chat_eval.py [MODEL] --json docs/chat_eval.json      # prints the table in docs/model.md

Each answer is cut where the server cuts it: at the model's end-of-text token or at the template's stop strings,
with the whitespace after the turn's opening dropped. Three measures, per setting: the share of answers with
non-empty content; the share that end naturally (end-of-text or a stop string) within the 96 tokens; and the share
in which no word 3-gram occurs more than 3 times (no looping).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path

from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))

import tinyloop
from quant_models import DEFAULT, ROOT
from tinyloop import Generation, SamplingParams
from tinyloop.server.protocol import ChatMessage
from tinyloop.server.template import ChatFormat

PROMPTS = ROOT / "tests" / "data" / "chat_prompts.txt"
MAX_TOKENS, LOOPS = 96, 8
SETTINGS = {"greedy": {"temperature": 0.0}, "temperature 0.7": {"temperature": 0.7}}


def answer(engine, chat: ChatFormat, prompt: str, sampling: dict, seed: int) -> tuple[str, bool]:
    """(the answer as the server would hand it out, whether it ended naturally)."""
    text = chat.render([ChatMessage(role="user", content=prompt)])
    ids = engine.encode(text, allow_special=chat.special, add_special=not chat.special)  # as the server encodes it
    params = SamplingParams(max_tokens=MAX_TOKENS, seed=seed, **sampling)
    out = engine.generate(ids, Generation(params, loops=LOOPS))
    reply = out.text
    cuts = [i for s in chat.stops if (i := reply.find(s)) >= 0]
    natural = out.finish_reason == "stop" or bool(cuts)
    return reply[: min(cuts)].strip() if cuts else reply.strip(), natural


def looping(text: str) -> bool:
    words = text.split()
    grams = Counter(zip(words, words[1:], words[2:], strict=False))
    return any(n > 3 for n in grams.values())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", nargs="?", type=Path, default=DEFAULT)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--repetition-penalty", type=float, default=1.0, help="for every setting (1.0: off)")
    ap.add_argument(
        "--frequency-penalty", type=float, default=None, help="for every setting (default: the file's recommendation)"
    )
    args = ap.parse_args()
    engine = tinyloop.Engine(args.model)
    chat = ChatFormat(engine)
    prompts = [line for line in PROMPTS.read_text(encoding="utf-8").splitlines() if line.strip()]
    # What a chat completions request that leaves the penalties out gets: the file's recommendation.
    frequency = args.frequency_penalty
    frequency = engine.generation_defaults.get("frequency_penalty", 0.0) if frequency is None else frequency
    penalties = {"repetition_penalty": args.repetition_penalty, "frequency_penalty": frequency}
    results = {}
    for name, sampling in SETTINGS.items():
        sampling = sampling | penalties
        answers = [answer(engine, chat, p, sampling, seed=i) for i, p in enumerate(tqdm(prompts, desc=name))]
        n = len(answers)
        results[name] = {
            "non_empty": sum(bool(a) for a, _ in answers) / n,
            "natural_stop": sum(nat for _, nat in answers) / n,
            "no_looping": sum(not looping(a) for a, _ in answers) / n,
            "samples": [{"prompt": p, "answer": a} for p, (a, _) in zip(prompts, answers, strict=True)][:5],
        }
    print(f"| setting (loops {LOOPS}, ≤ {MAX_TOKENS} tokens) | non-empty | natural stop | no 3-gram > 3 times |")
    print("|---|---|---|---|")
    for name, r in results.items():
        print(f"| {name} | {r['non_empty']:.0%} | {r['natural_stop']:.0%} | {r['no_looping']:.0%} |")
    if args.json:
        meta = {"model": args.model.name, "prompts": len(prompts)} | penalties
        args.json.write_text(json.dumps(meta | results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
