"""Server-sent events: the framing every streaming family shares."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import orjson
from fastapi.responses import StreamingResponse

from .errors import error_body

SSE_DONE = b"data: [DONE]\n\n"


def sse(obj: Any) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def stream_error(message: str) -> bytes:
    """The event that ends a stream whose generation failed after the 200 was sent (then `[DONE]` follows)."""
    return sse(error_body(500, message, code="engine_error"))


def sse_response(body: AsyncIterator[bytes]) -> StreamingResponse:
    return StreamingResponse(body, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
