"""tinyloop as a Ray Serve application: replicas of the server, each with its own engine, behind one HTTP address.

Two deployments. `Replica` holds the same FastAPI application `tinyloop-serve` runs (configured by the same
`TINYLOOP_*` environment, carried to every replica) and answers whole HTTP requests handed to it through a
deployment handle, streaming the response back. `Ingress` takes the requests from Ray's HTTP proxy, reads each
body, and hands the request to a replica chosen by `PrefixAffinityRouter`: requests whose prompts begin alike (the
same system prompt and first user turn, or the same first characters of a completion prompt) go to the same
replica — the one whose prompt cache holds that prefix — by rendezvous hashing over the live replicas, so a
replica's loss moves only its own conversations. (Ray's HTTP proxy routes on headers alone; the body is what says
which conversation a request continues, hence the ingress.)

A request that fails before its response started (its replica died or was being replaced) is retried on another
replica; a response already streaming when its replica dies ends with an error event in its family's format, never
a hang. Every response names its replica in `x-tinyloop-replica`. docs/scale-out.md has the commands and figures.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import random
from collections.abc import AsyncIterator, MutableMapping
from typing import Any

from prometheus_client import CollectorRegistry
from ray import serve
from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError
from ray.serve.config import RequestRouterConfig
from ray.serve.handle import DeploymentHandle
from ray.serve.request_router import FIFOMixin, PendingRequest, RequestRouter, RunningReplica
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from .config import is_loopback
from .errors import APIError
from .gate import replayed

log = logging.getLogger("tinyloop.server.ray")

REPLICA_HEADER = "x-tinyloop-replica"
# How much of a prompt's start decides its replica: enough to tell conversations apart, short enough that every
# turn of one conversation shares it.
AFFINITY_CHARS = 512
# Tries of a request whose replica was lost before its response started (each on a live replica, 0.5 s apart).
ATTEMPTS = 6
_LOST = (ActorDiedError, ActorUnavailableError, RayActorError)
_SCOPE_KEYS = ("type", "asgi", "http_version", "scheme", "method", "path", "raw_path", "query_string", "headers")


def affinity_key(body: bytes) -> str | None:
    """What decides a request's replica: a hash of its prompt's start — the system prompt and the first user turn
    of a conversation (every later turn repeats them), or the first `AFFINITY_CHARS` characters of a plain prompt.
    None when the body has no prompt."""
    try:
        req = json.loads(body)
    except ValueError:
        return None
    if not isinstance(req, dict):
        return None
    messages = req.get("messages", req.get("input"))
    if isinstance(messages, list):
        users = [i for i, m in enumerate(messages) if isinstance(m, dict) and m.get("role") == "user"]
        start: Any = [req.get("system"), req.get("instructions"), messages[: users[0] + 1 if users else 1]]
    elif isinstance(req.get("prompt", messages), str | list):
        start = req.get("prompt", messages)
    else:
        return None
    text = json.dumps(start, sort_keys=True, ensure_ascii=False)[:AFFINITY_CHARS]
    return hashlib.blake2b(text.encode(), digest_size=8).hexdigest()


def _rank(key: str, replica: str) -> int:
    return int.from_bytes(hashlib.blake2b(f"{key}/{replica}".encode(), digest_size=8).digest(), "big")


class PrefixAffinityRouter(FIFOMixin, RequestRouter):
    """Ray Serve request router: a request with an affinity key tries the live replicas in rendezvous-hash order of
    that key (the first one unless it is full), so each prompt prefix has one home while its replica lives; a
    request without one goes to a random replica."""

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        key = pending_request.kwargs.get("affinity") if pending_request is not None else None
        if key is None:
            return [random.sample(candidate_replicas, len(candidate_replicas))]
        ranked = sorted(candidate_replicas, key=lambda r: _rank(key, r.replica_id.unique_id), reverse=True)
        return [[r] for r in ranked]


class Replica:
    """One engine and the server application around it; `__call__` answers one HTTP request (its ASGI scope and
    whole body), yielding `(status, headers)` and then the body's chunks. `affinity` is the request router's to read
    (`PrefixAffinityRouter`); the replica does not use it."""

    def __init__(self) -> None:
        from .app import create_app

        self.app = create_app()
        self.name = serve.get_replica_context().replica_id.unique_id
        self._lifespan = self.app.router.lifespan_context(self.app)
        self._started: asyncio.Task | None = None
        self._mirror: asyncio.Task | None = None  # mirror_metrics, from the first request on

    async def _start(self) -> None:
        if self._started is None:
            self._started = asyncio.ensure_future(self._lifespan.__aenter__())
            self._mirror = asyncio.ensure_future(mirror_metrics(self.app.state.metrics.registry))
        await self._started

    async def __call__(self, scope: dict, body: bytes, affinity: str | None = None) -> AsyncIterator[Any]:
        await self._start()
        out: asyncio.Queue[dict] = asyncio.Queue()
        gone = asyncio.Event()
        receive = replayed(body, gone)

        async def send(message: MutableMapping[str, Any]) -> None:
            await out.put(dict(message))

        task = asyncio.ensure_future(self.app({**scope, "app": self.app, "state": {}}, receive, send))
        try:
            start = await _sent(out, task)
            headers = [*start.get("headers", []), (REPLICA_HEADER.encode(), self.name.encode())]
            yield start["status"], headers
            while True:
                message = await _sent(out, task)
                if message.get("body"):
                    yield message["body"]
                if not message.get("more_body", False):
                    break
            await task
        finally:
            gone.set()  # the client left (or the response ended): the application sees the disconnect
            if not task.done():
                await asyncio.wait([task], timeout=5)


async def _sent(out: asyncio.Queue[dict], app: asyncio.Future) -> dict:
    """The application's next ASGI message; its error if it ended without one."""
    get = asyncio.ensure_future(out.get())
    await asyncio.wait([get, app], return_when=asyncio.FIRST_COMPLETED)
    if get.done():
        return get.result()
    get.cancel()
    if not out.empty():
        return out.get_nowait()
    app.result()  # raises what ended the application
    raise RuntimeError("the application ended without completing its response")


async def mirror_metrics(registry: CollectorRegistry, every: float = 2.0) -> None:
    """The replica's Prometheus metrics as Ray Serve gauges, every `every` seconds: Ray's metrics export then has
    them (as `ray_<name>`) labelled by deployment, replica and application."""
    from ray.serve.metrics import Gauge

    gauges: dict[str, Gauge] = {}
    while True:
        for family in registry.collect():
            for sample in family.samples:
                if sample.name.endswith(("_bucket", "_created")):
                    continue
                gauge = gauges.get(sample.name)
                if gauge is None:
                    keys = tuple(sorted(sample.labels))
                    # Ray's annotation says a 1-tuple; any tuple of names is what it takes.
                    gauge = gauges[sample.name] = Gauge(sample.name, family.documentation, tag_keys=keys)  # type: ignore[arg-type]
                gauge.set(sample.value, tags=dict(sample.labels))
        await asyncio.sleep(every)


class Ingress:
    """Takes HTTP requests from Ray's proxy and hands each to a replica chosen by its prompt's start."""

    def __init__(self, replicas: DeploymentHandle) -> None:
        self.replicas = replicas.options(stream=True)

    async def __call__(self, request: Request) -> Response:
        body = await request.body()
        scope = {k: request.scope[k] for k in _SCOPE_KEYS if k in request.scope}
        scope["client"], scope["server"] = request.scope.get("client"), request.scope.get("server")
        key = affinity_key(body) if request.method == "POST" else None
        for attempt in range(ATTEMPTS):
            chunks = self.replicas.remote(scope, body, affinity=key)
            try:
                status, headers = await chunks.__anext__()  # type: ignore[union-attr]  # a streaming handle
            except _LOST as e:
                log.warning(
                    "replica lost before %s %s started (try %d): %s",
                    request.method,
                    request.url.path,
                    attempt + 1,
                    type(e).__name__,
                )
                await asyncio.sleep(0.5)
                continue
            response = StreamingResponse(_rest(chunks, request.url.path), status_code=status)
            response.raw_headers = [(k, v) for k, v in headers if k.lower() != b"content-length"]
            return response
        refused = APIError(503, "no replica could take the request; try again", code="no_replica")
        path = request.url.path
        return JSONResponse(refused.body_for(path), status_code=refused.status_for(path))


async def _rest(chunks, path: str) -> AsyncIterator[bytes]:
    """The response's body; if its replica dies mid-way, an error event in the family's format ends it."""
    try:
        async for chunk in chunks:
            yield chunk
    except _LOST as e:
        log.warning("replica lost while streaming %s: %s", path, type(e).__name__)
        yield lost_stream_event(path)
    finally:
        chunks.cancel()  # the client left first: the replica's application sees the disconnect


def lost_stream_event(path: str) -> bytes:
    """The event that ends a stream whose replica was lost: Anthropic's and the Responses API's `error` events,
    else the OpenAI-style `data: {"error": ...}` and `[DONE]`."""
    message = "the replica serving this stream was lost; retry the request"
    data: dict[str, Any]
    if path.startswith("/v1/messages"):
        data = {"type": "error", "error": {"type": "api_error", "message": message}}
        return f"event: error\ndata: {json.dumps(data)}\n\n".encode()
    if path.startswith("/v1/responses"):
        data = {"type": "error", "code": "server_error", "message": message, "param": None}
        return f"event: error\ndata: {json.dumps(data)}\n\n".encode()
    body = APIError(503, message, code="replica_lost").body()
    return b"data: " + json.dumps(body).encode() + b"\n\ndata: [DONE]\n\n"


def application(replicas: int, num_cpus: float = 1.0, env: dict[str, str] | None = None) -> serve.Application:
    """The Ray Serve application: `replicas` engines (each `num_cpus` CPUs), configured by `env` (`TINYLOOP_*`
    variables; default: this process's)."""
    env = env if env is not None else {k: v for k, v in os.environ.items() if k.startswith(("TINYLOOP_", "RAYON_"))}
    replica = serve.deployment(
        Replica,
        num_replicas=replicas,
        max_ongoing_requests=64,
        ray_actor_options={"num_cpus": num_cpus, "runtime_env": {"env_vars": env}},
        request_router_config=RequestRouterConfig(request_router_class=PrefixAffinityRouter),  # type: ignore[arg-type]
        health_check_period_s=2,
        health_check_timeout_s=10,
    )
    ingress = serve.deployment(Ingress, num_replicas=1, max_ongoing_requests=1024, ray_actor_options={"num_cpus": 0})
    return ingress.bind(replica.bind())  # type: ignore[attr-defined]  # serve.deployment(cls) is a Deployment


def app_builder(args: dict[str, str]) -> serve.Application:
    """`serve run tinyloop.server.ray:app_builder replicas=2 num_cpus=1` (or `import_path` in a config file);
    the server's settings come from the `TINYLOOP_*` environment (`runtime_env.env_vars` in a config file)."""
    return application(int(args.get("replicas", 1)), float(args.get("num_cpus", 1.0)))


def run(host: str, port: int, replicas: int, num_cpus: float, address: str | None) -> int:
    """`tinyloop-serve --ray`: the application on the cluster at `address` (else a new local one), Ray's HTTP proxy
    on `host:port`, until interrupted."""
    import signal

    import ray

    # A local cluster serving on loopback stays on loopback: Ray would otherwise look for the machine's address by
    # probing a public resolver.
    local = address is None and is_loopback(host)
    ray.init(address=address, include_dashboard=False, _node_ip_address="127.0.0.1" if local else None)

    def stop(signum: int, _frame: Any) -> None:
        raise KeyboardInterrupt(signal.Signals(signum).name)

    signal.signal(signal.SIGTERM, stop)  # as Ctrl-C: the application and the local cluster are shut down
    try:
        serve.start(http_options={"host": host, "port": port})
        serve.run(application(replicas, num_cpus), name="tinyloop", route_prefix="/", blocking=True)
    except KeyboardInterrupt:
        pass
    finally:
        if address is None:
            serve.shutdown()  # the local cluster goes with this process
        else:
            serve.delete("tinyloop")  # an existing cluster keeps its other applications
        ray.shutdown()
    return 0
