"""Value types of the engine model: configuration, requests, per-step events, per-rank loads, errors."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Literal, NamedTuple

from loadtest.engine_model import StepModel, capacity_plan, step_model_from_plan
from router.model import load_model
from router.units import round_down

EngineMode = Literal["sglang", "vllm"]
ENGINE_MODES: tuple[EngineMode, ...] = ("sglang", "vllm")
# SGLang's chunked_prefill_size on H200 before it is divided by dp_size under DP attention.
SGLANG_CHUNKED_PREFILL_TOKENS = 8192


class EngineError(ValueError):
    """A request the engine refuses; ``status`` is the HTTP status a real server answers with."""

    status: int = 400


class RankOutOfRange(EngineError):
    pass


class RankUnavailable(EngineError):
    status = 503


class PromptTooLong(EngineError):
    pass


class DuplicateRequest(EngineError):
    pass


class EngineConfigError(ValueError):
    pass


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """One DP-attention deployment.

    ``mixed_chunk``: a rank that prefills in a step also decodes its running sequences in that step (vLLM
    always; SGLang only with ``--enable-mixed-chunk``, so by default its decoders stall on a prefill step).
    ``token_events``: False makes :meth:`Engine.step` report only first-token and finish events (the
    simulator's fast path); True reports every generated token (the emulator).
    """

    dp_size: int = 8
    kv_tokens_per_rank: int = 510_229
    page_size: int = 1
    prefill_chunk_tokens: int = 1024
    max_running_per_rank: int = 1024
    preempt_mode: EngineMode = "sglang"
    mixed_chunk: bool = False
    max_model_len: int = 163_840
    token_events: bool = True
    step: StepModel = field(default_factory=StepModel)

    @property
    def capacity_pages_per_rank(self) -> int:
        return self.kv_tokens_per_rank // self.page_size

    def validate(self) -> None:
        checks = {
            "dp_size": self.dp_size,
            "page_size": self.page_size,
            "prefill_chunk_tokens": self.prefill_chunk_tokens,
            "max_running_per_rank": self.max_running_per_rank,
            "max_model_len": self.max_model_len,
        }
        for name, value in checks.items():
            if value <= 0:
                raise EngineConfigError(f"{name} must be positive, got {value}")
        if self.kv_tokens_per_rank < self.page_size:
            raise EngineConfigError(
                f"kv_tokens_per_rank ({self.kv_tokens_per_rank}) must hold one page ({self.page_size})"
            )
        if self.preempt_mode not in ENGINE_MODES:
            raise EngineConfigError(f"preempt_mode must be one of {ENGINE_MODES}, got {self.preempt_mode!r}")

    @classmethod
    def for_engine(
        cls,
        engine: EngineMode = "sglang",
        *,
        dp_size: int = 8,
        model: str = "deepseek-v3",
        gpu: str = "h200",
        gpus: int = 8,
        page_size: int = 1,
        capacity_scale: float = 1.0,
        **overrides: Any,
    ) -> EngineConfig:
        """Defaults of ``engine`` on ``gpus`` × ``gpu`` from the capacity planner (DeepSeek-V3 on 8×H200:
        510,229 tokens per rank). ``capacity_scale`` multiplies the per-rank pool (e.g. 0.01 for tests)."""
        if engine not in ENGINE_MODES:
            raise EngineConfigError(f"engine must be one of {ENGINE_MODES}, got {engine!r}")
        if capacity_scale <= 0:
            raise EngineConfigError(f"capacity_scale must be positive, got {capacity_scale}")
        p = capacity_plan(model, gpu, gpus, page_size)
        scaled = int(p.layouts["dp_ep"].kv_tokens_per_rank * capacity_scale)
        per_rank = max(page_size, round_down(scaled, page_size))
        cfg = cls(
            dp_size=dp_size,
            kv_tokens_per_rank=per_rank,
            page_size=page_size,
            prefill_chunk_tokens=max(1, SGLANG_CHUNKED_PREFILL_TOKENS // dp_size),
            preempt_mode=engine,
            mixed_chunk=engine == "vllm",
            max_model_len=load_model(model).max_context_tokens,
            step=step_model_from_plan(p),
        )
        cfg = replace(cfg, **overrides) if overrides else cfg
        cfg.validate()
        return cfg


@dataclass(frozen=True, slots=True)
class EngineRequest:
    """``output_tokens``: the length the request generates on its own (its EOS); None = until
    ``max_output_tokens``. With ``ignore_eos`` it always runs to ``max_output_tokens``."""

    rid: str
    prompt_tokens: int
    max_output_tokens: int
    output_tokens: int | None = None
    ignore_eos: bool = False


class TokenEvent(NamedTuple):
    """``new_tokens`` generated for ``rid`` on ``rank`` in one step; ``generated_tokens`` is the total so
    far. ``finish_reason`` is "stop", "length" or "abort" when ``finished``."""

    rid: str
    rank: int
    new_tokens: int
    generated_tokens: int
    first_token: bool = False
    finished: bool = False
    finish_reason: str | None = None


@dataclass(frozen=True, slots=True)
class StepResult:
    duration_s: float
    events: list[TokenEvent]
    preempted_rids: tuple[str, ...] = ()

    @property
    def preemptions(self) -> int:
        return len(self.preempted_rids)


@dataclass(frozen=True, slots=True)
class RankLoad:
    """One rank's truth. ``used_tokens`` = KV pages in use × page size; ``waiting_tokens`` = prompt (and,
    after a preemption, already generated) tokens of queued requests; ``prefill_tokens_pending`` adds the
    unprefilled rest of requests being prefilled; ``context_tokens`` = KV the decoders read per step."""

    rank: int
    running: int
    waiting: int
    used_tokens: int
    capacity_tokens: int
    waiting_tokens: int
    preemptions_total: int
    prefill_tokens_pending: int
    context_tokens: int
    decode_seqs: int
    prompt_tokens_total: int
    generation_tokens_total: int
    healthy: bool = True

    @property
    def token_usage(self) -> float:
        return self.used_tokens / self.capacity_tokens if self.capacity_tokens else 0.0
