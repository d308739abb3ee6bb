"""One choice of one request: turn the step events of its engine job into text deltas, apply stop strings.

When a stop string matches, the text ends where the stop string begins, and so do the tokens: `tokens` keeps the
tokens that lie wholly before the stop string (a token in which the stop string begins is dropped, though the text
keeps its characters before the stop). Streams hand out a token only once the text it decodes to has been handed
out, so a streamed request's tokens and text equal the non-streamed ones.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

from .logprobs import Entry
from .runner import EngineRunner, Job
from .text import TextStream


@dataclass
class ChoiceRun:
    """Follows one submitted generation; `deltas()` yields (text, finish_reason, tokens handed out) triples, the
    last one with a finish reason."""

    runner: EngineRunner
    job: Job
    stop: Sequence[str] = ()
    lstrip: bool = False  # chat: drop the whitespace the model puts after "Assistant:"
    tokens: list[int] = field(default_factory=list)
    logprobs: list[Entry] = field(default_factory=list)  # one per token in `tokens`, when the request asks
    generated: int = 0  # tokens the engine generated (usage counts them, a matched stop string's included)
    text: str = ""
    finish_reason: str | None = None
    stopped_by_string: bool = False
    stop_string: str | None = None  # which one, when a stop string ended the text
    error: str | None = None  # the engine's message when finish_reason is "error"
    first_token_at: float | None = None

    @property
    def loops(self) -> int:
        """The loops the generation runs (verifies, when speculative) at."""
        return self.job.loops

    def cancel(self) -> None:
        self.runner.cancel(self.job)

    def _clean(self, delta: str) -> str:
        if self.lstrip and not self.text:
            delta = delta.lstrip()
        self.text += delta
        return delta

    async def deltas(self) -> AsyncIterator[tuple[str, str | None, int]]:
        ts = TextStream(self.stop)
        ends: list[int] = []  # per token: the text position where it ends (TextStream.position)
        try:
            async for ev in self.job.events():
                delta = ""
                if ev.token_id >= 0:
                    if self.first_token_at is None:
                        self.first_token_at = time.perf_counter()
                    self.tokens.append(ev.token_id)
                    if ev.logprob is not None:
                        self.logprobs.append(ev.logprob)
                    self.generated += 1
                    delta = ts.push(ev.bytes)
                    ends.append(ts.position())
                if ts.stopped:
                    self.finish_reason, self.stopped_by_string, self.stop_string = "stop", True, ts.matched
                    del self.tokens[bisect.bisect_right(ends, len(ts.text)) :]
                    del self.logprobs[len(self.tokens) :]
                    self.cancel()
                    yield self._clean(delta), "stop", len(self.tokens)
                    return
                if ev.finish_reason is not None:
                    self.finish_reason, self.error = ev.finish_reason, getattr(ev, "error", None)
                    yield self._clean(delta + ts.finish()), ev.finish_reason, len(self.tokens)
                    return
                if delta:
                    yield self._clean(delta), None, bisect.bisect_right(ends, len(ts.text))
        finally:
            self.cancel()  # no-op when finished; frees the engine slot when the consumer went away

    def draft_stats(self) -> tuple[int, int, int]:
        """(rounds, proposed, accepted), valid once the generation has ended."""
        return self.job.draft_stats

    def auto_loops(self) -> tuple[int, int]:
        """Adaptive depth's (tokens decided, loops they ran), valid once the generation has ended."""
        return self.job.auto_loops

    async def run(self) -> ChoiceRun:
        async for _ in self.deltas():
            pass
        return self
