"""The data path keeps one kept-alive connection per engine when answers end well, whatever their shape.

A request that asked to stream but got a whole JSON answer (an engine that ignores ``stream``, or an error
it reports as JSON) is read to its end and its connection goes back to the pool: nothing is leaked, and
the next request reuses the connection instead of opening another.
"""

from __future__ import annotations

import httpx
import pytest
from backends_fakes import MODEL, FakeSGLang, serve
from gateway_support import ranks_settled, router

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.mark.parametrize("stream", [True, False])
async def test_whole_answers_reuse_one_upstream_connection(stream: bool) -> None:
    fake = FakeSGLang(dp=2)
    async with serve(fake.app()) as engine, router(backends=[f"sglang={engine}"]) as url:
        async with httpx.AsyncClient(timeout=10) as http:
            for _ in range(6):  # sequential: each answer ends before the next request leaves
                body = {"model": MODEL, "prompt": "hello", "max_tokens": 4, "stream": stream}
                resp = await http.post(url + "/v1/completions", json=body)
                assert resp.status_code == 200, resp.text
                assert resp.json()["choices"][0]["text"] == "x"
        rows = await ranks_settled(url)
    assert len(fake.peer_ports) == 6
    assert len(set(fake.peer_ports)) == 1, fake.peer_ports  # one connection, reused six times
    assert all(r["reserved_tokens"] == 0 and r["inflight"] == 0 for r in rows), rows
