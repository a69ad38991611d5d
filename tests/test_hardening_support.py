"""Helpers for the hardening tests (no tests here): error-shape checks, the ledger at zero, an in-process
router with the production HTTP protocol, and a real ``kvrouter serve`` subprocess."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import uvicorn
from asgi_server import serve_asgi

from router.config import Settings
from router.gateway import create_app
from router.gateway.protocol import GatewayHttpProtocol

ERROR_KEYS = {"message", "type", "param", "code"}


def assert_error(resp: httpx.Response, status: int, code: str | None = None) -> dict[str, Any]:
    """An OpenAI-style refusal: the status, ``{"error": {message, type, param, code}}``, no traceback."""
    assert resp.status_code == status, (resp.status_code, resp.text[:300])
    assert b"Traceback" not in resp.content
    assert resp.headers["content-type"].startswith("application/json"), resp.headers
    err = resp.json()["error"]
    assert set(err) == ERROR_KEYS and isinstance(err["message"], str) and err["message"], err
    if code is not None:
        assert err["code"] == code, err
    return dict(err)


async def rank_rows(http: httpx.AsyncClient, url: str, **kw: Any) -> list[dict[str, Any]]:
    body = (await http.get(url + "/ranks", **kw)).json()
    return [r for b in body["backends"] for r in b["ranks"]]


async def ledger_zero(http: httpx.AsyncClient, url: str, timeout_s: float = 5.0, **kw: Any) -> None:
    """Every rank back at zero reserved and zero in flight (waits for releases still under way)."""
    deadline_s = time.monotonic() + timeout_s
    while True:
        rows = await rank_rows(http, url, **kw)
        if all(r["reserved_tokens"] == 0 and r["inflight"] == 0 for r in rows):
            return
        assert time.monotonic() < deadline_s, rows
        await asyncio.sleep(0.02)


async def engine_idle(http: httpx.AsyncClient, emu_url: str, timeout_s: float = 5.0) -> dict[str, Any]:
    """The emulator's own truth: nothing running or waiting, no orphan left behind."""
    deadline_s = time.monotonic() + timeout_s
    while True:
        stats: dict[str, Any] = (await http.get(emu_url + "/_emulator/stats")).json()
        if stats["inflight"] == 0:
            assert stats.get("orphaned_requests", 0) == 0, stats
            return stats
        assert time.monotonic() < deadline_s, stats
        await asyncio.sleep(0.02)


@contextlib.asynccontextmanager
async def serve_router(
    ready: bool = True, http_protocol: type[asyncio.Protocol] = GatewayHttpProtocol, **kw: Any
) -> AsyncIterator[str]:
    """A gateway in this process on 127.0.0.1:<free port>, with the protocol `kvrouter serve` uses."""
    settings = Settings(**{"port": 0, "reconcile_interval_s": 0.1, **kw})
    served = serve_asgi(
        create_app(settings), http=http_protocol, h11_max_incomplete_event_size=settings.max_header_bytes
    )
    async with served as url:
        if ready:
            await wait_ready(url)
        yield url


async def wait_ready(url: str, timeout_s: float = 10.0, **kw: Any) -> None:
    async with httpx.AsyncClient() as http:
        deadline_s = time.monotonic() + timeout_s
        while True:
            with contextlib.suppress(httpx.TransportError):
                if (await http.get(url + "/ready", **kw)).status_code == 200:
                    return
            if time.monotonic() > deadline_s:
                raise RuntimeError(f"{url} never became ready")
            await asyncio.sleep(0.02)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ServeProcess:
    """``kvrouter serve`` as a child process; its stdout+stderr go to ``log_path``."""

    def __init__(self, args: list[str], log_path: Path, env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        cmd = [sys.executable, "-m", "router.cli", "serve", "--port", str(self.port), *args]
        self._log = log_path.open("wb")
        self.proc = subprocess.Popen(
            cmd, stdout=self._log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})}
        )

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")

    def sigterm(self) -> None:
        self.proc.send_signal(signal.SIGTERM)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)
        self._log.close()


@contextlib.contextmanager
def serve_process(
    args: list[str], log_path: Path, env: dict[str, str] | None = None
) -> Iterator[ServeProcess]:
    proc = ServeProcess(args, log_path, env)
    try:
        yield proc
    finally:
        proc.stop()


class RouterThread:
    """The gateway on a daemon thread with its own event loop (for synchronous clients: schemathesis)."""

    def __init__(self, **kw: Any) -> None:
        self.settings = Settings(**{"port": 0, "reconcile_interval_s": 0.1, **kw})
        config = uvicorn.Config(
            create_app(self.settings), host="127.0.0.1", port=0, log_level="warning", lifespan="on",
            loop="asyncio", http=GatewayHttpProtocol, timeout_graceful_shutdown=2,
        )  # fmt: skip
        self.server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._main, name="router", daemon=True)
        self.url = ""

    def _main(self) -> None:
        asyncio.run(self.server.serve())

    def __enter__(self) -> RouterThread:
        self._thread.start()
        deadline_s = time.monotonic() + 10
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline_s:
                raise RuntimeError("router did not start")
            time.sleep(0.01)
        self.url = f"http://127.0.0.1:{self.server.servers[0].sockets[0].getsockname()[1]}"
        while httpx.get(self.url + "/ready").status_code != 200:
            if time.monotonic() > deadline_s:
                raise RuntimeError("router never became ready")
            time.sleep(0.02)
        return self

    def __exit__(self, *_: object) -> None:
        self.server.should_exit = True
        self._thread.join(15)
