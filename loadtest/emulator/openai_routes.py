"""``/v1/chat/completions`` and ``/v1/completions`` for both faces (SSE framing per sglang.md §5.2 and
vllm.md §6.2: role chunk, content chunks, finish, optional usage chunk with ``choices: []``, ``[DONE]``)."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from loadtest.emulator.common import (
    DONE_EVENT,
    ApiError,
    DropConnection,
    SSEResponse,
    count_chat,
    count_prompt,
    error_body,
    error_response,
    int_field,
    json_response,
    read_json,
    sse,
    token_text,
    wait_done_or_disconnect,
)
from loadtest.emulator.face import Face, asked_tokens
from loadtest.emulator.runner import RequestHandle


async def chat_completions(face: Face, request: Request) -> Response:
    return await _serve(face, request, chat=True)


async def completions(face: Face, request: Request) -> Response:
    return await _serve(face, request, chat=False)


async def _serve(face: Face, request: Request, chat: bool) -> Response:
    try:
        body = await read_json(request)
        prompt = count_chat(body) if chat else count_prompt(body.get("prompt"), "prompt")
        n = int_field(body, "n", 1)
        if n is not None and n > 1:
            raise ApiError("n > 1 is not supported by the emulator", param="n")
        rid = face.request_id(request, body, "chatcmpl-" if chat else "cmpl-")
        handle = face.submit(request, body, rid, prompt, asked_tokens(body, chat), openai_route=True)
    except ApiError as exc:
        return error_response(exc)
    model = body.get("model") if isinstance(body.get("model"), str) else face.served_model_name
    created = int(time.time())
    headers = {"X-Emulator-Rank": str(handle.rank), "X-Request-Id": rid}
    if body.get("stream"):
        opts = body.get("stream_options")
        usage = isinstance(opts, dict) and bool(opts.get("include_usage"))
        chunks = _stream(face, handle, chat, str(model), created, usage)
        return SSEResponse(chunks, lambda: face.runner.client_gone(handle), headers)
    await wait_done_or_disconnect(request, lambda: _drain(handle), lambda: face.runner.client_gone(handle))
    if handle.finish_reason == "abort":
        return json_response(error_body(handle.error or "request aborted", 500), 500, headers)
    text = token_text(0, handle.generated)
    if chat:
        choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": text}}
    else:
        choice = {"index": 0, "text": text}
    choice.update(logprobs=None, finish_reason=handle.finish_reason)
    out = {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": created,
           "model": model, "choices": [choice], "usage": _usage(handle)}  # fmt: skip
    return json_response(out, headers=headers)


async def _drain(handle: RequestHandle) -> None:
    while not handle.done:
        await handle.wait()


def _usage(h: RequestHandle) -> dict[str, Any]:
    return {"prompt_tokens": h.prompt_tokens, "completion_tokens": h.generated,
            "total_tokens": h.prompt_tokens + h.generated, "prompt_tokens_details": None}  # fmt: skip


async def _stream(
    face: Face, h: RequestHandle, chat: bool, model: str, created: int, include_usage: bool
) -> AsyncIterator[bytes]:
    head = {"id": h.rid, "object": "chat.completion.chunk" if chat else "text_completion", "created": created,
            "model": model}  # fmt: skip

    def chunk(text: str | None, finish: str | None, role: bool = False) -> bytes:
        if chat:
            delta: dict[str, Any] = {"role": "assistant", "content": ""} if role else {}
            if text is not None:
                delta["content"] = text
            choice: dict[str, Any] = {"index": 0, "delta": delta}
        else:
            choice = {"index": 0, "text": text or ""}
        choice.update(logprobs=None, finish_reason=finish)
        return sse({**head, "choices": [choice]})

    if chat:
        yield chunk(None, None, role=True)
    sent = 0
    finished = False
    while True:
        n = await h.wait()
        if h.client_gone:
            return
        if n:
            last = h.done and h.finish_reason != "abort" and face.finish_on_last_chunk
            yield chunk(token_text(sent, n), h.finish_reason if last else None)
            sent += n
            finished = last
        if h.done:
            break
    if h.finish_reason == "abort":
        if h.error and h.error.startswith("emulator fault") and face.runner.faults.abort_mode == "drop":
            raise DropConnection(h.error)
        yield sse(error_body(h.error or "request aborted", 500))
        yield DONE_EVENT
        return
    if not finished:
        yield chunk(None if chat else "", h.finish_reason)
    if include_usage:
        yield sse({**head, "choices": [], "usage": _usage(h)})
    yield DONE_EVENT
