"""The emulated SGLang / vLLM servers, through real sockets and the real openai client."""

from __future__ import annotations

import time
from typing import Any

import httpx
import openai
import pytest
from emulator_fixtures import StartEmulator
from prometheus_client.parser import text_string_to_metric_families

MODEL = "deepseek-ai/DeepSeek-V3"


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def _metrics(url: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    text = httpx.get(url + "/metrics").text
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out.setdefault(s.name, []).append((s.labels, s.value))
    return out


def _wait_for(predicate: Any, timeout_s: float = 5.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if value := predicate():
            return value
        time.sleep(0.02)
    raise AssertionError("condition not met in time")


@pytest.mark.anyio
@pytest.mark.parametrize("engine", ["sglang", "vllm"])
async def test_openai_client_chat_and_completions(start_emulator: StartEmulator, engine: str) -> None:
    emu = start_emulator(engine)
    async with openai.AsyncOpenAI(base_url=emu.url + "/v1", api_key="x", max_retries=0) as client:
        stream = await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hello there"}], max_tokens=10, stream=True,
            stream_options={"include_usage": True},
        )  # fmt: skip
        text, finish, usage = "", None, None
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
                finish = chunk.choices[0].finish_reason or finish
            if chunk.usage:
                usage = chunk.usage
        assert usage is not None and usage.completion_tokens == 10 and usage.prompt_tokens == 4 + 3
        assert len(text) == 40 and finish == "length"
        chat = await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}])
        assert chat.usage is not None and chat.usage.completion_tokens == 16  # its own length, not max_tokens
        assert chat.choices[0].finish_reason == "stop" and len(chat.choices[0].message.content or "") == 64
        comp = await client.completions.create(model=MODEL, prompt="abcdefgh", max_tokens=5)
        assert comp.usage is not None and (comp.usage.prompt_tokens, comp.usage.completion_tokens) == (2, 5)
        parts = [c.choices[0].text async for c in await client.completions.create(
            model=MODEL, prompt=[1, 2, 3], max_tokens=3, stream=True) if c.choices]  # fmt: skip
        assert "".join(parts) == comp.choices[0].text[:12]


def test_sglang_generate_stream_and_pin(start_emulator: StartEmulator) -> None:
    emu = start_emulator("sglang", dp_size=4, time_scale=0.5, output_len_dist="max")
    body = {"input_ids": list(range(100)), "sampling_params": {"max_new_tokens": 400}, "stream": True,
            "routed_dp_rank": 3, "rid": "pinned-1"}  # fmt: skip
    with httpx.Client(base_url=emu.url, timeout=10) as c:
        with c.stream("POST", "/generate", json=body) as r:
            assert r.headers["x-emulator-rank"] == "3"
            lines = r.iter_lines()  # keep the iterator: dropping it closes the connection
            assert next(lines).startswith("data: {")
            loads = c.get("/v1/loads").json()["loads"]  # observed while it runs
            assert [ld["num_running_reqs"] for ld in loads] == [0, 0, 0, 1]
            assert loads[3]["num_used_tokens"] > 100
            assert c.get("/v1/loads", params={"dp_rank": 3}).json()["loads"][0]["num_running_reqs"] == 1
            assert c.get("/_emulator/requests").json()["requests"][0]["rank"] == 3
        done = _wait_for(lambda: c.get("/_emulator/requests").json()["finished"])
        assert done[-1]["rid"] == "pinned-1" and done[-1]["rank"] == 3  # aborted by the disconnect
        c.post("/_emulator/faults", json={"abort_after_tokens": None})
        with c.stream("POST", "/generate", json={**body, "sampling_params": {"max_new_tokens": 16}}) as r:
            lines = [ln for ln in r.iter_lines() if ln.startswith("data: ")]
    final = httpx.Response(200, content=lines[-2][6:]).json()
    assert lines[-1] == "data: [DONE]" and final["meta_info"]["completion_tokens"] == 16
    assert final["meta_info"]["finish_reason"] == {"type": "length", "length": 16}
    assert len(final["output_ids"]) == 16 and len(final["text"]) == 64  # cumulative
    assert final["meta_info"]["prompt_tokens"] == 100


def test_sglang_info_endpoints(start_emulator: StartEmulator) -> None:
    emu = start_emulator("sglang", dp_size=2, page_size=64, kv_tokens_per_rank=8192, max_model_len=6000)
    info = httpx.get(emu.url + "/server_info").json()
    assert (info["dp_size"], info["page_size"], info["enable_dp_attention"]) == (2, 64, True)
    assert info["max_total_num_tokens"] == 8192 and len(info["internal_states"]) == 2
    assert info["internal_states"][1]["memory_usage"]["token_capacity"] == 8192
    assert httpx.get(emu.url + "/get_server_info").json()["served_model_name"] == MODEL
    assert httpx.get(emu.url + "/v1/models").json()["data"][0]["max_model_len"] == 6000
    assert [x["dp_rank"] for x in httpx.get(emu.url + "/get_load").json()] == [0, 1]
    assert httpx.get(emu.url + "/v1/loads", params={"include": "bogus"}).status_code == 400
    assert httpx.get(emu.url + "/health").status_code == 200


@pytest.mark.parametrize("engine", ["sglang", "vllm"])
def test_errors_have_the_engines_shapes(start_emulator: StartEmulator, engine: str) -> None:
    emu = start_emulator(engine, max_model_len=1000)
    chat = emu.url + "/v1/chat/completions"
    long_msg = {"model": MODEL, "messages": [{"role": "user", "content": "x" * 8000}]}
    r = httpx.post(chat, json=long_msg)
    assert r.status_code == 400
    expect = (
        "longer than the model's context length" if engine == "sglang" else "maximum context length is 1000"
    )
    assert expect in r.json()["error"]["message"] and set(r.json()["error"]) == {
        "message",
        "type",
        "param",
        "code",
    }
    ok = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    r = httpx.post(chat, json=ok, headers={"X-Data-Parallel-Rank": "5"})
    expect = (
        "routed_dp_rank=5 out of range [0, 2)"
        if engine == "sglang"
        else "data_parallel_rank 5 is out of range"
    )
    assert r.status_code == 400 and expect in r.json()["error"]["message"]
    r = httpx.post(chat, json=ok, headers={"X-Data-Parallel-Rank": "one"})
    assert r.status_code == (400 if engine == "sglang" else 200)  # vLLM silently ignores a non-integer
    assert httpx.post(chat, content=b"{not json").status_code == 400
    with pytest.raises(openai.BadRequestError):
        openai.OpenAI(base_url=emu.url + "/v1", api_key="x", max_retries=0).chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "y" * 8000}])  # fmt: skip
    big = httpx.post(chat, json={**ok, "max_tokens": 5000})  # SGLang refuses, vLLM clamps
    assert big.status_code == (400 if engine == "sglang" else 200)
    if engine == "sglang":
        assert httpx.post(emu.url + "/generate", json={"text": "hi", "routed_dp_rank": 2}).status_code == 400


def test_vllm_internal_lb_pin_and_metrics(start_emulator: StartEmulator) -> None:
    emu = start_emulator("vllm", dp_size=4, time_scale=0.5, page_size=16, output_len_dist="max")
    body = {"model": MODEL, "prompt": "p" * 400, "max_tokens": 1000, "stream": True}
    with httpx.stream(
        "POST", emu.url + "/v1/completions", json=body, headers={"X-data-parallel-rank": "2"}
    ) as r:
        lines = r.iter_lines()
        next(lines)
        m = _metrics(emu.url)
        running = {lb["engine"]: v for lb, v in m["vllm:num_requests_running"]}
        assert running == {"0": 0.0, "1": 0.0, "2": 1.0, "3": 0.0}
        usage = {lb["engine"]: v for lb, v in m["vllm:kv_cache_usage_perc"]}
        assert 0 < usage["2"] < 1 and usage["0"] == 0.0
    info = _metrics(emu.url)["vllm:cache_config_info"]
    assert len(info) == 4 and all(lb["num_gpu_blocks"] == str(4 * 4096 // 16) for lb, _ in info)  # summed
    assert {lb["kv_cache_size_tokens"] for lb, _ in info} == {"4096"} and info[0][0]["block_size"] == "16"
    m = _metrics(emu.url)
    assert {lb["engine"]: v for lb, v in m["vllm:generation_tokens_total"]}["2"] >= 1
    assert sum(v for _, v in m["vllm:time_to_first_token_seconds_count"]) == 1
    tok = httpx.post(emu.url + "/tokenize", json={"prompt": "abcdefgh"}).json()
    assert tok["count"] == 2 and tok["max_model_len"] == 163_840


def test_vllm_external_lb_one_server_per_rank(start_emulator: StartEmulator) -> None:
    emu = start_emulator("vllm", dp_size=3, external_lb=True)
    assert len(emu.urls) == 3
    ok = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    for rank, url in enumerate(emu.urls):
        r = httpx.post(url + "/v1/chat/completions", json=ok)
        assert r.status_code == 200 and r.headers["x-emulator-rank"] == str(rank)
        engines = {lb["engine"] for lb, _ in _metrics(url)["vllm:num_requests_running"]}
        assert engines == {str(rank)}
    r = httpx.post(emu.urls[1] + "/v1/chat/completions", json=ok, headers={"X-data-parallel-rank": "1"})
    assert r.status_code == 400 and "out of range [0, 1)" in r.json()["error"]["message"]
    r = httpx.post(emu.urls[1] + "/v1/chat/completions", json=ok, headers={"X-data-parallel-rank": "0"})
    assert r.headers["x-emulator-rank"] == "1"


def test_sglang_metrics_parse(start_emulator: StartEmulator) -> None:
    emu = start_emulator("sglang", dp_size=2)
    httpx.post(emu.url + "/generate", json={"text": "hello", "sampling_params": {"max_new_tokens": 4},
                                            "data_parallel_rank": 1})  # fmt: skip
    m = _metrics(emu.url)
    for name in (
        "sglang:num_running_reqs",
        "sglang:num_used_tokens",
        "sglang:token_usage",
        "sglang:num_queue_reqs",
        "sglang:max_total_num_tokens",
        "sglang:gen_throughput",
        "sglang:num_retracted_requests_total",
    ):
        labels = [lb for lb, _ in m[name]]  # fmt: skip
        assert [lb["dp_rank"] for lb in labels] == ["0", "1"] and labels[0]["model_name"] == MODEL
        assert {"engine_type", "tp_rank"} <= set(labels[0])
    assert m["sglang:prompt_tokens_total"][0][1] == 2 and m["sglang:generation_tokens_total"][0][1] == 4
    assert m["sglang:time_to_first_token_seconds_count"][0][1] == 1


def test_client_disconnect_aborts_in_engine(start_emulator: StartEmulator) -> None:
    emu = start_emulator("sglang", time_scale=0.05, output_len_dist="max")
    body = {"model": MODEL, "prompt": "x", "max_tokens": 2000, "stream": True}
    with httpx.stream("POST", emu.url + "/v1/completions", json=body) as r:
        next(r.iter_lines())
    stats = _wait_for(lambda: (s := httpx.get(emu.url + "/_emulator/stats").json())["inflight"] == 0 and s)
    assert stats["client_disconnects"] == 1 and stats["orphaned_requests"] == 0
    assert all(ld["num_used_tokens"] == 0 for ld in httpx.get(emu.url + "/v1/loads").json()["loads"])
    assert httpx.get(emu.url + "/_emulator/requests").json()["finished"][-1]["finish_reason"] == "abort"


def test_runtime_faults(start_emulator: StartEmulator) -> None:
    emu = start_emulator("sglang", dp_size=2)
    faults = emu.url + "/_emulator/faults"
    ok = {"text": "hi", "sampling_params": {"max_new_tokens": 30}}
    assert httpx.post(faults, json={"down_ranks": [1]}).json()["down_ranks"] == [1]
    r = httpx.post(emu.url + "/generate", json={**ok, "routed_dp_rank": 1})
    assert r.status_code == 503 and "not active" in r.json()["error"]["message"]
    assert httpx.post(faults, json={"down_ranks": [], "ignore_pin": True}).status_code == 200
    ranks = {httpx.post(emu.url + "/generate", json={**ok, "routed_dp_rank": 1}).headers["x-emulator-rank"]
             for _ in range(4)}  # fmt: skip
    assert ranks == {"0", "1"}  # the pin was accepted but ignored: round robin
    httpx.post(faults, json={"ignore_pin": False, "abort_after_tokens": 5})
    with httpx.stream("POST", emu.url + "/generate", json={**ok, "stream": True}) as s:
        events = [ln for ln in s.iter_lines() if ln.startswith("data: ")]
    assert '"error"' in events[-2] and events[-1] == "data: [DONE]"
    assert httpx.post(faults, json={"bogus": 1}).status_code == 400
    assert httpx.post(faults, json={"slow_ranks": {"9": 2}}).status_code == 400


def test_legacy_crash_kills_the_server(start_emulator: StartEmulator) -> None:
    emu = start_emulator("sglang", dp_size=2)
    url = emu.url  # read once: the address is gone once the server has died
    httpx.post(url + "/_emulator/faults", json={"legacy_crash": True})
    r = httpx.post(url + "/generate", json={"text": "hi", "routed_dp_rank": -1})
    assert r.status_code == 200 and r.headers["x-emulator-rank"] == "1"  # old servers wrap negative ranks
    with pytest.raises(httpx.HTTPError):
        httpx.post(url + "/generate", json={"text": "hi", "routed_dp_rank": 7})
        _wait_for(lambda: httpx.get(url + "/health") and False, timeout_s=3)
    assert emu.crashed
