"""Operator routes: take a rank out of rotation and put it back (``POST /ranks/{backend}/{rank}/drain``).

A drained rank gets no new request (the policy sees ``RankView.draining``); what already runs there
finishes normally. Mutations need the admin token, and are refused outright when none is configured:
an API key or no credentials never move traffic. 401 = no bearer token, 403 = a token that is not the
admin token (or admin routes disabled). The drained set is this process's: with several workers or
replicas, drain each (or use engine-side health), see docs/hardening.md.
"""

from __future__ import annotations

import hmac

import orjson
from fastapi import APIRouter, Request
from starlette.responses import Response

from router.placement.snapshot import RankKey

from .errors import ApiError
from .runtime import Gateway
from .state import gateway_of

router = APIRouter()


def check_admin_mutation(request: Request, gw: Gateway) -> None:
    """Constant-time check of the admin bearer token; mutations are off without one configured."""
    secret = gw.settings.admin_token
    if secret is None:
        raise ApiError(403, "Admin routes are disabled: configure admin_token.", code="admin_disabled")
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise ApiError(
            401, "Missing admin token.", code="invalid_admin_token", headers={"WWW-Authenticate": "Bearer"}
        )
    if not hmac.compare_digest(token.strip().encode(), secret.get_secret_value().encode()):
        raise ApiError(403, "Invalid admin token.", code="invalid_admin_token")


def _known_rank(gw: Gateway, backend: str, rank: int) -> RankKey:
    key = RankKey(backend, rank)
    if gw.store.rank(key) is None:
        raise ApiError(404, f"No discovered rank {rank} on backend {backend!r}.", code="rank_not_found")
    return key


def _state(gw: Gateway, key: RankKey) -> Response:
    body = {"backend": key.backend, "rank": key.rank, "draining": key in gw.placer.drained}
    return Response(orjson.dumps(body), 200, media_type="application/json")


@router.post("/ranks/{backend}/{rank}/drain")
async def drain(request: Request, backend: str, rank: int) -> Response:
    gw = gateway_of(request)
    check_admin_mutation(request, gw)
    key = _known_rank(gw, backend, rank)
    gw.placer.drained.add(key)
    return _state(gw, key)


@router.post("/ranks/{backend}/{rank}/undrain")
async def undrain(request: Request, backend: str, rank: int) -> Response:
    gw = gateway_of(request)
    check_admin_mutation(request, gw)
    key = _known_rank(gw, backend, rank)
    gw.placer.drained.discard(key)
    gw.queue.wake()  # room may have appeared for a waiting request
    return _state(gw, key)
