"""Dynamic model residency: `--lazy-load` loads the model when the first request that needs it arrives (`/health`,
`/metrics` and the model list never load it), and `--idle-unload-seconds N` (which implies lazy loading) unloads it
once N seconds have passed in which no request needed it (probes and scrapes do not count) and nothing is in
flight; `POST /v1/models/unload` unloads it at once when nothing else is in flight.
Without either flag the model is loaded at start-up and stays (`ServerState.residency` is None).

One lock orders loads and unloads. An unload first checks that no HTTP request is in flight (the gate counts them
before any route runs) and clears `ServerState.engine` in the same step of the event loop, so a request either
arrived before the check (and the unload does not happen) or finds no engine and waits on the lock to load one.
The engine thread and the model's memory are released off the event loop.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from .._core import Engine, TinyloopError
from ..errors import APIError
from .gate import InFlight
from .metrics import Metrics
from .runner import EngineRunner, release_all_memory

if TYPE_CHECKING:
    from .state import ServerState

log = logging.getLogger("tinyloop.server")

# Routes that never load the model: probes, metrics, the model list, unloading it, profiling.
NO_LOAD = frozenset(
    {"/health", "/metrics", "/metrics/json", "/v1/models", "/api/v0/models", "/v1/models/unload"}
    | {"/start_profile", "/stop_profile"}
)


class Residency:
    def __init__(
        self,
        load: Callable[[], tuple[Engine, EngineRunner]],
        metrics: Metrics,
        inflight: InFlight,
        idle_seconds: float = 0.0,
    ):
        self._load, self.metrics, self.inflight, self.idle_seconds = load, metrics, inflight, idle_seconds
        self._lock = asyncio.Lock()
        self._last_busy = time.monotonic()

    async def ensure(self, state: ServerState) -> None:
        """Load the model unless it is resident (a failed load is a 503 with the reason, and is retried by the next
        request)."""
        self._last_busy = time.monotonic()
        if state.engine is not None:
            return
        async with self._lock:
            if state.engine is not None:
                return
            started = time.monotonic()
            try:
                state.engine, state.runner = await asyncio.get_running_loop().run_in_executor(None, self._load)
            except TinyloopError as e:
                state.load_error = str(e)
                raise APIError(503, f"Engine not loaded: {e}", code="engine_not_loaded") from e
            state.load_error = None
            self.metrics.model_resident.set(1)
            log.info("model loaded in %.2f s", time.monotonic() - started)

    async def unload(self, state: ServerState, own: int = 0) -> bool:
        """Unload the model if it is resident and no request but `own` others (the caller's) is in flight; whether
        it was unloaded."""
        async with self._lock:
            runner = state.runner
            if state.engine is None or runner is None or self.inflight.count > own or not runner.idle():
                return False
            state.engine, state.runner = None, None  # in this step of the loop: no request can pick them up now
            self.metrics.model_resident.set(0)
            await asyncio.get_running_loop().run_in_executor(None, _release, runner)
            log.info("model unloaded")
            return True

    async def watch_idle(self, state: ServerState) -> None:
        """Unload the model once `idle_seconds` have passed since a request last needed it and the engine has
        nothing to do (runs for the server's lifetime). Probes and metrics scrapes do not count as use: a
        liveness probe every second must not keep a model loaded. The unload itself still waits for a moment with
        no request in flight at all."""
        while True:
            await asyncio.sleep(min(1.0, self.idle_seconds / 4))
            now = time.monotonic()
            if state.runner is not None and not state.runner.idle():
                self._last_busy = now
            elif state.engine is not None and now - self._last_busy >= self.idle_seconds:
                await self.unload(state)


def _release(runner: EngineRunner) -> None:
    """End the engine thread and hand the model's memory back (the last references go with `runner`)."""
    runner.close()
    runner.engine = None  # type: ignore[assignment]
    release_all_memory()


def busy_error(inflight: int) -> APIError:
    return APIError(409, f"{inflight} request(s) in flight: unload when they are done", code="model_busy")
