"""The launcher's questions. Every one has a default, taken by pressing Enter (or at the end of the input), so a
user who does not know the answer still gets a working server; an answer that is not understood is asked again
with the reason."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TextIO, TypeVar

from .errors import LaunchError

T = TypeVar("T")


class Prompter:
    def __init__(self, stdin: TextIO, stdout: TextIO):
        self.stdin, self.stdout = stdin, stdout

    def _ask(self, question: str) -> str | None:
        """One line of input with the question printed first; None at the end of the input."""
        self.stdout.write(question)
        self.stdout.flush()
        line = self.stdin.readline()
        if not line:
            self.stdout.write("\n")
            return None
        return line.strip()

    def ask(self, question: str, default: T, parse: Callable[[str], T], shown_default: str) -> T:
        """Ask until `parse` accepts the answer (it raises LaunchError with the reason otherwise); an empty answer or
        the end of the input is `default`."""
        while True:
            answer = self._ask(f"{question} [{shown_default}]: ")
            if not answer:
                return default
            try:
                return parse(answer)
            except LaunchError as e:
                self.stdout.write(f"  {e}\n")

    def choose(
        self, question: str, options: Sequence[tuple[str, T]], default: int = 0, other: Callable[[str], T] | None = None
    ) -> T:
        """A numbered menu of (label, value); the answer is a number or, with `other`, free text that `other` turns
        into a value (a name, a path)."""
        self.stdout.write(question + "\n")
        for i, (label, _) in enumerate(options, 1):
            self.stdout.write(f"  {i}) {label}{'   (default)' if i - 1 == default else ''}\n")

        def parse(answer: str) -> T:
            if answer.isdigit() and 1 <= int(answer) <= len(options):
                return options[int(answer) - 1][1]
            if other is not None:
                return other(answer)
            raise LaunchError(f"answer with a number from 1 to {len(options)}")

        return self.ask("Your choice", options[default][1], parse, str(default + 1))
