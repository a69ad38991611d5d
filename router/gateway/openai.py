"""OpenAI-compatible generation routes; all the work is in :class:`~router.gateway.proxy.Proxy`."""

from __future__ import annotations

from fastapi import APIRouter, Request
from starlette.responses import Response

from .fastpath import ProxiedResponse
from .openapi_schemas import CHAT_COMPLETION, COMPLETION, json_body
from .state import proxy_of

router = APIRouter()


@router.post("/v1/chat/completions", openapi_extra=json_body(CHAT_COMPLETION))
async def chat_completions(request: Request) -> Response:
    return ProxiedResponse(proxy_of(request), "/v1/chat/completions")


@router.post("/v1/completions", openapi_extra=json_body(COMPLETION))
async def completions(request: Request) -> Response:
    return ProxiedResponse(proxy_of(request), "/v1/completions")
