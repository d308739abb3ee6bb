"""The chat page: `GET /` and its two assets, static files shipped in the package (`page_assets/`). They hold no
data, so they are served without an API key; the page asks for one when the API answers 401 and sends it with every
call."""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import Response

from .errors import APIError

router = APIRouter()

PAGE = Path(__file__).resolve().parent / "page_assets"
ASSETS = {"chat.js": "text/javascript; charset=utf-8", "chat.css": "text/css; charset=utf-8"}
PUBLIC_PATHS = frozenset({"/", *(f"/page/{name}" for name in ASSETS)})


def _file(name: str, media_type: str) -> Response:
    # no-cache: the page changes with the package, and it is a few kilobytes.
    return Response((PAGE / name).read_bytes(), media_type=media_type, headers={"Cache-Control": "no-cache"})


@router.get("/", include_in_schema=False)
async def index():
    return _file("index.html", "text/html; charset=utf-8")


@router.get("/page/{name}", include_in_schema=False)
async def asset(name: str):
    if name not in ASSETS:  # only the shipped files: a name is never turned into a path
        raise APIError(404, f"no page asset {name!r}", code="not_found")
    return _file(name, ASSETS[name])
