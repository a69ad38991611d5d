"""Placement: pure policies over an immutable :class:`~router.placement.snapshot.Snapshot`.

A policy is ``(Snapshot, RequestShape) -> list[int]``: indices into ``snapshot.ranks`` of the ranks where
the request fits now, best first (the gateway tries them in order, so a reservation that lost a race
falls through to the next). An empty list means wait or refuse; :func:`router.placement.admission.decide`
says which. A policy is named with optional numeric parameters: ``lockstep:hold_stretch=1``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Final

from router.placement.engine_like import vllm_internal
from router.placement.lockstep import Lockstep
from router.placement.policies import (
    CacheAware,
    Policy,
    kv_fit,
    least_requests,
    power_of_two,
    random_choice,
    round_robin,
)

DEFAULT_POLICY: Final[str] = "lockstep"

# Factories, not instances: a configurable policy is built fresh from its parameters on every call.
_FACTORIES: Final[dict[str, Callable[..., Policy]]] = {
    "lockstep": Lockstep,
    "lockstep_eager": lambda: Lockstep(hold_stretch=0.0),
    "kv_fit": lambda: kv_fit,
    "round_robin": lambda: round_robin,
    "least_requests": lambda: least_requests,
    "power_of_two": lambda: power_of_two,
    "vllm_internal": lambda: vllm_internal,
    "sglang_cache_aware": CacheAware,
    "random": lambda: random_choice,
}

POLICY_NAMES: Final[tuple[str, ...]] = tuple(_FACTORIES)


class UnknownPolicy(ValueError):
    """A policy name or parameter the registry does not know."""


def _value(text: str) -> int | float | None:
    if text.lower() == "none":
        return None
    try:
        return int(text)
    except ValueError:
        try:
            return float(text)
        except ValueError:
            raise UnknownPolicy(f"policy parameter value {text!r} is not a number or none") from None


def parse_spec(spec: str) -> tuple[str, dict[str, Any]]:
    """``name`` or ``name:key=value,key=value`` (numbers or ``none``; ``;`` also separates, for lists that
    are themselves comma-separated), e.g. ``lockstep:hold_stretch=1``."""
    name, _, rest = spec.partition(":")
    params: dict[str, Any] = {}
    for item in filter(None, (p.strip() for p in rest.replace(";", ",").split(","))):
        key, eq, text = item.partition("=")
        if not eq or not key.strip():
            raise UnknownPolicy(f"policy parameter {item!r} is not key=value (in {spec!r})")
        params[key.strip()] = _value(text.strip())
    return name, params


def get_policy(name: str, **params: Any) -> Policy:
    """The policy called ``name`` (see ``POLICY_NAMES``), configured with ``params``. ``name`` may carry
    parameters itself (:func:`parse_spec`: ``lockstep:hold_stretch=1``); ``params`` override those.

    Raises :class:`UnknownPolicy` (a ValueError) with a one-line message for an unknown name or parameter.
    """
    name, inline = parse_spec(name)
    params = inline | params
    factory = _FACTORIES.get(name.strip().lower().replace("-", "_"))
    if factory is None:
        raise UnknownPolicy(f"unknown policy {name!r} (known: {', '.join(POLICY_NAMES)})")
    try:
        return factory(**params)
    except TypeError:
        raise UnknownPolicy(f"policy {name!r} does not take parameters {sorted(params)}") from None
    except ValueError as exc:
        raise UnknownPolicy(f"policy {name!r}: {exc}") from None


__all__ = ["DEFAULT_POLICY", "POLICY_NAMES", "Policy", "UnknownPolicy", "get_policy", "parse_spec"]
