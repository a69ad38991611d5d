"""Open N concurrent SSE streams and count the events that arrive (raw asyncio: a cheap client).

``python -m loadtest.bench.sse_client --url http://127.0.0.1:P --streams 1000 --tokens 300 --model M``
prints one JSON line: events, elapsed_s (first request to last ``[DONE]``), completed, failed, and the
median time to the first event.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from typing import cast
from urllib.parse import urlsplit

import orjson

_MARK = b"data: {"
_DONE = b"[DONE]"
_CARRY = 8
SAMPLE_S = 0.05


class Stream(asyncio.Protocol):
    def __init__(self, request: bytes, done: asyncio.Future[bool]) -> None:
        self.request = request
        self.done = done
        self.events = 0
        self.tail = b""
        self.first_event_s: float | None = None
        self.started_s = time.monotonic()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's transports are not subclasses
        self.transport.write(self.request)

    def data_received(self, data: bytes) -> None:
        window = self.tail + data
        n = window.count(_MARK)
        if n and self.first_event_s is None:
            self.first_event_s = time.monotonic()
        self.events += n
        if _DONE in window and not self.done.done():
            self.done.set_result(True)
            self.transport.close()
        self.tail = data[-_CARRY:]

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.done.done():
            self.done.set_result(False)


async def _sample(protos: list[Stream], out: list[tuple[float, int]]) -> None:
    while True:
        out.append((time.monotonic(), sum(p.events for p in protos)))
        await asyncio.sleep(SAMPLE_S)


def steady_rate(samples: list[tuple[float, int]]) -> float:
    """Events/s between 10 % and 90 % of all events: stream setup and the last stragglers left out."""
    if len(samples) < 2 or samples[-1][1] == 0:
        return float("nan")
    total = samples[-1][1]
    t10 = next(t for t, n in samples if n >= 0.1 * total)
    n10 = next(n for t, n in samples if n >= 0.1 * total)
    t90, n90 = next((t, n) for t, n in samples if n >= 0.9 * total)
    return (n90 - n10) / (t90 - t10) if t90 > t10 else float("nan")


def build_request(host: str, port: int, model: str, tokens: int) -> bytes:
    body = orjson.dumps({
        "model": model, "messages": [{"role": "user", "content": "Stream to the benchmark."}],
        "max_tokens": tokens, "stream": True,
    })  # fmt: skip
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}:{port}\r\n"
            "Content-Type: application/json\r\nAccept: text/event-stream\r\nConnection: close\r\n"
            f"Content-Length: {len(body)}\r\n\r\n")  # fmt: skip
    return head.encode() + body


async def run(url: str, streams: int, tokens: int, model: str, timeout_s: float) -> dict[str, float]:
    parts = urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    request = build_request(host, port, model, tokens)
    loop = asyncio.get_running_loop()
    protos: list[Stream] = []
    t0 = time.monotonic()
    for _ in range(streams):
        fut: asyncio.Future[bool] = loop.create_future()
        _, proto = await loop.create_connection(lambda f=fut: Stream(request, f), host, port)  # type: ignore[misc]
        protos.append(proto)
    samples: list[tuple[float, int]] = []
    sampler = asyncio.create_task(_sample(protos, samples))
    try:
        results = await asyncio.wait_for(asyncio.gather(*(p.done for p in protos)), timeout_s)
    except TimeoutError:
        results = [p.done.done() and not p.done.cancelled() and p.done.result() for p in protos]
    elapsed = time.monotonic() - t0
    sampler.cancel()
    samples.append((time.monotonic(), sum(p.events for p in protos)))
    first = [p.first_event_s - p.started_s for p in protos if p.first_event_s is not None]
    return {
        "events": float(sum(p.events for p in protos)),
        "elapsed_s": elapsed,
        "steady_events_per_s": steady_rate(samples),
        "completed": float(sum(1 for r in results if r)),
        "failed": float(sum(1 for r in results if not r)),
        "first_event_p50_ms": statistics.median(first) * 1000 if first else float("nan"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--url", required=True)
    parser.add_argument("--streams", type=int, default=100)
    parser.add_argument("--tokens", type=int, default=300)
    parser.add_argument("--model", default="deepseek-ai/DeepSeek-V3")
    parser.add_argument("--timeout-s", type=float, default=120.0)
    args = parser.parse_args()
    coro = run(args.url, args.streams, args.tokens, args.model, args.timeout_s)
    try:
        import uvloop

        out = uvloop.run(coro)
    except ImportError:
        out = asyncio.run(coro)
    print(orjson.dumps(out).decode(), flush=True)


if __name__ == "__main__":
    main()
