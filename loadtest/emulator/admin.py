"""``/_emulator/*``: the per-rank truth for tests, and runtime fault switches. Not part of any real engine."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from loadtest.emulator.common import ApiError, error_response, json_response, read_json
from loadtest.emulator.faults import FaultError
from loadtest.emulator.runner import EngineRunner


def routes(runner: EngineRunner) -> list[Route]:
    async def requests(request: Request) -> Response:
        """In-flight requests with the rank they run on, and the last finished ones (``?finished=N``)."""
        eng = runner.engine
        running = {rid for r in range(eng.config.dp_size) for rid in eng.running_rids(r)}
        live = [
            {"rid": h.rid, "rank": h.rank, "pinned_rank": h.pinned_rank, "prompt_tokens": h.prompt_tokens,
             "generated_tokens": h.generated, "state": "running" if h.rid in running else "waiting",
             "client_gone": h.client_gone, "preemptions": h.preemptions}
            for h in runner.inflight()
        ]  # fmt: skip
        try:
            limit = int(request.query_params.get("finished", "100"))
        except ValueError:
            return error_response(ApiError("finished must be an integer", param="finished"))
        done = list(runner.finished)[-limit:] if limit > 0 else []
        return json_response({"requests": live, "finished": done})

    async def stats(_: Request) -> Response:
        return json_response(runner.stats())

    async def faults(request: Request) -> Response:
        if request.method == "POST":
            try:
                body = await read_json(request)
                runner.set_faults(runner.faults.updated(body, runner.engine.config.dp_size))
            except (ApiError, FaultError) as exc:
                return error_response(exc if isinstance(exc, ApiError) else ApiError(str(exc)))
        return json_response(runner.faults.to_json())

    return [
        Route("/_emulator/requests", requests),
        Route("/_emulator/stats", stats),
        Route("/_emulator/faults", faults, methods=["GET", "POST"]),
    ]
