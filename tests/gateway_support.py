"""Gateway test helpers: the router in-process under uvicorn on a free port, an emulator beside it."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
from asgi_server import serve_asgi

from loadtest.emulator.app import EmulatorSettings
from loadtest.emulator.host import EmulatorThread
from router.config import Settings
from router.gateway import create_app

MODEL = "deepseek-ai/DeepSeek-V3"


@contextlib.contextmanager
def emulator(**kw: Any) -> Iterator[EmulatorThread]:
    settings = EmulatorSettings(**{"engine": "sglang", "dp_size": 4, "port": 0, "time_scale": 0.0, **kw})
    with EmulatorThread(settings) as emu:
        yield emu


@contextlib.asynccontextmanager
async def router(ready: bool = True, http: Any = None, **kw: Any) -> AsyncIterator[str]:
    """A gateway on 127.0.0.1:<free port> with the HTTP protocol ``kvrouter serve`` uses (or ``http``);
    waits for /ready unless ``ready`` is False."""
    settings = Settings(**{"port": 0, "reconcile_interval_s": 0.1, **kw})
    options: dict[str, Any] = {"h11_max_incomplete_event_size": settings.max_header_bytes}
    if http is not None:
        options["http"] = http
    async with serve_asgi(create_app(settings), **options) as url:
        if ready:
            async with httpx.AsyncClient() as http:
                for _ in range(500):
                    if (await http.get(url + "/ready")).status_code == 200:
                        break
                    await asyncio.sleep(0.01)
                else:
                    raise RuntimeError("router never became ready")
        yield url


async def get_json(url: str, **kw: Any) -> Any:
    async with httpx.AsyncClient() as http:
        resp = await http.get(url, **kw)
        return resp.json()


async def ranks_settled(url: str, timeout_s: float = 5.0) -> list[dict[str, Any]]:
    """/ranks rows once every rank is back to zero reserved and zero in flight (or the last seen)."""
    rows: list[dict[str, Any]] = []
    for _ in range(int(timeout_s / 0.02)):
        body = await get_json(url + "/ranks")
        rows = [r for b in body["backends"] for r in b["ranks"]]
        if all(r["reserved_tokens"] == 0 and r["inflight"] == 0 for r in rows):
            return rows
        await asyncio.sleep(0.02)
    return rows


async def emulator_finished(emu_url: str, count: int, timeout_s: float = 5.0) -> list[dict[str, Any]]:
    """The emulator's finished requests once ``count`` are recorded: it books a request as finished a
    moment after the client has read ``[DONE]``, so reading it at once races on a busy machine."""
    finished: list[dict[str, Any]] = []
    for _ in range(int(timeout_s / 0.02)):
        finished = (await get_json(emu_url + "/_emulator/requests"))["finished"]
        if len(finished) >= count:
            return finished
        await asyncio.sleep(0.02)
    return finished
