"""Output reservations in the gateway (ISSUE 11): the router in-process over loopback in front of the
SGLang emulator, reservation_mode predicted vs max, clients asking max_tokens far above the real answer."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import openai
import orjson
import pytest
from gateway_support import MODEL, emulator, get_json, ranks_settled, router
from typer.testing import CliRunner

from router.backends.base import BackendInfo
from router.cli import app
from router.config import ConfigError, Settings, load_settings
from router.gateway.flight import Flight
from router.gateway.output_plan import plan_request
from router.gateway.runtime import Gateway
from router.placement.snapshot import RankKey, RequestShape
from router.reservation.histogram import bin_of, bin_upper_tokens
from router.reservation.modes import ReservationMode
from router.reservation.predictor import RequestKey
from router.sizing import Sized, Sizer
from router.telemetry import Metrics
from router.units import round_up

pytestmark = pytest.mark.anyio

PROMPT_IDS = list(range(1, 101))  # 100 prompt tokens, counted exactly (token ids)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


# ---- settings and flags ------------------------------------------------------------------------------------
async def test_reservation_settings_default_to_max_and_refuse_bad_values_in_one_line() -> None:
    default = Settings()
    assert (
        default.reservation_settings().mode is ReservationMode.MAX and default.reservation_step_tokens == 64
    )
    s = load_settings(reservation_mode=" Predicted ", reservation_bound="BERNSTEIN", reservation_quantile=0.3)
    res = s.reservation_settings()
    assert (res.mode, res.bound, res.predictor.quantile) == (ReservationMode.PREDICTED, "bernstein", 0.3)
    for bad in ({"reservation_mode": "guess"}, {"reservation_quantile": 1.0}, {"reservation_bound": "loose"},
                {"reservation_target_preemption_rate": 0}, {"reservation_step_tokens": -1},
                {"reservation_share_interval_s": 0}):  # fmt: skip
        with pytest.raises(ConfigError, match="reservation_"):
            load_settings(**bad)
    result = CliRunner().invoke(app, ["serve", "--backend", "sglang=http://x", "--reservation-mode", "guess"])
    assert result.exit_code == 2 and "unknown reservation mode 'guess'" in result.output


# ---- report_tokens, token by token, against the real ledger (no HTTP) ------------------------------------
@asynccontextmanager
async def one_rank_gateway(page: int, step: int, capacity: int = 100_000) -> AsyncIterator[Gateway]:
    settings = Settings(
        backends=["sglang=http://127.0.0.1:9"], reservation_mode="predicted", reservation_step_tokens=step
    )
    gw = Gateway(settings, Metrics())
    name = settings.backend_specs()[0].name
    gw.store.set_info(
        BackendInfo(name, "sglang", "http://127.0.0.1:9", ("m",), 1, page, 1 << 20, (capacity,))
    )
    await gw.ledger.register({RankKey(name, 0): capacity})
    try:
        yield gw
    finally:
        await gw.stop()


def expected_reservations(prompt: int, first: int, limit: int, page: int, step: int) -> list[int]:
    """What the ledger must hold after each generated token g = 0..limit: the next token (prompt + g + 1)
    always fits; growth goes to the page boundary at or above prompt + g + 1 + step, never past the
    page-rounded prompt + limit."""
    out, held = [], first
    for g in range(limit + 1):
        if prompt + g + 1 > held:
            held = max(round_up(prompt + g + 1, page), min(round_up(prompt + g + 1 + step, page),
                                                           round_up(prompt + limit, page)))  # fmt: skip
        out.append(held)
    return out


@pytest.mark.parametrize(("page", "step"), [(1, 0), (16, 0), (64, 0), (16, 24), (1, 64)])
async def test_report_tokens_grows_exactly_to_cover_the_next_token(page: int, step: int) -> None:
    prompt, limit = 100, 300
    async with one_rank_gateway(page, step) as gw:
        sized = Sized(prompt, limit, 1, limit, limit_given=True, exact=True)
        plan = plan_request(gw.book, "/generate", "m", sized, "", stream=True)
        assert plan is not None and plan.output_tokens < limit  # cold predictor: the prior's median
        flight = Flight("r1", "/generate", sized, RequestShape(prompt, plan.output_tokens), True, plan=plan)
        gw.begin(flight)
        key = await gw.placer.place(flight, list(gw.store.ranks()))
        first = round_up(prompt + plan.output_tokens, page)
        want = expected_reservations(prompt, first, limit, page, step)
        held = await gw.ledger.get("r1")
        assert held is not None and held.tokens == first == want[0]
        assert flight.grow_at_tokens == first - prompt  # g at which prompt + g + 1 > first
        growths = 0
        for g in range(1, limit + 1):
            flight.on_tokens(gw.load, 1)
            if g >= flight.grow_at_tokens:  # the relay's trigger (and every token otherwise: a no-op)
                growths += 1
            await gw.report_tokens(flight)
            held = await gw.ledger.get("r1")
            assert held is not None and held.tokens == want[g], (g, held.tokens, want[g])
            assert held.tokens >= prompt + g + 1 or held.tokens == round_up(prompt + limit, page)
            assert held.tokens % page == 0
            if step == 0 and g < limit:  # closed form: exactly the page holding the next token
                assert held.tokens == max(first, round_up(prompt + g + 1, page))
        assert growths == len(set(want)) - 1  # the trigger fires exactly once per growth
        assert (await gw.ledger.usage())[key].reserved_tokens == want[-1]
        await gw.finish(flight, 200)
        assert (await gw.ledger.usage())[key].reserved_tokens == 0
        assert len(gw.book) == 0
        assert gw.book.predictor.weight(RequestKey("/generate", "m", prompt)) > 0  # it learned the length


async def test_an_aborted_request_teaches_nothing_and_releases() -> None:
    async with one_rank_gateway(16, 0) as gw:
        sized = Sized(100, 300, 1, 300, limit_given=True, exact=True)
        plan = plan_request(gw.book, "/generate", "m", sized, "", stream=True)
        assert plan is not None
        flight = Flight("r2", "/generate", sized, RequestShape(100, plan.output_tokens), True, plan=plan)
        gw.begin(flight)
        await gw.placer.place(flight, list(gw.store.ranks()))
        flight.on_tokens(gw.load, 200)
        await gw.report_tokens(flight)
        flight.outcome = "client_disconnect"
        await gw.finish(flight, 200)
        assert all(u.reserved_tokens == 0 for u in (await gw.ledger.usage()).values())
        assert len(gw.book) == 0 and len(gw.book.predictor) == 0


# ---- end to end: openai client → router → SGLang emulator ----------------------------------------------
def chat_body(real_tokens: int) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": "Summarise the reservation design. " * 12}],
            "extra_body": {"emulator_output_tokens": real_tokens}}  # fmt: skip


async def rank_rows(url: str) -> list[dict[str, Any]]:
    body = await get_json(url + "/ranks")
    return [r for b in body["backends"] for r in b["ranks"]]


async def stream_chat(client: openai.AsyncOpenAI, real: int, max_tokens: int, **extra: Any) -> int:
    """One streamed chat completion; returns the completion tokens the engine reported."""
    stream = await client.chat.completions.create(
        model=MODEL, max_tokens=max_tokens, stream=True, stream_options={"include_usage": True},
        **chat_body(real), **extra,
    )  # fmt: skip
    used = 0
    async for chunk in stream:
        if chunk.usage is not None:
            used = chunk.usage.completion_tokens
    return used


async def held_per_request(url: str, want_inflight: int, timeout_s: float = 10.0) -> float:
    """Reserved tokens per in-flight request once ``want_inflight`` requests are in flight."""
    for _ in range(int(timeout_s / 0.01)):
        rows = await rank_rows(url)
        inflight = sum(r["inflight"] for r in rows)
        if inflight >= want_inflight:
            return sum(r["reserved_tokens"] for r in rows) / inflight
        await asyncio.sleep(0.01)
    raise AssertionError(f"never saw {want_inflight} requests in flight")


@pytest.mark.parametrize("mode", ["predicted", "max"])
async def test_reservations_follow_the_real_output_not_max_tokens(mode: str) -> None:
    """Clients ask 8x the real answer. After warm-up, predicted reserves about the real answer (the
    learned median, at most one bin above); max reserves prompt + max_tokens, as it always did."""
    real, page = 48, 16
    prompt = (
        Sizer(default_max_tokens=512).prompt("/v1/chat/completions", chat_body(real)).per_sequence_tokens[0]
    )
    with emulator(dp_size=2, kv_tokens_per_rank=32768, time_scale=0.5, page_size=page) as emu:
        async with router(backends=[f"sglang={emu.url}"], reservation_mode=mode) as url:
            client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
            try:
                warm = await asyncio.gather(*(stream_chat(client, real, 8 * real) for _ in range(20)))
                assert warm == [real] * 20  # the engine is never capped at the prediction
                batch = [asyncio.create_task(stream_chat(client, real, 8 * real)) for _ in range(6)]
                per_request = await held_per_request(url, 6)
                assert await asyncio.gather(*batch) == [real] * 6
            finally:
                await client.close()
            if mode == "max":
                assert per_request == round_up(prompt + 8 * real, page)
            else:  # it learned the real length (the usage chunk's exact count): its bin's top at most
                upper = bin_upper_tokens(bin_of(real))
                assert round_up(prompt + real, page) <= per_request <= round_up(prompt + upper, page)
            assert all(r["reserved_tokens"] == 0 for r in await ranks_settled(url))


async def generate(
    http: httpx.AsyncClient, max_new: int, real: int | None = None, on_event: Any = None, **headers: str
) -> int:
    """One streamed SGLang /generate of 100 prompt tokens; returns the engine's completion tokens.
    ``on_event(generated)`` is awaited after every event (the engine's exact count so far)."""
    body: dict[str, Any] = {"input_ids": PROMPT_IDS, "sampling_params": {"max_new_tokens": max_new},
                            "stream": True}  # fmt: skip
    if real is not None:
        body["emulator_output_tokens"] = real
    generated = 0
    async with http.stream("POST", "/generate", json=body, headers=headers) as resp:
        assert resp.status_code == 200, await resp.aread()
        async for line in resp.aiter_lines():
            if line.startswith("data: {"):
                generated = orjson.loads(line[6:])["meta_info"]["completion_tokens"]
                if on_event is not None:
                    await on_event(generated)
    return generated


async def test_growth_past_the_prediction_is_page_exact_over_http() -> None:
    """Warm up on 16-token answers, then one answer of 80: the ledger holds exactly the page holding the
    next token, grown one page at a time (step 0), whatever the client asked for."""
    page, prompt, real = 16, len(PROMPT_IDS), 80
    with emulator(dp_size=1, kv_tokens_per_rank=16384, time_scale=1.0, page_size=page) as emu:
        async with (
            router(
                backends=[f"sglang={emu.url}"], reservation_mode="predicted", reservation_step_tokens=0
            ) as url,
            httpx.AsyncClient(base_url=url, timeout=30) as http,
        ):
            assert await asyncio.gather(*(generate(http, 128, 16) for _ in range(20))) == [16] * 20
            first = round_up(prompt + bin_upper_tokens(bin_of(16)), page)  # the learned median's bin top
            samples: list[tuple[int, int]] = []

            async def look(generated: int) -> None:  # one client kept open: a /ranks read takes ~3 ms
                rows = (await http.get("/ranks")).json()["backends"][0]["ranks"]
                samples.append((generated, rows[0]["reserved_tokens"]))

            assert await generate(http, 8 * real, real, look) == real
            assert all(r["reserved_tokens"] == 0 for r in await ranks_settled(url))

    def want(g: int) -> int:  # prompt + g + 1 always held, in whole pages, from the first reservation on
        return max(first, round_up(prompt + g + 1, page))

    assert samples[0][0] < first - prompt and samples[0][1] == first  # an event may carry a few tokens
    for g, held in samples[:-1]:  # the router may be a few steps (~24 ms each) ahead of this client
        assert held % page == 0 and held >= prompt + g + 1, (g, held)
        assert held in {want(g + ahead) for ahead in range(10)}, (g, held, want(g))
    grown_to = sorted({held for _, held in samples[:-1]})  # the last event may find it released
    assert grown_to == list(range(first, want(real - 1) + 1, page))  # every page step, none skipped


POOL_TOKENS, ASK_TOKENS, OVERCOMMIT_REQUESTS = 4096, 1600, 96


async def test_moderate_overcommit_runs_without_preemption() -> None:
    """A seeded run: answers ~ lognormal(mean 200), clients ask 1,600 (8x). Once it has learned, predicted
    runs several times what prompt + max_tokens reservations allow on the pools at once (measured: 18 vs 4
    requests, 3.7x over-commit, reservations at 85 % of a pool), and the engine never preempts."""
    run = await overcommit_run("predicted", concurrency=40)
    assert run["ok"] == OVERCOMMIT_REQUESTS and run["settled"]
    assert run["preemptions"] == 0
    max_mode_inflight = 2 * (POOL_TOKENS // round_up(len(PROMPT_IDS) + ASK_TOKENS, 16))
    assert run["peak_inflight"] >= 2 * max_mode_inflight
    assert run["overcommit"] >= 2.0  # prompt + max_tokens of what ran at once, over both pools


async def overcommit_run(mode: str, concurrency: int) -> dict[str, Any]:
    emu_kw = {"dp_size": 2, "kv_tokens_per_rank": POOL_TOKENS, "page_size": 16, "time_scale": 0.1,
              "output_len_dist": "lognormal:200:0.5", "seed": 7}  # fmt: skip
    with emulator(**emu_kw) as emu:
        async with (
            router(backends=[f"sglang={emu.url}"], reservation_mode=mode) as url,
            httpx.AsyncClient(base_url=url, timeout=60) as http,
        ):
            peak = peak_reserved = peak_used = 0
            done = asyncio.Event()

            async def watch() -> None:
                nonlocal peak, peak_reserved, peak_used
                while not done.is_set():
                    rows = (await http.get("/ranks")).json()["backends"][0]["ranks"]
                    peak = max(peak, sum(r["inflight"] for r in rows))
                    peak_reserved = max(peak_reserved, *(r["reserved_tokens"] for r in rows))
                    peak_used = max(peak_used, *(r["engine_used_tokens"] or 0 for r in rows))
                    await asyncio.sleep(0.005)

            watcher = asyncio.create_task(watch())
            sem = asyncio.Semaphore(concurrency)

            async def one() -> int:
                async with sem:
                    return await generate(http, ASK_TOKENS)

            lengths = await asyncio.gather(*(one() for _ in range(OVERCOMMIT_REQUESTS)))
            done.set()
            await watcher
            stats = await get_json(emu.url + "/_emulator/stats")
            settled = all(r["reserved_tokens"] == 0 and r["inflight"] == 0 for r in await ranks_settled(url))
    asked = len(PROMPT_IDS) + ASK_TOKENS
    return {"ok": sum(1 for n in lengths if n > 0), "preemptions": stats["preemptions_total"],
            "peak_inflight": peak, "overcommit": peak * asked / (2 * POOL_TOKENS),
            "engine_s": stats["engine_clock_s"], "settled": settled, "tokens": sum(lengths),
            "peak_reserved_util": peak_reserved / POOL_TOKENS,
            "peak_used_util": peak_used / POOL_TOKENS}  # fmt: skip


async def test_client_hints_are_learned_apart_and_bad_hints_refused() -> None:
    """X-KVRouter-Output-Hint splits otherwise identical requests: short and long answers each get their
    own median. A hint outside [A-Za-z0-9_.-]{1,64} is a 400 in the OpenAI error shape."""
    page, prompt = 16, len(PROMPT_IDS)
    with emulator(dp_size=1, kv_tokens_per_rank=32768, time_scale=0.3, page_size=page) as emu:
        async with (
            router(backends=[f"sglang={emu.url}"], reservation_mode="predicted") as url,
            httpx.AsyncClient(base_url=url, timeout=30) as http,
        ):
            hint = "x-kvrouter-output-hint"
            warm = [generate(http, 1280, 16, **{hint: "summary.v1"}) for _ in range(20)]
            warm += [generate(http, 1280, 160, **{hint: "essay_v2"}) for _ in range(20)]
            assert sorted(await asyncio.gather(*warm)) == [16] * 20 + [160] * 20
            held: dict[str, int] = {}
            for label, real in (("summary.v1", 16), ("essay_v2", 160)):
                await ranks_settled(url)  # a client sees [DONE] a moment before the router releases

                async def look(generated: int, label: str = label) -> None:
                    if label not in held:  # the first event: a few tokens at most, far from any growth
                        held[label] = (await http.get("/ranks")).json()["backends"][0]["ranks"][0][
                            "reserved_tokens"
                        ]

                assert await generate(http, 1280, real, look, **{hint: label}) == real
            assert held == {
                "summary.v1": round_up(prompt + bin_upper_tokens(bin_of(16)), page),
                "essay_v2": round_up(prompt + bin_upper_tokens(bin_of(160)), page),
            }
            for bad in ("has space", "x" * 65, "semi;colon"):
                resp = await http.post("/generate", json={"input_ids": PROMPT_IDS}, headers={hint: bad})
                assert resp.status_code == 400
                assert resp.json()["error"]["param"] == "X-KVRouter-Output-Hint"
            assert all(r["reserved_tokens"] == 0 for r in await ranks_settled(url))
