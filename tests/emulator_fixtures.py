"""Start emulated SGLang/vLLM servers in-process for tests (re-exported by tests/conftest.py).

Usage in any test module::

    def test_something(start_emulator):
        emu = start_emulator("sglang", dp_size=4)           # running; stopped at teardown
        httpx.get(emu.url + "/v1/loads")                    # emu.urls: one per rank (vLLM external_lb=True)
        httpx.post(emu.url + "/_emulator/faults", json={"down_ranks": [2]})   # inject faults at runtime
        httpx.get(emu.url + "/_emulator/requests")          # which rank each request ran on

Defaults (override with keyword arguments of :class:`EmulatorSettings`): port 0 (free ports), 4,096 KV
tokens per rank, ``time_scale=0`` (steps as fast as possible), answers of exactly 16 tokens unless
``max_tokens`` is smaller (``output_len_dist="fixed:16"``). Set ``time_scale`` (e.g. 0.05) to keep
requests running long enough to observe them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from loadtest.emulator.app import EmulatorSettings
from loadtest.emulator.host import EmulatorThread

TEST_DEFAULTS: dict[str, Any] = {
    "port": 0,
    "kv_tokens_per_rank": 4096,
    "time_scale": 0.0,
    "output_len_dist": "fixed:16",
}

StartEmulator = Callable[..., EmulatorThread]


@pytest.fixture
def start_emulator() -> Iterator[StartEmulator]:
    """``start_emulator(engine="sglang", dp_size=2, **settings) -> EmulatorThread`` (``.url``, ``.urls``)."""
    started: list[EmulatorThread] = []

    def start(engine: str = "sglang", dp_size: int = 2, **settings: Any) -> EmulatorThread:
        merged = {**TEST_DEFAULTS, **settings}
        emu = EmulatorThread(EmulatorSettings(engine=engine, dp_size=dp_size, **merged))  # type: ignore[arg-type]
        started.append(emu.start())
        return emu

    yield start
    for emu in started:
        emu.stop()
