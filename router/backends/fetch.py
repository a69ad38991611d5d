"""Control-plane HTTP calls to engines: always bounded by a timeout, every failure a one-line BackendError."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import httpx
import orjson

from router.backends.base import BackendError

DEFAULT_TIMEOUT_S = 2.0


class EndpointMissing(BackendError):
    """The engine answered 404/405: this version has no such endpoint (try the fallback)."""


async def get(http: httpx.AsyncClient, url: str, timeout_s: float) -> httpx.Response:
    """GET ``url``; 404/405 raise EndpointMissing, other non-2xx and transport errors BackendError."""
    try:
        resp = await http.get(url, timeout=timeout_s)
    except httpx.TimeoutException:
        raise BackendError(f"GET {url}: no answer within {timeout_s:g} s") from None
    except httpx.HTTPError as exc:
        raise BackendError(f"GET {url}: {type(exc).__name__}: {exc}") from None
    if resp.status_code in (404, 405):
        raise EndpointMissing(f"GET {url}: HTTP {resp.status_code}")
    if resp.status_code >= 400:
        raise BackendError(f"GET {url}: HTTP {resp.status_code}: {resp.text[:200]!r}")
    return resp


async def get_json(http: httpx.AsyncClient, url: str, timeout_s: float) -> Any:
    resp = await get(http, url, timeout_s)
    try:
        return orjson.loads(resp.content)
    except orjson.JSONDecodeError:
        raise BackendError(f"GET {url}: body is not JSON: {resp.text[:200]!r}") from None


async def get_text(http: httpx.AsyncClient, url: str, timeout_s: float) -> str:
    return (await get(http, url, timeout_s)).text


async def post_json(
    http: httpx.AsyncClient, url: str, body: Any, timeout_s: float, headers: Mapping[str, str] | None = None
) -> int:
    """POST a JSON body; returns the status code (callers decide what a failure means)."""
    try:
        resp = await http.post(
            url,
            content=orjson.dumps(body),
            headers={"content-type": "application/json", **(headers or {})},
            timeout=timeout_s,
        )
    except httpx.TimeoutException:
        raise BackendError(f"POST {url}: no answer within {timeout_s:g} s") from None
    except httpx.HTTPError as exc:
        raise BackendError(f"POST {url}: {type(exc).__name__}: {exc}") from None
    return resp.status_code


def as_int(value: Any) -> int | None:
    """Engines print ints as ``"123"``, ``123.0`` or ``"None"``; anything non-numeric is None."""
    if isinstance(value, bool) or value is None:
        return None
    try:
        return int(float(value))
    except (TypeError, ValueError, OverflowError):
        return None


def as_dict(value: Any, what: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise BackendError(f"{what}: expected a JSON object, got {type(value).__name__}")
    return value


async def get_models(
    http: httpx.AsyncClient, base_url: str, timeout_s: float
) -> tuple[tuple[str, ...], int | None]:
    """Model ids and the context window (``max_model_len``, an SGLang/vLLM extension) from /v1/models."""
    body = as_dict(await get_json(http, f"{base_url}/v1/models", timeout_s), f"{base_url}/v1/models")
    data = body.get("data")
    if not isinstance(data, list):
        raise BackendError(f"{base_url}/v1/models: no 'data' list")
    ids = tuple(str(m["id"]) for m in data if isinstance(m, dict) and "id" in m)
    lens = [as_int(m.get("max_model_len")) for m in data if isinstance(m, dict)]
    known = [n for n in lens if n is not None and n > 0]
    return ids, (known[0] if known else None)
