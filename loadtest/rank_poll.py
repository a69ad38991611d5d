"""Sample a live router's per-rank occupancy (``GET /ranks``, DESIGN.md §4) during a run, for plots."""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

import aiohttp


def ranks_occupancy(doc: Any) -> list[int] | None:
    """Tokens in use per rank across all backends: the engine's report when known, else reservations."""
    if not isinstance(doc, dict) or not isinstance(doc.get("backends"), list):
        return None
    out: list[int] = []
    for backend in doc["backends"]:
        for rank in backend.get("ranks", []) if isinstance(backend, dict) else []:
            used = rank.get("engine_used_tokens")
            out.append(int(used if used is not None else rank.get("reserved_tokens", 0)))
    return out


class RankPoller:
    """Polls ``{url}/ranks`` every ``interval_s`` until stopped; failures leave gaps, never errors."""

    def __init__(self, url: str, interval_s: float = 1.0, api_key: str | None = None) -> None:
        self.url = url.rstrip("/").removesuffix("/v1") + "/ranks"
        self.interval_s = interval_s
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.t_s: list[float] = []
        self.used_tokens: list[list[int]] = []
        self.capacity_tokens: list[int] = []

    async def run(self, session: aiohttp.ClientSession, stop: asyncio.Event) -> None:
        t0 = time.perf_counter()
        timeout = aiohttp.ClientTimeout(total=max(self.interval_s, 1.0))
        while not stop.is_set():
            try:
                async with session.get(self.url, headers=self.headers, timeout=timeout) as resp:
                    doc = await resp.json(content_type=None) if resp.status == 200 else None
            except (aiohttp.ClientError, TimeoutError, ValueError):
                doc = None
            used = ranks_occupancy(doc)
            if used:
                self.t_s.append(round(time.perf_counter() - t0, 3))
                self.used_tokens.append(used)
                if not self.capacity_tokens and isinstance(doc, dict):
                    self.capacity_tokens = [
                        int(r.get("capacity_tokens", 0)) for b in doc["backends"] for r in b.get("ranks", [])
                    ]
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self.interval_s)

    def timeseries(self) -> dict[str, Any]:
        return {"t_s": self.t_s, "used_tokens": self.used_tokens, "capacity_tokens": self.capacity_tokens}
