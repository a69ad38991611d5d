"""Bearer-token checks: client API keys on the model routes, the admin token on /ranks.

Comparisons are constant-time (``hmac.compare_digest``) and every configured key is compared, so the
time taken says nothing about which key, or how much of one, matched.
"""

from __future__ import annotations

import hmac

from fastapi import Request
from pydantic import SecretStr

from router.config import Settings

from .errors import ApiError


def _bearer(value: str) -> bytes:
    scheme, _, token = value.partition(" ")
    return token.strip().encode() if scheme.lower() == "bearer" else b""


def _matches(token: bytes, secrets: list[SecretStr]) -> bool:
    ok = False
    for secret in secrets:
        ok |= hmac.compare_digest(token, secret.get_secret_value().encode())
    return ok and bool(token)


def check_api_key(request: Request, settings: Settings) -> None:
    check_bearer(request.headers.get("authorization", ""), settings)


def check_bearer(authorization: str, settings: Settings) -> None:
    """The client API key check on an ``Authorization`` header value (the raw-ASGI data path)."""
    if settings.api_keys and not _matches(_bearer(authorization), settings.api_keys):
        raise ApiError(
            401,
            "Invalid or missing API key (Authorization: Bearer <key>).",
            code="invalid_api_key",
            headers={"WWW-Authenticate": "Bearer"},
        )


def check_admin(request: Request, settings: Settings) -> None:
    if settings.admin_token is not None and not _matches(
        _bearer(request.headers.get("authorization", "")), [settings.admin_token]
    ):
        raise ApiError(
            401,
            "Invalid or missing admin token.",
            code="invalid_admin_token",
            headers={"WWW-Authenticate": "Bearer"},
        )
