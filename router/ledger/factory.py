"""Build the configured ledger from plain settings values (the gateway calls this once, in its lifespan)."""

from __future__ import annotations

from typing import Final, Literal, cast, get_args

from router.ledger.base import Ledger
from router.ledger.memory import DEFAULT_LEASE_TTL_S, InMemoryLedger

FailureMode = Literal["fail_closed", "fail_open"]
FAILURE_MODES: Final[tuple[str, ...]] = get_args(FailureMode)
DEFAULT_SOCKET_TIMEOUT_S: Final[float] = 0.25
DEFAULT_NAMESPACE: Final[str] = "default"
# How ``kvrouter serve --workers N`` hands the shared-memory ledger file to its worker processes (the same
# name Settings reads ``ledger_path`` from): the gateway passes build_ledger only the Redis settings.


def check_failure_mode(value: str) -> FailureMode:
    normalised = value.strip().lower().replace("-", "_")
    if normalised not in FAILURE_MODES:
        raise ValueError(f"failure mode must be one of {', '.join(FAILURE_MODES)}, got {value!r}")
    return cast(FailureMode, normalised)


def check_namespace(namespace: str) -> str:
    """A namespace goes inside a Redis hash tag ``{...}``: braces would break the tag, empty is ambiguous."""
    if not namespace or any(c in namespace for c in "{}\r\n "):
        raise ValueError(f"ledger namespace must be non-empty without braces or spaces, got {namespace!r}")
    return namespace


def build_ledger(
    redis_url: str | None = None,
    *,
    failure_mode: str = "fail_closed",
    lease_ttl_s: float = DEFAULT_LEASE_TTL_S,
    namespace: str = DEFAULT_NAMESPACE,
    replicas: int = 1,
    socket_timeout_s: float = DEFAULT_SOCKET_TIMEOUT_S,
    shm_path: str | None = None,
) -> Ledger:
    """``redis_url`` → a :class:`RedisLedger` (no I/O here: it connects on first use); else ``shm_path``
    → a :class:`SharedMemoryLedger` on that existing file, the one
    ledger of a ``serve``'s worker processes; else :class:`InMemoryLedger`. ``replicas`` is how many router
    replicas share the deployment: in ``fail_open`` each one reserves against ``capacity // replicas`` of
    every rank while Redis is unreachable.
    Raises ValueError on a bad value.
    """
    if not lease_ttl_s > 0:
        raise ValueError(f"lease TTL must be > 0 s, got {lease_ttl_s}")
    if redis_url is None or not redis_url.strip():
        if not shm_path:
            return InMemoryLedger(lease_ttl_s=lease_ttl_s)
        from router.ledger.shm import SharedMemoryLedger

        return SharedMemoryLedger(shm_path, lease_ttl_s=lease_ttl_s)
    if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 1:
        raise ValueError(f"replicas must be an int >= 1, got {replicas!r}")
    if not socket_timeout_s > 0:
        raise ValueError(f"socket timeout must be > 0 s, got {socket_timeout_s}")
    from router.ledger.redis import RedisLedger  # the Redis client is only needed when configured

    return RedisLedger.from_url(
        redis_url.strip(),
        failure_mode=check_failure_mode(failure_mode),
        lease_ttl_s=lease_ttl_s,
        namespace=check_namespace(namespace),
        replicas=replicas,
        socket_timeout_s=socket_timeout_s,
    )
