"""The gateway's HTTP protocol: generation POSTs served from the parser's callbacks, off the ASGI cycle.

uvicorn's httptools protocol turns every request into an ASGI cycle (scope, request/response message
dicts, header validation, a receive/send pair, plus the listener task the proxy needs to learn of a
disconnect): ~25 % of a proxied request's CPU under py-spy (docs/bench.md). Here, once a head is
complete, a POST to a generation route on HTTP/1.1 (no ``Expect``, no ``Upgrade``, no query string) goes
to the proxy through a :class:`~router.gateway.direct.DirectExchange` on the transport, once the lifespan
state holds the proxy. Its body comes from ``on_body``/``on_message_complete``; ``connection_lost``
cancels the request's task directly. Everything else (FastAPI routes, ``/metrics``, HTTP/1.0, ``Expect:
100-continue``) is uvicorn's, unchanged, and reaches the same proxy through ASGI when it is a generation
route (router/gateway/fastpath.py).

uvicorn's machinery is kept where it holds state: the exchange becomes ``self.cycle`` (so pipelining waits
for the answer in progress, ``shutdown()`` closes the connection after it, the keep-alive timer is armed
after it), its task is registered in ``server_state.tasks`` (graceful shutdown waits for it and cancels it
after ``timeout_graceful_shutdown``), and the head limits (431/408) are :class:`HeadLimitedHttpTools`'.

Measured paired against the ASGI path (same tree otherwise, wrk -> nginx, 3 rounds x 4 s, load ~2-3):
c=8 3,212 -> 3,516 req/s, c=64 3,456 -> 3,443 (within noise: placement now dominates); relay at 1,000
streams 27.3k -> 29.2k events/s. py-spy after: parsing + protocol + exchange ~13 % of a proxied request
(half of it the send syscall); in the relay the per-event ``transport.write`` and the loop's reads are
~50 %, i.e. one send and one receive syscall per event.
"""

from __future__ import annotations

import contextvars
from typing import Any

from uvicorn._types import ASGI3Application
from uvicorn.protocols.http.httptools_impl import RequestResponseCycle

from router.backends.base import Route

from .direct import DirectExchange
from .exchange import CONTENT_LENGTH, wanted_headers
from .fastpath import HOT_ROUTES, serve_exchange
from .limits import HeadLimitedHttpTools

_HOT: dict[bytes, Route] = {path.encode(): route for path, route in HOT_ROUTES.items()}


class GatewayHttpProtocol(HeadLimitedHttpTools):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._running: DirectExchange | None = None  # the exchange being answered
        self._asgi_cycle: RequestResponseCycle | None = None  # the last request given to uvicorn's cycle

    def _intercept(self) -> bool:
        route = _HOT.get(self.url)
        if route is None:
            return False
        proxy = self.app_state.get("proxy")
        parser = self.parser
        if (
            proxy is None
            or parser.get_method() != b"POST"
            or parser.get_http_version() != "1.1"
            or self.expect_100_continue
            or parser.should_upgrade()
            or self.root_path
            or self._over_concurrency_limit()
        ):
            return False
        headers = wanted_headers(self.headers)
        declared = headers.get(CONTENT_LENGTH)
        declared_bytes = int(declared) if declared is not None and declared.isdigit() else None
        exchange = DirectExchange(self, proxy, route, headers, parser.should_keep_alive(), declared_bytes)
        previous = self.cycle
        self.cycle = exchange  # type: ignore[assignment]  # duck-typed where uvicorn reads it: direct.py
        if previous is None or previous.response_complete:
            self._start_asgi_task(exchange, self.app)
        else:  # pipelined: waits for the answer in progress, as uvicorn's own requests do
            self.flow.pause_reading()
            self.pipeline.appendleft((exchange, self.app))  # type: ignore[arg-type]
        return True

    def _over_concurrency_limit(self) -> bool:
        """uvicorn answers 503 past ``limit_concurrency``: such a request is left to it."""
        limit = self.limit_concurrency
        return limit is not None and (len(self.connections) >= limit or len(self.tasks) >= limit)

    def _start_asgi_task(self, cycle: RequestResponseCycle | DirectExchange, app: ASGI3Application) -> None:
        if not isinstance(cycle, DirectExchange):
            self._asgi_cycle = cycle
            super()._start_asgi_task(cycle, app)
            return
        if self.config.reset_contextvars:  # as uvicorn's option: no context leaks into the request
            task = self.loop.create_task(self._serve(cycle), context=contextvars.Context())
        else:
            task = self.loop.create_task(self._serve(cycle))
        task.add_done_callback(self.tasks.discard)
        self.tasks.add(task)

    async def _serve(self, exchange: DirectExchange) -> None:
        self._running = exchange
        try:
            await serve_exchange(exchange.proxy, exchange, exchange.route)
        except BaseException as exc:  # as uvicorn's run_asgi: logged, a 500 if nothing was sent, closed
            self.logger.error("Exception in the gateway's data path", exc_info=exc)
            exchange.fail()
        else:
            if not exchange.response_complete and not exchange.disconnected:
                self.logger.error("The data path returned without completing its response.")
                exchange.fail()
        finally:
            if self._running is exchange:
                self._running = None

    def on_body(self, body: bytes) -> None:
        cycle = self.cycle
        if isinstance(cycle, DirectExchange):
            cycle.feed(body)
        else:
            super().on_body(body)

    def on_message_complete(self) -> None:
        cycle = self.cycle
        if isinstance(cycle, DirectExchange):
            cycle.message_complete()
            self._next_head()
        else:
            super().on_message_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._running is not None:
            self._running.lost()
        cycle = self.cycle
        if isinstance(cycle, DirectExchange):
            cycle.lost()
            # uvicorn tells only self.cycle: give it an ASGI request still answering, if any
            asgi = self._asgi_cycle
            self.cycle = asgi if asgi is not None and not asgi.response_complete else None
        super().connection_lost(exc)
