"""Errors in each API's own shape: `{"error": {"message", "type", "param", "code"}}` (what the openai SDK expects), and
`{"type": "error", "error": {"type", "message"}}` on the Anthropic Messages routes (what the anthropic SDK expects)."""

from __future__ import annotations

from typing import Any

_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    422: "invalid_request_error",
    503: "service_unavailable",
    500: "internal_error",
}


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, self.param, self.code)

    def status_for(self, path: str) -> int:
        """The status in the API family that `path` belongs to: on Anthropic's routes a request the schema refuses is
        400 (as every `invalid_request_error` is there) and a server that cannot take it now is 529
        `overloaded_error`."""
        if path.startswith(ANTHROPIC_ROUTES):
            return _ANTHROPIC_STATUS.get(self.status, self.status)
        return self.status

    def body_for(self, path: str) -> dict[str, Any]:
        """The error in the shape of the API family that `path` belongs to."""
        if path.startswith(ANTHROPIC_ROUTES):
            return anthropic_error_body(self.status_for(path), self.message)
        return self.body()


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {
        "error": {"message": message, "type": _TYPES.get(status, "invalid_request_error"), "param": param, "code": code}
    }


ANTHROPIC_ROUTES = "/v1/messages"
_ANTHROPIC_STATUS = {415: 400, 422: 400, 503: 529}
_ANTHROPIC_TYPES = {
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    529: "overloaded_error",
}


def anthropic_error_body(status: int, message: str) -> dict[str, Any]:
    return {
        "type": "error",
        "error": {"type": _ANTHROPIC_TYPES.get(status, "invalid_request_error"), "message": message},
    }
