"""SGLang's native ``/generate`` (served only by SGLang backends; ``model`` may be omitted)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from starlette.responses import Response

from .state import proxy_of

router = APIRouter()


@router.post("/generate")
async def generate(request: Request) -> Response:
    return await proxy_of(request).handle(request, "/generate")
