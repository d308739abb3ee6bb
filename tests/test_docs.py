"""Every curl example in docs/api.md runs against a live server and answers with the shape the doc shows."""

from __future__ import annotations

import itertools
import json
import re
import subprocess
from pathlib import Path

import pytest

from serverutil import running_server

DOC = Path(__file__).resolve().parents[1] / "docs" / "api.md"
BLOCK = re.compile(r"```(\w*)\n(.*?)```", re.S)


def examples() -> list[tuple[str, str, str]]:
    blocks = BLOCK.findall(DOC.read_text())
    out = []
    for (lang, body), (next_lang, expected) in itertools.pairwise(blocks):
        if lang == "bash" and body.lstrip().startswith("curl"):
            out.append((body, next_lang, expected))
    return out


@pytest.fixture(scope="module")
def server(tiny):
    with running_server(tiny.path) as base:
        yield base


def same_keys(actual, expected, path="") -> None:
    if isinstance(expected, dict):
        assert isinstance(actual, dict), path
        if path == "":
            assert set(expected) <= set(actual), (path, set(expected) - set(actual))
        else:
            assert set(actual) == set(expected) or path.startswith("tinyloop_"), (path, set(actual) ^ set(expected))
        for k, v in expected.items():
            if isinstance(v, dict) and k in actual:
                same_keys(actual[k], v, f"{path}.{k}" if path else k)


def test_the_doc_has_examples():
    assert len(examples()) >= 7


@pytest.mark.parametrize("idx", range(len(examples())))
def test_curl_example(server, idx):
    cmd, lang, expected = examples()[idx]
    cmd = cmd.replace("http://127.0.0.1:8000", server)
    out = subprocess.run(["bash", "-c", cmd.replace("curl -s", "curl -sf", 1)], capture_output=True, timeout=120)
    assert out.returncode == 0, out.stderr.decode()
    text = out.stdout.decode()
    if lang == "json":
        same_keys(json.loads(text), json.loads(expected))
    else:  # an SSE stream
        events = [e for e in text.split("\n\n") if e]
        assert events[-1] == "data: [DONE]"
        first = json.loads(events[0][len("data: ") :])
        doc_first = json.loads(expected.split("\n\n")[0][len("data: ") :])
        same_keys(first, doc_first)
        assert first["choices"][0]["delta"] == {"role": "assistant"}
