"""Tiny engine stand-ins for the adapter and reconcile tests: real uvicorn servers on 127.0.0.1.

Payloads copy the wire formats in reference/sglang.md §2-§4 and reference/vllm.md §5-§6. State is plain
attributes the test mutates between polls (usage, a hanging rank, a missing endpoint).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from asgi_server import serve_asgi
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

MODEL = "deepseek-ai/DeepSeek-V3"


Handler = Callable[[Request], Awaitable[Response]]


def guarded(fake: FakeEngine, handler: Handler) -> Handler:
    """503 while ``fake.down``; hold the request while ``fake.hang`` (until teardown releases it)."""

    async def wrapped(request: Request) -> Response:
        if fake.hang:
            await fake.release.wait()
        if fake.down:
            return Response(status_code=503)
        return await handler(request)

    return wrapped


@dataclass
class FakeEngine:
    down: bool = False
    hang: bool = False
    release: asyncio.Event = field(default_factory=asyncio.Event)


@contextlib.asynccontextmanager
async def serve(app: Starlette, release: asyncio.Event | None = None) -> AsyncIterator[str]:
    """Run ``app`` on a free loopback port for the duration of the block; yields its base URL."""
    async with serve_asgi(app, lifespan="off") as url:
        try:
            yield url
        finally:
            if release is not None:
                release.set()  # let hung handlers finish before the server shuts down


def models_payload(max_model_len: int, owned_by: str) -> dict[str, Any]:
    card = {
        "id": MODEL,
        "object": "model",
        "created": 0,
        "owned_by": owned_by,
        "max_model_len": max_model_len,
    }
    return {"object": "list", "data": [card]}


@dataclass
class FakeSGLang(FakeEngine):
    """SGLang with --enable-dp-attention: all ranks behind one server."""

    dp: int = 8
    capacity: int = 412_160
    page_size: int = 64
    max_model_len: int = 163_840
    used: list[int] = field(default_factory=list)
    running: list[int] = field(default_factory=list)
    has_v1_loads: bool = True
    has_server_info: bool = True  # False: only the deprecated /get_server_info
    internal_states: bool = True
    silent_ranks: set[int] = field(default_factory=set)  # omitted from /v1/loads and /metrics
    aborted: list[str] = field(default_factory=list)
    inactive_ranks: set[int] = field(default_factory=set)  # pinned completions get 503 "not active"
    pins: list[tuple[int | None, str | None]] = field(default_factory=list)  # (body rank, header) seen
    peer_ports: list[int] = field(default_factory=list)  # client port per completion: connection reuse
    attn_dp_size_field: bool = False  # SGLang 0.5.23 --attn-dp-size: reports dp_size 1, attn_dp_size N

    def __post_init__(self) -> None:
        self.used = self.used or [0] * self.dp
        self.running = self.running or [0] * self.dp

    def server_info(self) -> dict[str, Any]:
        state = {"dp_size": self.dp, "memory_usage": {"weight": 80.3, "kvcache": 27.1, "graph": 2.1}}
        states = [
            {
                **state,
                "memory_usage": {
                    **state["memory_usage"],
                    "token_capacity": self.capacity + r * self.page_size,
                },
            }
            for r in range(self.dp)
        ]
        info: dict[str, Any] = {
            "model_path": MODEL, "served_model_name": MODEL, "tp_size": self.dp, "dp_size": self.dp,
            "enable_dp_attention": True, "page_size": self.page_size, "context_length": None,
            "status": "ready", "max_total_num_tokens": self.capacity, "max_req_input_len": 163_834,
            "internal_states": states if self.internal_states else [], "version": "0.5.x",
        }  # fmt: skip
        if self.attn_dp_size_field:
            info.update(dp_size=1, attn_dp_size=self.dp)
        return info

    def loads(self) -> dict[str, Any]:
        loads = [
            {
                "dp_rank": r,
                "num_running_reqs": self.running[r],
                "num_waiting_reqs": 1,
                "num_used_tokens": self.used[r],
                "max_total_num_tokens": self.capacity + r * self.page_size,
                "token_usage": round(self.used[r] / self.capacity, 4),
                "num_total_reqs": self.running[r] + 1,
            }
            for r in range(self.dp)
            if r not in self.silent_ranks
        ]
        return {
            "timestamp": "2026-11-29T12:00:00Z",
            "version": "0.5.x",
            "dp_rank_count": self.dp,
            "loads": loads,
        }

    def metrics(self) -> str:
        lines = [
            "# HELP sglang:num_used_tokens The number of used tokens",
            "# TYPE sglang:num_used_tokens gauge",
        ]
        for r in range(self.dp):
            if r in self.silent_ranks:
                continue
            labels = f'dp_rank="{r}",engine_type="unified",model_name="{MODEL}",moe_ep_rank="{r}",'
            labels += f'pp_rank="0",tp_rank="{r}"'
            lines += [
                f"sglang:num_used_tokens{{{labels}}} {float(self.used[r])}",
                f"sglang:num_running_reqs{{{labels}}} {float(self.running[r])}",
                f"sglang:num_queue_reqs{{{labels}}} 1.0",
                f"sglang:num_retracted_requests_total{{{labels}}} {float(r)}",
                f'sglang:time_to_first_token_seconds_bucket{{le="0.1",model_name="{MODEL}"}} 3.0',
            ]
        return "\n".join(lines) + "\n"

    def app(self) -> Starlette:
        async def server_info(_: Request) -> Response:
            if not self.has_server_info:
                return JSONResponse({"detail": "Not Found"}, 404)
            return JSONResponse(self.server_info())

        async def get_server_info(_: Request) -> Response:
            return JSONResponse(self.server_info())

        async def v1_loads(_: Request) -> Response:
            return (
                JSONResponse(self.loads())
                if self.has_v1_loads
                else JSONResponse({"detail": "Not Found"}, 404)
            )

        async def metrics(_: Request) -> Response:
            return PlainTextResponse(self.metrics())

        async def models(_: Request) -> Response:
            return JSONResponse(models_payload(self.max_model_len, "sglang"))

        async def completions(request: Request) -> Response:
            body = await request.json()
            rank = body.get("routed_dp_rank")
            self.pins.append((rank, request.headers.get("x-data-parallel-rank")))
            self.peer_ports.append(request.client.port if request.client else -1)
            if rank in self.inactive_ranks:
                return JSONResponse({"error": {"message": f"DP rank {rank} is not active."}}, 503)
            return JSONResponse({"id": "cmpl-1", "object": "text_completion", "choices": [{"text": "x"}]})

        async def abort(request: Request) -> Response:
            self.aborted.append((await request.json())["rid"])
            return Response(status_code=200)

        return Starlette(
            routes=[
                Route("/server_info", guarded(self, server_info)),
                Route("/get_server_info", guarded(self, get_server_info)),
                Route("/v1/loads", guarded(self, v1_loads)),
                Route("/metrics", guarded(self, metrics)),
                Route("/v1/models", guarded(self, models)),
                Route("/abort_request", guarded(self, abort), methods=["POST"]),
                Route("/v1/completions", guarded(self, completions), methods=["POST"]),
            ]
        )


@dataclass
class FakeVLLM(FakeEngine):
    """vLLM: ``engines`` lists the engine labels this server reports (all of them in internal LB)."""

    engines: list[int] = field(default_factory=lambda: list(range(8)))
    blocks_per_engine: int = 25_000
    block_size: int = 16
    max_model_len: int = 163_840
    summed: bool = True  # internal LB sums num_gpu_blocks over the engines it manages
    size_tokens_label: bool = False  # newer vLLM: per-engine kv_cache_size_tokens
    usage: dict[int, float] = field(default_factory=dict)
    running: dict[int, int] = field(default_factory=dict)

    def metrics(self) -> str:
        blocks = self.blocks_per_engine * (len(self.engines) if self.summed else 1)
        out = [
            "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig",
            "# TYPE vllm:cache_config_info gauge",
        ]
        for e in self.engines:
            size = (
                f',kv_cache_size_tokens="{self.blocks_per_engine * self.block_size}"'
                if self.size_tokens_label
                else ""
            )
            out.append(
                f'vllm:cache_config_info{{block_size="{self.block_size}",cache_dtype="auto",'
                f'enable_prefix_caching="True",engine="{e}",gpu_memory_utilization="0.9",num_cpu_blocks="None",'
                f'num_gpu_blocks="{blocks}",num_gpu_blocks_override="None",prefix_caching_hash_algo="sha256"'
                f'{size},sliding_window="None"}} 1.0'
            )
        for e in self.engines:
            labels = f'engine="{e}",model_name="{MODEL}"'
            out += [
                f"vllm:num_requests_running{{{labels}}} {float(self.running.get(e, 0))}",
                f"vllm:num_requests_waiting{{{labels}}} 0.0",
                f'vllm:num_requests_waiting_by_reason{{{labels},reason="capacity"}} 0.0',
                f"vllm:kv_cache_usage_perc{{{labels}}} {self.usage.get(e, 0.0)}",
                f"vllm:num_preemptions_total{{{labels}}} {float(e)}",
                f"vllm:num_preemptions_created{{{labels}}} 1.7e9",
                f'vllm:time_to_first_token_seconds_bucket{{{labels},le="0.001"}} 0.0',
            ]
        return "\n".join(out) + "\n"

    def app(self) -> Starlette:
        async def metrics(_: Request) -> Response:
            return PlainTextResponse(self.metrics())

        async def models(_: Request) -> Response:
            return JSONResponse(models_payload(self.max_model_len, "vllm"))

        return Starlette(
            routes=[Route("/metrics", guarded(self, metrics)), Route("/v1/models", guarded(self, models))]
        )
