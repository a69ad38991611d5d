"""Graceful shutdown of a real ``kvrouter serve`` process: SIGTERM closes admission (503, /ready false),
a short stream finishes, a long one is cut after the grace period with an in-band error, the engine is
left holding nothing, and the process exits on its own."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import aiohttp
import orjson
import pytest
from gateway_support import MODEL, emulator
from test_hardening_support import serve_process, wait_ready

pytestmark = pytest.mark.anyio

GRACE_S = 1.5


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def stream_body(tokens: int) -> bytes:
    return orjson.dumps({"model": MODEL, "prompt": "x", "max_tokens": tokens, "stream": True,
                         "emulator_output_tokens": tokens})  # fmt: skip


async def read_all(resp: aiohttp.ClientResponse) -> bytes:
    return await resp.content.read()


async def test_sigterm_drains_then_cuts_then_exits(tmp_path: Path) -> None:
    # Real time: ~30 ms per engine step, so 20 tokens end well within the grace period, 3,000 never do.
    with emulator(dp_size=2, time_scale=1.0, kv_tokens_per_rank=8192) as emu:
        args = ["--backend", f"sglang={emu.url}", "--shutdown-grace", str(GRACE_S),
                "--reconcile-interval", "0.2", "--log-level", "info"]  # fmt: skip
        with serve_process(args, tmp_path / "serve.log") as router:
            await wait_ready(router.url, timeout_s=30)
            async with aiohttp.ClientSession() as session:
                url = router.url + "/v1/completions"
                short = await session.post(url, data=stream_body(20))
                long = await session.post(url, data=stream_body(3000))
                assert short.status == 200 and long.status == 200
                await short.content.readany()
                await long.content.readany()
                short_rest = asyncio.create_task(read_all(short))
                long_rest = asyncio.create_task(read_all(long))
                router.sigterm()
                t0 = time.monotonic()
                await asyncio.sleep(0.2)
                # Admission is closed but the listener is still there: clear answers, not refusals.
                async with session.get(router.url + "/ready") as ready:
                    assert ready.status == 503 and (await ready.json())["shutting_down"] is True
                new = {"model": MODEL, "prompt": "x", "max_tokens": 2}
                async with session.post(url, data=orjson.dumps(new)) as refused:
                    assert refused.status == 503 and refused.headers["Retry-After"] == "1"
                    assert (await refused.json())["error"]["code"] == "shutting_down"
                short_body = await short_rest
                assert short_body.rstrip().endswith(b"data: [DONE]") and b'"error"' not in short_body
                assert time.monotonic() - t0 < GRACE_S  # finished within the grace period, uncut
                long_body = await long_rest
                cut_after_s = time.monotonic() - t0
                assert b"shutting down" in long_body and long_body.rstrip().endswith(b"data: [DONE]")
                assert GRACE_S - 0.1 < cut_after_s < GRACE_S + 2.0, cut_after_s
            code = await asyncio.to_thread(router.proc.wait, 10)
            assert time.monotonic() - t0 < GRACE_S + 5.0
            assert code in (0, -15), code
            async with aiohttp.ClientSession() as session:
                stats = await (await session.get(emu.url + "/_emulator/stats")).json()
            log = router.log()
            assert "2 in flight at SIGTERM, 1 cut after the grace period, 0 left" in log, log[-2000:]
            assert "Traceback" not in log, log[-2000:]
    assert stats["inflight"] == 0, stats  # the cut request was aborted upstream, not left running
