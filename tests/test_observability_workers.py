"""``kvrouter serve --workers 2`` behind one port exposes one consistent /metrics: a scrape lands on either
worker, and every scrape shows the counts of both (prometheus_client multiprocess files), not the half
that one worker saw."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
from gateway_support import MODEL
from observability_support import parse, per_rank, per_worker_requests, total

BIN = Path(sys.executable).parent
REQUESTS = 24
REDIS_DB = 11  # a database of the session's redis-server no other test uses


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def two_workers(start_emulator: Any, redis_url: str, tmp_path: Path) -> Iterator[tuple[str, Path]]:
    emu = start_emulator("sglang", dp_size=2)
    ledger_url = redis_url.rsplit("/", 1)[0] + f"/{REDIS_DB}"
    with redis.Redis.from_url(ledger_url) as r:
        r.flushdb()
    metrics_dir = tmp_path / "metrics"
    port = free_port()
    argv = [str(BIN / "kvrouter"), "serve", "--workers", "2", "--port", str(port), "--backend",
            f"sglang={emu.url}", "--redis-url", ledger_url, "--reconcile-interval", "0.2",
            "--log-level", "warning"]  # fmt: skip
    log = (tmp_path / "router.log").open("wb")
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(metrics_dir)}
    proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline_s = time.monotonic() + 60
        while True:
            assert proc.poll() is None, (tmp_path / "router.log").read_text()
            try:
                if httpx.get(url + "/ready", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline_s, "router workers never became ready"
            time.sleep(0.1)
        yield url, metrics_dir
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def test_every_scrape_shows_both_workers(two_workers: tuple[str, Path], tmp_path: Path) -> None:
    url, metrics_dir = two_workers
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 4}
    for _ in range(REQUESTS):  # a new connection each time: the kernel hands them to either worker
        with httpx.Client(headers={"Connection": "close"}) as http:
            assert http.post(url + "/v1/completions", json=body).status_code == 200
    seen = []
    for _ in range(10):
        with httpx.Client(headers={"Connection": "close"}) as http:
            m = parse(http.get(url + "/metrics").text)
        seen.append(
            (
                total(m, "kvrouter_requests_total", code="200"),
                total(m, "kvrouter_placements_total"),
                total(m, "kvrouter_request_duration_seconds_count"),
                total(m, "kvrouter_queue_depth"),
                tuple(sorted(per_rank(m, "kvrouter_rank_capacity_tokens", "sglang-0").items())),
            )
        )
    assert set(seen) == {(REQUESTS, REQUESTS, REQUESTS, 0, ((0, 4096.0), (1, 4096.0)))}
    workers = per_worker_requests(metrics_dir, tmp_path)
    assert len(workers) == 2 and sum(workers) == REQUESTS
    print(f"requests per worker: {workers}")  # both usually non-zero: each scrape summed them anyway
