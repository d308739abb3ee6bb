"""Function tools on chat completions (docs/api.md, "Tools"): the tools go into the prompt, the model calls one by
writing `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, and the server hands the calls back as
`message.tool_calls` (or tool-call deltas). With `tool_choice` "required" or a named function the call is enforced by
a grammar, so the arguments always match the function's `parameters`.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import Field

from .._core import Grammar
from ..errors import APIError
from .strict import Strict
from .structured import NAME_PATTERN

OPEN, CLOSE = "<tool_call>", "</tool_call>"
# The call's JSON as json.dumps writes it (the engine sets the same for a response_format schema).
SEPARATORS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class FunctionDef(Strict):
    name: str = Field(pattern=NAME_PATTERN)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None  # enforced or not by tool_choice, never by this flag


class Tool(Strict):
    type: str
    function: FunctionDef


class FunctionName(Strict):
    name: str


class NamedToolChoice(Strict):
    type: str
    function: FunctionName


ToolChoice = Literal["auto", "none", "required"] | NamedToolChoice


class FunctionCall(Strict):
    name: str
    arguments: str


class ToolCall(Strict):
    id: str
    type: Literal["function"]
    function: FunctionCall


def render_calls(calls: list[ToolCall]) -> str:
    """An assistant turn's calls as the model writes them."""
    out = []
    for c in calls:
        try:
            arguments: Any = json.loads(c.function.arguments)
        except ValueError:
            arguments = c.function.arguments
        out.append(OPEN + json.dumps({"name": c.function.name, "arguments": arguments}) + CLOSE)
    return "".join(out)


@dataclass(frozen=True)
class ToolUse:
    """A request's tools, checked: what the prompt says, what the output must match, how calls are read back."""

    tools: list[FunctionDef]
    forced: list[FunctionDef] = field(default_factory=list)  # the grammar allows only calls of these
    parallel: bool = True

    @staticmethod
    def of(tools: list[Tool] | None, choice: ToolChoice | None, parallel: bool | None) -> ToolUse | None:
        """None when the request has no tools or `tool_choice` is "none" (the prompt then lists none)."""
        for i, t in enumerate(tools or []):
            if t.type != "function":
                raise APIError(
                    400, f"tool type {t.type!r} is not supported: only function tools", param=f"tools.{i}.type"
                )
        if isinstance(choice, NamedToolChoice) and choice.type != "function":
            raise APIError(400, f"tool_choice type {choice.type!r} is not supported", param="tool_choice.type")
        if not tools:
            if choice not in (None, "none", "auto"):
                raise APIError(400, "tool_choice needs tools", param="tool_choice")
            return None
        if choice == "none":
            return None
        functions = [t.function for t in tools]
        forced: list[FunctionDef] = []
        if choice == "required":
            forced = functions
        elif isinstance(choice, NamedToolChoice):
            forced = [f for f in functions if f.name == choice.function.name]
            if not forced:
                raise APIError(
                    400, f"tool_choice names {choice.function.name!r}, which is not in tools", param="tool_choice"
                )
        return ToolUse(functions, forced, parallel is not False)

    def preamble(self) -> str:
        """The system line that lists the tools and how to call one."""
        listed = " ".join(
            json.dumps({"name": f.name, "description": f.description or "", "parameters": f.parameters or {}})
            for f in self.tools
        )
        return (
            f"You can call these functions: {listed} "
            f'To call one, answer {OPEN}{{"name": <function name>, "arguments": <arguments object>}}{CLOSE}.'
        )

    def grammar(self) -> Grammar | None:
        """With "required" or a named function: exactly one call of a forced function, arguments per its schema."""
        if not self.forced:
            return None
        calls = [
            {
                "type": "object",
                "properties": {"name": {"const": f.name}, "arguments": f.parameters or {"type": "object"}},
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
            for f in self.forced
        ]
        schema = {"anyOf": calls, "x-guidance": SEPARATORS}
        return Grammar.lark(f"start: {json.dumps(OPEN)} call {json.dumps(CLOSE)}\ncall: %json {json.dumps(schema)}")


@dataclass
class CallReader:
    """Splits a choice's text, as it streams, into content and tool calls. Text that might still become `<tool_call>`
    is held back; a block that is not a well-formed call stays content."""

    parallel: bool = True
    calls: list[dict[str, Any]] = field(default_factory=list)
    _held: str = ""

    def feed(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        """(content, new calls) that `text` completes."""
        self._held += text
        content, new = [], []
        while True:
            start = self._held.find(OPEN)
            if start < 0:
                keep = _partial_suffix(self._held, OPEN)
                content.append(self._held[: len(self._held) - keep])
                self._held = self._held[len(self._held) - keep :]
                break
            end = self._held.find(CLOSE, start)
            if end < 0:
                content.append(self._held[:start])
                self._held = self._held[start:]
                break
            content.append(self._held[:start])
            block, self._held = self._held[start : end + len(CLOSE)], self._held[end + len(CLOSE) :]
            call = _parse_call(block[len(OPEN) : -len(CLOSE)])
            if call is None:
                content.append(block)
            elif self.parallel or not self.calls:
                self.calls.append(call)
                new.append(call)
        return "".join(content), new

    def finish(self) -> str:
        """What is still held (an unfinished call is content)."""
        rest, self._held = self._held, ""
        return rest


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of `text` that begins `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def _parse_call(body: str) -> dict[str, Any] | None:
    try:
        value = json.loads(body)
    except ValueError:
        return None
    if not (
        isinstance(value, dict) and isinstance(value.get("name"), str) and isinstance(value.get("arguments"), dict)
    ):
        return None
    return {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": value["name"], "arguments": json.dumps(value["arguments"])},
    }


async def with_calls(
    deltas: AsyncIterator[tuple[int, str, str | None, int]], tools: ToolUse | None
) -> AsyncIterator[tuple[int, str, list[dict[str, Any]], str | None, int]]:
    """A request's merged deltas (`RunningRequest.merged_deltas`) with the calls split out of each choice's text:
    (choice, text, calls completed, finish, tokens handed out). Without tools the text passes unchanged."""
    readers: dict[int, CallReader] = {}
    async for i, delta, finish, count in deltas:
        calls: list[dict[str, Any]] = []
        if tools is not None:
            reader = readers.setdefault(i, CallReader(tools.parallel))
            delta, calls = reader.feed(delta)
            delta += reader.finish() if finish is not None else ""
        yield i, delta, calls, finish, count
