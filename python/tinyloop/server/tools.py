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
from typing import Any, Literal, NamedTuple

from pydantic import Field

from .._core import Grammar
from .errors import APIError
from .strict import Strict
from .structured import NAME_PATTERN, closed

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

    def grammar(self, text: dict[str, Any] | None = None) -> Grammar | None:
        """With "required" or a named function: exactly one call of a forced function, arguments per its schema (the
        call decides the turn: a text schema has nothing to shape). Else, with a text schema (a structured output):
        one call of any tool, or the text document. Else None: the model writes freely."""
        if not self.forced and text is None:
            return None
        calls = [
            {
                "type": "object",
                "properties": {"name": {"const": f.name}, "arguments": closed(f.parameters or {"type": "object"})},
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
            for f in self.forced or self.tools
        ]
        call = f"call: %json {json.dumps({'anyOf': calls, 'x-guidance': SEPARATORS})}"
        rule = f"start: {json.dumps(OPEN)} call {json.dumps(CLOSE)}"
        if self.forced:
            return Grammar.lark(f"{rule}\n{call}")
        document = f"document: %json {json.dumps({'x-guidance': SEPARATORS, **closed(text)})}"
        return Grammar.lark(f"{rule} | document\n{call}\n{document}")


@dataclass
class Call:
    """One tool call as the model writes it: its arguments are the model's own text, fragment by fragment."""

    name: str
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")
    arguments: str = ""
    closed: bool = False  # the arguments object was written to its end (else the generation cut it)

    @property
    def complete(self) -> bool:
        """Closed, and its arguments a JSON object: a call the client can make."""
        return self.closed and isinstance(_json_or_none(self.arguments), dict)

    def openai(self) -> dict[str, Any]:
        """As a chat completion's `tool_calls` entry."""
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def _json_or_none(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None


class Event(NamedTuple):
    """What a stretch of text adds: `text` (content), `start` (a call's name is known), `args` (a fragment of its
    arguments) or `end` (its block closed)."""

    kind: Literal["text", "start", "args", "end"]
    text: str = ""
    call: Call | None = None


_HEAD = ("{", '"name"', ":", None, ",", '"arguments"', ":")  # None: the name, a JSON string


def _head(block: str) -> tuple[str, int, str | None]:
    """Reads `{"name": "...", "arguments": ` at the start of a call block: ("more", 0, None) while the text may still
    become one, ("no", 0, None) once it cannot, ("yes", where the arguments object begins, name)."""
    i, name = 0, None
    for part in (*_HEAD, "{"):
        while i < len(block) and block[i].isspace():
            i += 1
        rest = block[i:]
        if part is None:
            end = _string_end(rest)
            if end < 0:
                return ("more" if not rest or rest[0] == '"' else "no"), 0, None
            name = _json_or_none(rest[:end])
            if not isinstance(name, str):
                return "no", 0, None
            i += end
        elif not rest.startswith(part):
            return ("more" if part.startswith(rest) else "no"), 0, None
        elif part != "{" or name is None:
            i += len(part)
    return "yes", i, name


def _string_end(text: str) -> int:
    """The length of the JSON string `text` begins with, or -1 while it is unfinished."""
    if not text.startswith('"'):
        return -1
    escaped = False
    for i, ch in enumerate(text[1:], 1):
        if escaped:
            escaped = False
        elif ch == "\\":
            escaped = True
        elif ch == '"':
            return i + 1
    return -1


@dataclass
class CallReader:
    """Splits a choice's text, as it streams, into content and tool calls (`Event`s). Text that might still become
    `<tool_call>` is held back; once it is one, nothing up to `</tool_call>` is content: a block that begins a call's
    head (`{"name": "f", "arguments": `) is that call, its arguments streamed as written; any other block is dropped
    (or read whole at its end, for a call written in another layout). Fed the same text cut anywhere, it gives the
    same calls and content."""

    parallel: bool = True
    calls: list[Call] = field(default_factory=list)
    marked: bool = False  # some of the text was markup (a block, or a marker the generation cut)
    _held: str = ""
    _mode: Literal["text", "head", "args", "tail", "skip"] = "text"
    _depth: int = 0  # the arguments' open brackets, string and escape state
    _in_string: bool = False
    _escaped: bool = False

    def feed(self, text: str) -> list[Event]:
        """The events `text` completes."""
        self._held += text
        out: list[Event] = []
        while self._step(out):
            pass
        return out

    def finish(self, cut: bool = False) -> list[Event]:
        """At the end of the generation: held text that never became `<tool_call>` is content — unless the generation
        was `cut` (by max_tokens, an abort, an error) while the model was writing it; a call cut short stays as written
        so far (`Call.closed` false); an unfinished head is dropped."""
        rest, self._held = self._held, ""
        if self._mode == "text" and rest and not cut:
            return [Event("text", rest)]
        self.marked = self.marked or bool(rest)
        return []

    def _step(self, out: list[Event]) -> bool:
        """Consume what the held text decides; False when it must wait for more."""
        held = self._held
        if self._mode == "text":
            start = held.find(OPEN)
            cut = start if start >= 0 else len(held) - _partial_suffix(held, OPEN)
            if cut:
                out.append(Event("text", held[:cut]))
            self._held = held[cut + len(OPEN) :] if start >= 0 else held[cut:]
            self._mode = "head" if start >= 0 else "text"
            self.marked = self.marked or start >= 0
            return start >= 0
        if self._mode == "head":
            verdict, at, name = _head(held)
            if verdict == "more":
                return False
            if verdict == "no" or (self.calls and not self.parallel):
                self._mode = "skip"
                return True
            call = Call(name or "")
            self.calls.append(call)
            out.append(Event("start", call=call))
            self._held, self._mode, self._depth, self._in_string, self._escaped = held[at:], "args", 0, False, False
            return True
        if self._mode == "args":
            return self._arguments(out)
        end = held.find(CLOSE)
        if end < 0:
            keep = _partial_suffix(held, CLOSE)
            self._held = held if self._mode == "skip" else held[len(held) - keep :]
            return False
        if self._mode == "skip":
            self._read_whole(held[:end], out)
        self._held, self._mode = held[end + len(CLOSE) :], "text"
        return True

    def _arguments(self, out: list[Event]) -> bool:
        """Scan the arguments object a character at a time, handing each stretch out as a fragment."""
        call, held = self.calls[-1], self._held
        i = 0
        while i < len(held):
            ch = held[i]
            if self._escaped:
                self._escaped = False
            elif self._in_string:
                self._escaped, self._in_string = ch == "\\", ch != '"'
            elif ch == "<" and CLOSE.startswith(held[i : i + len(CLOSE)]):
                break  # the block closes (or may) inside unbalanced arguments
            elif ch == '"':
                self._in_string = True
            elif ch in "{[":
                self._depth += 1
            elif ch in "}]":
                self._depth -= 1
            i += 1
            if self._depth == 0 and not self._in_string:
                call.closed = True
                break
        if i:
            call.arguments += held[:i]
            out.append(Event("args", held[:i], call))
        self._held = held[i:]
        if not (call.closed or self._held.startswith(CLOSE)):
            return False
        self._mode = "tail"
        out.append(Event("end", call=call))
        return True

    def _read_whole(self, body: str, out: list[Event]) -> None:
        """A dropped block that is a call after all, in a layout the head does not read (keys in another order)."""
        value = _json_or_none(body)
        if not isinstance(value, dict) or (self.calls and not self.parallel):
            return
        if not (isinstance(value.get("name"), str) and isinstance(value.get("arguments"), dict)):
            return
        call = Call(value["name"], arguments=json.dumps(value["arguments"]), closed=True)
        self.calls.append(call)
        out += [Event("start", call=call), Event("args", call.arguments, call), Event("end", call=call)]


def read_calls(text: str, finish: str | None, tools: ToolUse) -> tuple[str | None, list[Call]]:
    """A whole choice's text and finish reason: (content, calls), as the same text streamed gives them. The content
    is None where the text was tool-call markup and nothing (but whitespace) else."""
    reader = CallReader(tools.parallel)
    events = reader.feed(text) + reader.finish(cut=finish != "stop")
    content = "".join(e.text for e in events if e.kind == "text")
    return (None if reader.marked and not content.strip() else content), reader.calls


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of `text` that begins `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


async def with_calls(
    deltas: AsyncIterator[tuple[int, str, str | None, int]], tools: ToolUse | None
) -> AsyncIterator[tuple[int, list[Event], str | None, int]]:
    """A request's merged deltas (`RunningRequest.merged_deltas`) as events, the calls split out of each choice's
    text: (choice, events, finish, tokens handed out). Without tools each delta is one text event."""
    readers: dict[int, CallReader] = {}
    async for i, delta, finish, count in deltas:
        if tools is None:
            events = [Event("text", delta)] if delta else []
        else:
            reader = readers.setdefault(i, CallReader(tools.parallel))
            events = reader.feed(delta) + (reader.finish(cut=finish != "stop") if finish is not None else [])
        yield i, events, finish, count
