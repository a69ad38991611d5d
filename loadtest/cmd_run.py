"""``kvrouter-loadtest run``: one scenario against one live endpoint, a progress bar, vLLM's summary, JSON."""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated, Any

import orjson
import typer
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from loadtest.metrics import RequestOutcome, compute_metrics, detailed, format_extras, format_summary
from loadtest.run import APIS, RunConfig, RunState, run_scenario
from loadtest.workload import Scenario, ScenarioError, load_scenario


def _fail(message: str) -> typer.Exit:
    typer.echo(f"error: {message}", err=True)
    return typer.Exit(code=2)


def build_results(
    scenario: Scenario,
    cfg: RunConfig,
    model: str,
    outcomes: list[RequestOutcome],
    duration_s: float,
    *,
    interrupted: bool = False,
    save_detailed: bool = False,
) -> dict[str, Any]:
    """The results JSON: vLLM's keys plus what makes a run reproducible (seed, realised rate)."""
    outcomes = sorted(outcomes, key=lambda o: o.index)
    result: dict[str, Any] = {
        "date": datetime.now(UTC).strftime("%Y%m%d-%H%M%S"),
        "backend": cfg.api,
        "base_url": cfg.url,
        "model_id": model,
        "scenario": scenario.name,
        "seed": scenario.seed,
        "num_prompts": len(outcomes),
        "request_rate": scenario.arrival.rate_rps if math.isfinite(scenario.arrival.rate_rps) else "inf",
        "burstiness": scenario.arrival.burstiness,
        "max_concurrency": cfg.max_concurrency or scenario.max_concurrency,
        "interrupted": interrupted,
    }
    last_start = max((o.start_s for o in outcomes), default=0.0)
    result["realised_request_rate"] = (len(outcomes) - 1) / last_start if last_start > 0 else None
    result.update(compute_metrics(outcomes, duration_s, scenario.slo))
    if save_detailed:
        result.update(detailed(outcomes))
    result["scenario_spec"] = scenario.to_dict()
    return result


async def _run_with_progress(
    scenario: Scenario, cfg: RunConfig, show: bool, outcomes: list[RequestOutcome]
) -> tuple[str, float]:
    state = RunState()
    t0 = time.perf_counter()
    progress = Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total}"),
        TextColumn("{task.fields[info]}"),
        TimeElapsedColumn(),
        disable=not show,
        transient=False,
    )
    with progress:
        task = progress.add_task(scenario.name, total=None, info="")

        async def refresh() -> None:
            while True:
                ttft = f"{state.last_ttft_ms:.0f} ms" if state.last_ttft_ms is not None else "-"
                info = (
                    f"ok {state.completed}  failed {state.failed}  in-flight {state.in_flight}  TTFT {ttft}"
                )
                progress.update(
                    task, total=state.planned or None, completed=state.completed + state.failed, info=info
                )
                await asyncio.sleep(0.25)

        ui = asyncio.create_task(refresh())
        try:
            result = await run_scenario(scenario, cfg, state, on_outcome=outcomes.append)
        finally:
            ui.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await ui
    return result.model, time.perf_counter() - t0


def run_command(
    url: Annotated[str, typer.Option(help="Base URL of the server or router, e.g. http://127.0.0.1:30000")],
    scenario: Annotated[str, typer.Option(help="A built-in scenario name or a YAML file")],
    rate: Annotated[float | None, typer.Option(help="Override the arrival rate (req/s)")] = None,
    duration: Annotated[float | None, typer.Option(help="Override the duration (s)")] = None,
    requests: Annotated[int | None, typer.Option(help="Override the request count")] = None,
    api: Annotated[
        str, typer.Option(help="chat | completions | generate (SGLang-native, input_ids)")
    ] = "chat",
    model: Annotated[str | None, typer.Option(help="Model name (default: the first of /v1/models)")] = None,
    out: Annotated[Path | None, typer.Option(help="Write the results JSON here")] = None,
    timeout_s: Annotated[float, typer.Option(help="Per-request timeout (s)")] = 600.0,
    max_concurrency: Annotated[int | None, typer.Option(help="Client-side cap on requests in flight")] = None,
    api_key: Annotated[str | None, typer.Option(help="Bearer token", envvar="KVROUTER_API_KEY")] = None,
    save_detailed: Annotated[bool, typer.Option(help="Add vLLM's per-request arrays to the JSON")] = False,
    progress: Annotated[bool, typer.Option(help="Show the live progress bar")] = True,
) -> None:
    """Run a scenario open-loop against a live endpoint and print vLLM's summary block."""
    if api not in APIS:
        raise _fail(f"--api must be one of {', '.join(APIS)}, got {api!r}")
    if not url.startswith(("http://", "https://")):
        raise _fail(f"--url must start with http:// or https://, got {url!r}")
    if timeout_s <= 0 or (max_concurrency is not None and max_concurrency < 1):
        raise _fail("--timeout-s must be > 0 and --max-concurrency >= 1")
    try:
        sc = load_scenario(scenario).with_overrides(rate_rps=rate, duration_s=duration, requests=requests)
    except ScenarioError as exc:
        raise _fail(str(exc)) from None
    cfg = RunConfig(url=url, api=api, model=model, timeout_s=timeout_s, max_concurrency=max_concurrency,
                    api_key=api_key)  # fmt: skip
    outcomes: list[RequestOutcome] = []
    start = time.perf_counter()
    interrupted = False
    used_model = model or "default"
    try:
        used_model, duration_s = asyncio.run(_run_with_progress(sc, cfg, progress, outcomes))
    except KeyboardInterrupt:
        interrupted, duration_s = True, time.perf_counter() - start
    result = build_results(sc, cfg, used_model, outcomes, duration_s, interrupted=interrupted,
                           save_detailed=save_detailed)  # fmt: skip
    limit = cfg.max_concurrency or sc.max_concurrency
    rate_rps = sc.arrival.rate_rps
    typer.echo(format_summary(result, request_rate=rate_rps, max_concurrency=limit))
    typer.echo(format_extras(result))
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_bytes(orjson.dumps(result, option=orjson.OPT_INDENT_2 | orjson.OPT_SERIALIZE_NUMPY))
        typer.echo(f"results written to {out}")
    if interrupted:
        raise typer.Exit(code=130)


def register(app: typer.Typer) -> None:
    app.command("run")(run_command)
