"""Read-only routes: models, liveness, readiness, the per-rank table, and Prometheus metrics."""

from __future__ import annotations

import time
from typing import Any

import orjson
from fastapi import APIRouter, Request
from starlette.responses import Response

from router.telemetry import CONTENT_TYPE

from .auth import check_admin, check_api_key
from .state import gateway_of

router = APIRouter()


def _json(data: Any, status: int = 200) -> Response:
    return Response(orjson.dumps(data), status, media_type="application/json")


@router.get("/v1/models")
async def models(request: Request) -> Response:
    gw = gateway_of(request)
    check_api_key(request, gw.settings)
    created = int(time.time())
    seen: dict[str, dict[str, Any]] = {}
    for info in gw.store.infos().values():
        for model in info.models:
            card = seen.setdefault(
                model,
                {"id": model, "object": "model", "created": created, "owned_by": "kvrouter", "root": model,
                 "max_model_len": info.max_model_len},
            )  # fmt: skip
            card["max_model_len"] = min(card["max_model_len"], info.max_model_len)
    return _json({"object": "list", "data": list(seen.values())})


@router.get("/health")
async def health() -> Response:
    return _json({"status": "ok"})


@router.get("/ready")
async def ready(request: Request) -> Response:
    gw = gateway_of(request)
    closing = gw.queue.closed  # shutting down: the load balancer must stop sending here
    ok = gw.ready() and not closing
    body: dict[str, Any] = {"ready": ok, "shutting_down": closing, "backends": {}}
    for name in gw.backends:
        info = gw.store.info(name)
        ranks = gw.store.backend_ranks(name)
        body["backends"][name] = {
            "discovered": info is not None,
            "healthy_ranks": sum(1 for t in ranks if t.healthy),
            "ranks": len(ranks),
            "error": gw.store.backend_error(name),
        }
    return _json(body, 200 if ok else 503)


@router.get("/ranks")
async def ranks(request: Request) -> Response:
    gw = gateway_of(request)
    check_admin(request, gw.settings)
    rows = await gw.rank_rows()
    out = []
    for name, backend in gw.backends.items():
        out.append(
            {
                "name": name,
                "engine": backend.spec.engine,
                "url": backend.spec.display_url,
                "ranks": [
                    {
                        "rank": r.rank,
                        "capacity_tokens": r.capacity_tokens,
                        "reserved_tokens": r.reserved_tokens,
                        "inflight": r.inflight,
                        "engine_used_tokens": r.engine_used_tokens,
                        "healthy": r.healthy,
                    }
                    for r in rows
                    if r.backend == name
                ],
            }
        )
    return _json({"backends": out})


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    # In-memory only (no ledger or backend call): cheap however often and however loaded.
    return Response(gateway_of(request).metrics.render(), media_type=CONTENT_TYPE)
