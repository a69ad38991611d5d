"""``kvrouter-loadtest sim``: compare placement policies on a scenario in virtual time."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Any

import orjson
import typer
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from loadtest.engine_types import ENGINE_MODES, EngineMode
from loadtest.sim import DEFAULT_SIM_POLICIES, SimConfig, normalise_policy, run_policy
from loadtest.sim_router import RESERVE_MODES, ReserveMode
from loadtest.workload import Scenario, ScenarioError, load_scenario

HELP = "\n\n".join(
    [
        "Simulate the engine in virtual time under each placement policy and compare them.",
        "Every policy sees the same requests (the scenario's seed). The simulated router sees only what the "
        "gateway sees: its own page-rounded reservations and engine telemetry refreshed every "
        "--telemetry-interval-s. Requests that fit no rank wait in a bounded FIFO (--queue-max, "
        "--queue-timeout-s) and count as rejected when it overflows or they time out.",
        "Policy `engine` (alias `none`) has no router: requests go straight to the engine's own dispatch "
        "(SGLang round robin, vLLM internal LB) without admission, which is where preemptions come from.",
        "Default scale: DeepSeek-V3 on 8 x H200, DP-attention + EP8, 510,229 KV tokens per rank "
        "(`kvrouter plan`). Results use vLLM benchmark key names; --out writes "
        "{scenario, config, results: {POLICY: ...}}.",
        "Example: kvrouter-loadtest sim --scenario long-context-mix --policies lockstep,round_robin,engine "
        "--out sim.json",
    ]
)


def _fail(message: str) -> typer.Exit:
    Console(stderr=True).print(f"error: {message}", markup=False, highlight=False, soft_wrap=True)
    return typer.Exit(2)


def _scenario(name: str, seed: int | None, duration_s: float | None, rate_rps: float | None) -> Scenario:
    try:
        sc = load_scenario(name).with_overrides(rate_rps=rate_rps, duration_s=duration_s)
    except ScenarioError as exc:
        raise _fail(str(exc).splitlines()[0]) from None
    return dataclasses.replace(sc, seed=seed) if seed is not None else sc


def _policies(text: str) -> list[str]:
    names = [p for p in (s.strip() for s in text.split(",")) if p]
    if not names:
        raise _fail("--policies is empty")
    try:
        return list(dict.fromkeys(normalise_policy(p) for p in names))
    except ValueError as exc:
        raise _fail(str(exc)) from None


def _table(scenario: str, results: dict[str, dict[str, Any]]) -> Table:
    t = Table(title=f"sim: {scenario}", title_justify="left")
    cols = ["policy", "done", "rejected", "goodput r/s", "out tok/s", "p50 TTFT s", "p99 TTFT s"]
    cols += ["p50 TPOT ms", "p99 ITL ms", "preempt", "imbalance", "max ctx", "wall s"]
    for c in cols:
        t.add_column(c, justify="left" if c == "policy" else "right", no_wrap=True)
    for name, r in results.items():
        t.add_row(
            name,
            str(r["completed"]),
            str(r["rejected"]),
            f"{r['request_goodput']:.3f}",
            f"{r['output_throughput']:.0f}",
            f"{r['median_ttft_ms'] / 1e3:.2f}",
            f"{r['p99_ttft_ms'] / 1e3:.1f}",
            f"{r['median_tpot_ms']:.0f}",
            f"{r['p99_itl_ms']:.0f}",
            str(r["preemptions"]),
            f"{r['imbalance']:.2f}",
            f"{r['mean_max_rank_context_tokens']:,.0f}",
            f"{r['wall_s']:.1f}",
        )
    return t


def _run_all(sc: Scenario, names: list[str], cfg: SimConfig, quiet: bool) -> dict[str, dict[str, Any]]:
    requests = sc.generate()
    span_s = requests[-1].arrival_s if requests else 1.0
    results: dict[str, dict[str, Any]] = {}
    columns = (TextColumn("{task.description:<16}"), BarColumn(), TextColumn("{task.fields[t]}"))
    with Progress(*columns, TimeElapsedColumn(), console=Console(stderr=True), disable=quiet) as bar:
        for name in names:
            task = bar.add_task(name, total=span_s, t="")

            def tick(now_s: float, _task: Any = task) -> None:
                bar.update(_task, completed=min(now_s, span_s), t=f"{now_s:,.0f} s virtual")

            results[name] = run_policy(sc, requests, name, cfg, tick)
            bar.update(task, completed=span_s, t=f"{results[name]['duration']:,.0f} s virtual")
    return results


def sim(
    scenario: str = typer.Option(..., "--scenario", "-s", help="Built-in scenario name or a YAML file."),
    policies: str = typer.Option(",".join(DEFAULT_SIM_POLICIES), help="Comma-separated policies to compare."),
    out: Path | None = typer.Option(None, "--out", "-o", help="Write the results JSON here."),
    duration_s: float | None = typer.Option(None, help="Override the scenario's arrival window (s)."),
    rate_rps: float | None = typer.Option(None, help="Override the scenario's arrival rate (requests/s)."),
    capacity_scale: float = typer.Option(
        1.0, help="Multiply every rank's KV pool (e.g. 0.05 for quick runs)."
    ),
    seed: int | None = typer.Option(None, help="Override the scenario's seed."),
    engine: str = typer.Option("sglang", help="Engine behaviour: sglang or vllm."),
    page_size: int = typer.Option(1, help="KV page size in tokens (router reservations round up to it)."),
    reserve: str = typer.Option("gateway", help="Output reservation when max_tokens is absent: gateway|max."),
    default_max_tokens: int = typer.Option(
        512, help="Reservation for requests without max_tokens (gateway)."
    ),
    queue_max: int = typer.Option(256, help="Requests that may wait for room in the router."),
    queue_timeout_s: float = typer.Option(30.0, help="Longest wait in the router queue (virtual s)."),
    telemetry_interval_s: float = typer.Option(1.0, help="Engine telemetry refresh period (virtual s)."),
    drain_limit_s: float = typer.Option(1800.0, help="Virtual time allowed after the last arrival."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress bar."),
    reservation: str = typer.Option(
        "max", help="Output reservation: max (max_tokens) or predicted (learned quantile, grown by pages)."
    ),
    target_preemption_rate: float = typer.Option(0.01, help="predicted: over-commit budget's target."),
    reservation_quantile: float = typer.Option(0.5, help="predicted: quantile of observed lengths."),
) -> None:
    if engine not in ENGINE_MODES:
        raise _fail(f"--engine must be one of {', '.join(ENGINE_MODES)}, got {engine!r}")
    if reserve not in RESERVE_MODES:
        raise _fail(f"--reserve must be one of {', '.join(RESERVE_MODES)}, got {reserve!r}")
    if (
        min(queue_timeout_s, telemetry_interval_s, drain_limit_s) <= 0
        or min(queue_max, default_max_tokens) < 0
    ):
        raise _fail("queue, timeout, telemetry and drain settings must be positive")
    names = _policies(policies)
    sc = _scenario(scenario, seed, duration_s, rate_rps)
    mode: EngineMode = "vllm" if engine == "vllm" else "sglang"
    rmode: ReserveMode = "max" if reserve == "max" else "gateway"
    cfg = SimConfig(
        mode, capacity_scale, page_size, default_max_tokens, rmode, queue_max, queue_timeout_s,
        telemetry_interval_s, drain_limit_s, reservation, target_preemption_rate, reservation_quantile,
    )  # fmt: skip
    try:
        cfg.reservation_settings()
        ecfg = cfg.engine_config()
    except ValueError as exc:  # EngineConfigError, CapacityError: bad sizes
        raise _fail(str(exc)) from None
    results = _run_all(sc, names, cfg, quiet)
    doc = {
        "scenario": sc.name,
        "seed": sc.seed,
        "config": dataclasses.asdict(cfg)
        | {"dp_size": ecfg.dp_size, "kv_tokens_per_rank": ecfg.kv_tokens_per_rank},
        "results": results,
    }
    if out is not None:
        try:
            out.write_bytes(orjson.dumps(doc, option=orjson.OPT_INDENT_2 | orjson.OPT_SERIALIZE_NUMPY))
        except OSError as exc:
            raise _fail(f"cannot write {out}: {exc.strerror}") from None
    Console(file=sys.stdout, width=160).print(_table(sc.name, results))


def register(app: typer.Typer) -> None:
    app.command("sim", help=HELP, no_args_is_help=True)(sim)
