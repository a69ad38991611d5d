"""The relay's generated-token count against the engine's own: the router through loopback in front of the
SGLang and vLLM emulators, streams whose real length the engine reports as ``completion_tokens``.

The count is what the ledger is told (``add_generated``), what the predictor learns when the request ends,
and what ``kvrouter_generated_tokens_total`` adds up: checked here through the counter, one request at a
time. Chat streams open with a role chunk per choice (``delta.role``, empty content) that carries no token.
"""

from __future__ import annotations

from typing import Any

import anyio
import openai
import pytest
from gateway_support import MODEL, emulator_finished, router
from observability_support import scrape, total

from loadtest.emulator.host import EmulatorThread
from router.gateway.flight import Flight, LocalLoad
from router.gateway.relay import CHAT_ROUTE, count_chunk
from router.placement.snapshot import RankKey, RequestShape
from router.sizing import Sized

LENGTHS = (1, 7, 70)  # 70 > the relay's report batch (64): the ledger is told part-way too


async def _stream(client: openai.AsyncOpenAI, chat: bool, real: int, usage: bool) -> int:
    """One streamed request of ``real`` tokens; returns the usage's completion_tokens (or -1)."""
    extra: dict[str, Any] = {"stream_options": {"include_usage": True}} if usage else {}
    body = {"emulator_output_tokens": real}
    if chat:
        stream: Any = await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "count"}], max_tokens=200, stream=True,
            extra_body=body, **extra,
        )  # fmt: skip
    else:
        stream = await client.completions.create(
            model=MODEL, prompt="count", max_tokens=200, stream=True, extra_body=body, **extra
        )
    reported = -1
    async for chunk in stream:
        if chunk.usage is not None:
            reported = chunk.usage.completion_tokens
    return reported


async def _counted_per_request(
    emu: EmulatorThread, chat: bool, usage: bool, lengths: tuple[int, ...]
) -> list[tuple[int, int]]:
    """(router's count, engine's completion_tokens) for each request of ``lengths``, one at a time."""
    pairs = []
    async with router(backends=[f"{emu.settings.engine}={emu.url}"]) as url:
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        try:
            before = 0.0
            for i, real in enumerate(lengths):
                reported = await _stream(client, chat, real, usage)
                (*_, finished) = await emulator_finished(emu.url, i + 1)
                engine = finished["completion_tokens"]
                assert engine == real and reported in (-1, engine)
                _, m = await scrape(url)
                counted = total(m, "kvrouter_generated_tokens_total")
                pairs.append((int(counted - before), engine))
                before = counted
        finally:
            await client.close()
    return pairs


@pytest.mark.parametrize("engine", ["sglang", "vllm"])
@pytest.mark.parametrize("chat", [True, False], ids=["chat", "completions"])
def test_streams_with_usage_count_exactly_the_engines_tokens(
    start_emulator: Any, engine: str, chat: bool
) -> None:
    """The usage chunk's completion_tokens is exact and wins, even below the events counted before it (a
    role chunk, SGLang's trailing finish event), whichever reads the events arrived in."""
    emu = start_emulator(engine, dp_size=2, kv_tokens_per_rank=8192, time_scale=0.05)
    pairs = anyio.run(_counted_per_request, emu, chat, True, LENGTHS)
    assert all(counted == real for counted, real in pairs), pairs


@pytest.mark.parametrize("engine", ["sglang", "vllm"])
def test_the_chat_role_chunk_is_not_a_token(start_emulator: Any, engine: str) -> None:
    """Without usage the relay counts events. One-token answers (one token event whatever the timing: the
    emulator, like the engines, may put several tokens in one event of a longer answer)."""
    emu = start_emulator(engine, dp_size=2, kv_tokens_per_rank=8192, time_scale=0.05)
    pairs = anyio.run(_counted_per_request, emu, True, False, (1, 1, 1))
    # SGLang closes a chat stream with a separate finish chunk (empty delta, finish_reason): an event
    # without a token that only the usage chunk's exact count tells apart without parsing events.
    trailing = 1 if engine == "sglang" else 0
    assert all(counted == real + trailing for counted, real in pairs), pairs


def _chat_event(index: int, delta: str, usage: str = "") -> bytes:
    tail = f',"usage":{usage}' if usage else ""
    return (f'data: {{"object":"chat.completion.chunk","choices":[{{"index":{index},"delta":{delta},'
            f'"finish_reason":null}}]{tail}}}\n\n').encode()  # fmt: skip


def test_count_chunk_skips_one_role_chunk_per_choice_and_trusts_the_exact_count() -> None:
    """n=2 as vLLM and SGLang send it (the emulator serves n=1 only): a role chunk per choice, possibly
    after the other choice's first token, then tokens; a usage chunk's count wins, even downwards."""
    sized = Sized(5, 10, 2, 10, limit_given=True, exact=True)
    flight = Flight("f", CHAT_ROUTE, sized, RequestShape(5, 20), True, key=RankKey("b", 0), role_events=2)
    role = '{"role":"assistant","content":""}'
    load = LocalLoad()
    first = _chat_event(0, role) + _chat_event(0, '{"content":"a"}') + _chat_event(1, role)
    for chunk, want in ((first, 1), (_chat_event(1, '{"content":"b"}'), 1), (_chat_event(0, "{}"), 1)):
        new = count_chunk(flight, chunk)
        assert new == want
        flight.on_tokens(load, new)
    assert flight.generated_tokens == 3 and flight.role_events == 0
    usage = '{"prompt_tokens":5,"completion_tokens":2,"total_tokens":7}'
    new = count_chunk(flight, b'data: {"choices":[],"usage":' + usage.encode() + b"}\n\n")
    assert new == -1  # the empty finish event was no token
    flight.on_tokens(load, new)
    assert flight.generated_tokens == 2 and load.get(RankKey("b", 0)).context_tokens == 2
