"""The vLLM face (reference/vllm.md §2, §5, §6, §10): internal LB (one server, all ranks, header pin) or
external LB (one server per rank, each showing only its own ``engine`` label)."""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from loadtest.emulator import openai_routes
from loadtest.emulator.common import (
    ApiError,
    count_chat,
    count_prompt,
    error_response,
    json_response,
    read_json,
    token_ids,
)
from loadtest.emulator.face import Face
from loadtest.emulator.promtext import PromText
from loadtest.emulator.runner import TTFT_BUCKETS_S

VLLM_VERSION = "0.33.0-emulated"


class VLLMFace(Face):
    engine_name = "vllm"
    owned_by = "vllm"
    finish_on_last_chunk = True

    def pin(self, request: Request, body: dict[str, Any], openai_route: bool) -> int | None:
        raw = request.headers.get("x-data-parallel-rank")
        if raw is None:
            return None
        try:
            rank = int(raw)
        except ValueError:
            return None  # vLLM silently ignores a non-integer header and balances the request itself
        return self.check_rank(rank, f"data_parallel_rank {rank} is out of range [0, {self.visible_ranks}).")

    def max_new_tokens(self, prompt_tokens: int, asked: int | None) -> int:
        ctx = self.max_model_len
        if prompt_tokens > ctx:
            raise ApiError(
                f"This model's maximum context length is {ctx} tokens. However, your prompt contains "
                f"{prompt_tokens} input tokens, which exceeds this limit even without any output tokens. "
                "Please reduce the length of the input prompt.",
                param="input_tokens",
            )
        if prompt_tokens == ctx:
            raise ApiError(f"Input length ({prompt_tokens}) exceeds model's maximum context length ({ctx}).")
        room = ctx - prompt_tokens
        return room if asked is None else min(asked, room)  # vLLM clamps max_tokens, it does not refuse

    def request_id(self, request: Request, body: dict[str, Any], prefix: str) -> str:
        given = request.headers.get("x-request-id")
        return f"{prefix}{given}" if given else self.runner.new_rid(prefix)

    def metrics(self) -> bytes:
        cfg = self.runner.engine.config
        loads = [ld for ld in self.runner.engine.rank_loads() if ld.rank in self.ranks]
        counters = self.runner.counters

        def lb(r: int) -> dict[str, str]:
            return {"model_name": self.served_model_name, "engine": str(r)}

        p = PromText()
        p.gauge("vllm:num_requests_running", "Number of requests in model execution batches.",
                [(lb(ld.rank), ld.running) for ld in loads])  # fmt: skip
        p.gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.",
                [(lb(ld.rank), ld.waiting) for ld in loads])  # fmt: skip
        p.gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
                [(lb(ld.rank), ld.token_usage) for ld in loads])  # fmt: skip
        p.counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.",
                  [(lb(ld.rank), ld.preemptions_total) for ld in loads])  # fmt: skip
        p.counter("vllm:prompt_tokens", "Number of prefill tokens processed.",
                  [(lb(ld.rank), ld.prompt_tokens_total) for ld in loads])  # fmt: skip
        p.counter("vllm:generation_tokens", "Number of generation tokens processed.",
                  [(lb(ld.rank), ld.generation_tokens_total) for ld in loads])  # fmt: skip
        ttft = [(lb(ld.rank), c.ttft_buckets, c.ttft_count, c.ttft_sum_s) for ld in loads
                if (c := counters[ld.rank])]  # fmt: skip
        p.histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                    TTFT_BUCKETS_S, ttft)  # fmt: skip
        blocks_total = sum(ld.capacity_tokens // cfg.page_size for ld in loads)  # summed over managed engines
        info = [
            ({"block_size": str(cfg.page_size), "cache_dtype": "auto", "enable_prefix_caching": "False",
              "gpu_memory_utilization": "0.92", "num_gpu_blocks": str(blocks_total),
              "num_gpu_blocks_override": "None", "kv_cache_size_tokens": str(ld.capacity_tokens),
              "engine": str(ld.rank)}, 1.0)
            for ld in loads
        ]  # fmt: skip
        p.gauge("vllm:cache_config_info", "Information of the LLMEngine CacheConfig", info)
        return p.render()


def routes(face: VLLMFace) -> list[Route]:
    async def models(_: Request) -> Response:
        name = face.served_model_name
        card = {"id": name, "object": "model", "created": face.created_s, "owned_by": "vllm", "root": name,
                "parent": None, "max_model_len": face.max_model_len, "permission": []}  # fmt: skip
        return json_response({"object": "list", "data": [card]})

    async def health(_: Request) -> Response:
        faults = face.runner.faults
        dead = faults.unhealthy or all(r in faults.down_ranks for r in face.ranks)
        return Response(status_code=503 if dead else 200)

    async def metrics(_: Request) -> Response:
        return Response(face.metrics(), media_type="text/plain; version=0.0.4; charset=utf-8")

    async def tokenize(request: Request) -> Response:
        try:
            body = await read_json(request)
            count = count_chat(body) if "messages" in body else count_prompt(body.get("prompt"), "prompt")
        except ApiError as exc:
            return error_response(exc)
        return json_response(
            {"count": count, "max_model_len": face.max_model_len, "tokens": token_ids(0, count)}
        )

    async def version(_: Request) -> Response:
        return json_response({"version": VLLM_VERSION})

    async def chat(request: Request) -> Response:
        return await openai_routes.chat_completions(face, request)

    async def completions(request: Request) -> Response:
        return await openai_routes.completions(face, request)

    return [
        Route("/v1/models", models), Route("/health", health), Route("/metrics", metrics),
        Route("/tokenize", tokenize, methods=["POST"]), Route("/version", version),
        Route("/v1/chat/completions", chat, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
    ]  # fmt: skip
