"""OpenAI-style error bodies ``{"error": {"message", "type", "param", "code"}}`` and the app's handlers.

Every refusal the router makes goes through :class:`ApiError`, so a client sees one shape whatever failed,
and the rejection counter gets one reason per refusal.
"""

from __future__ import annotations

from collections.abc import Mapping

import orjson
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response

MAX_WRAPPED_MESSAGE_BYTES = 1000

_TYPES: Mapping[int, str] = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "timeout_error",
    413: "invalid_request_error",
    431: "invalid_request_error",
    429: "rate_limit_error",
    500: "internal_server_error",
    502: "upstream_error",
    503: "service_unavailable_error",
    504: "timeout_error",
}


class ApiError(Exception):
    """A refusal with its HTTP status; ``code`` doubles as the rejection reason in metrics."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        code: str,
        param: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        self.headers = dict(headers or {})
        self.counted = False  # set once the request was counted in kvrouter_requests_total


def error_body(status: int, message: str, code: str | None = None, param: str | None = None) -> bytes:
    return orjson.dumps(
        {"error": {"message": message, "type": _TYPES.get(status, "error"), "param": param, "code": code}}
    )


def error_response(exc: ApiError) -> Response:
    return Response(
        error_body(exc.status, exc.message, exc.code, exc.param),
        status_code=exc.status,
        headers=exc.headers,
        media_type="application/json",
    )


def upstream_error_body(status: int, body: bytes) -> bytes:
    """An engine's error answer in the OpenAI shape: kept as is when it already is, wrapped otherwise
    (a FastAPI ``{"detail": ...}``, SGLang's ``{"object": "error", ...}``, a proxy's plain-text page)."""
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError:
        data = None
    if isinstance(data, dict) and isinstance(data.get("error"), dict):
        return body
    message: object = None
    if isinstance(data, dict):
        message = data.get("message") or data.get("detail") or data.get("error")
    if not isinstance(message, str):
        message = (
            body[:MAX_WRAPPED_MESSAGE_BYTES].decode("utf-8", "replace").strip()
            if message is None
            else str(message)
        )
    return error_body(status, message or f"upstream answered HTTP {status}", "upstream_error")


def sse_error_event(message: str, code: str, status: int = 502) -> bytes:
    """What a stream carries when the upstream fails after the first byte (SGLang/vLLM do the same)."""
    return b"data: " + error_body(status, message, code) + b"\n\ndata: [DONE]\n\n"


async def _api_error(_: Request, exc: Exception) -> Response:
    assert isinstance(exc, ApiError)
    return error_response(exc)


async def _http_error(_: Request, exc: Exception) -> Response:
    assert isinstance(exc, StarletteHTTPException)
    message = exc.detail if isinstance(exc.detail, str) else "HTTP error"
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
    return Response(
        error_body(exc.status_code, message, code),
        status_code=exc.status_code,
        headers=exc.headers,
        media_type="application/json",
    )


async def _validation_error(_: Request, exc: Exception) -> Response:
    assert isinstance(exc, RequestValidationError)
    first = exc.errors()[0] if exc.errors() else {"msg": "invalid request", "loc": ()}
    param = ".".join(str(p) for p in first.get("loc", ()) if p != "body") or None
    return Response(
        error_body(400, str(first["msg"]), "invalid_request", param), 400, media_type="application/json"
    )


async def _unexpected(_: Request, exc: Exception) -> Response:
    return Response(
        error_body(500, f"internal error: {type(exc).__name__}", "internal_error"),
        500,
        media_type="application/json",
    )


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(ApiError, _api_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(Exception, _unexpected)
