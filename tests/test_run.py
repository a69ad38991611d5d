"""Live runs over real loopback sockets against a tiny OpenAI-compatible SSE server started here."""

from __future__ import annotations

import asyncio
import json
import math
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest
from aiohttp import web
from typer.testing import CliRunner

from loadtest.cli import app as cli_app
from loadtest.run import RunConfig, RunResult, run_scenario
from loadtest.workload import RequestSpec, parse_scenario

SCENARIO = """\
name: tiny
seed: 3
requests: 40
arrival: {process: poisson, rate_rps: 200}
classes:
  - weight: 1
    prompt_tokens: {dist: uniform, min: 10, max: 300}
    output_tokens: {dist: uniform, min: 1, max: 12}
  - weight: 1
    prompt_tokens: {dist: fixed, value: 50}
    output_tokens: {dist: fixed, value: 5}
    max_tokens: {multiple: 8}
slo: {ttft_ms: 5000, tpot_ms: 1000}
"""


def _prompt_tokens(body: dict[str, object]) -> int:
    if "input_ids" in body:
        return len(body["input_ids"])  # type: ignore[arg-type]
    messages = body.get("messages")
    if isinstance(messages, list):  # the emulator's rule: 4 tokens per message plus its content
        return sum(4 + math.ceil(len(m["content"].encode()) / 4) for m in messages)
    return math.ceil(len(str(body["prompt"]).encode()) / 4)


async def _stream(request: web.Request) -> web.StreamResponse:
    body = await request.json()
    if body.get("model") == "fail":
        return web.json_response(
            {"error": {"message": "no", "type": "x", "param": None, "code": 503}}, status=503
        )
    native = request.path == "/generate"
    params = body.get("sampling_params", {}) if native else body
    n = int(body["emulator_output_tokens"])
    assert n == int(request.headers["X-Emulator-Output-Tokens"])
    assert n == int(params.get("min_new_tokens" if native else "min_tokens"))
    prompt = _prompt_tokens(body)
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    for i in range(n):
        await asyncio.sleep(0.002)
        if native:
            event = {
                "text": "x" * (i + 1),
                "meta_info": {"prompt_tokens": prompt, "completion_tokens": i + 1},
            }
        elif request.path.endswith("chat/completions"):
            event = {"choices": [{"index": 0, "delta": {"content": "tok "}}]}
        else:
            event = {"choices": [{"index": 0, "text": "tok "}]}
        await resp.write(b"data: " + orjson.dumps(event) + b"\n\n")
    if not native:
        usage = {"prompt_tokens": prompt, "completion_tokens": n, "total_tokens": prompt + n}
        await resp.write(b"data: " + orjson.dumps({"choices": [], "usage": usage}) + b"\n\n")
    await resp.write(b"data: [DONE]\n\n")
    return resp


async def _models(_: web.Request) -> web.Response:
    return web.json_response({"object": "list", "data": [{"id": "stub-model", "object": "model"}]})


@pytest.fixture(scope="module")
def stub_url() -> Iterator[str]:
    """An aiohttp server on a free loopback port, in its own thread and event loop."""
    loop = asyncio.new_event_loop()
    ready = threading.Event()
    box: dict[str, object] = {}

    async def start() -> None:
        app = web.Application()
        app.router.add_get("/v1/models", _models)
        for path in ("/v1/chat/completions", "/v1/completions", "/generate"):
            app.router.add_post(path, _stream)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        box["runner"] = runner
        box["port"] = runner.addresses[0][1]
        ready.set()

    thread = threading.Thread(
        target=lambda: (loop.run_until_complete(start()), loop.run_forever()), daemon=True
    )
    thread.start()
    assert ready.wait(10)
    yield f"http://127.0.0.1:{box['port']}"
    runner = box["runner"]
    assert isinstance(runner, web.AppRunner)
    asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(10)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)
    loop.close()


@pytest.mark.parametrize(
    ("engine", "api"), [("sglang", "chat"), ("sglang", "generate"), ("vllm", "completions")]
)
def test_live_run_against_emulator_zero_failures_exact_lengths(
    start_emulator: Any, engine: str, api: str
) -> None:
    """The real emulator (SGLang or vLLM face, 2 ranks): every request completes with the asked lengths."""
    emu = start_emulator(engine, dp_size=2, kv_tokens_per_rank=8192, served_model_name="emu-model")
    sc = parse_scenario(SCENARIO, "tiny.yaml")
    specs = {s.index: s for s in sc.generate()}
    result = asyncio.run(run_scenario(sc, RunConfig(url=emu.url, api=api, timeout_s=20)))
    _check_exact(result, specs)
    assert result.model == "emu-model"


@pytest.mark.parametrize("api", ["chat", "completions", "generate"])
def test_live_run_zero_failures_and_exact_lengths(stub_url: str, api: str) -> None:
    sc = parse_scenario(SCENARIO, "tiny.yaml")
    specs = {s.index: s for s in sc.generate()}
    result = asyncio.run(run_scenario(sc, RunConfig(url=stub_url, api=api, timeout_s=20)))
    assert result.model == "stub-model"
    _check_exact(result, specs)


def _check_exact(result: RunResult, specs: dict[int, RequestSpec]) -> None:
    assert len(result.outcomes) == 40
    assert all(o.success for o in result.outcomes), [o.error for o in result.outcomes if not o.success]
    for o in result.outcomes:
        spec = specs[o.index]
        assert o.output_tokens == spec.output_tokens
        assert o.prompt_tokens == spec.prompt_tokens  # the byte estimate is exact for synthetic prompts
        assert len(o.itls_s) == o.output_tokens - 1
        assert 0 < o.ttft_s <= o.e2el_s
    # Open loop on schedule: the last request starts near its arrival time (39 gaps at 200 req/s).
    assert max(o.start_s for o in result.outcomes) == pytest.approx(39 / 200, abs=0.15)


def test_cli_run_writes_vllm_keys_and_counts_http_errors(stub_url: str, tmp_path: Path) -> None:
    (tmp_path / "tiny.yaml").write_text(SCENARIO)
    out = tmp_path / "res.json"
    args = ["run", "--url", stub_url, "--scenario", str(tmp_path / "tiny.yaml"), "--requests", "12",
            "--rate", "100", "--out", str(out), "--no-progress", "--max-concurrency", "4"]  # fmt: skip
    res = CliRunner().invoke(cli_app, args)
    assert res.exit_code == 0, res.output
    assert "============ Serving Benchmark Result ============" in res.output
    assert "Maximum request concurrency:" in res.output
    data = json.loads(out.read_text())
    for key in ("completed", "failed", "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms", "mean_tpot_ms",
                "p99_itl_ms", "request_goodput", "output_throughput", "total_token_throughput"):  # fmt: skip
        assert key in data, key
    assert data["completed"] == 12 and data["failed"] == 0 and data["max_concurrent_requests"] <= 4
    assert data["request_goodput"] > 0

    res = CliRunner().invoke(cli_app, [*args[:-3], "--model", "fail"])
    assert res.exit_code == 0, res.output
    data = json.loads(out.read_text())
    assert data["failed"] == 12 and data["errors_by_kind"] == {"http_503": 12}


def test_cli_run_bad_input_exits_2(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(SCENARIO.replace("rate_rps: 200", "rate_rps: fast"))
    res = CliRunner().invoke(cli_app, ["run", "--url", "http://127.0.0.1:9", "--scenario", str(bad)])
    assert res.exit_code == 2
    assert "bad.yaml:4: arrival.rate_rps" in res.output
    res = CliRunner().invoke(cli_app, ["run", "--url", "ftp://x", "--scenario", "chat-short"])
    assert res.exit_code == 2


def test_unreachable_server_counts_connect_errors() -> None:
    sc = parse_scenario(SCENARIO, "tiny.yaml").with_overrides(requests=3)
    result = asyncio.run(run_scenario(sc, RunConfig(url="http://127.0.0.1:9", model="m", timeout_s=5)))
    assert [o.error_kind for o in result.outcomes] == ["connect"] * 3
