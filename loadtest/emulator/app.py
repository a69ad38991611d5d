"""Assemble an emulated deployment: one engine, one runner, and one (or, vLLM external LB, N) ASGI apps."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute

from loadtest.emulator import admin, sglang, vllm
from loadtest.emulator.common import ApiError, error_response
from loadtest.emulator.faults import Faults
from loadtest.emulator.outlen import OutputLenDist
from loadtest.emulator.runner import EngineRunner
from loadtest.engine import Engine, EngineConfig
from loadtest.engine_types import EngineMode

SERVED_NAMES = {
    "deepseek-v3": "deepseek-ai/DeepSeek-V3",
    "llama-3.3-70b": "meta-llama/Llama-3.3-70B-Instruct",
}


@dataclass(frozen=True)
class EmulatorSettings:
    """Everything ``kvrouter-loadtest emulate`` takes. ``kv_tokens_per_rank`` None = the capacity plan of
    ``model`` on 8×H200 times ``capacity_scale``; ``max_model_len`` None = the model's context window."""

    engine: EngineMode = "sglang"
    dp_size: int = 8
    host: str = "127.0.0.1"
    port: int = 30000
    kv_tokens_per_rank: int | None = None
    capacity_scale: float = 1.0
    page_size: int = 1
    prefill_chunk_tokens: int | None = None
    time_scale: float = 1.0
    model: str = "deepseek-v3"
    served_model_name: str | None = None
    max_model_len: int | None = None
    external_lb: bool = False
    output_len_dist: str = "lognormal:350:0.6"
    seed: int = 0
    faults: Faults = field(default_factory=Faults)

    @property
    def served_name(self) -> str:
        return self.served_model_name or SERVED_NAMES.get(self.model, self.model)

    def engine_config(self) -> EngineConfig:
        overrides: dict[str, Any] = {}
        if self.kv_tokens_per_rank is not None:
            overrides["kv_tokens_per_rank"] = self.kv_tokens_per_rank
        if self.prefill_chunk_tokens is not None:
            overrides["prefill_chunk_tokens"] = self.prefill_chunk_tokens
        if self.max_model_len is not None:
            overrides["max_model_len"] = self.max_model_len
        return EngineConfig.for_engine(
            self.engine, dp_size=self.dp_size, model=self.model, page_size=self.page_size,
            capacity_scale=self.capacity_scale, **overrides,
        )  # fmt: skip


async def _not_found(request: Request, exc: Exception) -> Response:
    return error_response(ApiError(f"Not Found: {request.url.path}", 404))


async def _server_error(request: Request, exc: Exception) -> Response:
    return error_response(ApiError(f"internal emulator error: {type(exc).__name__}", 500))


class Emulator:
    """The engine + runner and the ASGI apps in front of them; ``apps[i]`` listens on ``port + i``.
    Call :meth:`start` inside the event loop that serves the apps."""

    def __init__(self, settings: EmulatorSettings, crash: Callable[[], None] | None = None) -> None:
        self.settings = settings
        cfg = settings.engine_config()
        self.engine = Engine(cfg)
        out_len = OutputLenDist.parse(settings.output_len_dist)
        self.runner = EngineRunner(
            self.engine, time_scale=settings.time_scale, output_len=out_len, seed=settings.seed,
            faults=settings.faults,
        )  # fmt: skip
        max_len = cfg.max_model_len
        self.apps: list[Starlette] = []
        if settings.engine == "sglang":
            face = sglang.SGLangFace(self.runner, settings.served_name, max_len, crash=crash)
            self.apps.append(self._app(sglang.routes(face)))
        elif settings.external_lb:
            for r in range(cfg.dp_size):
                vface = vllm.VLLMFace(
                    self.runner, settings.served_name, max_len, rank_offset=r, visible_ranks=1
                )
                self.apps.append(self._app(vllm.routes(vface)))
        else:
            self.apps.append(
                self._app(vllm.routes(vllm.VLLMFace(self.runner, settings.served_name, max_len)))
            )

    def _app(self, routes: Sequence[BaseRoute]) -> Starlette:
        return Starlette(
            routes=[*routes, *admin.routes(self.runner)],
            exception_handlers={404: _not_found, 405: _not_found, 500: _server_error},
        )

    def start(self) -> None:
        self.runner.start()

    async def stop(self) -> None:
        await self.runner.stop()
