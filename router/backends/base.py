"""What the gateway needs from an engine deployment (one "backend" = one SGLang or vLLM server set).

One module per engine implements :class:`Backend`: discovery (DP size, per-rank capacity, page size,
context window, served models), how a request is pinned to a rank, and per-rank telemetry parsing.
The gateway never builds upstream URLs itself, so no client input can choose one.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, runtime_checkable

import httpx

EngineKind = Literal["sglang", "vllm", "vllm-external"]
ENGINE_KINDS: tuple[EngineKind, ...] = ("sglang", "vllm", "vllm-external")
Route = Literal["/v1/chat/completions", "/v1/completions", "/generate"]
OPENAI_ROUTES: frozenset[str] = frozenset({"/v1/chat/completions", "/v1/completions"})


class BackendError(RuntimeError):
    """Discovery or telemetry failed (unreachable, unexpected payload)."""


class UnsupportedRoute(BackendError):
    """The engine has no such route (vLLM has no ``/generate``): the gateway answers 404, never forwards."""


class RankOutOfRange(BackendError):
    """A rank outside ``[0, dp_size)``: refused locally, because old SGLang servers crash on one."""


class NotDiscovered(BackendError):
    """The backend's DP size is not known yet (it was down at startup): no rank can be pinned."""


@dataclass(frozen=True, slots=True)
class BackendSpec:
    """A configured backend: ``sglang=URL``, ``vllm=URL``, or ``vllm-external=URL0,URL1,...`` ."""

    engine: EngineKind
    urls: tuple[str, ...]
    name: str = ""

    @property
    def display_url(self) -> str:
        return ",".join(self.urls)

    @classmethod
    def parse(cls, text: str, index: int = 0) -> BackendSpec:
        engine, sep, rest = text.partition("=")
        engine = engine.strip().lower()
        if not sep or not rest.strip():
            raise ValueError(
                f"backend {text!r}: expected ENGINE=URL (ENGINE one of {', '.join(ENGINE_KINDS)})"
            )
        if engine not in ENGINE_KINDS:
            raise ValueError(
                f"backend {text!r}: unknown engine {engine!r} (one of {', '.join(ENGINE_KINDS)})"
            )
        urls = tuple(u.strip().rstrip("/") for u in rest.split(",") if u.strip())
        for u in urls:
            if not u.startswith(("http://", "https://")):
                raise ValueError(f"backend {text!r}: URL {u!r} must start with http:// or https://")
        # sglang with several URLs = per-rank HTTP ports (SGLANG_RUST_SERVER=1), one URL per rank in order.
        if engine == "vllm" and len(urls) != 1:
            raise ValueError(
                f"backend {text!r}: {engine} takes exactly one URL (use vllm-external for one per rank)"
            )
        return cls(engine=engine, urls=urls, name=f"{engine}-{index}")


@dataclass(frozen=True, slots=True)
class BackendInfo:
    """What discovery learned. ``capacities_tokens[i]`` is rank i's KV pool in tokens."""

    name: str
    engine: EngineKind
    url: str
    models: tuple[str, ...]
    dp_size: int
    page_size: int
    max_model_len: int
    capacities_tokens: tuple[int, ...]
    extra: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Upstream:
    """How to send one request to one rank: the full URL, headers to add, JSON body fields to set."""

    url: str
    headers: Mapping[str, str] = field(default_factory=dict)
    body_fields: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class RankTelemetry:
    """One rank's truth as the engine reports it; None where the engine does not say."""

    rank: int
    used_tokens: int | None = None
    running: int | None = None
    waiting: int | None = None
    capacity_tokens: int | None = None
    preemptions_total: int | None = None
    healthy: bool = True


@runtime_checkable
class Backend(Protocol):
    spec: BackendSpec

    @property
    def name(self) -> str: ...

    async def discover(self, http: httpx.AsyncClient) -> BackendInfo: ...

    def upstream(self, rank: int, route: Route) -> Upstream:
        """Pinned target for ``route`` on ``rank`` (validated 0 <= rank < dp_size by the caller)."""

    async def poll(self, http: httpx.AsyncClient) -> list[RankTelemetry]: ...

    async def abort(self, http: httpx.AsyncClient, rank: int, request_id: str) -> None:
        """Best-effort upstream abort (SGLang ``/abort_request``); closing the stream also aborts."""
