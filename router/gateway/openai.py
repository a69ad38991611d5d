"""OpenAI-compatible generation routes; all the work is in :class:`~router.gateway.proxy.Proxy`."""

from __future__ import annotations

from fastapi import APIRouter, Request
from starlette.responses import Response

from .state import proxy_of

router = APIRouter()


@router.post("/v1/chat/completions")
async def chat_completions(request: Request) -> Response:
    return await proxy_of(request).handle(request, "/v1/chat/completions")


@router.post("/v1/completions")
async def completions(request: Request) -> Response:
    return await proxy_of(request).handle(request, "/v1/completions")
