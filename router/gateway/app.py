"""``create_app(settings) -> FastAPI``: routes split by concern, resources owned by the lifespan."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI

from router.config import Settings
from router.telemetry import Metrics, multiprocess_dir

from . import drain, info, openai, sglang_generate
from .errors import install_error_handlers
from .fastpath import GatewayApp
from .proxy import Proxy
from .runtime import Gateway
from .state import LifespanState


def create_app(settings: Settings) -> FastAPI:
    """A gateway app for ``settings``; nothing is opened until the lifespan starts."""

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[LifespanState]:
        metrics = Metrics(policy=settings.policy, multiprocess_dir=multiprocess_dir(settings.workers))
        gateway = Gateway(settings, metrics)
        await gateway.start()
        try:
            yield {"gateway": gateway, "proxy": Proxy(gateway)}
        finally:
            await gateway.stop()

    app = GatewayApp(  # generation POSTs skip FastAPI entirely (router/gateway/fastpath.py)
        title="kvrouter",
        summary="KV-aware router for MLA models served with data-parallel attention",
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
    )
    install_error_handlers(app)
    app.include_router(openai.router)
    app.include_router(sglang_generate.router)
    app.include_router(info.router)
    app.include_router(drain.router)
    return app
