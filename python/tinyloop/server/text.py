"""Turning a stream of token bytes into text deltas: whole UTF-8 characters only, exact stop strings held back.

`TextStream.push(bytes)` returns the text that is safe to emit now; `finish()` returns the tail. A delta never
splits a character, never contains a stop string, and never contains text that could still turn out to be the
start of one — so a stop string never leaks into a streamed delta.
"""

from __future__ import annotations

import codecs
from collections.abc import Sequence


class TextStream:
    def __init__(self, stop: Sequence[str] = ()):
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._stop = [s for s in stop if s]
        self._held = ""  # decoded text not yet emitted (a possible stop-string prefix)
        self.stopped = False  # a stop string matched: the caller ends the generation
        self.matched: str | None = None  # the stop string that matched (the earliest in the text)
        self.text = ""  # everything emitted so far

    def push(self, data: bytes) -> str:
        if self.stopped:
            return ""
        self._held += self._decoder.decode(data)
        return self._release(final=False)

    def position(self) -> int:
        """Characters decoded so far, emitted or held, counting a character whose bytes have only begun: a token
        ends at this position, and lies wholly before a stop string when it is at most where the stop begins."""
        return len(self.text) + len(self._held) + (1 if self._decoder.getstate()[0] else 0)

    def finish(self) -> str:
        """Flush at the end: incomplete bytes become U+FFFD, a held stop-string prefix is text after all."""
        if not self.stopped:
            self._held += self._decoder.decode(b"", final=True)
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        if self.stopped:
            return ""
        cut = None
        for s in self._stop:
            i = self._held.find(s)
            if i != -1 and (cut is None or i < cut):
                cut, self.matched = i, s
        if cut is not None:
            out, self._held, self.stopped = self._held[:cut], "", True
        elif final:
            out, self._held = self._held, ""
        else:
            keep = self._longest_stop_prefix_suffix()
            out, self._held = self._held[: len(self._held) - keep], self._held[len(self._held) - keep :]
        self.text += out
        return out

    def _longest_stop_prefix_suffix(self) -> int:
        """Length of the longest suffix of the held text that is a proper prefix of some stop string."""
        best = 0
        for s in self._stop:
            for n in range(min(len(s) - 1, len(self._held)), best, -1):
                if self._held.endswith(s[:n]):
                    best = n
                    break
        return best
