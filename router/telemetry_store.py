"""What the engines last said about each rank, kept in process for the gateway to read.

Written only by the reconcile loop (router/reconcile.py), read by the gateway when it builds a placement
snapshot, serves ``/ranks`` or renders ``/metrics``: reads never reach a backend, so a Prometheus scrape
costs no fan-out. Values are immutable :class:`RankTruth` records replaced whole on every update, so a
reader never sees half an update.

A rank is healthy when both planes say so:
* control plane (polls): ``unhealthy_after`` consecutive failed polls take a rank out, ``healthy_after``
  consecutive good ones bring it back (hysteresis);
* data plane (a circuit breaker): the gateway reports rank-level upstream failures of real requests
  (:meth:`report_upstream`); ``trip_after`` in a row trip the rank, because a rank that answers polls but
  refuses work (SGLang "DP rank R is not active.") looks empty and would otherwise attract every request.
  The reconcile loop probes a tripped rank with a one-token pinned request until it succeeds.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, replace

from router.backends.base import BackendInfo, RankTelemetry
from router.placement.snapshot import RankKey


@dataclass(frozen=True, slots=True)
class RankTruth:
    """One rank as the engine reports it, plus how far that is from the router's own estimate.

    ``drift_tokens`` = ``engine_used_tokens`` - ``estimate_tokens`` (the ledger's reservation total at
    poll time): negative while reserved output is not generated yet; persistently positive means the
    engine holds KV the router does not know about (another client, a leaked request, a lost release).
    """

    key: RankKey
    capacity_tokens: int
    healthy: bool = True
    engine_used_tokens: int | None = None
    running: int | None = None
    waiting: int | None = None
    preemptions_total: int | None = None
    estimate_tokens: int | None = None
    drift_tokens: int | None = None
    consecutive_failures: int = 0
    consecutive_successes: int = 0
    polled_healthy: bool = True  # the control-plane verdict alone
    tripped: bool = False  # the data-plane breaker is open
    upstream_failures: int = 0  # consecutive rank-level failures of forwarded requests
    updated_s: float | None = None  # monotonic clock of the last good probe
    last_error: str | None = None


class TelemetryStore:
    def __init__(
        self,
        *,
        unhealthy_after: int = 3,
        healthy_after: int = 2,
        trip_after: int = 3,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if unhealthy_after < 1 or healthy_after < 1 or trip_after < 1:
            raise ValueError("unhealthy_after, healthy_after and trip_after must be >= 1")
        self.unhealthy_after = unhealthy_after
        self.healthy_after = healthy_after
        self.trip_after = trip_after
        self._clock = clock
        self._ranks: dict[RankKey, RankTruth] = {}
        self._infos: dict[str, BackendInfo] = {}
        self._errors: dict[str, str] = {}
        self.polls = 0  # completed reconcile rounds; lets readers see the loop is alive
        self.infos_version = 0  # bumped by set_info: readers cache what depends on discovery only

    # -- read API (gateway, telemetry, /ranks, /ready) ---------------------------------------------------

    def ranks(self) -> dict[RankKey, RankTruth]:
        return dict(self._ranks)

    def rank(self, key: RankKey) -> RankTruth | None:
        return self._ranks.get(key)

    def backend_ranks(self, backend: str) -> list[RankTruth]:
        return [t for k, t in self._ranks.items() if k.backend == backend]

    def drift_tokens(self, key: RankKey) -> int | None:
        truth = self._ranks.get(key)
        return None if truth is None else truth.drift_tokens

    def healthy(self, key: RankKey) -> bool:
        """False for a rank never discovered: the router cannot pin what it has not seen."""
        truth = self._ranks.get(key)
        return truth is not None and truth.healthy

    def info(self, backend: str) -> BackendInfo | None:
        return self._infos.get(backend)

    def infos(self) -> dict[str, BackendInfo]:
        return dict(self._infos)

    def backend_error(self, backend: str) -> str | None:
        """The last discovery or poll failure of this backend, None once it answers again."""
        return self._errors.get(backend)

    # -- write API (the reconcile loop only) -------------------------------------------------------------

    def set_info(self, info: BackendInfo) -> bool:
        """Install discovery results; returns True when ranks or capacities changed."""
        changed = self._infos.get(info.name) != info
        self._infos[info.name] = info
        self.infos_version += 1
        for key in [k for k in self._ranks if k.backend == info.name and k.rank >= info.dp_size]:
            del self._ranks[key]  # the backend came back with fewer ranks
        unverified = set(info.extra.get("unverified_ranks", ()))
        for rank, capacity in enumerate(info.capacities_tokens):
            key = RankKey(info.name, rank)
            old = self._ranks.get(key)
            # A new rank that answered discovery starts healthy, one that did not must earn it;
            # a known rank keeps its health history.
            if old is None:
                answered = rank not in unverified
                self._ranks[key] = RankTruth(key, capacity, healthy=answered, polled_healthy=answered)
            else:
                self._ranks[key] = replace(old, capacity_tokens=capacity)
        return changed

    def set_backend_error(self, backend: str, error: str | None) -> None:
        if error is None:
            self._errors.pop(backend, None)
        else:
            self._errors[backend] = error

    def record(self, key: RankKey, telemetry: RankTelemetry, estimate_tokens: int | None = None) -> None:
        """A probe answered. A rank the engine itself reports unhealthy counts as a failure."""
        old = self._ranks.get(key)
        if old is None:
            return  # not (or no longer) discovered
        if not telemetry.healthy:
            self.record_failure(key, "engine reported no data for this rank")
            return
        used = telemetry.used_tokens
        successes = old.consecutive_successes + 1
        polled_healthy = old.polled_healthy or successes >= self.healthy_after
        self._ranks[key] = replace(
            old,
            polled_healthy=polled_healthy,
            healthy=polled_healthy and not old.tripped,
            engine_used_tokens=used,
            running=telemetry.running,
            waiting=telemetry.waiting,
            preemptions_total=telemetry.preemptions_total,
            capacity_tokens=telemetry.capacity_tokens or old.capacity_tokens,
            estimate_tokens=estimate_tokens,
            drift_tokens=None if used is None or estimate_tokens is None else used - estimate_tokens,
            consecutive_failures=0,
            consecutive_successes=successes,
            updated_s=self._clock(),
            last_error=None,
        )

    def record_failure(self, key: RankKey, error: str) -> None:
        old = self._ranks.get(key)
        if old is None:
            return
        failures = old.consecutive_failures + 1
        polled_healthy = old.polled_healthy and failures < self.unhealthy_after
        self._ranks[key] = replace(
            old,
            polled_healthy=polled_healthy,
            healthy=polled_healthy and not old.tripped,
            consecutive_failures=failures,
            consecutive_successes=0,
            last_error=error,
        )

    def report_upstream(self, key: RankKey, ok: bool, reason: str = "") -> None:
        """The data plane's verdict on one forwarded request (gateway; cheap when nothing changes).

        ``ok=False`` only for failures that are the rank's fault (connection refused or reset before the
        first byte, 5xx, "rank not active"), never for a client's 4xx. ``ok=True`` closes the breaker.
        """
        old = self._ranks.get(key)
        if old is None:
            return
        if ok:
            if old.tripped or old.upstream_failures:
                self._ranks[key] = replace(
                    old, tripped=False, upstream_failures=0, healthy=old.polled_healthy
                )
            return
        failures = old.upstream_failures + 1
        tripped = old.tripped or failures >= self.trip_after
        self._ranks[key] = replace(
            old,
            upstream_failures=failures,
            tripped=tripped,
            healthy=old.polled_healthy and not tripped,
            last_error=reason or old.last_error,
        )

    def tripped(self) -> list[RankKey]:
        return [k for k, t in self._ranks.items() if t.tripped]
