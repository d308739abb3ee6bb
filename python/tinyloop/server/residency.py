"""Dynamic model residency: `--lazy-load` loads the model when the first request that needs it arrives (`/health`,
`/metrics` and the model list never load it), and `--idle-unload-seconds N` (which implies lazy loading) unloads it
once N seconds have passed in which no request needed it (probes and scrapes do not count) and nothing is in
flight; `POST /v1/models/unload` unloads it at once when nothing else is in flight.
`--models-dir DIR` serves every `.tinyloop` under DIR by its file name, one resident at a time: a request naming
another model than the resident one waits until the requests in flight have ended (requests arriving meanwhile
wait behind it), and the switch unloads one model and loads the other. Without any of these flags the model is
loaded at start-up and stays (`ServerState.residency` is None).

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
from pathlib import Path
from typing import Protocol

from .._core import Engine, TinyloopError
from .errors import APIError
from .gate import InFlight
from .metrics import Metrics
from .runner import EngineRunner, release_all_memory

log = logging.getLogger("tinyloop.server")


class Resident(Protocol):
    """What residency changes of the server's state (`state.ServerState`): the loaded model, its engine thread, its
    id, and why it failed to load."""

    engine: Engine | None
    runner: EngineRunner | None
    model_id: str
    load_error: str | None


SWITCH_POLL_SECONDS = 0.01  # how often a pending model switch looks whether the old model's requests have ended

# Routes that never load the model: probes, metrics, the model list, unloading it, profiling.
NO_LOAD = frozenset(
    {"/health", "/metrics", "/metrics/json", "/v1/models", "/api/v0/models", "/v1/models/unload"}
    | {"/start_profile", "/stop_profile"}
)


class CatalogError(Exception):
    """`--models-dir` names no usable catalog (the message says why)."""


def scan_catalog(directory: str | Path) -> dict[str, Path]:
    """Every `.tinyloop` file under `directory`, by id: the file's name without `.tinyloop`."""
    root = Path(directory)
    if not root.is_dir():
        raise CatalogError(f"--models-dir {directory}: not a directory")
    catalog: dict[str, Path] = {}
    for path in sorted(root.rglob("*.tinyloop")):
        if path.stem in catalog:
            raise CatalogError(
                f"--models-dir {directory}: two models are named {path.stem!r} ({catalog[path.stem]}, {path})"
            )
        catalog[path.stem] = path
    if not catalog:
        raise CatalogError(f"--models-dir {directory}: no .tinyloop files under it")
    return catalog


class Residency:
    """Which model is loaded, and when. `catalog` maps ids to files; `named` (`--models-dir`): a request's `model`
    picks among them (else every request is served by the one model, whatever it names); `default` serves requests
    that name none."""

    def __init__(
        self,
        load: Callable[[Path], tuple[Engine, EngineRunner]],
        catalog: dict[str, Path],
        default: str,
        metrics: Metrics,
        inflight: InFlight,
        idle_seconds: float = 0.0,
        named: bool = False,
    ):
        self._load, self.catalog, self.default, self.named = load, catalog, default, named
        self.metrics, self.inflight, self.idle_seconds = metrics, inflight, idle_seconds
        self._lock = asyncio.Lock()
        self._last_busy = time.monotonic()
        self._blocked = 0  # requests waiting in `ensure` (counted in flight, but not using an engine)
        self._switching = False

    def resolve(self, state: Resident, name: str | None) -> str:
        """The id of the model a request gets: the one it names (`named` only; 404 for a name not in the catalog),
        else the resident one, else the default."""
        if self.named and name is not None:
            if name not in self.catalog:
                ids = ", ".join(sorted(self.catalog))
                raise APIError(
                    404,
                    f"model {name!r} is not served here; the models are: {ids}",
                    param="model",
                    code="model_not_found",
                )
            return name
        return state.model_id if state.engine is not None else self.default

    async def ensure(self, state: Resident, name: str | None = None) -> None:
        """Make the model the request gets resident, switching models once the requests using the resident one have
        ended (a failed load is a 503 with the reason, and is retried by the next request)."""
        want = self.resolve(state, name)
        self._last_busy = time.monotonic()
        if state.engine is not None and state.model_id == want and not self._switching:
            return
        self._blocked += 1
        try:
            async with self._lock:
                if state.engine is not None and state.model_id == want:
                    return
                if state.engine is not None:
                    await self._switch_out(state)
                await self._load_into(state, want)
        finally:
            self._blocked -= 1

    async def _switch_out(self, state: Resident) -> None:
        """Unload the resident model once no request is in flight but those waiting here (new requests wait too,
        rather than keep the old model busy for ever)."""
        self._switching = True
        try:
            while self.inflight.count > self._blocked or (state.runner is not None and not state.runner.idle()):
                await asyncio.sleep(SWITCH_POLL_SECONDS)
            await self._drop(state)
        finally:
            self._switching = False

    async def _load_into(self, state: Resident, want: str) -> None:
        started = time.monotonic()
        try:
            state.engine, state.runner = await asyncio.get_running_loop().run_in_executor(
                None, self._load, self.catalog[want]
            )
        except TinyloopError as e:
            state.load_error = str(e)
            raise APIError(503, f"Engine not loaded: {e}", code="engine_not_loaded") from e
        state.load_error, state.model_id = None, want
        self.metrics.model_resident.set(1)
        log.info("model %s loaded in %.2f s", want, time.monotonic() - started)

    async def _drop(self, state: Resident) -> None:
        runner = state.runner
        state.engine, state.runner = None, None  # in this step of the loop: no request can pick them up now
        self.metrics.model_resident.set(0)
        if runner is not None:
            await asyncio.get_running_loop().run_in_executor(None, _release, runner)
        log.info("model %s unloaded", state.model_id)

    async def unload(self, state: Resident, own: int = 0) -> bool:
        """Unload the model if it is resident and no request but `own` others (the caller's) is in flight; whether
        it was unloaded."""
        async with self._lock:
            runner = state.runner
            if state.engine is None or runner is None or self.inflight.count > own or not runner.idle():
                return False
            await self._drop(state)
            return True

    def listed(self, state: Resident) -> list[str]:
        """The ids `/v1/models` lists."""
        return sorted(self.catalog) if self.named else [state.model_id]

    async def watch_idle(self, state: Resident) -> None:
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
