"""Edit JSON-with-comments settings files (Zed's, OpenCode's, Qwen Code's) in place.

The launcher adds one member to a file the user also edits by hand. Loading it into a dict and dumping it back
would drop every comment and reorder nothing else the user cares about, so the file is scanned instead: the scanner
finds where each member's value starts and ends, and `set_path` rewrites only the span of the member it sets (or
inserts a new member after the last one). Every byte outside that span stays as it was.

Accepted: JSON plus `//` and `/* */` comments and trailing commas (what these editors accept). Anything else raises
`JsoncError` with the line and column, before anything is written.
"""

from __future__ import annotations

import itertools
import json
import re
from dataclasses import dataclass, field
from typing import Any

_TOKEN = re.compile(
    r"""
    (?P<ws>[ \t\r\n\ufeff]+)
  | (?P<comment>//[^\n]*|/\*.*?\*/)
  | (?P<string>"(?:[^"\\\n]|\\.)*")
  | (?P<punct>[{}\[\]:,])
  | (?P<number>-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?)
  | (?P<word>true|false|null)(?![A-Za-z0-9_])
    """,
    re.S | re.X,
)
MAX_DEPTH = 200  # deeper nesting than any settings file has; keeps a hostile file from exhausting the stack


class JsoncError(ValueError):
    """The text is not JSON with comments; the message names where."""


@dataclass
class Token:
    kind: str  # comment, string, punct, number, word
    start: int
    end: int


@dataclass
class Node:
    """A value's extent in the text: [start, end). Objects list their members, arrays their items."""

    kind: str  # object, array, scalar
    start: int
    end: int
    members: list[Member] = field(default_factory=list)
    items: list[Node] = field(default_factory=list)


@dataclass
class Member:
    key: str
    key_start: int
    value: Node
    comma: int | None  # the comma after the value, if any (after the last member: a trailing comma)


def _where(text: str, pos: int) -> str:
    line = text.count("\n", 0, pos) + 1
    return f"line {line}, column {pos - (text.rfind(chr(10), 0, pos) + 1) + 1}"


def tokenize(text: str) -> list[Token]:
    """Every token but whitespace, comments included (so that `strip` can blank them)."""
    tokens, pos = [], 0
    while pos < len(text):
        m = _TOKEN.match(text, pos)
        if m is None:
            what = {"/*": "an unterminated /* comment", '"': "an unterminated string"}
            found = what.get(text[pos : pos + 2]) or what.get(text[pos]) or f"unexpected {text[pos]!r}"
            raise JsoncError(f"{found} at {_where(text, pos)}")
        if m.lastgroup != "ws":
            tokens.append(Token(m.lastgroup or "", m.start(), m.end()))
        pos = m.end()
    return tokens


class _Parser:
    def __init__(self, text: str):
        self.text = text
        self.tokens = [t for t in tokenize(text) if t.kind != "comment"]
        self.i = 0

    def peek(self) -> Token | None:
        return self.tokens[self.i] if self.i < len(self.tokens) else None

    def take(self, expected: str | None = None) -> Token:
        tok = self.peek()
        if tok is None:
            raise JsoncError(f"the text ends where {expected or 'a value'} was expected")
        if expected is not None and self.text[tok.start : tok.end] != expected:
            raise JsoncError(f"expected {expected!r} at {_where(self.text, tok.start)}")
        self.i += 1
        return tok

    def punct(self, chars: str) -> bool:
        tok = self.peek()
        return tok is not None and tok.kind == "punct" and self.text[tok.start] in chars

    def value(self, depth: int = 0) -> Node:
        if depth > MAX_DEPTH:
            raise JsoncError(f"nested deeper than {MAX_DEPTH} levels")
        tok = self.take()
        if tok.kind in ("string", "number", "word"):
            return Node("scalar", tok.start, tok.end)
        opener = self.text[tok.start]
        if opener == "{":
            return self.members(tok, depth)
        if opener == "[":
            return self.items(tok, depth)
        raise JsoncError(f"unexpected {opener!r} at {_where(self.text, tok.start)}")

    def members(self, opener: Token, depth: int) -> Node:
        node = Node("object", opener.start, opener.end)
        while not self.punct("}"):
            key = self.take()
            if key.kind != "string":
                raise JsoncError(f"expected a member name in quotes at {_where(self.text, key.start)}")
            self.take(":")
            value = self.value(depth + 1)
            comma = self.take(",").start if self.punct(",") else None
            node.members.append(Member(_string(self.text, key), key.start, value, comma))
            if comma is None:
                break
        node.end = self.take("}").end
        return node

    def items(self, opener: Token, depth: int) -> Node:
        node = Node("array", opener.start, opener.end)
        while not self.punct("]"):
            node.items.append(self.value(depth + 1))
            if not self.punct(","):
                break
            self.take(",")
        node.end = self.take("]").end
        return node


def _string(text: str, tok: Token) -> str:
    try:
        return json.loads(text[tok.start : tok.end])
    except json.JSONDecodeError as e:
        raise JsoncError(f"bad string at {_where(text, tok.start)}: {e.msg}") from None


def parse(text: str) -> Node | None:
    """The top-level value's extents; None for a file of only whitespace and comments."""
    parser = _Parser(text)
    if parser.peek() is None:
        return None
    root = parser.value()
    extra = parser.peek()
    if extra is not None:
        raise JsoncError(f"unexpected text after the top-level value at {_where(text, extra.start)}")
    return root


def loads(text: str) -> Any:
    """The value the text holds (comments and trailing commas ignored; of repeated keys the last wins)."""
    root = parse(text)
    return None if root is None else _value(text, root)


def _value(text: str, node: Node) -> Any:
    if node.kind == "object":
        return {m.key: _value(text, m.value) for m in node.members}
    if node.kind == "array":
        return [_value(text, item) for item in node.items]
    return json.loads(text[node.start : node.end])


def strip(text: str) -> str:
    """The text as strict JSON: comments and trailing commas become spaces (newlines kept, so positions in error
    messages still match the original)."""
    tokens = tokenize(text)
    significant = [t for t in tokens if t.kind != "comment"]
    blank = [t for t in tokens if t.kind == "comment"]
    for tok, nxt in itertools.pairwise(significant):
        if text[tok.start : tok.end] == "," and text[nxt.start] in "}]":
            blank.append(tok)
    out = list(text)
    for tok in blank:
        for i in range(tok.start, tok.end):
            if out[i] not in "\r\n":
                out[i] = " "
    return "".join(out)
