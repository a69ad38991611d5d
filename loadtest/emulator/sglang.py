"""The SGLang face (reference/sglang.md §1-§5, §9): one server for all DP ranks."""

from __future__ import annotations

from collections.abc import AsyncIterator
from datetime import UTC, datetime
from typing import Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from loadtest.emulator import openai_routes
from loadtest.emulator.common import (
    DONE_EVENT,
    ApiError,
    DropConnection,
    SSEResponse,
    count_prompt,
    error_body,
    error_response,
    json_response,
    read_json,
    sse,
    token_ids,
    token_text,
    wait_done_or_disconnect,
)
from loadtest.emulator.face import Face, body_rank
from loadtest.emulator.promtext import PromText
from loadtest.emulator.runner import TTFT_BUCKETS_S, RequestHandle

SGLANG_VERSION = "0.5.9-emulated"
LOADS_SECTIONS = {"core", "memory", "spec", "lora", "disagg", "queues", "all"}
GENERATE_DEFAULT_MAX_NEW_TOKENS = 128
EOS_TOKEN_ID = 1


class SGLangFace(Face):
    engine_name = "sglang"
    owned_by = "sglang"

    def pin(self, request: Request, body: dict[str, Any], openai_route: bool) -> int | None:
        rank: int | None = None
        header = request.headers.get("x-data-parallel-rank") if openai_route else None
        if header is not None:  # SG-LATE: the header wins over the body on OpenAI routes
            try:
                rank = int(header)
            except ValueError:
                raise ApiError("Invalid X-Data-Parallel-Rank header", param="X-Data-Parallel-Rank") from None
        else:
            rank = body_rank(body)
        if rank is None:
            return None
        n = self.visible_ranks
        if not 0 <= rank < n and self.runner.faults.legacy_crash:
            if -n <= rank < 0:
                return n + rank  # old servers index the worker list: a negative rank wraps silently
            if self.crash is not None:
                self.crash()
            raise ApiError("DataParallelController hit an exception", 500)
        return self.check_rank(rank, f"routed_dp_rank={rank} out of range [0, {n})")

    def max_new_tokens(self, prompt_tokens: int, asked: int | None) -> int:
        ctx = self.max_model_len
        if prompt_tokens >= ctx:
            raise ApiError(
                f"The input ({prompt_tokens} tokens) is longer than the model's context length "
                f"({ctx} tokens).",
                param="input_tokens",
            )
        if asked is None:
            return ctx - prompt_tokens
        if asked + prompt_tokens >= ctx:
            raise ApiError(
                f"Requested token count exceeds the model's maximum context length of {ctx} tokens. You "
                f"requested a total of {asked + prompt_tokens} tokens: {prompt_tokens} tokens from the input "
                f"messages and {asked} tokens for the completion. Please reduce the number of tokens in the "
                "input messages or the completion to fit within the limit.",
                param="max_tokens",
            )
        return asked

    def request_id(self, request: Request, body: dict[str, Any], prefix: str) -> str:
        rid = body.get("rid")
        if rid is not None and not isinstance(rid, str):
            raise ApiError("'rid' must be a string", param="rid")
        return rid or self.runner.new_rid(prefix)

    # ---- native endpoints ----------------------------------------------------------------------------
    def server_info(self) -> dict[str, Any]:
        cfg = self.runner.engine.config
        loads = self.runner.engine.rank_loads()
        thr = self.runner.gen_throughput()
        args = {
            "model_path": self.served_model_name, "served_model_name": self.served_model_name,
            "tp_size": cfg.dp_size, "dp_size": cfg.dp_size, "ep_size": cfg.dp_size, "pp_size": 1,
            "enable_dp_attention": True, "page_size": cfg.page_size, "kv_cache_dtype": "auto",
            "context_length": self.max_model_len, "max_total_tokens": None,
            "max_running_requests": cfg.max_running_per_rank * cfg.dp_size,
            "chunked_prefill_size": cfg.prefill_chunk_tokens, "load_balance_method": "round_robin",
            "disaggregation_mode": "null", "enable_metrics": True, "enable_mixed_chunk": cfg.mixed_chunk,
        }  # fmt: skip
        kv_gb = loads[0].capacity_tokens * cfg.step.kv_bytes_per_token / 1e9
        states = [
            {**args, "dp_rank": ld.rank, "last_gen_throughput": thr[ld.rank],
             "memory_usage": {"weight": 93.87, "kvcache": round(kv_gb, 2),
                              "token_capacity": ld.capacity_tokens, "graph": 2.1},
             "effective_max_running_requests_per_dp": cfg.max_running_per_rank}
            for ld in loads
        ]  # fmt: skip
        return {**args, "status": "ready", "max_total_num_tokens": loads[0].capacity_tokens,
                "max_req_input_len": self.max_model_len - 1, "internal_states": states,
                "version": SGLANG_VERSION}  # fmt: skip

    def model_info(self) -> dict[str, Any]:
        return {"model_path": self.served_model_name, "tokenizer_path": self.served_model_name,
                "is_generation": True, "preferred_sampling_params": None, "weight_version": "default",
                "has_image_understanding": False, "has_audio_understanding": False,
                "model_type": "deepseek_v3", "architectures": ["DeepseekV3ForCausalLM"]}  # fmt: skip

    def loads(self, dp_rank: int | None) -> dict[str, Any]:
        cfg = self.runner.engine.config
        thr = self.runner.gen_throughput()
        sel = [ld for ld in self.runner.engine.rank_loads() if dp_rank is None or ld.rank == dp_rank]
        out = []
        for ld in sel:
            out.append({
                "dp_rank": ld.rank, "num_running_reqs": ld.running, "num_waiting_reqs": ld.waiting,
                "num_used_tokens": ld.used_tokens, "max_total_num_tokens": ld.capacity_tokens,
                "token_usage": round(ld.token_usage, 4), "gen_throughput": thr[ld.rank],
                "cache_hit_rate": 0.0, "utilization": round(ld.token_usage, 4),
                "max_running_requests": cfg.max_running_per_rank,
                "num_total_reqs": ld.running + ld.waiting,
                "memory": {"token_capacity": ld.capacity_tokens},
                "queues": {"waiting": ld.waiting, "grammar": 0, "paused": 0, "retracted": 0},
            })  # fmt: skip
        n = max(1, len(sel))
        usage = round(sum(ld.token_usage for ld in sel) / n, 4)
        agg = {"total_running_reqs": sum(ld.running for ld in sel),
               "total_waiting_reqs": sum(ld.waiting for ld in sel),
               "total_reqs": sum(ld.running + ld.waiting for ld in sel), "avg_token_usage": usage,
               "avg_throughput": sum(thr[ld.rank] for ld in sel) / n, "avg_utilization": usage}  # fmt: skip
        return {"timestamp": datetime.now(UTC).isoformat(), "version": SGLANG_VERSION,
                "dp_rank_count": cfg.dp_size, "loads": out, "aggregate": agg}  # fmt: skip

    def metrics(self) -> bytes:
        model = self.served_model_name
        loads = self.runner.engine.rank_loads()
        thr = self.runner.gen_throughput()

        def lb(r: int) -> dict[str, str]:
            return {"dp_rank": str(r), "engine_type": "unified", "model_name": model, "moe_ep_rank": str(r),
                    "pp_rank": "0", "tp_rank": str(r)}  # fmt: skip

        p = PromText()
        for name, help_text, value in (
            ("num_running_reqs", "The number of running requests.", lambda ld: ld.running),
            ("num_used_tokens", "The number of used tokens.", lambda ld: ld.used_tokens),
            ("token_usage", "The token usage.", lambda ld: round(ld.token_usage, 4)),
            ("num_queue_reqs", "The number of requests in the waiting queue.", lambda ld: ld.waiting),
            ("max_total_num_tokens", "Maximum total number of tokens in the KV cache pool.",
             lambda ld: ld.capacity_tokens),
            ("cache_hit_rate", "The prefix cache hit rate.", lambda ld: 0.0),
        ):  # fmt: skip
            p.gauge(f"sglang:{name}", help_text, [(lb(ld.rank), value(ld)) for ld in loads])
        p.gauge("sglang:gen_throughput", "The generation throughput (token/s).",
                [(lb(ld.rank), thr[ld.rank]) for ld in loads])  # fmt: skip
        p.counter("sglang:num_retracted_requests", "Total number of retracted requests.",
                  [(lb(ld.rank), ld.preemptions_total) for ld in loads])  # fmt: skip
        tok = {"model_name": model}
        p.counter("sglang:prompt_tokens", "Number of prefill tokens processed.",
                  [(tok, sum(ld.prompt_tokens_total for ld in loads))])  # fmt: skip
        p.counter("sglang:generation_tokens", "Number of generation tokens processed.",
                  [(tok, sum(ld.generation_tokens_total for ld in loads))])  # fmt: skip
        counters = self.runner.counters
        p.counter("sglang:num_requests", "Number of requests processed.",
                  [(tok, sum(c.requests_total for c in counters))])  # fmt: skip
        buckets = [sum(c.ttft_buckets[i] for c in counters) for i in range(len(TTFT_BUCKETS_S))]
        p.histogram("sglang:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                    TTFT_BUCKETS_S, [(tok, buckets, sum(c.ttft_count for c in counters),
                                      sum(c.ttft_sum_s for c in counters))])  # fmt: skip
        return p.render()


# ---- /generate -----------------------------------------------------------------------------------------
def _finish_reason(h: RequestHandle) -> dict[str, Any] | None:
    if not h.done:
        return None
    if h.finish_reason == "stop":
        return {"type": "stop", "matched": EOS_TOKEN_ID}
    return {"type": "length", "length": h.generated}


def _generate_out(h: RequestHandle, text: str, ids: list[int]) -> dict[str, Any]:
    meta = {"id": h.rid, "finish_reason": _finish_reason(h), "prompt_tokens": h.prompt_tokens,
            "completion_tokens": h.generated, "cached_tokens": 0, "weight_version": "default",
            "total_retractions": h.preemptions}  # fmt: skip
    return {"text": text, "output_ids": ids, "meta_info": meta}


async def _generate_stream(face: SGLangFace, h: RequestHandle) -> AsyncIterator[bytes]:
    text, ids = "", list[int]()
    while True:
        n = await h.wait()
        if h.client_gone:
            return
        if h.done and h.finish_reason == "abort":
            break
        if n:
            text += token_text(len(ids), n)
            ids += token_ids(len(ids), n)
            yield sse(_generate_out(h, text, ids))  # SGLang streams cumulative text and ids
        if h.done:
            yield DONE_EVENT
            return
    if h.error and h.error.startswith("emulator fault") and face.runner.faults.abort_mode == "drop":
        raise DropConnection(h.error)
    yield sse(error_body(h.error or "request aborted", 500))
    yield DONE_EVENT


async def generate(face: SGLangFace, request: Request) -> Response:
    try:
        body = await read_json(request)
        if "input_ids" in body and body["input_ids"] is not None:
            prompt = count_prompt(body["input_ids"], "input_ids")
        else:
            prompt = count_prompt(body.get("text"), "text")
        sp = body.get("sampling_params") or {}
        if not isinstance(sp, dict):
            raise ApiError("'sampling_params' must be an object", param="sampling_params")
        asked = sp.get("max_new_tokens", GENERATE_DEFAULT_MAX_NEW_TOKENS)
        if asked is not None and (isinstance(asked, bool) or not isinstance(asked, int) or asked < 0):
            raise ApiError("'max_new_tokens' must be a non-negative integer", param="max_new_tokens")
        rid = face.request_id(request, body, "")
        h = face.submit(request, body, rid, prompt, max(1, asked) if asked is not None else None, False)
    except ApiError as exc:
        return error_response(exc)
    headers = {"X-Emulator-Rank": str(h.rank)}
    if body.get("stream"):
        return SSEResponse(_generate_stream(face, h), lambda: face.runner.client_gone(h), headers)
    await wait_done_or_disconnect(request, lambda: _drain(h), lambda: face.runner.client_gone(h))
    if h.finish_reason == "abort":
        return json_response(error_body(h.error or "request aborted", 500), 500, headers)
    return json_response(
        _generate_out(h, token_text(0, h.generated), token_ids(0, h.generated)), 200, headers
    )


async def _drain(h: RequestHandle) -> None:
    while not h.done:
        await h.wait()


# ---- routes --------------------------------------------------------------------------------------------
def routes(face: SGLangFace) -> list[Route]:
    async def server_info(_: Request) -> Response:
        return json_response(face.server_info())

    async def model_info(_: Request) -> Response:
        return json_response(face.model_info())

    async def models(_: Request) -> Response:
        return json_response({"object": "list", "data": [
            {"id": face.served_model_name, "object": "model", "created": face.created_s, "owned_by": "sglang",
             "root": face.served_model_name, "max_model_len": face.max_model_len}]})  # fmt: skip

    async def v1_loads(request: Request) -> Response:
        q = request.query_params
        include = {s.strip() for s in q.get("include", "all").split(",") if s.strip()}
        if not include <= LOADS_SECTIONS:
            bad = ", ".join(sorted(include - LOADS_SECTIONS))
            return error_response(ApiError(f"Invalid include value(s): {bad}", param="include"))
        dp_rank = None
        if (raw := q.get("dp_rank")) is not None:
            try:
                dp_rank = int(raw)
            except ValueError:
                return error_response(ApiError("dp_rank must be an integer", param="dp_rank"))
        return json_response(face.loads(dp_rank))

    async def get_load(_: Request) -> Response:
        return json_response([
            {"dp_rank": ld.rank, "num_reqs": ld.running + ld.waiting, "num_waiting_reqs": ld.waiting,
             "num_tokens": ld.used_tokens + ld.waiting_tokens, "ts_tic": face.runner.engine.clock_s}
            for ld in face.runner.engine.rank_loads()])  # fmt: skip

    async def health(_: Request) -> Response:
        down = face.runner.faults.unhealthy or len(face.runner.faults.down_ranks) >= face.visible_ranks
        return Response(status_code=503 if down else 200)

    async def metrics(_: Request) -> Response:
        return Response(face.metrics(), media_type="text/plain; version=0.0.4; charset=utf-8")

    async def abort_request(request: Request) -> Response:
        try:
            body = await read_json(request)
        except ApiError as exc:
            return error_response(exc)
        if body.get("abort_all"):
            for h in face.runner.inflight():
                face.runner.abort(h.rid)
        elif isinstance(body.get("rid"), str):
            face.runner.abort(body["rid"])
        return Response(status_code=200)

    async def flush_cache(_: Request) -> Response:
        return Response(b"Cache flushed.\n", media_type="text/plain")

    async def do_generate(request: Request) -> Response:
        return await generate(face, request)

    async def chat(request: Request) -> Response:
        return await openai_routes.chat_completions(face, request)

    async def completions(request: Request) -> Response:
        return await openai_routes.completions(face, request)

    return [
        Route("/server_info", server_info), Route("/get_server_info", server_info),
        Route("/model_info", model_info), Route("/get_model_info", model_info),
        Route("/v1/models", models), Route("/v1/loads", v1_loads), Route("/get_load", get_load),
        Route("/health", health), Route("/health_generate", health), Route("/metrics", metrics),
        Route("/abort_request", abort_request, methods=["POST"]),
        Route("/flush_cache", flush_cache, methods=["POST", "GET"]),
        Route("/generate", do_generate, methods=["POST"]),
        Route("/v1/chat/completions", chat, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
    ]  # fmt: skip
