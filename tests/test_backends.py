"""Engine adapters against real loopback servers serving the engines' wire formats."""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
import pytest
from backends_fakes import MODEL, FakeSGLang, FakeVLLM, serve

from router.backends.base import (
    BackendError,
    BackendSpec,
    NotDiscovered,
    RankOutOfRange,
    UnsupportedRoute,
)
from router.backends.factory import make_backend
from router.backends.sglang import SGLangBackend
from router.backends.vllm import VLLMBackend, VLLMExternalBackend

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
async def http() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient() as client:
        yield client


def sglang(url: str, timeout_s: float = 2.0) -> SGLangBackend:
    backend = make_backend(BackendSpec.parse(f"sglang={url}"), timeout_s=timeout_s)
    assert isinstance(backend, SGLangBackend)
    return backend


# -- SGLang ---------------------------------------------------------------------------------------------


async def test_sglang_discovery_reads_per_rank_capacity_page_and_context(http: httpx.AsyncClient) -> None:
    fake = FakeSGLang()
    async with serve(fake.app()) as url:
        info = await sglang(url).discover(http)
    assert info.dp_size == 8
    assert info.page_size == 64
    assert info.max_model_len == 163_840
    assert info.models == (MODEL,)
    # internal_states differ per rank in the fake: rank 0's top-level value must not be copied to all
    assert info.capacities_tokens == tuple(412_160 + r * 64 for r in range(8))
    assert info.extra["capacity_source"] == "internal_states"


async def test_sglang_0_5_23_attn_dp_size_counts_the_ranks(http: httpx.AsyncClient) -> None:
    # Launched with the deprecated --enable-dp-attention, 0.5.23 reports dp_size 1 and attn_dp_size 8.
    async with serve(FakeSGLang(attn_dp_size_field=True).app()) as url:
        info = await sglang(url).discover(http)
    assert info.dp_size == 8
    assert len(info.capacities_tokens) == 8


async def test_sglang_capacity_fallbacks_and_old_server_info_path(http: httpx.AsyncClient) -> None:
    fake = FakeSGLang(dp=4, internal_states=False, has_server_info=False)
    async with serve(fake.app()) as url:
        info = await sglang(url).discover(http)
        assert info.extra["capacity_source"] == "/v1/loads"
        assert info.capacities_tokens == tuple(412_160 + r * 64 for r in range(4))
        fake.has_v1_loads = False
        info = await sglang(url).discover(http)
    assert info.extra["capacity_source"] == "max_total_num_tokens"
    assert info.capacities_tokens == (412_160,) * 4


async def test_sglang_pin_uses_both_body_fields_and_header_only_on_openai_routes(
    http: httpx.AsyncClient,
) -> None:
    async with serve(FakeSGLang().app()) as url:
        backend = sglang(url)
        with pytest.raises(NotDiscovered):
            backend.upstream(0, "/v1/chat/completions")
        await backend.discover(http)
    chat = backend.upstream(3, "/v1/chat/completions")
    assert chat.url == f"{url}/v1/chat/completions"
    assert dict(chat.body_fields) == {"routed_dp_rank": 3, "data_parallel_rank": 3}
    assert dict(chat.headers) == {"X-Data-Parallel-Rank": "3"}
    gen = backend.upstream(7, "/generate")
    assert dict(gen.body_fields) == {"routed_dp_rank": 7, "data_parallel_rank": 7}
    assert dict(gen.headers) == {}  # /generate ignores the header upstream
    for bad in (8, -1):  # old SGLang crashes on >= dp and silently wraps negatives
        with pytest.raises(RankOutOfRange):
            backend.upstream(bad, "/v1/completions")
    with pytest.raises(UnsupportedRoute):
        backend.upstream(0, "/v1/embeddings")  # type: ignore[arg-type]


async def test_sglang_per_rank_urls_pin_by_url(http: httpx.AsyncClient) -> None:
    fake = FakeSGLang(dp=2)
    async with serve(fake.app()) as url0, serve(FakeSGLang(dp=2).app()) as url1:
        backend = sglang(f"{url0},{url1}")
        info = await backend.discover(http)
        assert info.dp_size == 2 and info.extra["pin"] == "url"
        up = backend.upstream(1, "/v1/completions")
        assert up.url == f"{url1}/v1/completions" and not up.headers and not up.body_fields
        with pytest.raises(BackendError, match="dp_size is 2 but 3"):
            await sglang(f"{url0},{url1},{url1}").discover(http)


async def test_sglang_poll_prefers_v1_loads_then_falls_back_to_metrics(http: httpx.AsyncClient) -> None:
    fake = FakeSGLang(dp=4, used=[100, 2000, 0, 64], running=[1, 3, 0, 1])
    async with serve(fake.app()) as url:
        backend = sglang(url)
        await backend.discover(http)
        polled = await backend.poll(http)
        assert backend.load_source == "/v1/loads"
        assert [t.used_tokens for t in polled] == [100, 2000, 0, 64]
        assert [t.running for t in polled] == [1, 3, 0, 1]
        assert [t.waiting for t in polled] == [1, 1, 1, 1]
        assert [t.preemptions_total for t in polled] == [0, 1, 2, 3]  # from the periodic /metrics scrape
        assert polled[1].capacity_tokens == 412_160 + 64
        fake.has_v1_loads = False
        fake.used[2] = 777
        backend.load_source = None  # a fresh adapter against an older server
        polled = await backend.poll(http)
        assert backend.load_source == "/metrics"
        assert [t.used_tokens for t in polled] == [100, 2000, 777, 64]


async def test_sglang_rank_missing_from_report_is_unhealthy(http: httpx.AsyncClient) -> None:
    fake = FakeSGLang(dp=4, silent_ranks={2})
    async with serve(fake.app()) as url:
        backend = sglang(url)
        await backend.discover(http)
        polled = await backend.poll(http)
    assert [t.healthy for t in polled] == [True, True, False, True]


async def test_sglang_abort_posts_rid_and_never_raises(http: httpx.AsyncClient) -> None:
    fake = FakeSGLang(dp=2)
    async with serve(fake.app()) as url:
        backend = sglang(url)
        await backend.abort(http, 1, "req-42")
        assert fake.aborted == ["req-42"]
    await backend.abort(http, 1, "req-43")  # server gone: best effort, no exception


async def test_sglang_unreachable_is_a_one_line_backend_error(http: httpx.AsyncClient) -> None:
    async with serve(FakeSGLang().app()) as url:
        pass  # the port is now closed
    with pytest.raises(BackendError) as err:
        await sglang(url, timeout_s=0.5).discover(http)
    assert "\n" not in str(err.value) and url in str(err.value)


async def test_timeout_bounds_a_hanging_engine(http: httpx.AsyncClient) -> None:
    fake = FakeSGLang(hang=True)
    async with serve(fake.app(), fake.release) as url:
        with pytest.raises(BackendError, match=r"no answer within 0\.2 s"):
            await sglang(url, timeout_s=0.2).discover(http)


# -- vLLM -----------------------------------------------------------------------------------------------


async def test_vllm_internal_discovery_divides_summed_blocks(http: httpx.AsyncClient) -> None:
    fake = FakeVLLM(engines=list(range(8)), blocks_per_engine=25_000, block_size=16)
    async with serve(fake.app()) as url:
        backend = make_backend(BackendSpec.parse(f"vllm={url}"))
        assert isinstance(backend, VLLMBackend)
        info = await backend.discover(http)
        assert info.dp_size == 8 and info.page_size == 16 and info.max_model_len == 163_840
        assert info.capacities_tokens == (400_000,) * 8  # 8 × 25k blocks summed → 25k × 16 per rank
        fake.size_tokens_label, fake.blocks_per_engine = True, 30_000
        info = await backend.discover(http)
    assert info.capacities_tokens == (480_000,) * 8  # per-engine kv_cache_size_tokens wins


async def test_vllm_internal_pin_and_poll_per_engine(http: httpx.AsyncClient) -> None:
    fake = FakeVLLM(engines=list(range(4)), blocks_per_engine=1000, block_size=64)
    async with serve(fake.app()) as url:
        backend = make_backend(BackendSpec.parse(f"vllm={url}"))
        await backend.discover(http)
        fake.usage = {1: 0.5, 3: 0.25}
        fake.running = {1: 7}
        polled = await backend.poll(http)
        fake.engines = [0, 1, 3]  # engine 2's series vanish
        after = await backend.poll(http)
    assert [t.used_tokens for t in polled] == [0, 32_000, 0, 16_000]
    assert [t.running for t in polled] == [0, 7, 0, 0]
    assert [t.preemptions_total for t in polled] == [0, 1, 2, 3]
    assert [t.healthy for t in after] == [True, True, False, True]
    up = backend.upstream(2, "/v1/chat/completions")
    assert up.url == f"{url}/v1/chat/completions" and dict(up.headers) == {"X-data-parallel-rank": "2"}
    assert not up.body_fields
    with pytest.raises(UnsupportedRoute, match="/generate"):
        backend.upstream(0, "/generate")
    with pytest.raises(RankOutOfRange):
        backend.upstream(4, "/v1/completions")


async def test_vllm_external_one_url_per_rank(http: httpx.AsyncClient) -> None:
    fakes = [FakeVLLM(engines=[r], blocks_per_engine=1000 + r, summed=False) for r in range(3)]
    async with (
        serve(fakes[0].app()) as u0,
        serve(fakes[1].app()) as u1,
        serve(fakes[2].app(), fakes[2].release) as u2,
    ):
        backend = make_backend(BackendSpec.parse(f"vllm-external={u0},{u1},{u2}"), timeout_s=0.3)
        assert isinstance(backend, VLLMExternalBackend)
        info = await backend.discover(http)
        assert info.dp_size == 3
        assert info.capacities_tokens == (16_000, 16_016, 16_032)  # each its own, unsummed
        up = backend.upstream(1, "/v1/completions")
        assert up.url == f"{u1}/v1/completions" and not up.headers and not up.body_fields
        fakes[1].usage = {1: 1.0}
        fakes[2].hang = True
        polled = await backend.poll(http)
    assert [t.used_tokens for t in polled[:2]] == [0, 16_016]
    assert [t.healthy for t in polled] == [True, True, False]  # only the hanging rank
    with pytest.raises(UnsupportedRoute):
        backend.upstream(0, "/generate")


async def test_vllm_without_cache_config_is_not_ready(http: httpx.AsyncClient) -> None:
    fake = FakeVLLM(engines=[])
    async with serve(fake.app()) as url:
        with pytest.raises(BackendError, match="cache_config_info"):
            await make_backend(BackendSpec.parse(f"vllm={url}")).discover(http)


def test_factory_rejects_bad_timeout_and_spec_rejects_multi_url_vllm() -> None:
    with pytest.raises(ValueError, match="positive"):
        make_backend(BackendSpec.parse("sglang=http://127.0.0.1:1"), timeout_s=0)
    with pytest.raises(ValueError, match="exactly one URL"):
        BackendSpec.parse("vllm=http://127.0.0.1:1,http://127.0.0.1:2")
