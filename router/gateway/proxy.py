"""One proxied request, steps 1-6 of DESIGN §3: parse, size, place, forward pinned, relay, release.

The body is parsed once (orjson), client rank pins are dropped, the router's pin and output limit are set,
and it is serialised once per attempt. Retries move to another rank only before the client saw a byte:
connect errors, 5xx, or a stream that ended before its first chunk.
"""

from __future__ import annotations

import asyncio
import os
import time
from dataclasses import dataclass
from typing import Any

import orjson

from router.backends.base import BackendError, Route
from router.placement.snapshot import RankKey, RequestShape
from router.sizing import SizingError
from router.upstream import UpstreamError, UpstreamResponse

from .auth import check_bearer
from .errors import ApiError, upstream_error_body
from .exchange import AUTHORIZATION, JSON_TYPE, ClientLeft, Exchange, Headers, Reply, error_reply, media_type
from .flight import Flight
from .output_plan import output_hint, plan_request
from .placement import CandidateCache, Candidates
from .relay import RelayResponse, sum_completion_tokens
from .runtime import Gateway

# Client-supplied rank pins and engine request ids: no client ever chooses a rank (an out-of-range rank
# crashes older SGLang servers) or collides with the ids the router gives the engine.
STRIPPED_FIELDS = ("routed_dp_rank", "data_parallel_rank", "disagg_prefill_dp_rank", "rid")
MAX_ERROR_BODY_BYTES = 4096
NOT_ACTIVE = b"is not active"  # SGLang's "DP rank R is not active." (elastic EP, a rank taken down)


@dataclass(slots=True)
class Buffered:
    status: int
    body: bytes
    content_type: str


@dataclass(slots=True)
class Streaming:
    upstream: UpstreamResponse
    first_chunk: bytes


class RetryableUpstream(Exception):
    """This rank failed before the first byte: try another. ``kind`` labels kvrouter_upstream_errors_total."""

    def __init__(self, message: str, kind: str) -> None:
        super().__init__(message)
        self.kind = kind


def parse_json(body: bytes) -> dict[str, Any]:
    try:
        payload = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise ApiError(400, f"Request body is not valid JSON: {exc.msg}", code="invalid_json") from None
    if not isinstance(payload, dict):
        raise ApiError(400, "Request body must be a JSON object.", code="invalid_request")
    return payload


def validate(route: Route, payload: dict[str, Any]) -> str | None:
    """Checks the sizer does not do; returns the requested model (None: /generate without one)."""
    for name in STRIPPED_FIELDS:
        payload.pop(name, None)
    if "stream" in payload and not isinstance(payload["stream"], bool | None):
        # Checked on every route: a truthy non-bool would stream upstream but be buffered here.
        raise ApiError(400, "'stream' must be a boolean.", code="invalid_request", param="stream")
    options = payload.get("stream_options")
    if options is not None and (
        not isinstance(options, dict) or not all(isinstance(v, bool | None) for v in options.values())
    ):
        raise ApiError(
            400,
            "'stream_options' must be an object of booleans, e.g. {\"include_usage\": true}.",
            code="invalid_request",
            param="stream_options",
        )
    model = payload.get("model")
    if model is None and route == "/generate":
        return None
    if not isinstance(model, str) or not model:
        raise ApiError(
            400, "'model' is required and must be a non-empty string.", code="invalid_request", param="model"
        )
    return model


def set_output_limit(route: Route, payload: dict[str, Any], tokens: int) -> None:
    """Write the output limit the reservation assumed, so the engine cannot exceed it."""
    if route == "/generate":
        params = payload.get("sampling_params")
        if not isinstance(params, dict):
            params = payload["sampling_params"] = {}
        params["max_new_tokens"] = tokens
    elif "max_completion_tokens" in payload and payload["max_completion_tokens"] is not None:
        payload["max_completion_tokens"] = tokens
    else:
        payload["max_tokens"] = tokens


class Proxy:
    def __init__(self, gateway: Gateway) -> None:
        self.gw = gateway
        self._candidates = CandidateCache(gateway.store)

    async def serve(self, exchange: Exchange, route: Route) -> None:
        """The whole request; every refusal is counted once, as a rejection and as an answered request."""
        try:
            reply = await self._handle(exchange, route)
        except ApiError as exc:
            self.gw.metrics.rejections.labels(exc.code).inc()
            if not exc.counted:  # refused before a flight existed: nothing else counted it
                self.gw.metrics.requests.labels(route, str(exc.status), "").inc()
            reply = error_reply(exc)
        except ClientLeft:
            return
        await reply(exchange)

    async def _handle(self, exchange: Exchange, route: Route) -> Reply | RelayResponse:
        """Everything up to the answer; the flight is finished (released) before a whole answer is sent, and
        by the relay once a stream ends."""
        gw = self.gw
        headers = exchange.headers
        check_bearer(headers.get(AUTHORIZATION, ""), gw.settings)
        payload = parse_json(await exchange.body(gw.settings.max_body_bytes))
        model = validate(route, payload)
        cands = self._candidates.get(route, model)
        try:
            sized = gw.sizer.size(route, payload, cands.context_tokens, cands.capacity_tokens)
        except SizingError as exc:
            raise ApiError(400, str(exc), code=exc.code, param=exc.param) from None
        set_output_limit(route, payload, sized.output_limit_tokens)  # the client's limit, not the prediction
        stream = payload.get("stream") is True
        plan = plan_request(gw.book, route, model or "", sized, output_hint(headers), stream)
        output_tokens = sized.output_tokens if plan is None else plan.output_tokens * sized.sequences
        shape = RequestShape(sized.prompt_tokens, output_tokens, entropy=gw.placer.entropy())
        flight = Flight(os.urandom(16).hex(), route, sized, shape, stream, model=model or "", plan=plan)
        gw.begin(flight)
        handed_off = False
        status = 500
        exchange.watch()  # a client that leaves from here on cancels this task
        try:
            result = await self._forward(flight, payload, cands)
            status = result.status if isinstance(result, Buffered) else 200
            if isinstance(result, Streaming):
                handed_off = True
                return RelayResponse(gw, flight, result.upstream, result.first_chunk, _rank_header(flight))
            flight.on_tokens(gw.load, sum_completion_tokens(result.body) if status == 200 else 0)
            if status >= 400:  # the engine refused: its words, in the one error shape clients parse
                body = upstream_error_body(status, result.body)
                return Reply(status, body, _rank_header(flight), JSON_TYPE)
            return Reply(status, result.body, _rank_header(flight), media_type(result.content_type))
        except ApiError as exc:
            status = exc.status
            flight.outcome = exc.code
            exc.counted = True
            raise
        except asyncio.CancelledError:
            if not exchange.absorb():
                raise
            flight.outcome = "client_disconnect"
            status = 499
            gw.abort_upstream(flight)
            return Reply(499, b"", [], None)
        finally:
            if not handed_off:
                exchange.unwatch()
                await gw.finish(flight, status)

    async def _forward(
        self, flight: Flight, payload: dict[str, Any], cands: Candidates
    ) -> Buffered | Streaming:
        gw = self.gw
        tried: list[RankKey] = []
        last = "no attempt"
        for attempt in range(gw.settings.retry_attempts):
            key = await gw.placer.place(flight, cands.keys, exclude=tried)
            try:
                result = await self._attempt(flight, payload, key, attempt)
            except ApiError as exc:
                if exc.code == "upstream_timeout":
                    gw.store.report_upstream(key, False, "no answer in time")
                raise
            except RetryableUpstream as exc:
                gw.store.report_upstream(key, False, str(exc))  # the rank's breaker (telemetry_store)
                last = f"{key}: {exc}"
                tried.append(key)
                gw.metrics.upstream_errors.labels(key.backend, exc.kind).inc()
                if attempt + 1 < gw.settings.retry_attempts:
                    gw.metrics.retries.labels(key.backend).inc()
                await gw.unplace(flight)
            else:
                if isinstance(result, Buffered):  # a stream counts as served once it ends well (relay)
                    gw.store.report_upstream(key, True)
                return result
        raise ApiError(502, f"Upstream failed on {len(tried)} rank(s); last: {last}", code="upstream_error")

    async def _attempt(
        self, flight: Flight, payload: dict[str, Any], key: RankKey, attempt: int
    ) -> Buffered | Streaming:
        gw = self.gw
        backend = gw.backends[key.backend]
        try:
            up = backend.upstream(key.rank, flight.route)  # type: ignore[arg-type]
        except BackendError as exc:
            raise RetryableUpstream(str(exc), "rank_unavailable") from None
        for name in STRIPPED_FIELDS:  # a retry may go to another backend: drop the last attempt's pin
            payload.pop(name, None)
        payload.update(up.body_fields)
        if backend.spec.engine == "sglang" and flight.sized.sequences == 1:
            flight.rid = payload["rid"] = f"{flight.request_id}-{attempt}"
        headers = [
            (b"content-type", b"application/json"),
            (b"x-request-id", flight.request_id.encode()),
            *[(k.encode("latin-1"), v.encode("latin-1")) for k, v in up.headers.items()],  # rank pin
        ]
        assert gw.upstream is not None
        try:
            resp = await gw.upstream.post(up.url, orjson.dumps(payload), headers, gw.upstream_timeout_s)
        except UpstreamError as exc:  # refused, unreachable, connect timeout, or dropped before the headers
            raise RetryableUpstream(f"connect: {type(exc).__name__}", "connect") from None
        except TimeoutError:
            gw.metrics.upstream_errors.labels(key.backend, "timeout").inc()
            raise ApiError(504, "Upstream did not answer in time.", code="upstream_timeout") from None
        return await self._read_start(flight, resp)

    async def _read_start(self, flight: Flight, resp: UpstreamResponse) -> Buffered | Streaming:
        gw = self.gw
        streaming = False  # set once the relay owns the response (and releases it)
        try:
            if resp.status >= 500:
                detail = (await resp.read(MAX_ERROR_BODY_BYTES)).decode("utf-8", "replace")
                raise RetryableUpstream(f"HTTP {resp.status}: {detail[:200]}", "http_5xx")
            ctype = resp.content_type or "application/json"
            if resp.status != 200 or not flight.stream or "text/event-stream" not in ctype:
                body = await resp.read()
                if resp.status == 400 and NOT_ACTIVE in body:  # SGLang: the rank is down, not the request
                    raise RetryableUpstream(
                        f"HTTP 400: {body[:200].decode('utf-8', 'replace')}", "not_active"
                    )
                _first_byte(gw, flight, streamed=False)
                return Buffered(resp.status, body, ctype)
            first = await resp.read_chunk()
            if not first:
                raise RetryableUpstream("stream ended before its first byte", "empty_stream")
            _first_byte(gw, flight, streamed=True)
            streaming = True
            return Streaming(resp, first)
        except UpstreamError as exc:
            resp.close()
            raise RetryableUpstream(f"{type(exc).__name__} before the first byte", "read") from None
        except TimeoutError:
            resp.close()
            if flight.key is not None:
                gw.metrics.upstream_errors.labels(flight.key.backend, "timeout").inc()
            raise ApiError(504, "Upstream did not answer in time.", code="upstream_timeout") from None
        except BaseException:
            resp.close()
            raise
        finally:
            if not streaming:  # no-op after close(); else pooled when read to its end
                resp.release()


def _first_byte(gw: Gateway, flight: Flight, streamed: bool) -> None:
    flight.on_first_byte(gw.load)
    if streamed:  # a buffered answer's first byte is its last: it is in kvrouter_request_duration_seconds
        gw.metrics.ttft_of(flight.route, flight.model).observe(time.perf_counter() - flight.arrived_s)


def _rank_header(flight: Flight) -> Headers:
    return [(b"x-kvrouter-rank", str(flight.key).encode())] if flight.key is not None else []
