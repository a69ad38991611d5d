"""``kvrouter serve``: Settings (flags > env > config file > defaults), then the gateway in uvicorn."""

from __future__ import annotations

import gc
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import orjson
import typer
from pydantic import SecretStr

from router.config import ConfigError, Settings, load_settings

if TYPE_CHECKING:  # the web stack is imported only when serving, so `kvrouter plan` starts fast
    from fastapi import FastAPI

GC_GEN0_THRESHOLD = 10_000  # CPython's default is 700
SETTINGS_ENV = "KVROUTER_SERVE_SETTINGS_JSON"  # hands resolved settings to uvicorn worker processes


def _plain(value: Any) -> Any:
    if isinstance(value, SecretStr):
        return value.get_secret_value()
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


def configure_router_logging(level: str) -> None:
    """uvicorn configures only its own loggers: without a handler here the router's INFO lines
    (discovery, breaker probes, the shutdown drain) are dropped and its warnings print bare."""
    logger = logging.getLogger("router")
    numeric = logging.getLevelName(level.upper())
    logger.setLevel(numeric if isinstance(numeric, int) else logging.DEBUG)  # uvicorn's "trace" = debug
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s:     %(name)s: %(message)s"))
        logger.addHandler(handler)


def app_from_env() -> FastAPI:
    """uvicorn factory for ``--workers N`` (each worker process builds its own app from the same settings)."""
    from router.gateway import create_app

    settings = Settings(**orjson.loads(os.environ[SETTINGS_ENV]))
    configure_router_logging(settings.log_level)
    app = create_app(settings)
    tune_gc()
    return app


def tune_gc() -> None:
    """For a serving process: what start-up made (modules, settings, the app) leaves every collection, and
    young collections run ~14x less often (each request allocates a few hundred objects; at 700 a
    collection ran every few requests). Measured: ~5 % of the process in the collector, +10 % req/s at
    c=64 without it (docs/bench.md)."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(GC_GEN0_THRESHOLD, 20, 20)


def run(settings: Settings) -> None:
    import uvicorn

    configure_router_logging(settings.log_level)

    from router.gateway import create_app
    from router.gateway.limits import HTTP_PROTOCOL
    from router.gateway.shutdown import GracefulServer

    common: dict[str, Any] = {
        "host": settings.host,
        "port": settings.port,
        "loop": "uvloop",
        "http": HTTP_PROTOCOL,  # httptools with a bounded request head (router/gateway/limits.py)
        "h11_max_incomplete_event_size": settings.max_header_bytes,
        "log_level": settings.log_level.lower(),
        "timeout_graceful_shutdown": settings.shutdown_grace_s,
        "access_log": False,
        "server_header": False,  # per-response work no client needs (the data path is measured per µs)
        "date_header": False,
    }
    if settings.workers == 1:  # SIGTERM drains first: 503s while in-flight requests finish
        server = GracefulServer(uvicorn.Config(create_app(settings), **common), settings.shutdown_grace_s)
        tune_gc()
        server.run()
        if not server.started:
            raise SystemExit(3)  # startup failed (uvicorn.run exits the same way)
        return
    from router.ledger.shm_file import create_ledger_file, remove_ledger_file
    from router.telemetry import prepare_multiprocess_dir

    ledger_path = None
    if settings.shared_memory_ledger():  # a fresh file the workers share; never one a past serve left
        ledger_path = create_ledger_file(settings.ledger_path)
        settings = settings.model_copy(update={"ledger_path": ledger_path})  # to the workers' settings
    dumped = {k: _plain(v) for k, v in settings.model_dump().items() if k != "config_file"}
    os.environ[SETTINGS_ENV] = orjson.dumps(dumped).decode()
    prepare_multiprocess_dir()  # one /metrics for all workers, whichever answers the scrape
    try:
        uvicorn.run("router.cmd_serve:app_from_env", factory=True, workers=settings.workers, **common)
    finally:
        if ledger_path is not None:
            remove_ledger_file(ledger_path)


def serve_command(
    config: Annotated[
        Path | None,
        typer.Option(
            "--config", help="YAML/JSON settings file (flags win over KVROUTER_* env, which wins over it)."
        ),
    ] = None,
    host: Annotated[str | None, typer.Option(help="Listen address (default 127.0.0.1).")] = None,
    port: Annotated[int | None, typer.Option(help="Listen port (default 8080).")] = None,
    backend: Annotated[
        list[str] | None,
        typer.Option(help="ENGINE=URL, repeatable: sglang=URL, vllm=URL, vllm-external=URL0,URL1,..."),
    ] = None,
    policy: Annotated[str | None, typer.Option(help="Placement policy (default lockstep).")] = None,
    redis_url: Annotated[
        str | None,
        typer.Option(help="Redis URL: one ledger shared by replicas/workers (default: in-process)."),
    ] = None,
    workers: Annotated[
        int | None,
        typer.Option(
            help="uvicorn worker processes; they share a ledger in shared memory, or --redis-url's."
        ),
    ] = None,
    replicas: Annotated[
        int | None,
        typer.Option(help="How many router replicas share the Redis ledger (fail_open sizes shares by it)."),
    ] = None,
    ledger_namespace: Annotated[
        str | None, typer.Option(help="Redis key namespace: one per deployment (default 'default').")
    ] = None,
    api_key: Annotated[
        list[str] | None, typer.Option(help="Accepted client API key (Bearer), repeatable; none = open.")
    ] = None,
    admin_token: Annotated[
        str | None, typer.Option(help="Bearer token guarding /ranks and drain/undrain.")
    ] = None,
    default_max_tokens: Annotated[
        int | None, typer.Option(help="Output tokens reserved when a request sets no max_tokens (512).")
    ] = None,
    tokenizer_path: Annotated[
        str | None,
        typer.Option("--tokenizer", help="tokenizer.json for exact prompt counts (default: bytes/4 x 1.25)."),
    ] = None,
    queue_max: Annotated[
        int | None, typer.Option(help="Requests that may wait for KV room before 429 (256).")
    ] = None,
    queue_timeout_s: Annotated[
        float | None,
        typer.Option("--queue-timeout", help="Longest wait for KV room before 503, seconds (30)."),
    ] = None,
    request_timeout_s: Annotated[
        float | None,
        typer.Option("--request-timeout", help="Whole upstream request incl. stream, seconds (600)."),
    ] = None,
    connect_timeout_s: Annotated[
        float | None, typer.Option("--connect-timeout", help="Upstream connect, seconds (5).")
    ] = None,
    max_body_bytes: Annotated[
        int | None, typer.Option(help="Largest request body in bytes (413 above; 16 MiB).")
    ] = None,
    shutdown_grace_s: Annotated[
        float | None,
        typer.Option("--shutdown-grace", help="After SIGTERM, seconds in-flight streams may finish (30)."),
    ] = None,
    max_header_bytes: Annotated[
        int | None, typer.Option(help="Largest request head in bytes (431 above; 64 KiB).")
    ] = None,
    reconcile_interval_s: Annotated[
        float | None,
        typer.Option(
            "--reconcile-interval", help="Seconds between polls of every engine's per-rank truth (1)."
        ),
    ] = None,
    lease_ttl_s: Annotated[
        float | None,
        typer.Option("--lease-ttl", help="Reservation lease in seconds, renewed while a stream lives (60)."),
    ] = None,
    ledger_failure_mode: Annotated[
        str | None, typer.Option(help="Redis unreachable: fail_closed (503) or fail_open (local share).")
    ] = None,
    ledger_timeout_s: Annotated[
        float | None, typer.Option("--ledger-timeout", help="Bound on each Redis call, seconds (0.25).")
    ] = None,
    log_level: Annotated[str | None, typer.Option(help="uvicorn log level.")] = None,
    reservation_mode: Annotated[
        str | None, typer.Option(help="Output reservation: max (prompt+max_tokens) or predicted (learned).")
    ] = None,
    reservation_target_preemption_rate: Annotated[
        float | None, typer.Option(help="predicted: preemption target of the over-commit budget (0.01).")
    ] = None,
    reservation_quantile: Annotated[float | None, typer.Option(help="predicted: quantile (0.5).")] = None,
    reservation_step_tokens: Annotated[int | None, typer.Option(help="predicted: growth slack (64).")] = None,
    reservation_bound: Annotated[str | None, typer.Option(help="predicted: normal or bernstein.")] = None,
    reservation_share_interval_s: Annotated[
        float | None,
        typer.Option(
            "--reservation-share-interval", help="Seconds between predictor syncs through Redis (5)."
        ),
    ] = None,
) -> None:
    """Run the KV-aware gateway in front of SGLang / vLLM data-parallel deployments.

    Each request is sized (prompt + output reservation, in pages), placed on a rank where its KV fits.

    It is pinned there, streamed back, and its reservation released on every exit.

    Example: kvrouter serve --backend sglang=http://10.0.0.5:30000 --policy lockstep
    """
    from router.cli import fail

    try:
        settings = load_settings(
            config_file=str(config) if config is not None else None,
            host=host,
            port=port,
            backends=backend or None,
            policy=policy,
            redis_url=redis_url,
            workers=workers,
            replicas=replicas,
            ledger_namespace=ledger_namespace,
            api_keys=api_key or None,
            admin_token=admin_token,
            default_max_tokens=default_max_tokens,
            tokenizer_path=tokenizer_path,
            queue_max=queue_max,
            queue_timeout_s=queue_timeout_s,
            request_timeout_s=request_timeout_s,
            connect_timeout_s=connect_timeout_s,
            max_body_bytes=max_body_bytes,
            shutdown_grace_s=shutdown_grace_s,
            max_header_bytes=max_header_bytes,
            reconcile_interval_s=reconcile_interval_s,
            lease_ttl_s=lease_ttl_s,
            ledger_failure_mode=ledger_failure_mode,
            ledger_timeout_s=ledger_timeout_s,
            log_level=log_level,
            reservation_mode=reservation_mode,
            reservation_target_preemption_rate=reservation_target_preemption_rate,
            reservation_quantile=reservation_quantile,
            reservation_step_tokens=reservation_step_tokens,
            reservation_bound=reservation_bound,
            reservation_share_interval_s=reservation_share_interval_s,
        )
        check(settings)
    except (ConfigError, ValueError) as exc:
        fail(str(exc))
    run(settings)


def check(settings: Settings) -> None:
    """Fail fast (exit 2) on what would otherwise surface only at startup."""
    from router.placement import get_policy
    from router.sizing import load_tokenizer

    if not settings.backends:
        raise ValueError(
            "no backend configured: pass --backend ENGINE=URL (or KVROUTER_BACKENDS, or a config file)"
        )
    get_policy(settings.policy)
    if settings.tokenizer_path:
        load_tokenizer(settings.tokenizer_path)
