"""One choice of one request: submit to the engine, turn step events into text deltas, apply stop strings."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

from .._core import SamplingParams
from .runner import EngineRunner
from .text import TextStream


@dataclass
class ChoiceRun:
    """Drives one generation; `deltas()` yields (text, finish_reason) pairs, the last one with a finish reason."""

    runner: EngineRunner
    prompt: list[int]
    params: SamplingParams
    loops: int | None
    stop: Sequence[str] = ()
    lstrip: bool = False  # chat: drop the whitespace the model puts after "Assistant:"
    draft: tuple[int, int, int] | None = None  # (draft_loops, draft_ahead, k_branches); `loops` verifies
    mode: str = "generate"
    cache_window: int = 0  # > 0: attend to (and keep) only the last cache_window positions
    tokens: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    first_token_at: float | None = None

    def __post_init__(self) -> None:
        self.job = self.runner.submit(self.prompt, self.params, self.loops, self.draft, self.mode, self.cache_window)

    def cancel(self) -> None:
        self.job.cancel()

    def _clean(self, delta: str) -> str:
        if self.lstrip and not self.text:
            delta = delta.lstrip()
        self.text += delta
        return delta

    async def deltas(self) -> AsyncIterator[tuple[str, str | None]]:
        ts = TextStream(self.stop)
        try:
            async for ev in self.job.events():
                delta = ""
                if ev.token_id >= 0:
                    if self.first_token_at is None:
                        self.first_token_at = time.perf_counter()
                    self.tokens.append(ev.token_id)
                    delta = ts.push(ev.bytes)
                if ts.stopped:
                    self.finish_reason = "stop"
                    self.job.cancel()
                    yield self._clean(delta), "stop"
                    return
                if ev.finish_reason is not None:
                    self.finish_reason = ev.finish_reason
                    yield self._clean(delta + ts.finish()), ev.finish_reason
                    return
                if delta:
                    yield self._clean(delta), None
        finally:
            self.job.cancel()  # no-op when finished; frees the engine slot when the consumer went away

    def draft_stats(self) -> tuple[int, int, int]:
        """(rounds, proposed, accepted), valid once the generation has ended."""
        return self.job.draft_stats

    async def run(self) -> ChoiceRun:
        async for _ in self.deltas():
            pass
        return self
