"""Reservation metrics on /metrics: what the book predicts, grows and learns, after predicted-mode traffic
through the router in front of the SGLang emulator (and, for a refused growth, the gateway's own
report_tokens against a rank held full), with bounded labels only."""

from __future__ import annotations

import asyncio
import subprocess
from typing import Any

import httpx
import pytest
from gateway_support import router
from observability_support import parse, promtool, scrape, select, total

from router.backends.base import BackendInfo
from router.config import Settings
from router.gateway.flight import Flight
from router.gateway.output_plan import plan_request
from router.gateway.runtime import Gateway
from router.placement.snapshot import RankKey, RequestShape
from router.reservation.histogram import bin_of, bin_upper_tokens
from router.sizing import Sized
from router.telemetry import Metrics
from router.units import round_up

pytestmark = pytest.mark.anyio
PROMPT_IDS = list(range(1, 101))  # 100 prompt tokens, counted exactly
HINT = "tenant-secret-hint"  # a client value: keys the predictor, never a label


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


async def _generate(http: httpx.AsyncClient, real: int, max_new: int = 512) -> None:
    body = {"input_ids": PROMPT_IDS, "sampling_params": {"max_new_tokens": max_new}, "stream": True,
            "emulator_output_tokens": real}  # fmt: skip
    async with http.stream("POST", "/generate", json=body, headers={"x-kvrouter-output-hint": HINT}) as resp:
        assert resp.status_code == 200
        async for _ in resp.aiter_bytes():
            pass


async def test_predicted_traffic_shows_predictions_growths_learning_and_the_quantile(
    start_emulator: Any,
) -> None:
    """20 answers of 16 tokens teach the median; one of 80 then grows page by page (step 0) from the
    learned median's bin to the page holding its last token. Every number is exact."""
    page, warm = 16, 20
    emu = start_emulator("sglang", dp_size=1, kv_tokens_per_rank=16384, page_size=page, time_scale=0.2)
    async with (
        router(
            backends=[f"sglang={emu.url}"], reservation_mode="predicted", reservation_step_tokens=0
        ) as url,
        httpx.AsyncClient(base_url=url, timeout=30) as http,
    ):
        _, cold = await scrape(url)
        assert total(cold, "kvrouter_reservation_growths_total") == 0
        assert select(cold, "kvrouter_reservation_growths_total", outcome="refused")  # zero, there for rate()
        await asyncio.gather(*(_generate(http, 16) for _ in range(warm)))
        await _generate(http, 80)
        text, m = await scrape(url)
    learned_tokens = bin_upper_tokens(bin_of(16))
    first = round_up(len(PROMPT_IDS) + learned_tokens, page)
    last = round_up(len(PROMPT_IDS) + 80, page)  # the page holding token 80 (prompt + 79 + 1)
    (model,) = {dict(lv)["model"] for lv in select(m, "kvrouter_reservation_predicted_output_tokens_count")}
    labels = {"route": "/generate", "model": model}
    assert total(m, "kvrouter_reservation_predicted_output_tokens_count", **labels) == warm + 1
    assert total(m, "kvrouter_reservation_learned_requests_total", route="/generate") == warm + 1
    assert total(m, "kvrouter_reservation_growths_total", outcome="ok") == (last - first) // page
    assert total(m, "kvrouter_reservation_growths_total", outcome="refused") == 0
    assert total(m, "kvrouter_reservation_predicted_output_tokens_bucket", le="+Inf", **labels) == warm + 1
    quantile = select(m, "kvrouter_reservation_predicted_quantile_tokens", **labels)
    assert list(quantile.values()) == [learned_tokens]  # the route's level: 21 lengths >= min_weight
    assert HINT not in text and "tenant" not in text
    label_names = {k for (name, lv) in m if name.startswith("kvrouter_reservation_") for k, _ in lv}
    assert label_names <= {"route", "model", "outcome", "le"}


async def test_a_refused_growth_is_counted_and_the_scrape_passes_promtool() -> None:
    """A rank held full by another reservation: the stream passes its reservation, the ledger refuses the
    growth, the request runs on; refused and ok are counted apart."""
    page, prompt, capacity = 16, 100, 512
    settings = Settings(
        backends=["sglang=http://127.0.0.1:9"], reservation_mode="predicted", reservation_step_tokens=0
    )
    gw = Gateway(settings, Metrics())
    name = settings.backend_specs()[0].name
    gw.store.set_info(
        BackendInfo(name, "sglang", "http://127.0.0.1:9", ("m",), 1, page, 1 << 20, (capacity,))
    )
    key = RankKey(name, 0)
    await gw.ledger.register({key: capacity})
    try:
        sized = Sized(prompt, 300, 1, 300, limit_given=True, exact=True)
        plan = plan_request(gw.book, "/generate", "m", sized, "", stream=True)
        assert plan is not None
        flight = Flight("r1", "/generate", sized, RequestShape(prompt, plan.output_tokens), True, plan=plan)
        gw.begin(flight)
        await gw.placer.place(flight, [key])
        held = await gw.ledger.get("r1")
        assert held is not None
        flight.on_tokens(gw.load, held.tokens - prompt)  # the next token no longer fits: growth is due
        await gw.report_tokens(flight)  # room left: granted
        grown = await gw.ledger.get("r1")
        assert grown is not None and grown.tokens > held.tokens
        assert await gw.ledger.reserve("other", [key], capacity - grown.tokens) == key  # the rank is full
        flight.on_tokens(gw.load, grown.tokens - prompt - flight.generated_tokens)
        await gw.report_tokens(flight)  # refused: the request runs on, its reservation unchanged
        after = await gw.ledger.get("r1")
        assert after is not None and after.tokens == grown.tokens
        await gw.finish(flight, 200)
        text = gw.metrics.render().decode()
    finally:
        await gw.stop()
    m = parse(text)
    assert total(m, "kvrouter_reservation_growths_total", outcome="ok") == 1
    assert total(m, "kvrouter_reservation_growths_total", outcome="refused") == 1
    assert total(m, "kvrouter_reservation_learned_requests_total", route="/generate") == 1
    proc = await asyncio.to_thread(_promtool_check, text)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def _promtool_check(text: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [promtool(), "check", "metrics"], input=text, capture_output=True, text=True, timeout=30
    )
