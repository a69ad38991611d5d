"""/metrics after real traffic: the in-process router on a free port in front of the emulator, the openai
client, values checked against /ranks and against the emulated engine's own per-rank numbers."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import anyio
import httpx
import openai
import pytest
from gateway_support import MODEL, ranks_settled, router
from observability_support import (
    mixed_traffic,
    parse,
    per_rank,
    promtool,
    rank_table,
    scrape,
    select,
    sglang_per_rank,
    total,
    wait_for,
)

pytestmark = pytest.mark.anyio
BACKEND = "sglang-0"
FREEZE = {"slow_ranks": {"0": 1e9}}  # lockstep: one endless step stops every rank, numbers hold still


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


async def _post(url: str, body: dict[str, Any]) -> None:
    async with httpx.AsyncClient() as http:
        assert (await http.post(url, json=body)).status_code == 200


async def test_rank_gauges_equal_ranks_and_the_engine_while_requests_are_held(start_emulator: Any) -> None:
    emu = start_emulator("sglang", dp_size=2, time_scale=1.0, kv_tokens_per_rank=8192,
                         output_len_dist="fixed:5000")  # fmt: skip
    async with router(backends=[f"sglang={emu.url}"], reconcile_interval_s=0.05) as url:
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        streams = []
        for i in range(5):
            s = await client.completions.create(model=MODEL, prompt="hello " * (20 + 30 * i), max_tokens=900,
                                                stream=True)  # fmt: skip
            await s.__anext__()  # first token relayed: placed, prefilled, decoding
            streams.append(s)
        await _post(emu.url + "/_emulator/faults", FREEZE)
        await asyncio.sleep(0.5)  # the running step ends, then several reconcile rounds see the frozen state
        _, m = await scrape(url)
        table = await rank_table(url)
        async with httpx.AsyncClient() as http:
            engine_text = (await http.get(emu.url + "/metrics")).text
        engine = parse(engine_text)
        assert len(table) == 2
        for name, field in (("kvrouter_rank_capacity_tokens", "capacity_tokens"),
                            ("kvrouter_rank_reserved_tokens", "reserved_tokens"),
                            ("kvrouter_rank_inflight_requests", "inflight"),
                            ("kvrouter_rank_engine_used_tokens", "engine_used_tokens"),
                            ("kvrouter_rank_healthy", "healthy")):  # fmt: skip
            assert per_rank(m, name, BACKEND) == {r: float(table[(BACKEND, r)][field]) for r in (0, 1)}, name
        assert sum(per_rank(m, "kvrouter_rank_inflight_requests", BACKEND).values()) == 5
        assert per_rank(m, "kvrouter_rank_engine_used_tokens", BACKEND) == sglang_per_rank(
            engine, "sglang:num_used_tokens"
        )
        assert per_rank(m, "kvrouter_rank_capacity_tokens", BACKEND) == sglang_per_rank(
            engine, "sglang:max_total_num_tokens"
        ) == {0: 8192.0, 1: 8192.0}  # fmt: skip
        assert per_rank(m, "kvrouter_rank_engine_running_requests", BACKEND) == sglang_per_rank(
            engine, "sglang:num_running_reqs"
        )
        used = per_rank(m, "kvrouter_rank_engine_used_tokens", BACKEND)
        reserved = per_rank(m, "kvrouter_rank_reserved_tokens", BACKEND)
        assert min(used.values()) > 0
        assert per_rank(m, "kvrouter_rank_drift_tokens", BACKEND) == {r: used[r] - reserved[r] for r in used}
        assert per_rank(m, "kvrouter_rank_prefill_queued_tokens", BACKEND) == {0: 0.0, 1: 0.0}
        placed = {int(dict(lv)["rank"]): v for lv, v in select(m, "kvrouter_placements_total").items()}
        assert placed == {
            r: v for r, v in per_rank(m, "kvrouter_rank_inflight_requests", BACKEND).items() if v
        }
        assert 0 <= total(m, "kvrouter_ledger_snapshot_age_seconds") < 0.5
        assert max(per_rank(m, "kvrouter_rank_telemetry_age_seconds", BACKEND).values()) < 0.5

        await _post(emu.url + "/_emulator/faults", {"slow_ranks": {}})
        for s in streams:
            await s.close()  # client disconnect: the router releases and aborts upstream
        await client.close()
        await ranks_settled(url)

        async def gauges_back_to_zero() -> bool:
            _, after = await scrape(url)
            return (
                total(after, "kvrouter_rank_reserved_tokens")
                == 0
                == total(after, "kvrouter_rank_inflight_requests")
            )

        await wait_for(gauges_back_to_zero)
        _, m = await scrape(url)
        assert total(m, "kvrouter_client_disconnects_total") == 5
        assert total(m, "kvrouter_requests_total", model=MODEL) == 5
        assert total(m, "kvrouter_ttft_seconds_count") == 5


async def test_request_metrics_after_mixed_traffic_parse_and_pass_promtool(start_emulator: Any) -> None:
    emu = start_emulator("sglang", dp_size=4, time_scale=0.2)  # ~6 ms steps: tokens arrive apart
    async with router(backends=[f"sglang={emu.url}"]) as url:
        t0 = time.perf_counter()
        sent = await mixed_traffic(url, MODEL)
        elapsed_s = time.perf_counter() - t0
        text, m = await scrape(url)
    assert total(m, "kvrouter_requests_total") == sent["ok"] + sent["refused"]
    assert total(m, "kvrouter_requests_total", code="200") == sent["ok"]
    assert total(m, "kvrouter_requests_total", code="400", model=MODEL) == sent["refused"]  # served: labelled
    assert total(m, "kvrouter_rejections_total", reason="too_large") == sent["refused"]
    assert total(m, "kvrouter_placements_total", policy="lockstep") == sent["ok"]
    assert total(m, "kvrouter_queue_wait_seconds_count", outcome="placed") == sent["ok"]
    # TTFT only for streamed answers; duration for every request that got as far as placement (the
    # too_large refusal did: it is decided against the ranks).
    assert total(m, "kvrouter_ttft_seconds_count") == sent["streamed"]
    assert total(m, "kvrouter_request_duration_seconds_count") == sent["ok"] + sent["refused"]
    assert total(m, "kvrouter_request_duration_seconds_sum") <= elapsed_s
    # ITL: one gap per relayed event after the first (8 tokens, plus role and finish events on chat), never
    # more time than the streams took.
    itl_count = total(m, "kvrouter_inter_token_latency_seconds_count")
    assert sent["streamed"] <= itl_count <= sent["streamed"] * 10
    assert total(m, "kvrouter_inter_token_latency_seconds_sum") <= total(
        m, "kvrouter_request_duration_seconds_sum"
    )
    buckets = select(m, "kvrouter_ttft_seconds_bucket", route="/v1/chat/completions", model=MODEL)
    assert buckets[frozenset({("le", "+Inf"), ("route", "/v1/chat/completions"), ("model", MODEL)})] == 2
    assert total(m, "kvrouter_ledger_operation_seconds_count", op="reserve") == sent["ok"]
    # every flight releases once on its way out, the refused one included (a no-op there)
    assert total(m, "kvrouter_ledger_operation_seconds_count", op="release") == sent["ok"] + sent["refused"]
    assert total(m, "kvrouter_generated_tokens_total") >= 4 * 8  # the non-streamed answers, counted exactly
    assert total(m, "kvrouter_backend_up", backend=BACKEND, engine="sglang") == 1
    proc = await anyio.run_process([promtool(), "check", "metrics"], input=text.encode(), check=False)
    assert proc.returncode == 0, proc.stdout.decode() + proc.stderr.decode()


async def test_labels_stay_bounded_whatever_clients_send(start_emulator: Any) -> None:
    emu = start_emulator("sglang", dp_size=2)
    async with router(backends=[f"sglang={emu.url}"]) as url, httpx.AsyncClient(base_url=url) as http:
        bogus = "attacker-model-" + "x" * 40
        secret = {"prompt": "secret prompt text", "max_tokens": 2}
        for body in ({"model": bogus, **secret}, {"model": MODEL, "user": "u-123", **secret}):
            await http.post("/v1/completions", json=body, headers={"X-Request-Id": "req-abc-123"})
        text, m = await scrape(url)
    for needle in (bogus, "secret prompt", "req-abc-123", "u-123"):
        assert needle not in text
    assert total(m, "kvrouter_requests_total", code="404", model="") == 1
    assert total(m, "kvrouter_rejections_total", reason="model_not_found") == 1
    models = {dict(lv).get("model") for lv in select(m, "kvrouter_requests_total")}
    assert models == {"", MODEL}


async def test_queue_depth_wait_and_refusals_by_reason(start_emulator: Any) -> None:
    """One request fills the only rank; the next waits (depth 1 visible while it waits), then times out;
    one more finds the queue full."""
    emu = start_emulator("sglang", dp_size=1, time_scale=1.0, kv_tokens_per_rank=1024,
                         output_len_dist="fixed:5000")  # fmt: skip
    settings = {"queue_max": 1, "queue_timeout_s": 1.0, "policy": "kv_fit"}
    async with router(backends=[f"sglang={emu.url}"], **settings) as url:
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        holder = await client.completions.create(model=MODEL, prompt="x", max_tokens=900, stream=True)
        await holder.__anext__()
        waiter = asyncio.create_task(client.completions.create(model=MODEL, prompt="y", max_tokens=900))

        async def one_waiting() -> bool:
            return total((await scrape(url))[1], "kvrouter_queue_depth") == 1

        await wait_for(one_waiting)
        with pytest.raises(openai.RateLimitError):
            await client.completions.create(model=MODEL, prompt="z", max_tokens=900)
        with pytest.raises(openai.InternalServerError):  # 503 queue_timeout after 1 s
            await waiter
        _, m = await scrape(url)
        await holder.close()
        await client.close()
    assert total(m, "kvrouter_queue_depth") == 0
    assert total(m, "kvrouter_rejections_total", reason="queue_full") == 1
    assert total(m, "kvrouter_rejections_total", reason="queue_timeout") == 1
    assert total(m, "kvrouter_requests_total", code="429") == 1
    assert total(m, "kvrouter_requests_total", code="503") == 1
    timeouts = select(m, "kvrouter_queue_wait_seconds_sum", outcome="timeout")
    assert len(timeouts) == 1 and 1.0 <= next(iter(timeouts.values())) < 3.0
    assert total(m, "kvrouter_queue_wait_seconds_count", outcome="timeout") == 1


async def test_scrapes_touch_neither_ledger_nor_backends_and_stay_cheap(start_emulator: Any) -> None:
    emu = start_emulator("sglang", dp_size=8)
    async with router(backends=[f"sglang={emu.url}"], reconcile_interval_s=3600.0) as url:
        await mixed_traffic(url, MODEL)
        _, m0 = await scrape(url)
        costs_s = []
        async with httpx.AsyncClient(base_url=url) as http:
            for _ in range(50):
                t0 = time.perf_counter()
                assert (await http.get("/metrics")).status_code == 200
                costs_s.append(time.perf_counter() - t0)
        _, m1 = await scrape(url)
    usage = "kvrouter_ledger_operation_seconds_count"
    assert total(m1, usage, op="usage") == total(m0, usage, op="usage")  # no ledger read per scrape
    costs_s.sort()
    print(f"/metrics round trip over loopback, 8 ranks: p50 {costs_s[25] * 1e3:.2f} ms, "
          f"max {costs_s[-1] * 1e3:.2f} ms")  # fmt: skip
    assert costs_s[25] < 0.05
