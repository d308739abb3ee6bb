"""What every route needs: the engine, its runner and the server's settings (`ServerState`), reached through the
`State` dependency."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Annotated, Any

from fastapi import Depends, Request

from .. import __version__
from .._core import Engine, isa
from .errors import APIError
from .protocol import MAX_TOKENS_LIMIT
from .residency import NO_LOAD, Residency
from .runner import EngineRunner
from .template import ChatFormat

TOKENIZER_THREADS = 2  # encoding releases the GIL; prompts take milliseconds, the engine thread is the bottleneck


@dataclass
class ServerState:
    engine: Engine | None
    runner: EngineRunner | None
    model_id: str
    load_error: str | None
    kv_cache_mode: str
    commit: str | None
    max_tokens_limit: int = MAX_TOKENS_LIMIT
    device: str = "cpu"  # where the model computes (`--device`): "cpu", "cuda:N", "candle-cpu"
    always_usage: bool = False  # `--always-include-usage`: every /v1 and /api/v0 stream ends with a usage chunk
    # `--generate-config`: defaults for the sampling fields and loops a request does not send (defaults.py).
    generate_defaults: dict[str, Any] = field(default_factory=dict)
    profiler: Any = None  # `--profile DIR`: a profiling.Profiler, else None (the routes are not mounted)
    residency: Residency | None = None  # `--lazy-load` / `--idle-unload-seconds`; None: loaded at start, for good
    started: int = 0  # Unix time the server started: the model's `created`
    # Prompts are encoded here, off the event loop. A pool of its own, of a fixed size, rather than asyncio's
    # default one (up to 32 threads, created as bursts of requests arrive): the server's threads and the memory
    # they hold are the same on every machine and do not creep up as the load finds new peaks.
    tokenizer_pool: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(TOKENIZER_THREADS, thread_name_prefix="tinyloop-tokenize")
    )

    def require_engine(self) -> tuple[Engine, EngineRunner]:
        if self.engine is None or self.runner is None:
            raise APIError(503, f"Engine not loaded: {self.load_error}", code="engine_not_loaded")
        return self.engine, self.runner

    def defaults(self) -> dict[str, Any]:
        """The defaults a request's unsent fields take: the server's (`--generate-config`) over the loaded model
        file's recommendations (`Engine.generation_defaults`, e.g. a converted checkpoint's generation_config)."""
        engine, _ = self.require_engine()
        recommended = {k: int(v) if k == "top_k" else v for k, v in engine.generation_defaults.items()}
        return recommended | self.generate_defaults

    def chat_format(self) -> ChatFormat:
        """How the loaded model's conversations are written (its file's chat template, or "Role: content")."""
        engine, _ = self.require_engine()
        return ChatFormat(engine)

    def model_info(self) -> dict[str, Any]:
        engine, _ = self.require_engine()
        i = engine.info
        return {
            "arch": "weight-shared-looped-transformer",
            "dim": i.dim,
            "n_heads": i.n_heads,
            "ffn_dim": i.ffn_dim,
            "vocab_size": i.vocab_size,
            "default_loops": i.default_loops,
            "quant": i.quant,
            "kv_cache_mode": self.kv_cache_mode,
            "kv_share": i.kv_share,
            "device": i.device,
        }

    def runtime(self) -> dict[str, Any]:
        return {"name": "tinyloop", "version": __version__, "commit": self.commit, "isa": isa(), "device": self.device}

    def models(self) -> dict[str, Any]:
        """The model list (`/v1/models`, `/api/v0/models`): the `--models-dir` catalog, or the one model."""
        ids = self.residency.listed(self) if self.residency is not None else [self.model_id]
        return {
            "object": "list",
            "data": [{"id": i, "object": "model", "created": self.started, "owned_by": "tinyloop"} for i in ids],
        }


async def server_state(request: Request) -> ServerState:
    # `async`: FastAPI runs a plain `def` dependency in its thread pool, a thread hop per request and up to 40
    # threads under load.
    state: ServerState = request.app.state.tinyloop
    if state.residency is not None and request.url.path not in NO_LOAD:
        await state.residency.ensure(state, await _named_model(request) if state.residency.named else None)
    return state


async def _named_model(request: Request) -> str | None:
    """The `model` a request's JSON body names, if any (the gate has already refused malformed JSON; FastAPI has
    already read the body, so this parses the cached bytes)."""
    if request.method != "POST":
        return None
    try:
        body = await request.json()
    except ValueError:  # an empty body: the route's schema answers for it
        return None
    model = body.get("model") if isinstance(body, dict) else None
    return model if isinstance(model, str) else None


State = Annotated[ServerState, Depends(server_state)]
