"""Fault switches of the emulator, set from the command line or at runtime (POST /_emulator/faults)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

ABORT_MODES = ("error", "drop")


class FaultError(ValueError):
    pass


@dataclass(slots=True)
class Faults:
    """``down_ranks``: pinned requests get 503 "DP rank R is not active."; ``slow_ranks``: rank → factor
    on its per-step work; ``abort_after_tokens``: end every stream after N tokens (``abort_mode`` "error":
    an in-stream error then [DONE]; "drop": the connection is cut); ``ignore_pin``: accept pins but let
    the engine choose (a silent mis-pin); ``legacy_crash``: an out-of-range SGLang rank kills the server;
    ``unhealthy``: /health answers 503; ``keep_orphans``: a client disconnect does not abort the request
    (it keeps running, counted in /_emulator/stats ``orphaned_requests``)."""

    down_ranks: set[int] = field(default_factory=set)
    slow_ranks: dict[int, float] = field(default_factory=dict)
    abort_after_tokens: int | None = None
    abort_mode: str = "error"
    ignore_pin: bool = False
    legacy_crash: bool = False
    unhealthy: bool = False
    keep_orphans: bool = False

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["down_ranks"] = sorted(self.down_ranks)
        d["slow_ranks"] = {str(k): v for k, v in sorted(self.slow_ranks.items())}
        return d

    def updated(self, body: Any, dp_size: int) -> Faults:
        """A copy with the keys of ``body`` applied (unknown keys and bad values raise FaultError)."""
        if not isinstance(body, dict):
            raise FaultError("faults body must be a JSON object")
        unknown = set(body) - set(Faults.__slots__)
        if unknown:
            raise FaultError(f"unknown fault keys: {', '.join(sorted(unknown))}")
        new = Faults(
            **{**asdict(self), "down_ranks": set(self.down_ranks), "slow_ranks": dict(self.slow_ranks)}
        )
        if "down_ranks" in body:
            new.down_ranks = {_rank(r, dp_size) for r in _list(body["down_ranks"], "down_ranks")}
        if "slow_ranks" in body:
            slow = body["slow_ranks"]
            if not isinstance(slow, dict):
                raise FaultError("slow_ranks must be an object {rank: factor}")
            new.slow_ranks = {_rank(k, dp_size): _factor(v) for k, v in slow.items()}
        if "abort_after_tokens" in body:
            n = body["abort_after_tokens"]
            if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 0):
                raise FaultError("abort_after_tokens must be null or an integer >= 0")
            new.abort_after_tokens = n
        if "abort_mode" in body:
            if body["abort_mode"] not in ABORT_MODES:
                raise FaultError(f"abort_mode must be one of {ABORT_MODES}")
            new.abort_mode = body["abort_mode"]
        for flag in ("ignore_pin", "legacy_crash", "unhealthy", "keep_orphans"):
            if flag in body:
                if not isinstance(body[flag], bool):
                    raise FaultError(f"{flag} must be true or false")
                setattr(new, flag, body[flag])
        return new


def _list(value: Any, name: str) -> list[Any]:
    if not isinstance(value, list):
        raise FaultError(f"{name} must be a list")
    return value


def _rank(value: Any, dp_size: int) -> int:
    try:
        r = int(value)
    except (TypeError, ValueError):
        raise FaultError(f"rank {value!r} is not an integer") from None
    if not 0 <= r < dp_size:
        raise FaultError(f"rank {r} out of range [0, {dp_size})")
    return r


def _factor(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
        raise FaultError(f"slow factor {value!r} must be a positive number")
    return float(value)


def parse_slow(spec: str, dp_size: int) -> tuple[int, float]:
    """``R:FACTOR`` from the command line."""
    rank, sep, factor = spec.partition(":")
    if not sep:
        raise FaultError(f"--fault-slow-rank {spec!r}: expected RANK:FACTOR, e.g. 3:2.5")
    try:
        return _rank(rank, dp_size), _factor(float(factor))
    except ValueError as exc:
        raise FaultError(f"--fault-slow-rank {spec!r}: {exc}") from None
