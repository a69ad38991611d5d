"""Helpers for the observability tests: read an exposition into samples, drive some mixed traffic."""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.parser import text_string_to_metric_families

from router.telemetry_text import render_text

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def parse(text: str) -> Samples:
    """Every sample of an exposition (prometheus_client's own parser: it fails on a malformed line)."""
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            key = (s.name, frozenset(s.labels.items()))
            assert key not in out, f"duplicate sample {key}"
            out[key] = s.value
    return out


def exported_names(text: str) -> set[str]:
    """Sample names of an exposition, plus the names its families would have once they have samples."""
    names: set[str] = set()
    for family in text_string_to_metric_families(text):
        names.update(s.name for s in family.samples)
        suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count")}.get(
            family.type, ("",)
        )
        names.update(family.name + suffix for suffix in suffixes)
    return names


def select(samples: Samples, name: str, **labels: str) -> dict[frozenset[tuple[str, str]], float]:
    """Samples of ``name`` whose labels include ``labels``."""
    want = set(labels.items())
    return {lv: v for (n, lv), v in samples.items() if n == name and want <= lv}


def total(samples: Samples, name: str, **labels: str) -> float:
    return sum(select(samples, name, **labels).values())


def per_rank(samples: Samples, name: str, backend: str) -> dict[int, float]:
    return {int(dict(lv)["rank"]): v for lv, v in select(samples, name, backend=backend).items()}


def sglang_per_rank(samples: Samples, name: str) -> dict[int, float]:
    return {int(dict(lv)["dp_rank"]): v for lv, v in select(samples, name).items()}


async def scrape(url: str) -> tuple[str, Samples]:
    async with httpx.AsyncClient() as http:
        resp = await http.get(url + "/metrics")
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/plain; version=0.0.4")
        return resp.text, parse(resp.text)


async def rank_table(url: str) -> dict[tuple[str, int], Mapping[str, Any]]:
    async with httpx.AsyncClient() as http:
        body = (await http.get(url + "/ranks")).json()
    return {(b["name"], r["rank"]): r for b in body["backends"] for r in b["ranks"]}


async def mixed_traffic(url: str, model: str) -> dict[str, int]:
    """Chat and completions, streamed and not, plus /generate and one refusal; returns what was sent."""
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    sent = {"ok": 0, "streamed": 0, "refused": 0}
    try:
        for stream in (False, True):
            for _ in range(2):
                chat = await client.chat.completions.create(
                    model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=8, stream=stream
                )
                if stream:
                    async for _chunk in chat:  # type: ignore[union-attr]
                        pass
                done = await client.completions.create(
                    model=model, prompt="hello", max_tokens=8, stream=stream
                )
                if stream:
                    async for _chunk in done:  # type: ignore[union-attr]
                        pass
                sent["ok"] += 2
                sent["streamed"] += 2 if stream else 0
        with pytest.raises(openai.BadRequestError):  # more output than any rank holds: too_large
            await client.completions.create(model=model, prompt="x", max_tokens=10**7)
        sent["refused"] += 1
    finally:
        await client.close()
    async with httpx.AsyncClient() as http:
        body = {"text": "hello", "sampling_params": {"max_new_tokens": 8}, "stream": True}
        async with http.stream("POST", url + "/generate", json=body) as resp:
            assert resp.status_code == 200
            async for _ in resp.aiter_bytes():
                pass
    sent["ok"] += 1
    sent["streamed"] += 1
    return sent


async def wait_for(predicate: Any, timeout_s: float = 5.0, step_s: float = 0.05) -> None:
    """Await ``predicate()`` (an async callable returning bool) until true, or fail after ``timeout_s``."""
    for _ in range(int(timeout_s / step_s)):
        if await predicate():
            return
        await asyncio.sleep(step_s)
    raise AssertionError(f"condition not met within {timeout_s} s")


def promtool() -> str:
    """The promtool binary, or a loud skip (.ci/run installs it from Debian's prometheus package)."""
    path = shutil.which("promtool")
    if path is None:
        pytest.skip(
            "SKIPPED LOUDLY: promtool not found; install it with "
            "`apt-get update && apt-get install -y prometheus` to check metrics, rules and config"
        )
    return path


def per_worker_requests(metrics_dir: Path, tmp: Path) -> list[float]:
    """kvrouter_requests_total as each ``--workers N`` process alone counted it (its own multiprocess
    files), one directory per worker made under ``tmp``."""
    counts = []
    tmp.mkdir(exist_ok=True)
    for pid in sorted({p.stem.rsplit("_", 1)[1] for p in metrics_dir.glob("counter_*.db")}):
        alone = tmp / f"worker-{pid}"
        alone.mkdir()
        for db in metrics_dir.glob(f"*_{pid}.db"):
            (alone / db.name).write_bytes(db.read_bytes())
        registry = CollectorRegistry()
        MultiProcessCollector(registry, path=str(alone))  # type: ignore[no-untyped-call]
        counts.append(total(parse(render_text(registry).decode()), "kvrouter_requests_total"))
    return counts
