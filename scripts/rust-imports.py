#!/usr/bin/env python3
"""Print the import graph of the Rust crate in rust/ and fail (exit 1) on any import cycle.

Two granularities are checked:

- top-level modules: each folder or file directly under rust/ (`generate/`, `kv/`, `limits.rs`, ...; a file pulled
  in with `#[path = ...]` belongs to the module that includes it; lib.rs is the root and is left out);
- files within each folder: `mod.rs` and its sibling files. A child may use items of its folder's `mod.rs` only if
  `mod.rs` does not import that child back (re-exports included), which is the same rule: no cycle.

Every path is counted wherever it appears outside comments and strings — `use` lines and inline paths alike:
`crate::x::...`, `super::...` (resolved through inline `mod tests { }` blocks), `self::child::...`, and bare
`child::...` in a folder's `mod.rs`. A name used at the crate root (`crate::Result`, `crate::ensure_arg`) is
resolved through lib.rs's `pub use` lines or the `#[macro_export]` macro's home.

    python3 scripts/rust-imports.py [rust-dir]
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

IDENT = r"[A-Za-z_][A-Za-z0-9_]*"


def strip_code(text: str) -> str:
    """The source without comments, string literals and char literals (each replaced by a space)."""
    out, i, n = [], 0, len(text)
    while i < n:
        c = text[i]
        if text.startswith("//", i):
            j = text.find("\n", i)
            i = n if j < 0 else j
        elif text.startswith("/*", i):
            depth, i = 1, i + 2
            while i < n and depth:
                if text.startswith("/*", i):
                    depth, i = depth + 1, i + 2
                elif text.startswith("*/", i):
                    depth, i = depth - 1, i + 2
                else:
                    i += 1
            out.append(" ")
        elif m := re.compile(r'b?r(#*)"').match(text, i):
            end = text.find('"' + m.group(1), m.end())
            i = n if end < 0 else end + 1 + len(m.group(1))
            out.append(" ")
        elif c == '"' or text.startswith('b"', i):
            i += 1 if c == '"' else 2
            while i < n and text[i] != '"':
                i += 2 if text[i] == "\\" else 1
            i += 1
            out.append(" ")
        elif m := re.compile(r"b?'(\\.|\\u\{[0-9a-fA-F]+\}|[^\\'])'").match(text, i):
            i = m.end()
            out.append(" ")
        else:
            out.append(c)
            i += 1
    return "".join(out)


def expand_use_tree(prefix: list[str], tree: str) -> list[list[str]]:
    """`a::{b, c::{d}}` after `prefix` → [[...prefix, a, b], [...prefix, a, c, d]] (the leading segments matter)."""
    tree = tree.strip()
    if not tree:
        return [prefix]
    if tree.startswith("{"):
        inner, parts, depth, cur = tree[1 : tree.rfind("}")], [], 0, ""
        for ch in inner:
            if ch == "," and depth == 0:
                parts.append(cur)
                cur = ""
                continue
            depth += ch == "{"
            depth -= ch == "}"
            cur += ch
        parts.append(cur)
        return [p for part in parts if part.strip() for p in expand_use_tree(prefix, part)]
    m = re.match(rf"({IDENT}|\*)\s*(::\s*)?", tree)
    if not m:
        return [prefix]
    head, rest = m.group(1), tree[m.end() :]
    if not m.group(2):
        return [[*prefix, head]]
    return expand_use_tree([*prefix, head], rest)


def paths_in(code: str) -> list[tuple[int, list[str]]]:
    """(offset, segments) of every path: expanded `use` trees, and inline `a::b::c` paths."""
    found: list[tuple[int, list[str]]] = []
    spans = []
    for m in re.finditer(r"\buse\s+([^;]+);", code):
        spans.append((m.start(), m.end()))
        tree = re.sub(r"\s+as\s+" + IDENT, "", m.group(1))
        for segs in expand_use_tree([], tree):
            found.append((m.start(), segs))
    for m in re.finditer(rf"(?<![A-Za-z0-9_:$])(\$?{IDENT}(?:\s*::\s*{IDENT})+)", code):
        if any(a <= m.start() < b for a, b in spans):
            continue
        segs = [s.strip() for s in m.group(1).split("::")]
        found.append((m.start(), segs))
    return found


def inline_mod_depth(code: str) -> list[int]:
    """For each offset, how many inline `mod name { ... }` blocks enclose it."""
    depth_at = [0] * (len(code) + 1)
    opens = {m.end() - 1 for m in re.finditer(rf"\bmod\s+{IDENT}\s*\{{", code)}
    stack: list[bool] = []
    level = 0
    for i, ch in enumerate(code):
        depth_at[i] = level
        if ch == "{":
            stack.append(i in opens)
            level += i in opens
        elif ch == "}" and stack:
            level -= stack.pop()
    depth_at[len(code)] = level
    return depth_at


class Crate:
    def __init__(self, root: Path):
        self.root = root
        self.files = sorted(p for p in root.rglob("*.rs"))
        self.code = {p: strip_code(p.read_text()) for p in self.files}
        self.owner: dict[Path, Path] = {}  # a #[path]-included file -> the file that includes it
        for p in self.files:
            for m in re.finditer(r'#\[path\s*=\s*"([^"]+)"\]', p.read_text()):
                self.owner[(p.parent / m.group(1)).resolve()] = p
        self.top = {self.top_of(p) for p in self.files} - {"lib"}
        self.exports: dict[str, str] = {}  # a name at the crate root -> the top-level module it comes from
        lib = root / "lib.rs"
        for _, segs in paths_in(self.code.get(lib, "")):
            if len(segs) >= 2 and segs[0] in self.top:
                self.exports[segs[-1]] = segs[0]
        for p in self.files:
            for m in re.finditer(rf"#\[macro_export\]\s*macro_rules!\s*({IDENT})", p.read_text()):
                self.exports[m.group(1)] = self.top_of(p)

    def home(self, p: Path) -> Path:
        while p.resolve() in self.owner:
            p = self.owner[p.resolve()]
        return p

    def top_of(self, p: Path) -> str:
        p = self.home(p)
        return p.stem if p.parent == self.root else p.relative_to(self.root).parts[0]

    def node_in_folder(self, p: Path) -> str:
        return "mod.rs" if p.name == "mod.rs" else p.stem

    def resolve_crate(self, segs: list[str]) -> str | None:
        """The top-level module a `crate::...` path reaches."""
        if len(segs) < 2:
            return None
        first = segs[1]
        if first in self.top:
            return first
        if first in self.exports:
            return self.exports[first]
        raise SystemExit(f"cannot resolve crate::{'::'.join(segs[1:])}")

    def graphs(self) -> tuple[dict[str, set[str]], dict[Path, dict[str, set[str]]]]:
        top: dict[str, set[str]] = {m: set() for m in self.top}
        folders: dict[Path, dict[str, set[str]]] = {}
        dirs = sorted({p.parent for p in self.files if p.parent != self.root})
        for d in dirs:
            # A folder's nodes: its files, and its subfolders (each one module).
            names = sorted(
                {self.node_in_folder(p) for p in self.files if p.parent == d} | {e.name for e in dirs if e.parent == d}
            )
            folders[d] = {n: set() for n in names}
        for p in self.files:
            if p.name == "lib.rs":
                continue
            home = self.home(p)
            src, code = self.top_of(p), self.code[p]
            depth = inline_mod_depth(code)
            # A #[path] file is an inline module one level below its includer.
            extra = 1 if home != p else 0
            folder = folders.get(home.parent)
            me = self.node_in_folder(home) if folder is not None else None
            children = set(folder) - {"mod.rs"} if folder is not None and me == "mod.rs" else set()
            for off, segs in paths_in(code):
                head = segs[0].lstrip("$")
                if head == "crate":
                    dst = self.resolve_crate(segs)
                    if dst and dst != src:
                        top[src].add(dst)
                    if dst == src:
                        self.crate_edges(folders, home, segs[1:])
                    continue
                d = depth[off] + extra
                if head == "super":
                    n = len(segs) - len([s for s in segs if s != "super"])
                    up = n - d  # levels above this file's module
                    rest = segs[n:]
                    if up == 1 and folder is not None and me != "mod.rs":
                        self.folder_edge(folder, me, rest[0] if rest else "")
                    elif up == 1 and folder is None:
                        pass  # a top-level file's parent is the crate root: lib.rs items
                    elif up == 0 and me == "mod.rs" and rest and rest[0] in children:
                        self.folder_edge(folder, me, rest[0])
                    elif up > 1 or (up == 1 and me == "mod.rs"):
                        raise SystemExit(f"{p}: {'::'.join(segs)} leaves its top-level module; use crate::")
                elif head == "self" and d == 0 and me == "mod.rs" and len(segs) > 1 and segs[1] in children:
                    self.folder_edge(folder, me, segs[1])
                elif head in children and d == 0:
                    self.folder_edge(folder, me, head)
        return top, folders

    def crate_edges(self, folders: dict[Path, dict[str, set[str]]], home: Path, path: list[str]) -> None:
        """The edges a `crate::` path into the file's own top-level module draws: in each folder on the way down
        that both the file and the path are inside, from the node holding the file to the node the path enters."""
        mods = list(home.relative_to(self.root).parts[:-1])
        for level in range(1, len(mods) + 1):
            folder = folders.get(self.root.joinpath(*mods[:level]))
            if folder is None or path[:level] != mods[:level] or len(path) <= level:
                break
            me = mods[level] if level < len(mods) else self.node_in_folder(home)
            self.folder_edge(folder, me, path[level])

    @staticmethod
    def folder_edge(folder: dict[str, set[str]], me: str, name: str) -> None:
        dst = name if name in folder and name != "mod.rs" else "mod.rs"
        if dst != me:
            folder[me].add(dst)


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def show(title: str, graph: dict[str, set[str]]) -> list[list[str]]:
    print(title)
    width = max(map(len, graph), default=0)
    for v in sorted(graph):
        print(f"  {v:<{width}} -> {', '.join(sorted(graph[v])) or '-'}")
    found = cycles(graph)
    for c in found:
        print(f"  CYCLE: {' <-> '.join(c)}")
    return found


def main() -> int:
    root = Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).resolve().parent.parent / "rust").resolve()
    crate = Crate(root)
    top, folders = crate.graphs()
    bad = show("top-level modules (rust/):", top)
    for d, g in folders.items():
        bad += show(f"\nfiles in rust/{d.relative_to(root)}/:", g)
    print(f"\n{len(bad)} cycle(s)" if bad else "\nno cycles")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
