"""Who may do what: client keys, the admin token and rank drain, what is (not) forwarded upstream, and
secrets kept out of logs and metrics."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
from gateway_support import MODEL, emulator
from test_hardening_support import (
    assert_error,
    ledger_zero,
    rank_rows,
    serve_process,
    serve_router,
    wait_ready,
)

from router.config import Settings
from router.gateway import create_app

pytestmark = pytest.mark.anyio

KEY = "sk-client-7f3a9c2e51d04b8e"
ADMIN = "adm-4be1d9a0c6f27e35"
CHAT = "/v1/chat/completions"
MSGS = [{"role": "user", "content": "hi"}]
HOSTILE = {
    "Cookie": "session=c00kie-secret", "Proxy-Authorization": "Basic cHJveHk6c2VjcmV0",
    "X-Custom-Secret": "custom-secret", "X-Forwarded-Host": "evil.example", "Host": "evil.example:81",
    "X-Data-Parallel-Rank": "99", "Connection": "keep-alive, X-Custom-Secret", "TE": "trailers",
    "Upgrade": "h2c", "X-Forwarded-For": "10.6.6.6",
}  # fmt: skip


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


async def test_drain_needs_the_admin_token_and_lets_running_streams_finish() -> None:
    with emulator(dp_size=2, time_scale=0.3) as emu:
        opts = {
            "backends": [f"sglang={emu.url}"],
            "policy": "round_robin",
            "api_keys": [KEY],
            "admin_token": ADMIN,
        }
        async with serve_router(**opts) as url, httpx.AsyncClient(base_url=url, timeout=10) as http:
            body = {
                "model": MODEL,
                "messages": MSGS,
                "max_tokens": 60,
                "emulator_output_tokens": 60,
                "stream": True,
            }
            async with http.stream("POST", CHAT, json=body, headers=bearer(KEY)) as running:
                assert running.status_code == 200
                chunks = running.aiter_bytes()
                first = await chunks.__anext__()
                backend, rank = running.headers["x-kvrouter-rank"].split("@")
                drain = f"/ranks/{backend}/{rank}/drain"
                assert_error(await http.post(drain), 401, "invalid_admin_token")
                assert_error(await http.post(drain, headers=bearer(KEY)), 403, "invalid_admin_token")
                assert_error(await http.post(drain, headers=bearer(ADMIN[:-1])), 403)
                assert_error(await http.get("/ranks", headers=bearer(KEY)), 401)
                assert not (await http.get(emu.url + "/_emulator/faults")).json()["down_ranks"]
                resp = await http.post(drain, headers=bearer(ADMIN))
                assert resp.status_code == 200 and resp.json() == {
                    "backend": backend,
                    "rank": int(rank),
                    "draining": True,
                }
                for _ in range(6):  # no new work for the drained rank
                    short = {"model": MODEL, "messages": MSGS, "max_tokens": 2}
                    placed = await http.post(CHAT, json=short, headers=bearer(KEY))
                    assert (
                        placed.status_code == 200 and placed.headers["x-kvrouter-rank"] != f"{backend}@{rank}"
                    )
                rest = first + b"".join([c async for c in chunks])  # the running stream ends normally
            assert rest.rstrip().endswith(b"data: [DONE]") and b'"error"' not in rest
            assert_error(
                await http.post(f"/ranks/{backend}/7/drain", headers=bearer(ADMIN)), 404, "rank_not_found"
            )
            assert_error(await http.post(f"/ranks/{backend}/x/drain", headers=bearer(ADMIN)), 400)
            resp = await http.post(f"/ranks/{backend}/{rank}/undrain", headers=bearer(ADMIN))
            assert resp.json()["draining"] is False
            seen = set()
            for _ in range(4):
                placed = await http.post(
                    CHAT, json={"model": MODEL, "messages": MSGS, "max_tokens": 2}, headers=bearer(KEY)
                )
                seen.add(placed.headers["x-kvrouter-rank"])
            assert len(seen) == 2
            await ledger_zero(http, url, headers=bearer(ADMIN))
        # Without an admin token configured, nobody can drain (the read-only table stays open).
        async with (
            serve_router(backends=[f"sglang={emu.url}"]) as url,
            httpx.AsyncClient(base_url=url) as http,
        ):
            assert_error(
                await http.post("/ranks/sglang-0/0/drain", headers=bearer(ADMIN)), 403, "admin_disabled"
            )
            assert all(r["healthy"] for r in await rank_rows(http, url))


class Sniffer:
    """A TCP relay that records every byte the router sends upstream."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.sent = bytearray()
        self.server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    async def _pipe(self, r: asyncio.StreamReader, w: asyncio.StreamWriter, record: bool) -> None:
        with contextlib.suppress(ConnectionError):
            while data := await r.read(65536):
                if record:
                    self.sent += data
                w.write(data)
                await w.drain()
        w.close()

    async def _handle(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        ur, uw = await asyncio.open_connection("127.0.0.1", self.target_port)
        await asyncio.gather(self._pipe(r, uw, True), self._pipe(ur, w, False))

    async def _accept(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        try:
            await self._handle(r, w)
        finally:
            self._tasks.discard(task)

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[str]:
        self.server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        try:
            yield f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"
        finally:
            self.server.close()
            for task in list(self._tasks):
                task.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)


async def test_client_headers_and_credentials_never_reach_the_engine() -> None:
    with emulator(dp_size=2) as emu:
        sniffer = Sniffer(int(emu.url.rsplit(":", 1)[1]))
        async with (
            sniffer.running() as upstream,
            serve_router(backends=[f"sglang={upstream}"], api_keys=[KEY]) as url,
        ):
            hostile = {**bearer(KEY), **HOSTILE}
            body = {"model": MODEL, "messages": MSGS, "max_tokens": 2, "base_url": "http://evil.example/",
                    "url": "http://evil.example/v1"}  # fmt: skip
            async with httpx.AsyncClient() as http:
                mark = len(sniffer.sent)
                for stream in (False, True):
                    resp = await http.post(url + CHAT, json={**body, "stream": stream}, headers=hostile)
                    assert resp.status_code == 200, resp.text
                await ledger_zero(http, url)
        sent = bytes(sniffer.sent[mark:]).lower()
    assert sent.count(b"post /v1/chat/completions http/1.1") == 2, sent[:500]
    for secret in (KEY, "c00kie-secret", "cHJveHk6c2VjcmV0", "custom-secret", "10.6.6.6", "h2c"):
        assert secret.lower().encode() not in sent, secret
    assert b"host: evil" not in sent and b"x-forwarded" not in sent and b"cookie" not in sent
    assert (
        b"x-data-parallel-rank: 99" not in sent and b"x-data-parallel-rank: " in sent
    )  # only the router's pin


def test_no_route_lets_a_client_choose_an_upstream() -> None:
    paths = set(create_app(Settings()).openapi()["paths"])
    assert paths == {
        "/v1/chat/completions", "/v1/completions", "/generate", "/v1/models", "/health", "/ready", "/ranks",
        "/metrics", "/ranks/{backend}/{rank}/drain", "/ranks/{backend}/{rank}/undrain",
    }  # fmt: skip


async def test_secrets_never_reach_logs_or_metrics_and_an_idle_router_stops_at_once(tmp_path: Path) -> None:
    with emulator(dp_size=2) as emu:
        args = ["--backend", f"sglang={emu.url}", "--api-key", KEY, "--admin-token", ADMIN,
                "--log-level", "debug", "--reconcile-interval", "0.2", "--shutdown-grace", "30"]  # fmt: skip
        with serve_process(args, tmp_path / "serve.log") as router:
            await wait_ready(router.url, timeout_s=30)
            near_miss = KEY[:-2] + "zz"
            async with httpx.AsyncClient(base_url=router.url) as http:
                ok = {"model": MODEL, "messages": MSGS, "max_tokens": 2}
                assert (await http.post(CHAT, json=ok, headers=bearer(KEY))).status_code == 200
                refused = await http.post(CHAT, json=ok, headers=bearer(near_miss))
                assert_error(refused, 401, "invalid_api_key")
                assert near_miss not in refused.text and KEY not in refused.text
                assert_error(await http.post(CHAT, content=b"{bad", headers=bearer(KEY)), 400)
                assert (await http.post("/ranks/sglang-0/1/drain", headers=bearer(ADMIN))).status_code == 200
                assert (
                    await http.post("/ranks/sglang-0/1/undrain", headers=bearer(ADMIN))
                ).status_code == 200
                assert_error(await http.post("/ranks/sglang-0/1/drain", headers=bearer(near_miss)), 403)
                metrics = (await http.get("/metrics")).text
                ranks = (await http.get("/ranks", headers=bearer(ADMIN))).text
                ready = (await http.get("/ready")).text
            router.sigterm()  # nothing in flight: no reason to wait out the 30 s grace period
            t0 = time.monotonic()
            code = await asyncio.to_thread(router.proc.wait, 10)
            assert time.monotonic() - t0 < 3.0 and code in (0, -15), code
            log = router.log()
    assert "kvrouter_requests_total" in metrics and "router.reconcile" in log  # both are real
    for text in (metrics, ranks, ready, log):
        for secret in (KEY, ADMIN, near_miss):
            assert secret not in text
