"""Run an ASGI app under uvicorn on a free loopback port for the duration of a block (no tests here)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import uvicorn

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
