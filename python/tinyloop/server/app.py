"""The FastAPI application: the gate (auth, body limits, disconnects, metrics per request), errors in the API's
shape, health and metrics, and one router per API family (openai.py, responses.py, compact.py, anthropic.py,
lmstudio.py, native.py, tokens.py, page.py).

`create_app()` reads its settings from the environment (`ServerConfig.from_env`: the `TINYLOOP_*` variables that
`tinyloop-serve` sets from its flags, or that are set by hand; config.py declares each one).
"""

from __future__ import annotations

import asyncio
import logging
import time
from contextlib import asynccontextmanager
from pathlib import Path

import orjson
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException

from .. import __version__
from .._core import Engine, EngineError, TinyloopError, num_threads
from . import anthropic, compact, lmstudio, native, openai, page, profiling, responses, tokens
from .config import ServerConfig
from .defaults import ConfigError, load_defaults
from .errors import APIError
from .gate import Gate, InFlight
from .lifecycle import install_drain
from .metrics import Metrics
from .profiling import Profiler
from .residency import CatalogError, Residency, busy_error, scan_catalog
from .runner import EngineRunner
from .state import ServerState

log = logging.getLogger("tinyloop.server")


class ORJSONResponse(JSONResponse):
    def render(self, content) -> bytes:
        return orjson.dumps(content)


def _error(e: APIError, request: Request) -> ORJSONResponse:
    path = request.url.path
    return ORJSONResponse(e.body_for(path), status_code=e.status_for(path), headers=e.headers)


def load_engine(cfg: ServerConfig, metrics: Metrics, path: Path) -> tuple[Engine, EngineRunner]:
    """The model at `path` and its engine thread (raises the engine's load errors)."""
    engine = Engine(path, **cfg.engine_options())
    runner = EngineRunner(
        engine, metrics, max_running=cfg.max_running, max_waiting=cfg.max_waiting, request_timeout=cfg.request_timeout
    )
    metrics.threads.set(num_threads())
    for notice in engine.prompt_cache_notices():  # files in the prompt cache's directory it skipped
        log.warning("%s", notice)
    return engine, runner


def make_residency(cfg: ServerConfig, metrics: Metrics, inflight: InFlight) -> tuple[Residency, str]:
    """Residency on demand (residency.py): over the `--models-dir` catalog, or the one model; and the id of the model
    a request naming none gets."""
    if cfg.models_dir:
        catalog = scan_catalog(cfg.models_dir)
        given = next((i for i, p in catalog.items() if p.resolve() == cfg.model_path.resolve()), None)
        default = given or min(catalog)
    else:
        default = cfg.served_model_name or cfg.model_path.stem
        catalog = {default: cfg.model_path}
    residency = Residency(
        lambda path: load_engine(cfg, metrics, path),
        catalog,
        default,
        metrics,
        inflight,
        cfg.idle_unload_seconds,
        named=cfg.models_dir is not None,
    )
    return residency, default


def load_state(cfg: ServerConfig, inflight: InFlight) -> tuple[ServerState, Metrics]:
    metrics = Metrics()
    engine = runner = residency = None
    error = cfg.kv_mode_error()
    defaults: dict = {}
    try:
        defaults = load_defaults(cfg.generate_config)
    except ConfigError as e:
        error = error or str(e)
    model_id = cfg.served_model_name or cfg.model_path.stem
    if error is None and cfg.dynamic_residency():
        try:
            residency, model_id = make_residency(cfg, metrics, inflight)
        except CatalogError as e:
            error = str(e)
    elif error is None:
        try:
            engine, runner = load_engine(cfg, metrics, cfg.model_path)
            metrics.model_resident.set(1)
        except TinyloopError as e:
            error = str(e)
    if error:
        log.error("model not loaded: %s", error)
    state = ServerState(
        engine=engine,
        runner=runner,
        residency=residency,
        model_id=model_id,
        load_error=error,
        kv_cache_mode=cfg.kv_cache_mode(),
        device=engine.info.device if engine is not None else cfg.device,
        always_usage=cfg.always_include_usage,
        commit=cfg.build_commit(),
        max_tokens_limit=cfg.max_tokens_limit,
        started=int(time.time()),
        generate_defaults=defaults,
        profiler=Profiler(cfg.profile_dir) if cfg.profile_dir else None,
    )
    return state, metrics


def _error_handlers(app: FastAPI) -> None:
    """Every error in the API's shape (errors.py): ours, unknown routes and methods, schema failures, the
    engine's, and anything unexpected (500, logged)."""

    @app.exception_handler(APIError)
    async def api_error(request: Request, e: APIError):
        return _error(e, request)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, e: HTTPException):  # unknown routes (404), wrong methods (405)
        message = {404: "no such route", 405: "method not allowed on this route"}.get(e.status_code, str(e.detail))
        return _error(APIError(e.status_code, message, headers=dict(e.headers or {})), request)

    @app.exception_handler(Exception)
    async def unexpected(request: Request, e: Exception):
        log.exception("unexpected error")
        return _error(APIError(500, f"internal error: {type(e).__name__}", code="internal_error"), request)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, e: RequestValidationError):
        errors = e.errors()
        unknown = next((err for err in errors if err.get("type") == "extra_forbidden"), None)
        if unknown is not None:  # a field no schema declares: refused by name, never ignored
            name = ".".join(str(x) for x in unknown.get("loc", []) if x != "body")
            return _error(
                APIError(400, f"unsupported parameter: {name} is not implemented by tinyloop", param=name), request
            )
        first = errors[0] if errors else {}
        loc = [str(x) for x in first.get("loc", []) if x != "body"]
        msg = "; ".join(
            f"{'.'.join(str(x) for x in err.get('loc', []) if x != 'body')}: {err.get('msg')}" for err in errors
        )
        return _error(APIError(422, f"invalid request: {msg}", param=".".join(loc) or None), request)

    @app.exception_handler(EngineError)
    async def engine_error(request: Request, e: EngineError):
        log.exception("engine error")
        return _error(APIError(500, str(e), code="engine_error"), request)


def _finish(state: ServerState) -> None:
    """Shutdown: end the engine thread (its aborted requests leave their KV to the prompt cache), then wait for the
    prompt cache's files to be written, so a restart finds them."""
    if state.runner is not None:
        state.runner.close()
    if state.engine is not None:
        state.engine.prompt_cache_flush()


def create_app(cfg: ServerConfig | None = None) -> FastAPI:
    cfg = cfg or ServerConfig.from_env()
    inflight = InFlight()
    state, metrics = load_state(cfg, inflight)

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        install_drain(lambda: state.runner, inflight)
        watcher = None
        if state.residency is not None and state.residency.idle_seconds > 0:
            watcher = asyncio.create_task(state.residency.watch_idle(state))
        yield
        if watcher is not None:
            watcher.cancel()
        if state.runner is not None:
            state.runner.abort_all("the server is shutting down")
            await asyncio.to_thread(_finish, state)
        state.tokenizer_pool.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="tinyloop", version=__version__, default_response_class=ORJSONResponse, lifespan=lifespan)
    app.state.tinyloop = state
    app.state.metrics = metrics

    app.add_middleware(Gate, api_keys=cfg.keys(), metrics=metrics, max_body_bytes=cfg.max_body_bytes, inflight=inflight)

    _error_handlers(app)

    @app.get("/health")
    async def health():
        if state.load_error is not None or (state.engine is None and state.residency is None):
            return ORJSONResponse(
                {"status": "error", "reason": f"Engine not loaded: {state.load_error}"}, status_code=503
            )
        if state.residency is not None:  # loaded on demand: say whether it is now
            return {"status": "ok", "device": state.device, "resident": state.engine is not None}
        return {"status": "ok", "device": state.device}

    @app.post("/v1/models/unload")
    async def unload():
        if state.residency is None:
            raise APIError(
                409,
                "the model stays loaded for the server's lifetime: start it with --lazy-load or "
                "--idle-unload-seconds to unload it",
                code="static_residency",
            )
        was = state.engine is not None
        if was and not await state.residency.unload(state, own=1):
            raise busy_error(inflight.count - 1)
        return {"id": state.model_id, "resident": False, "unloaded": was}

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.prometheus(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/metrics/json")
    async def metrics_json():
        return metrics.snapshot()

    for family in (openai, responses, compact, anthropic, lmstudio, native, tokens, page):
        app.include_router(family.router)
    if state.profiler is not None:
        app.include_router(profiling.router)
    return app
