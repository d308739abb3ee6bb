"""Planned file changes: computed first, shown by --dry-run, written only when every one of them could be computed.

Writing goes through `apply`, which keeps the safety rules in one place: the file as it was is copied to
`<file>.tinyloop-backup` beside it before it is rewritten; the new text is written to a temporary file in the same
directory and renamed over the original, so a crash never leaves half a settings file; a symlinked settings file
(dotfile managers link them) is written through the link rather than replaced by a plain file; a file whose text
would not change is not touched at all.
"""

from __future__ import annotations

import difflib
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from .errors import LaunchError

BACKUP_SUFFIX = ".tinyloop-backup"


@dataclass
class FileChange:
    path: Path  # symlinks resolved: the file that is really written
    old: str | None  # the current text; None when the file does not exist yet
    new: str
    private: bool = False  # holds an API key: created readable by its owner only

    @property
    def changed(self) -> bool:
        return self.old != self.new

    @property
    def backup(self) -> Path:
        return self.path.with_name(self.path.name + BACKUP_SUFFIX)


def read_text(path: Path) -> str | None:
    """The file's text exactly (newline="": CRLF stays CRLF), or None if there is no file."""
    try:
        with open(path, encoding="utf-8", newline="") as f:
            return f.read()
    except FileNotFoundError:
        return None
    except UnicodeDecodeError as e:
        raise LaunchError(f"{path} is not UTF-8 text ({e.reason}); left untouched") from None
    except OSError as e:
        raise LaunchError(f"cannot read {path}: {e.strerror}") from None


def plan(path: Path, edit: Callable[[str | None], str], private: bool = False) -> FileChange:
    """The change `edit` (old text or None -> new text) makes to `path`."""
    real = path.resolve()
    old = read_text(real)
    return FileChange(real, old, edit(old), private)


def describe(change: FileChange) -> str:
    """What --dry-run prints for one file: its new text, or a diff against the current one."""
    if not change.changed:
        return f"{change.path}: already up to date"
    if change.old is None:
        body = "".join(f"    {line}" for line in change.new.splitlines(keepends=True))
        return f"would create {change.path}:\n{body.rstrip()}"
    diff = difflib.unified_diff(
        change.old.splitlines(keepends=True), change.new.splitlines(keepends=True), str(change.path), "(new)"
    )
    text = "".join(line if line.endswith("\n") else line + "\n" for line in diff)
    return f"would change {change.path} (backup: {change.backup.name}):\n{text.rstrip()}"


def apply(change: FileChange) -> str:
    """Write one change (see the module's docstring); returns a line saying what was done."""
    if not change.changed:
        return f"{change.path}: already up to date"
    path = change.path
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        if change.old is not None:
            shutil.copy2(path, change.backup)
        tmp = path.with_name(f".{path.name}.tinyloop-tmp")
        with open(tmp, "w", encoding="utf-8", newline="") as f:
            f.write(change.new)
        if change.old is not None:
            shutil.copymode(path, tmp)
        elif change.private:
            os.chmod(tmp, 0o600)
        os.replace(tmp, path)
    except OSError as e:
        raise LaunchError(f"cannot write {path}: {e.strerror}") from None
    if change.old is None:
        return f"wrote {path}"
    return f"updated {path} (the previous version is in {change.backup.name})"
