"""A command whose optional dependency (an extra in pyproject.toml) is missing stops with one line that names the
extra to install, and exit status 2 — not a traceback. The dependency is hidden from a fresh interpreter."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
HIDE = "import sys; sys.modules.update({m: None for m in %r}); sys.argv = %r; "


def run_hidden(modules: list[str], argv: list[str], code: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", HIDE % (modules, argv) + code], capture_output=True, text=True, timeout=120, cwd=ROOT
    )


@pytest.mark.parametrize(
    "modules,argv,code,extra",
    [
        (["ray"], ["tinyloop-serve", "--ray"], "from tinyloop.server.cli import main; sys.exit(main())", "ray"),
        (["ray.serve"], ["tinyloop-serve", "--ray"], "from tinyloop.server.cli import main; sys.exit(main())", "ray"),
        (
            ["torch"],
            ["train.py", "--help"],
            "import runpy; runpy.run_path('training/train.py', run_name='__main__')",
            "train",
        ),
        (
            ["torch"],
            ["export.py", "--help"],
            "import runpy; runpy.run_path('training/export.py', run_name='__main__')",
            "train",
        ),
        (
            ["matplotlib"],
            ["evaluate", "m.tinyloop", "held.txt", "--plot", "p.png"],
            "from tinyloop.modelfile.evaluate import main; sys.exit(main())",
            "train",
        ),
    ],
)
def test_a_missing_extra_is_one_line_and_exit_2(modules, argv, code, extra):
    out = run_hidden(modules, argv, code)
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2 and len(lines) == 1, (out.returncode, out.stderr)
    assert f"pip install 'tinyloop[{extra}]'" in lines[0] and "Traceback" not in out.stderr


def test_missing_lists_only_what_is_absent():
    from tinyloop.extras import MissingExtra, missing, require

    assert missing("json", "no_such_module_here", "no_such_module_here.sub") == [
        "no_such_module_here",
        "no_such_module_here.sub",
    ]
    require("ray", "nothing", "json")
    with pytest.raises(MissingExtra, match=r"x needs no_such_module_here, .*pip install 'tinyloop\[train\]'"):
        require("train", "x", "json", "no_such_module_here")
