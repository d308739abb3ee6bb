"""`POST /start_profile` and `POST /stop_profile`, mounted only when the server starts with `--profile DIR`
(`TINYLOOP_PROFILE_DIR`). Between the two, the engine times the stages of every step (`tinyloop.start_profile`,
`rust/profile.rs`) and cProfile records the event loop's thread (the HTTP layer, the API families' Python, the
detokenizer, SSE framing). Stopping writes to DIR, and answers with the paths of:

- `profile-<UTC time>-stages.json`: per engine stage, seconds of wall time and calls, and the profile's duration;
- `profile-<UTC time>-python.pstats`: cProfile's data (`python -m pstats FILE`, or any pstats viewer);
- `profile-<UTC time>-python.txt`: the event loop's 40 costliest functions by cumulative time.
"""

from __future__ import annotations

import cProfile
import io
import json
import pstats
import time
from pathlib import Path

from fastapi import APIRouter

from .._core import start_profile, stop_profile
from .errors import APIError
from .state import State

router = APIRouter()


class Profiler:
    def __init__(self, directory: Path):
        self.directory = directory
        self._python: cProfile.Profile | None = None
        self._started = 0.0

    def start(self) -> None:
        """Start recording (on the event loop's thread, which cProfile then follows)."""
        if self._python is not None:
            raise APIError(409, "a profile is already being recorded: POST /stop_profile first", code="conflict")
        start_profile()
        self._started = time.monotonic()
        self._python = cProfile.Profile()
        self._python.enable()

    def stop(self) -> list[Path]:
        """Stop recording and write the files; their paths."""
        if self._python is None:
            raise APIError(409, "no profile is being recorded: POST /start_profile first", code="conflict")
        python, self._python = self._python, None
        python.disable()
        stages = stop_profile()
        seconds = time.monotonic() - self._started
        self.directory.mkdir(parents=True, exist_ok=True)
        base = self.directory / f"profile-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}"
        files = [base.with_name(base.name + s) for s in ("-stages.json", "-python.pstats", "-python.txt")]
        record = {"seconds": seconds, "stages": {name: {"seconds": s, "calls": n} for name, s, n in stages}}
        files[0].write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
        python.dump_stats(files[1])
        text = io.StringIO()
        pstats.Stats(python, stream=text).sort_stats("cumulative").print_stats(40)
        files[2].write_text(text.getvalue(), encoding="utf-8")
        return files


def _profiler(state) -> Profiler:
    if state.profiler is None:  # the routes are mounted only with --profile; kept for a state built without it
        raise APIError(404, "profiling is off: start the server with --profile DIR", code="not_found")
    return state.profiler


@router.post("/start_profile")
async def start(state: State):
    _profiler(state).start()
    return {"status": "recording"}


@router.post("/stop_profile")
async def stop(state: State):
    return {"status": "written", "files": [str(p) for p in _profiler(state).stop()]}
