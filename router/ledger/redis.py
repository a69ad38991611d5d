"""Redis ledger: the reservations of every router replica in one place, one round trip per operation.

Every operation is one Lua script (EVALSHA, EVAL on NOSCRIPT), so check-and-reserve is atomic across
replicas; leases use the Redis server clock (see :mod:`router.ledger.redis_scripts`). Every call is
bounded by ``socket_timeout_s``; after a failure Redis is not tried again for ``retry_after_s`` (a circuit),
so an outage costs one timeout, not one per request.

While Redis is unreachable (error, timeout or open circuit):

* ``fail_closed``: every call raises :class:`LedgerUnavailable` (the gateway answers 503), except
  ``release`` — it never raises: a release that cannot reach Redis is queued and sent with the next
  successful ``renew``/``expire``/``close``, and returns True — and ``close``.
* ``fail_open``: ``reserve`` books against this replica's local share of each rank (what it held at its
  last ``usage`` read plus ``// replicas`` of the room free then, minus what it holds now; see
  :mod:`router.ledger.local_share`); ``usage`` reports that share; ``grow`` of a Redis-held
  reservation returns False; ``renew``/``expire`` only act locally. Reconciliation, on the first
  successful round trip afterwards: the local reservations still running are written into Redis (even
  past capacity: they run on the engine) and become ordinary Redis reservations; those that ended
  meanwhile are released locally and never reach Redis.

For ``settle_s`` after such a resync (default twice ``retry_after_s``: long enough for every other live
replica to reconnect and write its own back), ``reserve`` keeps to this replica's share even in Redis:
until then Redis may miss what the others booked while it was away (or lost in a restart).

In both modes, if Redis lost this replica's live reservations (restart without persistence) or reclaimed
them (this replica stalled past the TTL), the next ``renew`` or resync writes them back, so other replicas
see the true load; capacities are re-registered the same way. Nothing leaks: a reservation nobody renews
expires within the TTL, and each one is written back only while its owner keeps renewing it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from typing import Any, Final, TypeVar

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from router.ledger import redis_scripts as lua
from router.ledger.base import LedgerUnavailable, RankUsage, Reservation
from router.ledger.local_share import LocalShare
from router.ledger.memory import DEFAULT_LEASE_TTL_S, check_capacities, check_tokens
from router.ledger.redis_codec import FieldCodec
from router.placement.snapshot import RankKey

RESERVE_EXPIRE_BATCH: Final[int] = 16  # dead leases reclaimed in passing by each reserve
USAGE_EXPIRE_BATCH: Final[int] = 1024
EXPIRE_BATCH: Final[int] = 4096
_T = TypeVar("_T")
log = logging.getLogger(__name__)
_UNAVAILABLE_ERRORS = (RedisConnectionError, RedisTimeoutError, OSError, asyncio.TimeoutError)


class RedisLedger:
    """A :class:`~router.ledger.base.Ledger` in Redis. ``round_trips`` counts requests sent to Redis."""

    def __init__(
        self,
        client: aioredis.Redis,
        *,
        namespace: str = "default",
        lease_ttl_s: float = DEFAULT_LEASE_TTL_S,
        failure_mode: str = "fail_closed",
        replicas: int = 1,
        retry_after_s: float = 1.0,
        settle_s: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if failure_mode not in ("fail_closed", "fail_open"):
            raise ValueError(f"failure_mode must be fail_closed or fail_open, got {failure_mode!r}")
        self._client = client
        self._keys = [f"kvr:{{{namespace}}}:{suffix}" for suffix in lua.KEY_SUFFIXES]
        self._ttl_ms = max(1, round(lease_ttl_s * 1000))
        self.failure_mode = failure_mode
        self.retry_after_s = retry_after_s
        self.settle_s = 2 * retry_after_s if settle_s is None else settle_s
        self._settle_until_s = 0.0
        self._clock = clock
        self._share = LocalShare(replicas=replicas, lease_ttl_s=lease_ttl_s, clock=clock)
        self._pending_release: set[str] = set()
        self._down_until_s = 0.0
        self._needs_resync = False
        self._resync_lock = asyncio.Lock()
        self._codec = FieldCodec()
        self.round_trips = 0
        self.local_reserves = 0

    @classmethod
    def from_url(
        cls,
        url: str,
        *,
        namespace: str = "default",
        lease_ttl_s: float = DEFAULT_LEASE_TTL_S,
        failure_mode: str = "fail_closed",
        replicas: int = 1,
        socket_timeout_s: float = 0.25,
        connect_timeout_s: float = 1.0,
        retry_after_s: float = 1.0,
        settle_s: float | None = None,
        max_connections: int = 64,
    ) -> RedisLedger:
        """Client with a bounded pool, a timeout on every call and no client-side retries (we fail over).

        ``socket_timeout_s`` bounds every command; opening a connection (TCP + HELLO, a burst may open many
        at once) and waiting for a free one in the pool get ``connect_timeout_s`` (at least the former).
        """
        connect_timeout_s = max(connect_timeout_s, socket_timeout_s)
        pool = aioredis.BlockingConnectionPool.from_url(
            url,
            max_connections=max_connections,
            timeout=connect_timeout_s,
            socket_timeout=socket_timeout_s,
            socket_connect_timeout=connect_timeout_s,
            retry=Retry(NoBackoff(), 0),
            decode_responses=True,
        )
        return cls(
            aioredis.Redis.from_pool(pool),
            namespace=namespace,
            lease_ttl_s=lease_ttl_s,
            failure_mode=failure_mode,
            replicas=replicas,
            retry_after_s=retry_after_s,
            settle_s=settle_s,
        )

    @property
    def pending_releases(self) -> int:
        return len(self._pending_release)

    # --- the Ledger protocol ------------------------------------------------------------------------
    async def register(self, capacities: Mapping[RankKey, int]) -> None:
        check_capacities(capacities)
        caps = dict(capacities)
        self._share.register(caps)
        if caps:
            await self._guard(self._eval(lua.RESYNC, [self._ttl_ms, *self._codec.cap_args(caps)]), None)

    async def reserve(self, request_id: str, candidates: Sequence[RankKey], tokens: int) -> RankKey | None:
        check_tokens(tokens, allow_zero=False)
        if request_id in self._share.owned or self._share.holds_locally(request_id):
            raise ValueError(f"request {request_id!r} already holds a reservation")
        if not candidates:
            return None
        try:
            await self._sync_if_needed()
            return await self._reserve_in_redis(request_id, candidates, tokens)
        except LedgerUnavailable:
            if self.failure_mode == "fail_closed":
                raise
        self.local_reserves += 1
        return self._share.reserve(request_id, candidates, tokens)

    async def grow(self, request_id: str, tokens: int) -> bool:
        check_tokens(tokens, allow_zero=True)
        if self._share.holds_locally(request_id):
            return await self._share.local.grow(request_id, tokens)
        return await self._adjust(request_id, "grow", tokens)

    async def shrink(self, request_id: str, tokens: int) -> bool:
        check_tokens(tokens, allow_zero=True)
        if self._share.holds_locally(request_id):
            return await self._share.local.shrink(request_id, tokens)
        return await self._adjust(request_id, "shrink", tokens)

    async def add_generated(self, request_id: str, tokens: int) -> None:
        check_tokens(tokens, allow_zero=True)
        if self._share.holds_locally(request_id):
            await self._share.local.add_generated(request_id, tokens)
        else:
            await self._adjust(request_id, "gen", tokens)

    async def release(self, request_id: str) -> bool:
        if await self._share.local.release(request_id):
            return True
        held = self._share.disown(request_id)  # before the await: a concurrent renew must not write it back
        try:
            released = await self._eval(lua.RELEASE, [request_id])
        except LedgerUnavailable:
            if held is None:
                return False
            self._pending_release.add(request_id)
            return True
        return bool(released)  # False also when Redis lost it (restart) before it was written back

    async def renew(self, request_ids: Iterable[str]) -> None:
        ids = list(request_ids)
        local_ids = [rid for rid in ids if self._share.holds_locally(rid)]
        await self._share.local.renew(local_ids)
        if local_ids:
            local_set = set(local_ids)
            ids = [rid for rid in ids if rid not in local_set]
        redis_ids = ids
        self._share.renewed(redis_ids)
        pending = list(self._pending_release)
        if not redis_ids and not pending and not self._needs_resync:
            return
        missing = await self._guard(self._renew_in_redis(redis_ids, pending), [])
        lost = [rid for rid in missing if rid in self._share.owned]
        if lost:  # Redis restarted empty, or reclaimed them while this replica stalled: put them back
            await self._guard(self._resync(lost), None)

    async def expire(self) -> int:
        expired = await self._share.local.expire()
        self._share.live_owned()  # forget owned reservations nobody renews any more
        return expired + await self._guard(self._expire_in_redis(), 0)

    async def get(self, request_id: str) -> Reservation | None:
        if self._share.holds_locally(request_id):
            return await self._share.local.get(request_id)
        try:
            value = await self._eval(lua.GET, [request_id])
        except LedgerUnavailable:
            if self.failure_mode == "fail_closed":
                raise
            return self._share.owned_reservation(request_id)
        if value is None:
            return None
        tokens, generated, field = str(value).split(":", 2)
        return Reservation(request_id, self._codec.key(field), int(tokens), int(generated))

    async def usage(self) -> dict[RankKey, RankUsage]:
        try:
            for _ in range(2):
                await self._sync_if_needed()
                usage = self._codec.parse_usage(await self._eval(lua.USAGE, [USAGE_EXPIRE_BATCH]))
                if all(key in usage for key in self._share.capacity_tokens):
                    if not self._settling():  # while settling Redis may miss others' part: keep the old view
                        self._share.observe({key: u.reserved_tokens for key, u in usage.items()})
                    return usage
                self._needs_resync = True  # Redis lost registered ranks (restart): put them back, look again
            return usage
        except LedgerUnavailable:
            if self.failure_mode == "fail_closed":
                raise
            return self._share.usage()

    async def close(self) -> None:
        if self._pending_release and self._clock() >= self._down_until_s:
            try:
                await self._eval(lua.RELEASE, list(self._pending_release))
                self._pending_release.clear()
            except LedgerUnavailable:
                pass  # nothing more to do: those leases expire within the TTL
        await self._client.aclose()

    # --- Redis calls --------------------------------------------------------------------------------
    async def _eval(self, script: lua.Script, args: Sequence[str | int]) -> Any:
        """One round trip; Redis unreachable (or the circuit open) → LedgerUnavailable."""
        if self._clock() < self._down_until_s:
            raise LedgerUnavailable("Redis ledger unreachable (circuit open)")
        keys = self._keys
        self.round_trips += 1
        try:
            try:
                return await self._client.evalsha(script.sha, len(keys), *keys, *args)
            except NoScriptError:  # first use on this server (or it restarted): send the source once
                self.round_trips += 1
                return await self._client.eval(script.source, len(keys), *keys, *args)
        except _UNAVAILABLE_ERRORS as exc:
            # The cause, logged when the circuit opens: every call until it closes only says "circuit open".
            cause, retry_s = f"{type(exc).__name__}: {exc}", self.retry_after_s
            log.warning("Redis ledger %s failed (%s); not tried for %g s", script.name, cause, retry_s)
            self._down_until_s = self._clock() + self.retry_after_s
            self._needs_resync = True
            await self._drop_idle_connections()
            raise LedgerUnavailable(f"Redis ledger unreachable: {exc}") from exc

    async def _drop_idle_connections(self) -> None:
        """Every idle pooled connection leads to the server that just failed. Kept, each would fail once
        when load next reached it (Redis restarted: "Connection closed by server"), re-opening the circuit
        every time: seconds of refusals after Redis is back. The next call opens a fresh one instead."""
        with contextlib.suppress(Exception):
            await self._client.connection_pool.disconnect(inuse_connections=False)

    def _settling(self) -> bool:
        return self._clock() < self._settle_until_s

    async def _guard(self, call: Awaitable[_T], fallback: _T) -> _T:
        """Apply the failure mode to a call that has a harmless fallback in ``fail_open``."""
        try:
            return await call
        except LedgerUnavailable:
            if self.failure_mode == "fail_closed":
                raise
            return fallback

    async def _reserve_in_redis(
        self, request_id: str, candidates: Sequence[RankKey], tokens: int
    ) -> RankKey | None:
        if self._settling():
            candidates = self._share.within_share(candidates, tokens)
            if not candidates:
                return None
        args: list[str | int] = [request_id, tokens, self._ttl_ms, RESERVE_EXPIRE_BATCH]
        args += map(self._codec.field, candidates)
        try:
            index = int(await self._eval(lua.RESERVE, args))
        except ResponseError as exc:
            if "KVR_UNKNOWN_RANK" in str(exc) and all(k in self._share.capacity_tokens for k in candidates):
                self._needs_resync = True  # we registered these: Redis restarted empty, put them back
                await self._sync_if_needed()
                index = int(await self._eval(lua.RESERVE, args))
            elif "KVR_DUPLICATE" in str(exc):
                raise ValueError(f"request {request_id!r} already holds a reservation") from None
            elif "KVR_UNKNOWN_RANK" in str(exc):
                raise ValueError(
                    f"unknown rank among {[str(k) for k in candidates]} (not registered)"
                ) from None
            else:
                raise
        if index < 0:
            return None
        key = candidates[index]
        self._share.own(request_id, key, tokens)
        return key

    async def _adjust(self, request_id: str, op: str, tokens: int) -> bool:
        try:
            applied = bool(await self._eval(lua.ADJUST, [request_id, op, tokens]))
        except LedgerUnavailable:
            if self.failure_mode == "fail_closed":
                raise
            return False
        if applied:
            if op == "gen":
                self._share.adjust(request_id, 0, tokens)
            else:
                self._share.adjust(request_id, tokens if op == "grow" else -tokens)
        return applied

    async def _renew_in_redis(self, redis_ids: list[str], pending: list[str]) -> list[str]:
        await self._sync_if_needed()
        missing = await self._eval(lua.RENEW, [self._ttl_ms, len(redis_ids), *redis_ids, *pending])
        self._pending_release.difference_update(pending)
        return [str(rid) for rid in missing]

    async def _expire_in_redis(self) -> int:
        await self._sync_if_needed()
        pending = list(self._pending_release)
        total = 0
        while True:
            reclaimed = int(await self._eval(lua.EXPIRE, [EXPIRE_BATCH, *pending]))
            self._pending_release.difference_update(pending)
            pending = []
            total += reclaimed
            if reclaimed < EXPIRE_BATCH:
                return total

    async def _sync_if_needed(self) -> None:
        if self._needs_resync:
            async with self._resync_lock:
                if self._needs_resync:
                    await self._resync(None)

    async def _resync(self, owned_ids: list[str] | None) -> None:
        """Write back capacities, owned reservations (all, or ``owned_ids``) and local ones, in one trip."""
        live = self._share.live_owned()
        args: list[str | int] = [self._ttl_ms, *self._codec.cap_args(self._share.capacity_tokens)]
        written = [rid for rid in (live if owned_ids is None else owned_ids) if rid in live]
        for rid in written:
            held = live[rid]
            args += [rid, self._codec.field(held.key), held.tokens, held.generated_tokens]
        migrating = self._share.local.held()
        for rid, r in migrating.items():
            args += [rid, self._codec.field(r.key), r.tokens, r.generated_tokens]
        await self._eval(lua.RESYNC, args)
        self._needs_resync = False
        self._settle_until_s = self._clock() + self.settle_s
        # Released while the write was in flight (its RELEASE may have reached Redis first): release again.
        self._pending_release.update(rid for rid in written if rid not in self._share.owned)
        for rid, r in migrating.items():
            if self._share.local.release_now(rid):
                self._share.own(rid, r.key, r.tokens, r.generated_tokens)
            else:  # it ended while the write was in flight
                self._pending_release.add(rid)
