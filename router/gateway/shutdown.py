"""Graceful shutdown: on SIGTERM stop admitting, let in-flight requests finish, abort the rest, release.

uvicorn on its own closes the listening socket at once (a new request is refused at TCP, not answered),
then waits for open requests and finally cancels them. In front of GPUs we want the load balancer to see
a clear answer while its endpoint list catches up, and every reservation back in the ledger:

1. admission closes: ``/ready`` turns 503, every new or queued request is answered 503
   ``shutting_down`` (with ``Retry-After``), the listener stays open;
2. in-flight requests run to completion for up to ``shutdown_grace_s``;
3. what is left is cut: the upstream connections close (both engines abort a request whose connection
   closes; SGLang is also sent ``/abort_request``), streams end with an in-band error event and
   ``[DONE]``, and every flight is released;
4. then uvicorn's own shutdown runs (listener closed, lifespan stop releases anything still held).

A second SIGTERM/SIGINT skips what is left of the grace period.
"""

from __future__ import annotations

import asyncio
import logging
import math
import signal
from dataclasses import dataclass
from types import FrameType
from typing import Any

import uvicorn

from .runtime import Gateway

log = logging.getLogger(__name__)

SETTLE_S = 2.0  # after the cut: for the relays to send their error events and release
POLL_S = 0.05


@dataclass(frozen=True, slots=True)
class DrainReport:
    inflight_at_start: int
    cut_after_grace: int  # still running when the grace period ended
    left_after_cut: int  # not ended by the cut either (released by the lifespan stop)


async def _wait_idle(gw: Gateway, timeout_s: float) -> None:
    loop = asyncio.get_running_loop()
    deadline_s = loop.time() + timeout_s
    while gw.flights and loop.time() < deadline_s:  # noqa: ASYNC110 (flights have no change event)
        await asyncio.sleep(min(POLL_S, max(0.0, deadline_s - loop.time())))


async def drain_gateway(gw: Gateway, grace_s: float, settle_s: float = SETTLE_S) -> DrainReport:
    """Steps 1-3 above; returns what happened (also logged)."""
    gw.queue.close()
    start = len(gw.flights)
    log.info("shutdown: admission closed, %d request(s) in flight, grace %.1f s", start, grace_s)
    await _wait_idle(gw, grace_s)
    cut = len(gw.flights)
    if cut:
        log.warning("shutdown: grace period over, aborting %d request(s) upstream", cut)
        for flight in list(gw.flights.values()):
            if flight.cut is not None:  # a stream: it ends with an in-band error, closes and aborts upstream
                flight.cut()
            else:  # not streaming yet: SGLang aborts by id; what is left is cancelled by uvicorn and released
                gw.abort_upstream(flight)
        await _wait_idle(gw, settle_s)
    report = DrainReport(start, cut, len(gw.flights))
    log.info(
        "shutdown: drained (%d in flight at SIGTERM, %d cut after the grace period, %d left)",
        report.inflight_at_start,
        report.cut_after_grace,
        report.left_after_cut,
    )
    return report


class GracefulServer(uvicorn.Server):
    """A uvicorn server whose first SIGTERM/SIGINT drains the gateway (:func:`drain_gateway`) first."""

    def __init__(self, config: uvicorn.Config, grace_s: float, settle_s: float = SETTLE_S) -> None:
        super().__init__(config)
        self.grace_s = grace_s
        self.settle_s = settle_s
        self.drain_report: DrainReport | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_started = False
        self._drain_task: asyncio.Task[None] | None = None

    async def serve(self, sockets: Any = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def _gateway(self) -> Gateway | None:
        state = getattr(getattr(self, "lifespan", None), "state", None)
        gw = state.get("gateway") if isinstance(state, dict) else None
        return gw if isinstance(gw, Gateway) else None

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        gw = self._gateway()
        if self._drain_started or self.should_exit or gw is None or self._loop is None:
            super().handle_exit(sig, frame)  # a second signal, or nothing to drain: uvicorn's own path
            return
        self._drain_started = True
        # A signal handler runs between two bytecodes of the loop's thread: only hand the work over.
        self._loop.call_soon_threadsafe(self._start_drain, gw, sig)

    def _start_drain(self, gw: Gateway, sig: int) -> None:
        self._drain_task = asyncio.ensure_future(self._drain(gw, sig))

    async def _drain(self, gw: Gateway, sig: int) -> None:
        try:
            self.drain_report = await drain_gateway(gw, self.grace_s, self.settle_s)
        finally:
            # Drained: uvicorn's own shutdown only has finished responses left to wait for.
            self.config.timeout_graceful_shutdown = math.ceil(self.settle_s)
            super().handle_exit(sig if sig in (signal.SIGTERM, signal.SIGINT) else signal.SIGTERM, None)
