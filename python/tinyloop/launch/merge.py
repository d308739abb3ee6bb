"""Set one member of a JSON-with-comments file, rewriting only that member's text.

`set_path(text, ["language_models", "openai_compatible", "tinyloop"], value)` walks the objects named by the path,
creating the ones that are missing, and then either replaces the value of the last key (keeping the key, its
comments and everything around it) or inserts a new member after the object's last one, in the file's own
indentation and newline style. Setting the same value twice gives the same text: re-running the launcher changes
nothing the second time.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

from .jsonc import JsoncError, Member, Node, parse

_MEMBER_LINE = re.compile(r"^([ \t]+)\"", re.M)


def set_path(text: str, path: Sequence[str], value: Any) -> str:
    """`text` with the member at `path` set to `value` (see the module's docstring). Raises JsoncError when the text
    cannot be parsed, its top level is not an object, or a key on the path holds something other than an object."""
    if not path:
        raise ValueError("set_path needs at least one key")
    style = _Style(text)
    root = parse(text)
    if root is None:  # empty, or only comments: the object goes after them
        lead = text if not text or text.endswith(("\n", "\r")) else text + style.newline
        return lead + style.dump(_nest(path, value), "") + style.newline
    if root.kind != "object":
        raise JsoncError("the top-level value is not an object")
    node = root
    for depth, key in enumerate(path):
        member = _last(node.members, key)
        if member is None:
            return _insert(text, style, node, key, _nest(path[depth + 1 :], value))
        if depth == len(path) - 1:
            return _replace(text, style, member, value)
        if member.value.kind != "object":
            raise JsoncError(f"{'.'.join(path[: depth + 1])} holds a {member.value.kind}, not an object")
        node = member.value
    raise AssertionError("unreachable: the loop returns at the path's last key")


def _nest(path: Sequence[str], value: Any) -> Any:
    for key in reversed(path):
        value = {key: value}
    return value


def _last(members: list[Member], key: str) -> Member | None:
    """Of repeated keys the last is the one JSON readers keep, so that is the one to change."""
    found = [m for m in members if m.key == key]
    return found[-1] if found else None


class _Style:
    """The file's newline and indentation unit, so inserted text looks like the rest."""

    def __init__(self, text: str):
        self.newline = "\r\n" if "\r\n" in text else "\n"
        indents = [m.group(1) for m in _MEMBER_LINE.finditer(text)]
        if any("\t" in i for i in indents):
            self.unit = "\t"
        else:
            self.unit = " " * min((len(i) for i in indents), default=2)

    def dump(self, value: Any, indent: str) -> str:
        """`value` as JSON whose continuation lines start with `indent` (the indentation of its member's line)."""
        lines = json.dumps(value, indent=self.unit, ensure_ascii=False).split("\n")
        return (self.newline + indent).join(lines)


def _line_start(text: str, pos: int) -> int:
    return max(text.rfind("\n", 0, pos), text.rfind("\r", 0, pos)) + 1


def _line_indent(text: str, pos: int) -> str:
    start = _line_start(text, pos)
    return text[start : start + len(text[start:pos]) - len(text[start:pos].lstrip(" \t"))]


def _on_own_line(text: str, pos: int) -> bool:
    return text[_line_start(text, pos) : pos].strip(" \t") == ""


def _line_end(text: str, pos: int, limit: int) -> int | None:
    """Where the line break after `pos` is, if only blanks and comments lie between (so an insertion there keeps a
    comment on the line it annotates); None if something else comes first, or the break is at or past `limit`."""
    while pos < limit:
        ch = text[pos]
        if ch in " \t":
            pos += 1
        elif ch in "\r\n":
            return pos
        elif text.startswith("//", pos):
            end = min(i for i in (text.find("\n", pos), text.find("\r", pos), len(text)) if i >= 0)
            return end if end < limit else None
        elif text.startswith("/*", pos):
            end = text.find("*/", pos + 2) + 2
            if end < pos + 4 or "\n" in text[pos:end]:  # unterminated (not after a parse), or over several lines
                return None
            pos = end
        else:
            return None
    return None


def _replace(text: str, style: _Style, member: Member, value: Any) -> str:
    old = member.value
    if _on_own_line(text, member.key_start):
        new = style.dump(value, _line_indent(text, member.key_start))
    else:  # a one-line object: keep it on one line
        new = json.dumps(value, ensure_ascii=False)
    return text[: old.start] + new + text[old.end :]


def _insert(text: str, style: _Style, obj: Node, key: str, value: Any) -> str:
    close = obj.end - 1  # the closing brace
    if "\n" not in text[obj.start : obj.end] and "\r" not in text[obj.start : obj.end]:
        return _insert_one_line(text, style, obj, key, value)
    if obj.members:
        first = obj.members[0]
        indent = _line_indent(text, first.key_start) if _on_own_line(text, first.key_start) else None
    else:
        indent = None
    if indent is None:
        indent = _line_indent(text, obj.start) + style.unit
    member = json.dumps(key, ensure_ascii=False) + ": " + style.dump(value, indent)
    if not obj.members:
        at = _line_end(text, obj.start + 1, close)
        at = obj.start + 1 if at is None else at
        return text[:at] + style.newline + indent + member + text[at:]
    last = obj.members[-1]
    if last.comma is not None:  # a trailing comma: keep the style, the new member gets one too
        at = _line_end(text, last.comma + 1, close)
        at = last.comma + 1 if at is None else at
        return text[:at] + style.newline + indent + member + "," + text[at:]
    after = last.value.end
    at = _line_end(text, after, close)
    at = after if at is None else at
    return text[:after] + "," + text[after:at] + style.newline + indent + member + text[at:]


def _insert_one_line(text: str, style: _Style, obj: Node, key: str, value: Any) -> str:
    """An object written on one line (`{}` or `{"a": 1}`)."""
    close = obj.end - 1
    if not obj.members:  # `{}`: open it up over lines, as editors write settings files
        indent = _line_indent(text, obj.start)
        member = json.dumps(key, ensure_ascii=False) + ": " + style.dump(value, indent + style.unit)
        inner = text[obj.start + 1 : close]
        kept = inner if inner.strip() else ""  # a comment inside `{ /* ... */ }` stays, after the new member
        head = text[: obj.start + 1] + style.newline + indent + style.unit
        return head + member + kept + style.newline + indent + text[close:]
    member = json.dumps(key, ensure_ascii=False) + ": " + json.dumps(value, ensure_ascii=False)
    last = obj.members[-1]
    if last.comma is not None:
        return text[: last.comma + 1] + " " + member + "," + text[last.comma + 1 :]
    return text[: last.value.end] + ", " + member + text[last.value.end :]
