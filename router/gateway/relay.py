"""The streaming relay: upstream SSE bytes to the client, chunk by chunk, never re-parsing events.

Generated tokens are counted cheaply per chunk: the number of ``data: {`` events, less the OpenAI chat
role chunks (one per choice, before any token: ``delta.role`` and empty content, in SGLang and vLLM alike),
replaced by the engine's own cumulative ``completion_tokens`` whenever a chunk carries one (SGLang
``/generate`` meta_info on every event, the OpenAI usage chunk at the end), which is exact and may correct
the estimate downwards. The counts feed the ledger in batches, not per event.

A client that goes away cancels the request's task (the exchange's watch: router/gateway/exchange.py);
the relay then closes the upstream connection (both engines abort a request whose connection closes) and
asks the backend to abort by id. Whatever ends the stream, the flight is finished (its reservation
released) exactly once.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import time
from typing import TYPE_CHECKING

from router.telemetry import observe_spread
from router.upstream import UpstreamError, UpstreamReadError, UpstreamResponse

from .errors import sse_error_event

if TYPE_CHECKING:
    from .exchange import Exchange
    from .flight import Flight
    from .runtime import Gateway

REPORT_EVERY_TOKENS = 64
CHAT_ROUTE = "/v1/chat/completions"
_COMPLETION_TOKENS = b'"completion_tokens":'
_DIGITS = re.compile(rb"\s*(\d+)")
SSE_HEADERS = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),
]


def last_completion_tokens(chunk: bytes) -> int | None:
    """The last cumulative ``completion_tokens`` value in a chunk, if any (no JSON parsing)."""
    at = chunk.rfind(_COMPLETION_TOKENS)
    if at < 0:
        return None
    m = _DIGITS.match(chunk, at + len(_COMPLETION_TOKENS))
    return int(m.group(1)) if m else None


def sum_completion_tokens(body: bytes) -> int:
    """Generated tokens of a non-streamed body (one or a batch of results)."""
    total = 0
    start = 0
    while (at := body.find(_COMPLETION_TOKENS, start)) >= 0:
        start = at + len(_COMPLETION_TOKENS)
        m = _DIGITS.match(body, start)
        if m:
            total += int(m.group(1))
    return total


def count_chunk(flight: Flight, chunk: bytes) -> int:
    """New generated tokens seen in ``chunk`` (relative to what the flight counted so far). Negative when the
    engine's exact count corrects the event estimate (an SGLang finish chunk carries no token)."""
    exact = last_completion_tokens(chunk) if _COMPLETION_TOKENS in chunk else None
    if exact is not None:
        return exact - flight.generated_tokens
    events = chunk.count(b"data: {")
    if flight.role_events and events:  # the chat role chunks come first and carry no token
        skipped = min(events, flight.role_events)
        flight.role_events -= skipped
        events -= skipped
    return events


class RelayResponse:
    """Streams an already-opened upstream response to the client; owns the flight's end from here on."""

    def __init__(
        self,
        gateway: Gateway,
        flight: Flight,
        upstream: UpstreamResponse,
        first_chunk: bytes,
        extra_headers: list[tuple[bytes, bytes]],
    ) -> None:
        self._gw = gateway
        self._flight = flight
        self._upstream = upstream
        flight.cut = self._cut
        flight.role_events = flight.sized.sequences if flight.route == CHAT_ROUTE else 0
        self._first = first_chunk
        self._raw = SSE_HEADERS + extra_headers

    async def __call__(self, exchange: Exchange) -> None:
        gw, flight = self._gw, self._flight
        try:
            await exchange.start(200, self._raw)
            await self._pump(exchange)
            flight.outcome = "ok"
            if flight.key is not None:  # served to the end: the rank's breaker closes
                gw.store.report_upstream(flight.key, True)
        except asyncio.CancelledError:
            if not exchange.absorb():
                flight.outcome = "cancelled"
                raise
            flight.outcome = "client_disconnect"
        except (UpstreamError, TimeoutError) as exc:
            flight.outcome = "upstream_timeout" if isinstance(exc, TimeoutError) else "upstream_error"
            kind = "stream_timeout" if isinstance(exc, TimeoutError) else "stream_broken"
            gw.metrics.upstream_errors.labels(_backend(flight), kind).inc()
            if gw.queue.closed:  # shutdown cut the upstream after its grace period (gateway/shutdown.py)
                flight.outcome = "shutdown"
            elif flight.key is not None:  # the rank died mid-stream: its breaker counts it
                gw.store.report_upstream(flight.key, False, f"stream broken: {type(exc).__name__}")
            await self._fail(exchange, exc)
        finally:
            exchange.unwatch()
            await self._close_upstream(gw, flight)
            await gw.finish(flight, 200)

    async def _pump(self, exchange: Exchange) -> None:
        gw, flight = self._gw, self._flight
        load = gw.load
        itl = gw.metrics.itl_of(flight.route, flight.model)
        last_token_s: float | None = None  # arrival of the previous chunk that carried tokens
        chunk = self._first
        read_chunk = self._upstream.read_chunk
        while chunk:
            new = count_chunk(flight, chunk)
            if new:  # negative: the engine's exact count corrects events that carried no token
                flight.on_tokens(load, new)
            if new > 0:
                now_s = time.perf_counter()
                if last_token_s is not None:
                    observe_spread(itl, now_s - last_token_s, new)
                last_token_s = now_s
                batch = flight.generated_tokens - flight.reported_tokens >= REPORT_EVERY_TOKENS
                if batch or flight.generated_tokens >= flight.grow_at_tokens:  # or growth due (predicted)
                    await gw.report_tokens(flight)
            await exchange.write(chunk)
            chunk = await read_chunk()
        await exchange.end()

    async def _fail(self, exchange: Exchange, exc: BaseException) -> None:
        """Upstream died mid-stream: tell the client in-band, as the engines do, and end the stream."""
        what = "timed out" if isinstance(exc, TimeoutError) else f"failed: {type(exc).__name__}"
        message = f"upstream {what} after the stream started"
        if self._flight.outcome == "shutdown":
            message = "the router is shutting down: the stream was cut after its grace period"
        with contextlib.suppress(OSError):
            await exchange.end(sse_error_event(message, "upstream_error"))

    def _cut(self) -> None:
        """Wake the pump with an error; the relay's ``finally`` then drops the connection."""
        self._upstream.fail(UpstreamReadError("cut by the router's shutdown"))

    async def _close_upstream(self, gw: Gateway, flight: Flight) -> None:
        upstream = self._upstream
        if flight.outcome == "ok" and upstream.at_eof:
            upstream.release()  # keep-alive: the connection goes back to the pool
            return
        upstream.close()  # drops the connection: the engine aborts the request
        gw.abort_upstream(flight)


def _backend(flight: Flight) -> str:
    return flight.key.backend if flight.key is not None else ""
