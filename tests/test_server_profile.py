"""`--profile DIR`: POST /start_profile and /stop_profile record the engine's stages and the event loop's Python
and write them to DIR; without the flag the routes do not exist."""

from __future__ import annotations

import json
import pstats
from pathlib import Path

import httpx

from serverutil import running_server


def test_a_profile_records_the_engine_and_the_event_loop(tiny, tmp_path):
    out = tmp_path / "profiles"
    with running_server(tiny.path, "--profile", str(out)) as base:
        r = httpx.post(f"{base}/stop_profile")
        assert r.status_code == 409 and "start_profile" in r.json()["error"]["message"]
        assert httpx.post(f"{base}/start_profile").json() == {"status": "recording"}
        assert httpx.post(f"{base}/start_profile").status_code == 409  # one profile at a time
        body = {"model": "m", "prompt": "x", "max_tokens": 7, "ignore_eos": True, "stream": True}
        assert httpx.post(f"{base}/v1/completions", json=body, timeout=60).status_code == 200
        answer = httpx.post(f"{base}/stop_profile").json()
        assert answer["status"] == "written"
        files = [Path(f) for f in answer["files"]]
        assert [f.parent for f in files] == [out] * 3 and all(f.stat().st_size > 0 for f in files)
        stages = json.loads(files[0].read_text())["stages"]
        assert stages["step"]["calls"] >= 7 and stages["sample"]["calls"] >= 7  # one step per token at least
        assert 0 < stages["head"]["seconds"] <= stages["step"]["seconds"]
        recorded = {f"{Path(file).name}:{name}" for file, _, name in pstats.Stats(str(files[1])).stats}
        assert any(r.startswith("openai.py:") for r in recorded), "the completion's Python was not recorded"
        assert "cumulative" in files[2].read_text()
        assert httpx.post(f"{base}/stop_profile").status_code == 409  # stopped: nothing to stop
        assert httpx.post(f"{base}/start_profile").status_code == 200  # and a new one can start


def test_without_the_flag_there_are_no_profile_routes(tiny):
    with running_server(tiny.path) as base:
        assert httpx.post(f"{base}/start_profile").status_code == 404
        assert httpx.post(f"{base}/stop_profile").status_code == 404
