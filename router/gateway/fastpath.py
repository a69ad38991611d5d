"""The data-plane fast path: generation POSTs go straight to the :class:`Proxy`, skipping FastAPI's router.

Installed as the outermost user middleware, so only Starlette's ServerErrorMiddleware (an unexpected
exception → the app's 500 handler) remains above it. Route matching, the request/response wrappers and
the exception middleware cost ~20 % of a proxied request's CPU (py-spy, wrk c=64); every other route,
and any scope without the lifespan state, falls through to the full FastAPI app unchanged.
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.types import ASGIApp, Receive, Scope, Send

from router.backends.base import Route

from .errors import ApiError, error_response
from .proxy import Proxy

HOT_ROUTES: dict[str, Route] = {
    "/v1/chat/completions": "/v1/chat/completions",
    "/v1/completions": "/v1/completions",
    "/generate": "/generate",
}


class FastPath:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        route = HOT_ROUTES.get(scope["path"]) if scope["type"] == "http" else None
        proxy: Proxy | None = scope.get("state", {}).get("proxy") if route is not None else None
        if proxy is None or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        assert route is not None
        request = Request(scope, receive)
        try:
            response = await proxy.handle(request, route)
        except ApiError as exc:
            response = error_response(exc)
        await response(scope, receive, send)
