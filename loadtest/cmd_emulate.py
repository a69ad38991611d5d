"""``kvrouter-loadtest emulate``: an SGLang- or vLLM-compatible DP-attention server over the engine model."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Callable
from typing import Annotated

import typer

from loadtest.emulator.app import EmulatorSettings
from loadtest.emulator.faults import FaultError, Faults, parse_slow
from loadtest.emulator.outlen import OutputLenDist, OutputLenError
from loadtest.engine_types import ENGINE_MODES, EngineConfigError

Opt = typer.Option


def _loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop when installed (uvicorn[standard] brings it): the emulator's HTTP side is CPU-bound."""
    try:
        import uvloop
    except ImportError:
        return None
    factory: Callable[[], asyncio.AbstractEventLoop] = uvloop.new_event_loop
    return factory


def _fail(message: str) -> typer.Exit:
    typer.echo(f"error: {message}", err=True)
    return typer.Exit(2)


def emulate(
    engine: Annotated[str, Opt(help="sglang or vllm")] = "sglang",
    dp: Annotated[int, Opt("--dp", help="DP ranks")] = 8,
    port: Annotated[int, Opt(help="port (vLLM --external-lb: ranks on PORT..PORT+dp-1)")] = 30000,
    host: Annotated[str, Opt(help="bind address")] = "127.0.0.1",
    kv_tokens_per_rank: Annotated[int | None, Opt(help="KV pool per rank (default: capacity plan)")] = None,
    capacity_scale: Annotated[float, Opt(help="multiply the planned per-rank pool")] = 1.0,
    page_size: Annotated[int, Opt(help="KV page/block size in tokens")] = 1,
    prefill_chunk_tokens: Annotated[int | None, Opt(help="prefill tokens per rank per step")] = None,
    time_scale: Annotated[float, Opt(help="1 = real time, 0 = as fast as possible")] = 1.0,
    model: Annotated[str, Opt(help="model preset or config.json")] = "deepseek-v3",
    served_model_name: Annotated[str | None, Opt(help="name in /v1/models")] = None,
    max_model_len: Annotated[int | None, Opt(help="context window (default: the model's)")] = None,
    external_lb: Annotated[bool, Opt("--external-lb", help="vLLM: one server per rank")] = False,
    output_len_dist: Annotated[str, Opt(help="max | fixed:N | uniform:LO:HI | lognormal:MEAN:SIGMA")] = (
        "lognormal:350:0.6"
    ),
    seed: Annotated[int, Opt(help="seed of the output-length draws")] = 0,
    fault_down_rank: Annotated[list[int] | None, Opt(help="rank refusing work (503), repeatable")] = None,
    fault_slow_rank: Annotated[list[str] | None, Opt(help="RANK:FACTOR straggler, repeatable")] = None,
    fault_abort_after: Annotated[int | None, Opt(help="end every stream after N tokens")] = None,
    fault_abort_mode: Annotated[str, Opt(help="error (in-stream error) or drop (cut)")] = "error",
    fault_ignore_pin: Annotated[bool, Opt("--fault-ignore-pin", help="silently ignore rank pins")] = False,
    fault_legacy_crash: Annotated[
        bool, Opt("--fault-legacy-crash", help="bad SGLang rank kills server")
    ] = False,
    log_level: Annotated[str, Opt(help="uvicorn log level")] = "info",
) -> None:
    """Serve an emulated DP-attention engine (faults can also be set at runtime: POST /_emulator/faults)."""
    if engine not in ENGINE_MODES:
        raise _fail(f"--engine must be one of {', '.join(ENGINE_MODES)}, got {engine!r}")
    if external_lb and engine != "vllm":
        raise _fail("--external-lb applies to --engine vllm only")
    if time_scale < 0 or dp <= 0 or not 0 <= port <= 65535 - dp:
        raise _fail("--time-scale must be >= 0, --dp > 0 and --port a valid port")
    try:
        OutputLenDist.parse(output_len_dist)
        slow = dict(parse_slow(s, dp) for s in fault_slow_rank or [])
        faults = Faults().updated(
            {
                "down_ranks": fault_down_rank or [],
                "slow_ranks": slow,
                "abort_after_tokens": fault_abort_after,
                "abort_mode": fault_abort_mode,
                "ignore_pin": fault_ignore_pin,
                "legacy_crash": fault_legacy_crash,
            },
            dp,
        )
        settings = EmulatorSettings(
            engine=engine,
            dp_size=dp,
            host=host,
            port=port,
            kv_tokens_per_rank=kv_tokens_per_rank,
            capacity_scale=capacity_scale,
            page_size=page_size,
            prefill_chunk_tokens=prefill_chunk_tokens,
            time_scale=time_scale,
            model=model,
            served_model_name=served_model_name,
            max_model_len=max_model_len,
            external_lb=external_lb,
            output_len_dist=output_len_dist,
            seed=seed,
            faults=faults,
        )
        settings.engine_config()
    except (FaultError, OutputLenError, EngineConfigError, ValueError) as exc:
        raise _fail(str(exc)) from None
    from loadtest.emulator.host import serve_forever

    try:
        with asyncio.Runner(loop_factory=_loop_factory()) as runner:
            crashed = runner.run(serve_forever(settings, log_level))
    except OSError as exc:
        raise _fail(str(exc)) from None
    if crashed:
        typer.echo("DataParallelController hit an exception (out-of-range DP rank); exiting", err=True)
        sys.exit(1)
