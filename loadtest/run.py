"""The live open-loop client: send a scenario's requests on schedule, stream the answers, time them.

One shared aiohttp session (as ``vllm bench serve``; the tooling notes measured httpx ~6x slower). Each
request is sent at its arrival time whatever the server does (open loop); ``max_concurrency`` adds a
client-side semaphore whose wait is reported separately. A run stops by itself: dispatch ends with the
schedule and every request is bounded by ``timeout_s``.

What the engine should generate is told the usual way: ``max_tokens`` as the scenario asks (or absent),
``min_tokens`` = the real output length (vLLM and SGLang honour it) and ``ignore_eos`` when the two are
equal, so real engines produce the exact length too. The emulator reads the real length from the body
field ``emulator_output_tokens`` (relayed by a router, unlike headers) and the header
``X-Emulator-Output-Tokens``; real engines ignore both (``emulator_hints=False`` leaves them out).

Chat prompts: the emulator (like a chat template) counts 4 tokens per message on top of its content, so
the content is 4 tokens shorter than ``prompt_tokens`` and the engine sees exactly ``prompt_tokens``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson

from loadtest.metrics import RequestOutcome
from loadtest.workload import RequestSpec, Scenario

APIS = ("chat", "completions", "generate")
PATHS = {"chat": "/v1/chat/completions", "completions": "/v1/completions", "generate": "/generate"}
CHAT_MESSAGE_OVERHEAD_TOKENS = 4  # the emulator's per-message count, see loadtest/emulator/common.py


@dataclass
class RunState:
    """Live counters for a progress display (read by the UI task; written only by the run)."""

    planned: int = 0
    sent: int = 0
    completed: int = 0
    failed: int = 0
    in_flight: int = 0
    last_ttft_ms: float | None = None
    errors: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class RunConfig:
    url: str
    api: str = "chat"
    model: str | None = None
    timeout_s: float = 600.0
    max_concurrency: int | None = None
    api_key: str | None = None
    emulator_hints: bool = True

    def endpoint(self) -> str:
        base = self.url.rstrip("/")
        base = base.removesuffix("/v1")
        return base + PATHS[self.api]


@dataclass
class RunResult:
    outcomes: list[RequestOutcome]
    duration_s: float
    model: str
    interrupted: bool = False


def build_body(
    spec: RequestSpec, scenario_seed: int, api: str, model: str, emulator_hints: bool = True
) -> dict[str, Any]:
    """The request body for one spec on one API (chat, completions or SGLang-native generate)."""
    exact = spec.max_tokens is not None and spec.max_tokens == spec.output_tokens
    hint = {"emulator_output_tokens": spec.output_tokens} if emulator_hints else {}
    if api == "generate":
        params: dict[str, Any] = {"min_new_tokens": spec.output_tokens, "ignore_eos": exact}
        if spec.max_tokens is not None:
            params["max_new_tokens"] = spec.max_tokens
        ids = spec.token_ids(scenario_seed)
        return {"input_ids": ids, "sampling_params": params, "stream": True, **hint}
    body: dict[str, Any] = {
        "model": model,
        "stream": True,
        "stream_options": {"include_usage": True},
        "min_tokens": spec.output_tokens,
        "ignore_eos": exact,
        "temperature": 0.0,
        **hint,
    }
    if spec.max_tokens is not None:
        body["max_tokens"] = spec.max_tokens
    if api == "chat":
        content = spec.prompt(scenario_seed, minus_tokens=CHAT_MESSAGE_OVERHEAD_TOKENS)
        body["messages"] = [{"role": "user", "content": content}]
    else:
        body["prompt"] = spec.prompt(scenario_seed)
    return body


class _Stream:
    """Timing and token accounting of one streamed answer."""

    def __init__(self, start: float) -> None:
        self.start = start
        self.last = start
        self.ttft_s = 0.0
        self.itls_s: list[float] = []
        self.chunks = 0
        self.usage_prompt: int | None = None
        self.usage_output: int | None = None
        self.error: str | None = None

    def token_chunk(self, now: float) -> None:
        if self.chunks == 0:
            self.ttft_s = now - self.start
        else:
            self.itls_s.append(now - self.last)
        self.last = now
        self.chunks += 1

    def feed(self, event: dict[str, Any], api: str, now: float) -> None:
        if "error" in event:
            err = event["error"]
            self.error = str(err.get("message", err) if isinstance(err, dict) else err)
            return
        if api == "generate":
            meta = event.get("meta_info") or {}
            done = int(meta.get("completion_tokens") or 0)
            if done > (self.usage_output or 0):
                self.token_chunk(now)
            self.usage_prompt = meta.get("prompt_tokens", self.usage_prompt)
            self.usage_output = done or self.usage_output
            return
        choices = event.get("choices") or []
        if choices:
            c = choices[0]
            text = (c.get("delta") or {}).get("content") if api == "chat" else c.get("text")
            if text:
                self.token_chunk(now)
        usage = event.get("usage")
        if usage:
            self.usage_prompt = usage.get("prompt_tokens", self.usage_prompt)
            self.usage_output = usage.get("completion_tokens", self.usage_output)


async def _read_stream(resp: aiohttp.ClientResponse, st: _Stream, api: str) -> None:
    buf = b""
    async for chunk in resp.content.iter_any():
        now = time.perf_counter()
        buf += chunk
        *lines, buf = buf.split(b"\n")
        for raw in lines:
            line = raw.strip()
            if not line.startswith(b"data:"):
                continue
            payload = line[5:].strip()
            if payload == b"[DONE]" or not payload:
                continue
            try:
                event = orjson.loads(payload)
            except orjson.JSONDecodeError:
                st.error = f"bad SSE payload: {payload[:80]!r}"
                continue
            if isinstance(event, dict):
                st.feed(event, api, now)


async def send_one(
    session: aiohttp.ClientSession, cfg: RunConfig, model: str, spec: RequestSpec, seed: int, t0: float
) -> RequestOutcome:
    """Send one request and stream its answer; never raises (failures become outcomes)."""
    body = orjson.dumps(build_body(spec, seed, cfg.api, model, cfg.emulator_hints))
    headers = {"Content-Type": "application/json"}
    if cfg.emulator_hints:
        headers["X-Emulator-Output-Tokens"] = str(spec.output_tokens)
    if cfg.api_key:
        headers["Authorization"] = f"Bearer {cfg.api_key}"
    start = time.perf_counter()
    st = _Stream(start)
    out = RequestOutcome(
        index=spec.index, success=False, start_s=start - t0, prompt_tokens=spec.prompt_tokens
    )
    try:
        timeout = aiohttp.ClientTimeout(total=cfg.timeout_s)
        async with session.post(cfg.endpoint(), data=body, headers=headers, timeout=timeout) as resp:
            if resp.status != 200:
                text = (await resp.text(errors="replace"))[:300]
                out.error_kind, out.error = f"http_{resp.status}", text
            else:
                await _read_stream(resp, st, cfg.api)
    except TimeoutError:
        out.error_kind, out.error = "timeout", f"no complete answer within {cfg.timeout_s:g} s"
    except aiohttp.ClientConnectorError as exc:
        out.error_kind, out.error = "connect", str(exc)
    except (aiohttp.ClientPayloadError, aiohttp.ServerDisconnectedError) as exc:
        out.error_kind, out.error = "disconnect", str(exc) or type(exc).__name__
    except aiohttp.ClientError as exc:
        out.error_kind, out.error = "client", f"{type(exc).__name__}: {exc}"
    out.e2el_s = (st.last if st.chunks else time.perf_counter()) - start
    if out.error_kind:
        return out
    if st.error is not None:
        out.error_kind, out.error = "stream_error", st.error
    elif st.chunks == 0:
        out.error_kind, out.error = "empty", "the stream ended without a token"
    else:
        out.success = True
        out.ttft_s, out.itls_s = st.ttft_s, st.itls_s
        out.output_tokens = st.usage_output if st.usage_output else st.chunks
        out.prompt_tokens = st.usage_prompt or spec.prompt_tokens
    return out


async def probe_model(session: aiohttp.ClientSession, cfg: RunConfig) -> str:
    """The first model the server lists at /v1/models (as vLLM does); "default" if it lists none."""
    if cfg.model:
        return cfg.model
    url = cfg.url.rstrip("/").removesuffix("/v1") + "/v1/models"
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    try:
        async with session.get(url, headers=headers, timeout=aiohttp.ClientTimeout(total=10)) as resp:
            data = await resp.json(content_type=None) if resp.status == 200 else {}
    except (aiohttp.ClientError, TimeoutError, ValueError):
        return "default"
    models = data.get("data") if isinstance(data, dict) else None
    if isinstance(models, list) and models and isinstance(models[0], dict) and "id" in models[0]:
        return str(models[0]["id"])
    return "default"


async def run_scenario(
    scenario: Scenario,
    cfg: RunConfig,
    state: RunState | None = None,
    on_outcome: Callable[[RequestOutcome], None] | None = None,
) -> RunResult:
    """Run every request of ``scenario`` against ``cfg.url`` on schedule; returns when all have ended."""
    specs = scenario.generate()
    state = state or RunState()
    state.planned = len(specs)
    limit = cfg.max_concurrency or scenario.max_concurrency
    connector = aiohttp.TCPConnector(limit=limit or 0, keepalive_timeout=60)
    async with aiohttp.ClientSession(connector=connector) as session:
        model = await probe_model(session, cfg)
        t0 = time.perf_counter()
        outcomes = await _dispatch(session, cfg, model, specs, scenario.seed, t0, limit, state, on_outcome)
        duration = time.perf_counter() - t0
    return RunResult(outcomes=outcomes, duration_s=duration, model=model)


async def _dispatch(
    session: aiohttp.ClientSession,
    cfg: RunConfig,
    model: str,
    specs: Sequence[RequestSpec],
    seed: int,
    t0: float,
    limit: int | None,
    state: RunState,
    on_outcome: Callable[[RequestOutcome], None] | None,
) -> list[RequestOutcome]:
    sem = asyncio.Semaphore(limit) if limit else None

    async def one(spec: RequestSpec) -> RequestOutcome:
        queued = time.perf_counter()
        if sem is not None:
            await sem.acquire()
        state.in_flight += 1
        try:
            out = await send_one(session, cfg, model, spec, seed, t0)
        finally:
            state.in_flight -= 1
            if sem is not None:
                sem.release()
        out.queue_s = out.start_s - (queued - t0)
        if out.success:
            state.completed += 1
            state.last_ttft_ms = out.ttft_s * 1000.0
        else:
            state.failed += 1
            state.errors[out.error_kind] = state.errors.get(out.error_kind, 0) + 1
        if on_outcome is not None:
            on_outcome(out)
        return out

    tasks: list[asyncio.Task[RequestOutcome]] = []
    try:
        for spec in specs:
            delay = t0 + spec.arrival_s - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(spec)))
            state.sent += 1
        return list(await asyncio.gather(*tasks))
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
