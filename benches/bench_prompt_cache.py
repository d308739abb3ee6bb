"""What prompt reuse saves: the time to the first token of a conversation's next turn on the shipped default model,
with the earlier turns' KV in the prompt cache (a hit) and without it (a miss, on the same model loaded with the
cache off), in the same rounds.

    pytest benches/bench_prompt_cache.py --benchmark-json=.benchmarks/prompt_cache.json
    python benches/report_prompt_cache.py .benchmarks/prompt_cache.json     # the table in docs/performance.md

The conversation is about 400 tokens of alternating `User:` / `Assistant:` turns from the shipped calibration text;
each round asks a new question after it, so a hit reuses the conversation and prefills the question only — what a
client that re-sends the whole history each turn gets. This machine's speed drifts by 10-30% over a minute, so each
round times the miss first (pytest-benchmark's untimed `setup`, kept in `extra_info`) and then the hit.
"""

from __future__ import annotations

import sys
import time
from itertools import count
from pathlib import Path

import pytest

import tinyloop
from tinyloop import Generation, SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parent))
from quant_models import DEFAULT

CONVERSATION_TOKENS = 400
FIRST = SamplingParams(temperature=0.0, max_tokens=1)
CALIB = Path(tinyloop.__file__).parent / "assets" / "calib.txt"


def _conversation(engine) -> list[int]:
    """Alternating turns of the calibration text, cut to whole turns of about CONVERSATION_TOKENS tokens."""
    words = CALIB.read_text(encoding="utf-8").split()
    text, turn = "", 0
    while len(engine.encode(text)) < CONVERSATION_TOKENS:
        speaker = "User" if turn % 2 == 0 else "Assistant"
        text += f"{speaker}: {' '.join(words[turn * 30 : turn * 30 + 30])}\n"
        turn += 1
    return engine.encode(text)


def _ttft(engine, prompt: list[int], loops: int) -> float:
    """Seconds from submitting `prompt` to its first token (then the stream is released)."""
    start = time.perf_counter()
    stream = engine.stream(prompt, Generation(FIRST, loops=loops))
    event = next(stream)
    elapsed = time.perf_counter() - start
    assert event.token_id >= 0
    stream.release()
    return elapsed


@pytest.fixture(scope="module")
def engines():
    return tinyloop.Engine(DEFAULT), tinyloop.Engine(DEFAULT, prompt_cache_entries=0)


@pytest.mark.parametrize("loops", [8, 1], ids=lambda n: f"loops{n}")
def test_next_turn_time_to_first_token(benchmark, engines, loops):
    cached, plain = engines
    conversation = _conversation(cached)
    questions = (cached.encode(f"User: And what of question {i}?\nAssistant:") for i in count())
    misses: list[float] = []
    reused: list[int] = []
    prompt: list[int] = []

    def before_each_round():
        nonlocal prompt
        prompt = conversation + next(questions)
        misses.append(_ttft(plain, prompt, loops))
        cached.generate(conversation, Generation(FIRST, loops=loops))  # the earlier turns, as a server saw them

    def hit():
        stream = cached.stream(prompt, Generation(FIRST, loops=loops))
        next(stream)
        reused.append(stream.cached_tokens)
        stream.release()

    benchmark.pedantic(hit, setup=before_each_round, rounds=12, iterations=1, warmup_rounds=1)
    assert min(reused) == len(conversation)  # every hit reused the whole conversation
    benchmark.extra_info.update(
        loops=loops, prompt_tokens=len(prompt), cached_tokens=min(reused), miss_min_s=min(misses)
    )
