"""Pieces both faces share: errors, JSON and SSE responses, token counting and token text.

Token counting (documented contract, reproduced by the router's byte estimate and loadtest/prompts.py):
a text is ``ceil(utf8_bytes / 4)`` tokens; a chat prompt is the sum over messages of 4 + its content's
tokens (text parts only), plus the tools JSON; token-id inputs count exactly. Generated text is made of
4-byte ASCII words, so a completion of N tokens is 4N bytes.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

DONE_EVENT = b"data: [DONE]\n\n"
_WORDS = tuple(f"{a}{b}{c} " for a in "tlmnrsk" for b in "aeiou" for c in "nrstl")  # 175 4-byte words
_CYCLE = "".join(_WORDS)
_CYCLE_TOKENS = len(_WORDS)
TOKEN_ID_BASE = 1000
_ERROR_TYPES = {400: "BadRequestError", 404: "NotFoundError", 500: "InternalServerError",
                503: "ServiceUnavailableError"}  # fmt: skip


class ApiError(Exception):
    """An error answered with an OpenAI-style body and ``status``."""

    def __init__(self, message: str, status: int = 400, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.status, self.param)


def error_body(message: str, status: int, param: str | None = None) -> dict[str, Any]:
    err_type = _ERROR_TYPES.get(status, "BadRequestError" if status < 500 else "InternalServerError")
    return {"error": {"message": message, "type": err_type, "param": param, "code": status}}


def json_response(obj: Any, status: int = 200, headers: Mapping[str, str] | None = None) -> Response:
    return Response(orjson.dumps(obj), status, headers, media_type="application/json")


def error_response(err: ApiError) -> Response:
    return json_response(err.body(), err.status)


def sse(obj: Any) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


async def read_json(request: Request) -> dict[str, Any]:
    raw = await request.body()
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError:
        raise ApiError("request body is not valid JSON") from None
    if not isinstance(body, dict):
        raise ApiError("request body must be a JSON object")
    return body


# ---- tokens --------------------------------------------------------------------------------------------
def count_text_tokens(text: str) -> int:
    n_bytes = len(text) if text.isascii() else len(text.encode("utf-8", "replace"))
    return math.ceil(n_bytes / 4)


def count_prompt(value: Any, param: str) -> int:
    """A completion prompt: a string, one-element list of strings, or a token-id list."""
    if isinstance(value, str):
        return count_text_tokens(value)
    if isinstance(value, list) and value:
        if all(isinstance(v, int) and not isinstance(v, bool) for v in value):
            return len(value)
        if len(value) == 1:
            return count_prompt(value[0], param)
        raise ApiError(f"'{param}': batched prompts are not supported by the emulator", param=param)
    raise ApiError(f"'{param}' must be a non-empty string or a list of token ids", param=param)


def count_chat(body: dict[str, Any]) -> int:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError("'messages' must be a non-empty list", param="messages")
    total = 0
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict) or not isinstance(msg.get("role"), str):
            raise ApiError(f"messages[{i}] must be an object with a 'role'", param="messages")
        total += 4 + _content_tokens(msg.get("content"))
    if body.get("tools"):
        total += count_text_tokens(orjson.dumps(body["tools"]).decode())
    return total


def _content_tokens(content: Any) -> int:
    if isinstance(content, str):
        return count_text_tokens(content)
    if isinstance(content, list):
        return sum(
            count_text_tokens(p["text"])
            for p in content
            if isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
        )
    return 0


def token_text(start: int, n: int) -> str:
    """Text of generated tokens [start, start + n)."""
    off = (start % _CYCLE_TOKENS) * 4
    end = off + 4 * n
    reps = end // len(_CYCLE) + 1
    return (_CYCLE * reps)[off:end] if reps > 1 else _CYCLE[off:end]


def token_ids(start: int, n: int) -> list[int]:
    return [TOKEN_ID_BASE + (i % _CYCLE_TOKENS) for i in range(start, start + n)]


def int_field(body: Mapping[str, Any], name: str, low: int = 0) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ApiError(f"'{name}' must be an integer >= {low}", param=name)
    return value


def output_hint(request: Request, body: Mapping[str, Any]) -> int | None:
    """The load tester's real output length: body ``emulator_output_tokens`` or header
    ``X-Emulator-Output-Tokens`` (real engines ignore both)."""
    hint = int_field(body, "emulator_output_tokens", 1)
    if hint is None and (raw := request.headers.get("x-emulator-output-tokens")) is not None:
        try:
            hint = max(1, int(raw))
        except ValueError:
            raise ApiError("X-Emulator-Output-Tokens must be an integer") from None
    return hint


# ---- streaming -----------------------------------------------------------------------------------------
class DropConnection(Exception):
    """Raised inside a stream to cut the connection (the abort fault in "drop" mode)."""


class SSEResponse(Response):
    """Server-sent events from ``chunks``; a client disconnect calls ``on_disconnect`` at once (even while
    the request waits in a queue and nothing is being sent)."""

    media_type = "text/event-stream"

    def __init__(
        self, chunks: AsyncIterator[bytes], on_disconnect: Callable[[], None], headers: Mapping[str, str]
    ) -> None:
        self.chunks = chunks
        self.on_disconnect = on_disconnect
        self.status_code = 200
        self.background = None
        self.init_headers({**headers, "Cache-Control": "no-cache"})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        watcher = asyncio.get_running_loop().create_task(self._watch(receive))
        try:
            await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
            async for chunk in self.chunks:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except OSError:
            self.on_disconnect()
        finally:
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watcher
            aclose = getattr(self.chunks, "aclose", None)
            if aclose is not None:
                await aclose()

    async def _watch(self, receive: Receive) -> None:
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                self.on_disconnect()
                return


async def wait_done_or_disconnect(
    request: Request, wait: Callable[[], Any], on_disconnect: Callable[[], None]
) -> None:
    """Await ``wait()`` (the request's end) but give up and call ``on_disconnect`` if the client leaves."""

    async def watch() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(watch())
    waiter = asyncio.ensure_future(wait())
    try:
        await asyncio.wait({watcher, waiter}, return_when=asyncio.FIRST_COMPLETED)
        if watcher.done() and not waiter.done():
            on_disconnect()
        await waiter
    finally:
        watcher.cancel()
        waiter.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watcher
