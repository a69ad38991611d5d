"""Shared fixtures. ``redis_url``: one real redis-server per test session on a free loopback port.
``start_emulator``: in-process emulated SGLang/vLLM servers (see tests/emulator_fixtures.py)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from emulator_fixtures import start_emulator  # noqa: F401  (a fixture, re-exported for every test module)

from loadtest.bench.redis_proc import RedisServer, redis_server_binary


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    """A throwaway redis-server (no persistence); tests isolate themselves by ledger namespace."""
    if redis_server_binary() is None:
        pytest.skip("SKIPPED LOUDLY: no redis-server binary on PATH; install it to run the Redis tests")
    with RedisServer() as server:
        yield server.url
