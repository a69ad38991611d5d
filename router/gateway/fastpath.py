"""The data-plane fast path: generation POSTs go to the :class:`Proxy` before FastAPI.

Under the gateway's own HTTP protocol (router/gateway/protocol.py) they never become ASGI at all. Under
any other ASGI server, :class:`GatewayApp` is the FastAPI app with one dispatch in front: a POST to a
generation route, once the lifespan state holds the proxy, never enters Starlette's middleware stack,
router or Request/Response objects (together ~20 % of a proxied request's CPU under py-spy; FastAPI's
native telemetry check adds more). Everything else, including those routes' OpenAPI documentation, is
FastAPI unchanged.
"""

from __future__ import annotations

import contextlib
import logging

from fastapi import FastAPI
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from router.backends.base import Route

from .asgi import AsgiExchange
from .errors import error_body
from .exchange import JSON_TYPE, Exchange, Reply
from .proxy import Proxy

log = logging.getLogger(__name__)

HOT_ROUTES: dict[str, Route] = {
    "/v1/chat/completions": "/v1/chat/completions",
    "/v1/completions": "/v1/completions",
    "/generate": "/generate",
}


async def serve_exchange(proxy: Proxy, exchange: Exchange, route: Route) -> None:
    """``proxy.serve``, with the app's 500 answer for an unexpected error (as Starlette's
    ServerErrorMiddleware gives: then re-raised, so the server logs it and drops the connection)."""
    try:
        await proxy.serve(exchange, route)
    except Exception as exc:
        body = error_body(500, f"internal error: {type(exc).__name__}", "internal_error")
        with contextlib.suppress(Exception):  # fails if the response had started: nothing more to say
            await Reply(500, body, [], JSON_TYPE)(exchange)
        raise


class GatewayApp(FastAPI):
    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            route = HOT_ROUTES.get(scope["path"])
            state = scope.get("state") if route is not None else None
            proxy: Proxy | None = state.get("proxy") if state else None
            if proxy is not None:
                assert route is not None
                await serve_exchange(proxy, AsgiExchange(scope, receive, send), route)
                return
        await super().__call__(scope, receive, send)


class ProxiedResponse(Response):
    """What the FastAPI generation routes return (reached only without the fast path, e.g. an app whose
    lifespan did not run): the same proxy over raw ASGI."""

    def __init__(self, proxy: Proxy, route: Route) -> None:
        # Response.__init__ is skipped on purpose: nothing is rendered up front.
        self.status_code = 200
        self.background = None
        self._proxy = proxy
        self._route = route

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self._proxy.serve(AsgiExchange(scope, receive, send), self._route)
