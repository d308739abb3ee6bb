"""The ASGI layer in front of every route: API keys, request counts, the body's size and well-formedness, and the
client's departure.

It is plain ASGI (not Starlette's `BaseHTTPMiddleware`, which wraps `receive` so that a client's disconnect may
never reach the route). It reads the whole body before the route runs, so it can refuse an oversized body (413),
a body that is not JSON (415), not UTF-8, not well-formed JSON or holding a lone surrogate (400) in the API's
error shape, before FastAPI sees it. Then it watches the connection itself: a task waits on the server's
`receive()` for `http.disconnect` while the route runs, and when the client goes away it cancels the route. A
route that awaits a generation ends at once, and the generation's cleanup cancels the engine work, whether the
request streams or not, and whether its first byte was sent or not.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import re
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import orjson

from .errors import APIError
from .metrics import Metrics
from .page import PUBLIC_PATHS

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
_JSON_TYPES = ("application/json", "text/json")


async def send_error(send: Send, e: APIError, path: str = "") -> None:
    body = orjson.dumps(e.body_for(path))
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(k.lower().encode(), v.encode()) for k, v in e.headers.items()]
    await send({"type": "http.response.start", "status": e.status_for(path), "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


class InFlight:
    """How many HTTP requests are being answered (read by the shutdown drain)."""

    def __init__(self) -> None:
        self.count = 0


class Gate:
    def __init__(self, app, api_keys: Sequence[str], metrics: Metrics, max_body_bytes: int, inflight: InFlight):
        self.app, self.metrics, self.max_body_bytes, self.inflight = app, metrics, max_body_bytes, inflight
        self.api_keys = [k.encode() for k in api_keys]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        self.inflight.count += 1
        try:
            await self._answer(scope, receive, send)
        finally:
            self.inflight.count -= 1

    async def _answer(self, scope: Scope, receive: Receive, send: Send) -> None:

        async def counted(message: Message) -> None:
            if message["type"] == "http.response.start":
                route = scope.get("route")
                self.metrics.requests.labels(getattr(route, "path", "unmatched"), str(message["status"])).inc()
            await send(message)

        try:
            self._authorize(scope)
            body = await self._read_body(scope, receive)
            if body is None:
                return  # the client left while sending its body
            _check_body(scope, body)
        except APIError as e:
            return await send_error(counted, e, scope["path"])
        await self._run_watched(scope, receive, counted, body)

    def _authorize(self, scope: Scope) -> None:
        if not self.api_keys or scope["path"] == "/health" or scope["path"] in PUBLIC_PATHS:
            return
        headers = dict(scope["headers"])
        given = headers.get(b"authorization", b"")
        given = given[7:].strip() if given[:7].lower() == b"bearer " else b""
        given = given or headers.get(b"x-api-key", b"")
        # Every key is compared, each in constant time, so the answer's timing says nothing of which key is close.
        if not any([hmac.compare_digest(given, k) for k in self.api_keys]):
            raise APIError(
                401, "Invalid or missing API key: send 'Authorization: Bearer <key>'", code="invalid_api_key"
            )

    async def _read_body(self, scope: Scope, receive: Receive) -> bytes | None:
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body_bytes:
            raise _too_large(self.max_body_bytes)
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                raise _too_large(self.max_body_bytes)
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)

    async def _run_watched(self, scope: Scope, receive: Receive, send: Send, body: bytes) -> None:
        """Run the route with the body replayed; cancel it when the client disconnects."""
        gone = asyncio.Event()
        replay = replayed(body, gone)

        async def watch() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            if not route.done():  # counted here: once `gone` is set, the route may end before it is cancelled
                self.metrics.client_disconnects.inc()
            gone.set()

        route = asyncio.ensure_future(self.app(scope, replay, send))
        watcher = asyncio.ensure_future(watch())
        try:
            await asyncio.wait([route, watcher], return_when=asyncio.FIRST_COMPLETED)
        finally:
            watcher.cancel()
            if not route.done():
                route.cancel()
            try:
                await route
            except asyncio.CancelledError:
                if not gone.is_set():
                    raise  # this request itself was cancelled (server shutdown), not the route


def replayed(body: bytes, gone: asyncio.Event) -> Receive:
    """An ASGI `receive` that gives the whole `body` once, then `http.disconnect` once `gone` is set."""
    delivered = False

    async def receive() -> Message:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": body, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    return receive


def _too_large(limit: int) -> APIError:
    return APIError(
        413, f"request body is larger than the limit of {limit} bytes (--max-body-bytes)", code="request_too_large"
    )


def _check_body(scope: Scope, body: bytes) -> None:
    """A body must be JSON (or absent): UTF-8, well-formed, no lone surrogates. Types and ranges are the schema's."""
    if not body:
        return
    ctype = dict(scope["headers"]).get(b"content-type", b"").split(b";")[0].strip().decode("latin-1").lower()
    if ctype and ctype not in _JSON_TYPES and not ctype.endswith("+json"):
        raise APIError(
            415,
            f"the body must be JSON (Content-Type: application/json), got Content-Type {ctype!r}",
            code="unsupported_media_type",
        )
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as e:
        raise APIError(400, f"the body is not valid UTF-8 (byte {e.start})", code="invalid_body") from None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise APIError(
            400, f"the body is not valid JSON: {e.msg} (line {e.lineno}, column {e.colno})", code="invalid_json"
        ) from None
    except RecursionError:
        raise APIError(400, "the body's JSON is nested too deeply", code="invalid_json") from None
    if _SURROGATE_ESCAPE.search(body):
        where = _lone_surrogate(value)
        if where is not None:
            raise APIError(
                400,
                f"{where or 'the body'} holds a lone UTF-16 surrogate, which is not a character",
                param=where or None,
                code="invalid_json",
            )


def _lone_surrogate(value: Any) -> str | None:
    """The dotted path of the first string (key or value) holding a lone surrogate, else None (iterative walk)."""
    stack: list[tuple[str, Any]] = [("", value)]
    while stack:
        path, v = stack.pop()
        if isinstance(v, str):
            if not _encodes(v):
                return path
        elif isinstance(v, dict):
            for k, item in v.items():
                child = f"{path}.{k}" if path else str(k)
                if not _encodes(k):
                    return path
                stack.append((child, item))
        elif isinstance(v, list):
            stack.extend((f"{path}.{i}" if path else str(i), item) for i, item in enumerate(v))
    return None


def _encodes(s: str) -> bool:
    try:
        s.encode("utf-8")
        return True
    except UnicodeEncodeError:
        return False
