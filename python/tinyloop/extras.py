"""Optional dependencies behind the package's extras (`pyproject.toml`): `ray` (`tinyloop-serve --ray`) and
`train` (training, plots). A command that needs a missing one stops with one line naming the extra to install."""

from __future__ import annotations

import importlib.util
import sys


class MissingExtra(Exception):
    """What is missing and the `pip install` that brings it."""


def missing(*modules: str) -> list[str]:
    """The modules among `modules` that cannot be imported (a submodule of a missing package counts as missing)."""
    out = []
    for name in modules:
        try:
            found = importlib.util.find_spec(name) is not None
        except ModuleNotFoundError:
            found = False
        if not found:
            out.append(name)
    return out


def require(extra: str, what: str, *modules: str) -> None:
    """Raise `MissingExtra` unless every module of `modules` imports."""
    if absent := missing(*modules):
        raise MissingExtra(f"{what} needs {', '.join(absent)}, which is not installed: pip install 'tinyloop[{extra}]'")


def require_or_exit(extra: str, what: str, *modules: str) -> None:
    """For scripts: `require`, or the one line on stderr and exit status 2."""
    try:
        require(extra, what, *modules)
    except MissingExtra as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
