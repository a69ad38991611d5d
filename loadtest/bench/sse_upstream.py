"""A lockstep SSE engine stand-in for the relay benchmark (raw asyncio, no framework: it must not be the
bottleneck). Every step, every open stream gets one OpenAI chat chunk, like a DP-attention decode step.

``python -m loadtest.bench.sse_upstream --port P --step-ms 20 --static payloads.json``: streamed POSTs
get ``max_tokens`` events then ``[DONE]`` (chunked encoding, keep-alive); non-streamed POSTs and GETs are
answered from the static map (discovery: ``/server_info``, ``/v1/models``, ``/v1/loads`` ...).
"""

from __future__ import annotations

import argparse
import asyncio
import re
import time
from pathlib import Path
from typing import cast

import orjson

_MAX_TOKENS = re.compile(rb'"max_tokens"\s*:\s*(\d+)')
_STREAM = re.compile(rb'"stream"\s*:\s*true')
_EVENT = (
    b'data: {"id":"chatcmpl-bench","object":"chat.completion.chunk","created":0,"model":"m",'
    b'"choices":[{"index":0,"delta":{"content":"tok "},"logprobs":null,"finish_reason":null}]}\n\n'
)
_CHUNK = b"%x\r\n%s\r\n" % (len(_EVENT), _EVENT)
_SSE_HEAD = (
    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream; charset=utf-8\r\n"
    b"Cache-Control: no-cache\r\nTransfer-Encoding: chunked\r\n\r\n"
)


def _final(tokens: int) -> bytes:
    usage = (
        b'data: {"id":"chatcmpl-bench","object":"chat.completion.chunk","created":0,"model":"m",'
        b'"choices":[],"usage":{"prompt_tokens":8,"completion_tokens":%d}}\n\ndata: [DONE]\n\n' % tokens
    )
    return b"%x\r\n%s\r\n0\r\n\r\n" % (len(usage), usage)


class Engine:
    """The step clock: writes one event to every live stream per step, on an absolute schedule."""

    def __init__(self, step_s: float) -> None:
        self.step_s = step_s
        self.streams: dict[StreamProto, int] = {}

    async def run(self) -> None:
        next_s = time.monotonic()
        while True:
            if self.streams:
                done = []
                for proto, left in self.streams.items():
                    if proto.paused:
                        continue
                    proto.transport.write(_CHUNK)
                    self.streams[proto] = left - 1
                    if left <= 1:
                        done.append(proto)
                for proto in done:
                    del self.streams[proto]
                    proto.end_stream()
            next_s += self.step_s
            await asyncio.sleep(max(0.0, next_s - time.monotonic()))
            if time.monotonic() - next_s > 1.0:  # fell far behind (idle or overloaded): no burst catch-up
                next_s = time.monotonic()


class StreamProto(asyncio.Protocol):
    def __init__(self, engine: Engine, static: dict[bytes, bytes]) -> None:
        self.engine = engine
        self.static = static
        self.buf = b""
        self.paused = False
        self.tokens = 0
        self.transport: asyncio.Transport

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's transports are not subclasses

    def pause_writing(self) -> None:
        self.paused = True

    def resume_writing(self) -> None:
        self.paused = False

    def connection_lost(self, exc: Exception | None) -> None:
        self.engine.streams.pop(self, None)

    def data_received(self, data: bytes) -> None:
        self.buf += data
        while (end := self.buf.find(b"\r\n\r\n")) >= 0:
            head = self.buf[:end]
            length = 0
            for line in head.split(b"\r\n")[1:]:
                name, _, value = line.partition(b":")
                if name.strip().lower() == b"content-length":
                    length = int(value)
            if len(self.buf) < end + 4 + length:
                return
            body = self.buf[end + 4 : end + 4 + length]
            self.buf = self.buf[end + 4 + length :]
            self.answer(head.split(b" ", 2), body)

    def answer(self, request_line: list[bytes], body: bytes) -> None:
        method, path = request_line[0], request_line[1].split(b"?")[0]
        if method == b"POST" and _STREAM.search(body):
            m = _MAX_TOKENS.search(body)
            self.tokens = int(m.group(1)) if m else 16
            self.transport.write(_SSE_HEAD)
            self.engine.streams[self] = self.tokens
            return
        payload = self.static.get(path, b"{}" if method == b"POST" or path != b"/health" else b"")
        head = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n"
        self.transport.write(head % len(payload) + payload)

    def end_stream(self) -> None:
        self.transport.write(_final(self.tokens))


async def serve(port: int, step_s: float, static: dict[bytes, bytes]) -> None:
    engine = Engine(step_s)
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: StreamProto(engine, static), "127.0.0.1", port, backlog=4096)
    async with server:
        await engine.run()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--step-ms", type=float, default=20.0)
    parser.add_argument("--static", type=Path, required=True, help="JSON map: path -> answer body (string)")
    args = parser.parse_args()
    raw = orjson.loads(args.static.read_bytes())
    static = {k.encode(): v.encode() for k, v in raw.items()}
    try:
        import uvloop

        uvloop.run(serve(args.port, args.step_ms / 1000, static))
    except ImportError:
        asyncio.run(serve(args.port, args.step_ms / 1000, static))


if __name__ == "__main__":
    main()
