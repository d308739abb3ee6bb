#!/usr/bin/env python3
"""Fail (exit 1) on any import cycle among the modules of the Python package in python/tinyloop, as
scripts/rust-imports.py does for the crate.

Every import of a module of the package counts wherever it is written: at the top, under `if TYPE_CHECKING:`, or
inside a function (a deferred import only hides a cycle until it runs). `from . import x` is an import of the
module `x` when the package has one, else of the package itself. A package's `__init__` is a module like the others.

    python3 scripts/py-imports.py [package-dir]
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path


def module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(root: Path, path: Path, known: set[str]) -> set[str]:
    """The package's modules that the file at `path` imports."""
    name = module_name(root, path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name in known}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            for a in node.names:
                full = f"{base}.{a.name}"
                out.add(full if full in known else base)
    return {m for m in out if m in known and m != name}


def cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of `graph`, as the list of modules along it, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        path.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                return [*path[path.index(n) :], n]
            if n not in state and (found := visit(n)):
                return found
        state[m] = 2
        path.pop()
        return None

    for m in sorted(graph):
        if m not in state and (found := visit(m)):
            return found
    return None


def main() -> int:
    root = Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).resolve().parents[1] / "python" / "tinyloop")
    files = sorted(root.rglob("*.py"))
    known = {module_name(root, f) for f in files}
    graph = {module_name(root, f): imports(root, f, known) for f in files}
    found = cycle(graph)
    if found:
        print("import cycle: " + " -> ".join(found))
        return 1
    print(f"{len(graph)} modules, {sum(map(len, graph.values()))} imports, no cycle")
    return 0


if __name__ == "__main__":
    sys.exit(main())
