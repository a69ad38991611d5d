"""``kvrouter-loadtest compare``: one scenario over several policies -> DIR/results.json + DIR/report.md.

Three sources: ``--sim`` (the virtual-time simulator, every policy over the same requests, with an
optional ``--sweep`` of rate factors for the goodput plot), ``--url NAME=URL`` (live runs, one per router
URL, sampling its ``/ranks`` for occupancy), or ``--from results.json`` (render an existing file).
"""

from __future__ import annotations

import asyncio
import math
from pathlib import Path
from typing import Annotated, Any

import aiohttp
import orjson
import typer

from loadtest.cmd_run import build_results
from loadtest.rank_poll import RankPoller
from loadtest.run import APIS, RunConfig, run_scenario
from loadtest.workload import Scenario, ScenarioError, load_scenario

SWEEP_KEYS = ("request_goodput", "request_throughput", "p99_ttft_ms", "mean_tpot_ms", "completed", "failed")


def _fail(message: str) -> typer.Exit:
    typer.echo(f"error: {message}", err=True)
    return typer.Exit(code=2)


def parse_factors(text: str) -> list[float]:
    try:
        factors = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise _fail(f"--sweep must be comma-separated numbers, got {text!r}") from None
    if any(not (f > 0 and math.isfinite(f)) for f in factors):
        raise _fail(f"--sweep factors must be positive, got {text!r}")
    return factors


def compare_sim(
    scenario: Scenario, policies: list[str], factors: list[float], engine: str, capacity_scale: float
) -> dict[str, Any]:
    """Every policy in the simulator at the scenario's rate, plus goodput at ``factors`` x that rate."""
    from loadtest.sim import SimConfig, run_sim

    config = SimConfig(engine=engine, capacity_scale=capacity_scale)  # type: ignore[arg-type]

    def progress(name: str, t_s: float) -> None:
        typer.echo(f"  {name}: t = {t_s:.0f} s", err=True)

    typer.echo(
        f"simulating {scenario.name} at {scenario.arrival.rate_rps:g} req/s: {', '.join(policies)}", err=True
    )
    doc = run_sim(scenario, policies, config, progress)
    if factors:
        rates = [scenario.arrival.rate_rps * f for f in factors]
        sweep: dict[str, list[dict[str, Any]]] = {p: [] for p in doc["results"]}
        for factor, rate in zip(factors, rates, strict=True):
            typer.echo(f"sweep: {rate:g} req/s", err=True)
            # Factor 1 is the run just made: reuse it (the sim is deterministic).
            swept = (
                doc if factor == 1.0 else run_sim(scenario.with_overrides(rate_rps=rate), policies, config)
            )
            for p, r in swept["results"].items():
                sweep[p].append({k: r.get(k) for k in SWEEP_KEYS})
        doc["sweep"] = {"rates_rps": rates, "results": sweep}
    return doc


async def _live_one(scenario: Scenario, cfg: RunConfig) -> dict[str, Any]:
    poller = RankPoller(cfg.url, api_key=cfg.api_key)
    stop = asyncio.Event()
    async with aiohttp.ClientSession() as session:
        poll = asyncio.create_task(poller.run(session, stop))
        try:
            res = await run_scenario(scenario, cfg)
        finally:
            stop.set()
            await poll
    result = build_results(scenario, cfg, res.model, res.outcomes, res.duration_s)
    result["ttft_samples_ms"] = sorted(o.ttft_s * 1e3 for o in res.outcomes if o.success)
    if poller.t_s:
        result["timeseries"] = poller.timeseries()
    return result


def compare_live(scenario: Scenario, targets: list[tuple[str, str]], base: RunConfig) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for name, url in targets:
        typer.echo(f"running {scenario.name} against {name} = {url}", err=True)
        cfg = RunConfig(url=url, api=base.api, model=base.model, timeout_s=base.timeout_s,
                        max_concurrency=base.max_concurrency, api_key=base.api_key)  # fmt: skip
        results[name] = asyncio.run(_live_one(scenario, cfg))
    return {
        "scenario": scenario.name,
        "seed": scenario.seed,
        "config": {"source": "live"},
        "results": results,
    }


def _parse_targets(urls: list[str]) -> list[tuple[str, str]]:
    out = []
    for item in urls:
        name, sep, url = item.partition("=")
        if not sep or not name or not url.startswith(("http://", "https://")):
            raise _fail(f"--url takes NAME=http://host:port, got {item!r}")
        out.append((name, url))
    return out


def _load_results(path: Path) -> dict[str, Any]:
    try:
        doc = orjson.loads(path.read_bytes())
    except (OSError, orjson.JSONDecodeError) as exc:
        raise _fail(f"{path}: cannot read results JSON: {exc}") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("results"), dict):
        raise _fail(f'{path}: expected {{"scenario": ..., "results": {{POLICY: {{...}}}}}}')
    return doc


def compare_command(
    out: Annotated[Path, typer.Option(help="Output directory for results.json, report.md and PNGs")],
    scenario: Annotated[str | None, typer.Option(help="A built-in scenario name or a YAML file")] = None,
    policies: Annotated[str, typer.Option(help="Comma-separated policies (sim mode)")] = "",
    sim: Annotated[bool, typer.Option("--sim", help="Compare in the simulator")] = False,
    url: Annotated[list[str] | None, typer.Option(help="NAME=URL of a live router (repeatable)")] = None,
    from_: Annotated[Path | None, typer.Option("--from", help="Render an existing results JSON")] = None,
    rate: Annotated[float | None, typer.Option(help="Override the arrival rate (req/s)")] = None,
    duration: Annotated[float | None, typer.Option(help="Override the duration (s)")] = None,
    requests: Annotated[int | None, typer.Option(help="Override the request count")] = None,
    sweep: Annotated[
        str, typer.Option(help="Rate factors for the goodput plot (sim), '' for none")
    ] = "0.5,1,1.5",
    engine: Annotated[str, typer.Option(help="Simulated engine: sglang | vllm")] = "sglang",
    capacity_scale: Annotated[float, typer.Option(help="Scale the simulated KV pools")] = 1.0,
    api: Annotated[str, typer.Option(help="Live API: chat | completions | generate")] = "chat",
    model: Annotated[str | None, typer.Option(help="Live model name")] = None,
    timeout_s: Annotated[float, typer.Option(help="Live per-request timeout (s)")] = 600.0,
    notes: Annotated[str, typer.Option(help="A paragraph to put above the table")] = "",
) -> None:
    """Compare placement policies on one scenario and write a Markdown report with plots."""
    from loadtest.report import write_report

    modes = sum([sim, bool(url), from_ is not None])
    if modes != 1:
        raise _fail("choose exactly one of --sim, --url NAME=URL ..., --from results.json")
    if from_ is not None:
        doc = _load_results(from_)
    else:
        if scenario is None:
            raise _fail("--scenario is required with --sim or --url")
        try:
            sc = load_scenario(scenario).with_overrides(rate_rps=rate, duration_s=duration, requests=requests)
        except ScenarioError as exc:
            raise _fail(str(exc)) from None
        if sim:
            names = [p.strip() for p in policies.split(",") if p.strip()]
            if not names:
                raise _fail("--policies is required with --sim (e.g. lockstep,round_robin,engine)")
            if engine not in ("sglang", "vllm") or capacity_scale <= 0:
                raise _fail("--engine must be sglang or vllm and --capacity-scale > 0")
            try:
                doc = compare_sim(sc, names, parse_factors(sweep), engine, capacity_scale)
            except ValueError as exc:
                raise _fail(str(exc)) from None
        else:
            if api not in APIS:
                raise _fail(f"--api must be one of {', '.join(APIS)}")
            base = RunConfig(url="http://unused", api=api, model=model, timeout_s=timeout_s)
            doc = compare_live(sc, _parse_targets(url or []), base)
        out.mkdir(parents=True, exist_ok=True)
        (out / "results.json").write_bytes(orjson.dumps(doc, option=orjson.OPT_SERIALIZE_NUMPY))
    path = write_report(doc, out, notes)
    typer.echo(f"report written to {path}")


def register(app: typer.Typer) -> None:
    app.command("compare")(compare_command)
