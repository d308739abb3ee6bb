"""scripts/py-imports.py, which scripts/lint runs: the package has no import cycle, and a cycle — even through a
deferred import or one under TYPE_CHECKING — is found."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "py-imports.py"


def run(package: Path | None = None) -> subprocess.CompletedProcess:
    args = [sys.executable, str(SCRIPT), *([str(package)] if package else [])]
    return subprocess.run(args, capture_output=True, text=True, timeout=60)


def test_the_package_has_no_cycle():
    out = run()
    assert out.returncode == 0 and "no cycle" in out.stdout, out.stdout


@pytest.mark.parametrize(
    "a,b",
    [
        ("from .b import x\n", "from .a import y\n"),
        ("from . import b\n", "def f():\n    from .a import y\n"),
        ("import pkg.b\n", "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .a import y\n"),
    ],
)
def test_a_cycle_is_found(tmp_path, a, b):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text(a)
    (pkg / "b.py").write_text(b)
    (pkg / "c.py").write_text("from .a import z\n")
    out = run(pkg)
    assert out.returncode == 1 and "pkg.a -> pkg.b -> pkg.a" in out.stdout, out.stdout
