"""What differs between the SGLang and vLLM faces, and the submission path they share."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from starlette.requests import Request

from loadtest.emulator.common import ApiError, int_field, output_hint
from loadtest.emulator.runner import EngineRunner, RequestHandle
from loadtest.engine import EngineError, EngineRequest


class Face:
    """One HTTP face over the shared runner. ``rank_offset``/``visible_ranks`` describe which engine ranks
    this server fronts (all of them, or one in vLLM external-LB mode)."""

    engine_name = "engine"
    owned_by = "engine"
    finish_on_last_chunk = (
        False  # vLLM puts finish_reason on the last content chunk; SGLang sends a separate one
    )

    def __init__(
        self,
        runner: EngineRunner,
        served_model_name: str,
        max_model_len: int,
        *,
        rank_offset: int = 0,
        visible_ranks: int | None = None,
        crash: Callable[[], None] | None = None,
    ) -> None:
        self.runner = runner
        self.served_model_name = served_model_name
        self.max_model_len = max_model_len
        self.rank_offset = rank_offset
        self.visible_ranks = runner.engine.config.dp_size if visible_ranks is None else visible_ranks
        self.crash = crash
        self.created_s = int(time.time())

    @property
    def ranks(self) -> range:
        return range(self.rank_offset, self.rank_offset + self.visible_ranks)

    # ---- face-specific -------------------------------------------------------------------------------
    def pin(self, request: Request, body: dict[str, Any], openai_route: bool) -> int | None:
        raise NotImplementedError

    def max_new_tokens(self, prompt_tokens: int, asked: int | None) -> int:
        raise NotImplementedError

    def request_id(self, request: Request, body: dict[str, Any], prefix: str) -> str:
        return self.runner.new_rid(prefix)

    # ---- shared --------------------------------------------------------------------------------------
    def submit(
        self, request: Request, body: dict[str, Any], rid: str, prompt_tokens: int, asked: int | None,
        openai_route: bool,
    ) -> RequestHandle:  # fmt: skip
        """Validate lengths and pin, then queue in the engine; refusals become :class:`ApiError`."""
        max_new = self.max_new_tokens(prompt_tokens, asked)
        rank = self.pin(request, body, openai_route)
        if rank is None and self.visible_ranks != self.runner.engine.config.dp_size:
            rank = self.rank_offset  # a per-rank server (external LB) runs everything on its own rank
        ignore_eos = bool(body.get("ignore_eos") or (body.get("sampling_params") or {}).get("ignore_eos"))
        own = self.runner.output_tokens(output_hint(request, body))
        try:
            return self.runner.submit(EngineRequest(rid, prompt_tokens, max_new, own, ignore_eos), rank)
        except EngineError as exc:
            raise ApiError(str(exc), exc.status) from None

    def check_rank(self, rank: int, message: str) -> int:
        """``rank`` if inside this server's ranks; the engine's 400 otherwise."""
        if 0 <= rank < self.visible_ranks:
            return rank + self.rank_offset
        raise ApiError(message, 400, param="data_parallel_rank")


def body_rank(body: dict[str, Any]) -> int | None:
    """SGLang's body pin: ``routed_dp_rank``, or its deprecated alias ``data_parallel_rank``."""
    for name in ("routed_dp_rank", "data_parallel_rank"):
        value = body.get(name)
        if value is not None:
            if isinstance(value, bool) or not isinstance(value, int):
                raise ApiError(f"'{name}' must be an integer", param=name)
            return value
    return None


def asked_tokens(body: dict[str, Any], chat: bool) -> int | None:
    asked = int_field(body, "max_completion_tokens", 1) if chat else None
    return asked if asked is not None else int_field(body, "max_tokens", 1)
