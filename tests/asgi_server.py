"""Run an ASGI app under uvicorn on a free loopback port for the duration of a block (no tests here).

The HTTP protocol is the one ``kvrouter serve`` uses (head limits, generation POSTs off the ASGI cycle);
for an app without the gateway's lifespan state it behaves as uvicorn's httptools protocol.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import uvicorn

from router.gateway.protocol import GatewayHttpProtocol

SHUTDOWN_BOUND_S = 2  # uvicorn otherwise waits without limit for open connections when the block ends


@contextlib.asynccontextmanager
async def serve_asgi(app: Any, **config: Any) -> AsyncIterator[str]:
    """Yields ``http://127.0.0.1:<port>``; ``config`` overrides uvicorn.Config (lifespan, http, ...)."""
    options: dict[str, Any] = {
        "host": "127.0.0.1",
        "port": 0,
        "log_level": "warning",
        "lifespan": "on",
        "loop": "asyncio",
        "http": GatewayHttpProtocol,
        "timeout_graceful_shutdown": SHUTDOWN_BOUND_S,
        **config,
    }
    server = uvicorn.Server(uvicorn.Config(app, **options))
    task = asyncio.create_task(server.serve())
    try:
        while not server.started:
            if task.done():
                task.result()
                raise RuntimeError("server exited during startup")
            await asyncio.sleep(0.005)
        yield f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"
    finally:
        server.should_exit = True
        await task
