"""SGLang's native ``/generate`` (served only by SGLang backends; ``model`` may be omitted)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from starlette.responses import Response

from .fastpath import ProxiedResponse
from .openapi_schemas import GENERATE, json_body
from .state import proxy_of

router = APIRouter()


@router.post("/generate", openapi_extra=json_body(GENERATE))
async def generate(request: Request) -> Response:
    return ProxiedResponse(proxy_of(request), "/generate")
