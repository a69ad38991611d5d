"""What we ship for Prometheus and Grafana works as shipped: promtool accepts the configs and rules, the
alert unit tests pass, and every dashboard query names a metric that a real router scrape, the emulated
engines' /metrics or a recording rule actually provides."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
import yaml
from gateway_support import MODEL, router
from observability_support import exported_names, mixed_traffic, promtool

ROOT = Path(__file__).resolve().parent.parent
PROM = ROOT / "deploy/prometheus"
DASHBOARD = ROOT / "deploy/grafana/dashboards/kvrouter.json"
DOCS = ROOT / "docs/observability.md"

PROMQL_WORDS = {
    "by", "without", "on", "ignoring", "group_left", "group_right", "and", "or", "unless", "bool", "offset",
    "le", "inf", "nan",
}  # fmt: skip
IDENT = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")


def metric_names(expr: str) -> set[str]:
    """Metric names in a PromQL expression: identifiers that are not functions, keywords, labels or
    Grafana variables."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # string literals
    text = re.sub(r"label_values\(([^,()]+),\s*\w+\s*\)", r"\1", text)  # Grafana: (metric, label)
    text = re.sub(r"\$\{?\w+\}?", "1", text)  # $__rate_interval, $backend
    text = re.sub(r"\{[^}]*\}", "", text)  # label matchers
    text = re.sub(r"\[[^\]]*\]", "", text)  # range selectors
    text = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", text)
    names = set()
    for m in IDENT.finditer(text):
        rest = text[m.end() :].lstrip()
        word = m.group(0)
        if rest.startswith("(") or word.lower() in PROMQL_WORDS or re.fullmatch(r"\d.*", word):
            continue
        names.add(word)
    return names


def rule_groups() -> list[dict[str, Any]]:
    groups = []
    for path in sorted((PROM / "rules").glob("*.yml")):
        groups.extend(yaml.safe_load(path.read_text())["groups"])
    return groups


def dashboard_exprs() -> list[tuple[str, str]]:
    dash = json.loads(DASHBOARD.read_text())
    out = []
    for panel in dash["panels"]:
        for inner in [panel, *panel.get("panels", [])]:
            out += [(inner["title"], t["expr"]) for t in inner.get("targets", [])]
    out += [(f"variable {v['name']}", v["definition"]) for v in dash["templating"]["list"]]
    return out


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([promtool(), *args], capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("config", ["prometheus.yml", "prometheus.emulated.yml"])
def test_promtool_accepts_the_configs_with_their_rules(config: str) -> None:
    proc = run("check", "config", str(PROM / config))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "2 rule files found" in proc.stdout + proc.stderr  # rule_files resolve next to the config


def test_promtool_accepts_the_rules_and_their_unit_tests_pass() -> None:
    rules = sorted(str(p) for p in (PROM / "rules").glob("*.yml"))
    proc = run("check", "rules", *rules)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    proc = run("test", "rules", *sorted(str(p) for p in (PROM / "tests").glob("*.yml")))
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_vllm_per_rank_label_survives_the_scrape_config() -> None:
    """A target label called ``engine`` would overwrite vLLM's own ``engine`` (DP rank) label."""
    for config in PROM.glob("prometheus*.yml"):
        for job in yaml.safe_load(config.read_text())["scrape_configs"]:
            for static in job["static_configs"]:
                assert "engine" not in static.get("labels", {}), (config.name, job["job_name"])


async def _known_names(start_emulator: Any) -> set[str]:
    """Names a real router scrape (after traffic) and both emulated engines export."""
    sglang = start_emulator("sglang", dp_size=2, time_scale=0.2)
    vllm = start_emulator("vllm", dp_size=2)
    async with router(backends=[f"sglang={sglang.url}"]) as url, httpx.AsyncClient() as http:
        await mixed_traffic(url, MODEL)
        texts = [(await http.get(u + "/metrics")).text for u in (url, sglang.url, vllm.url)]
    names = set().union(*(exported_names(t) for t in texts))
    names |= {"up"}  # Prometheus's own per-target series
    return names | {r["record"] for g in rule_groups() for r in g["rules"] if "record" in r}


def test_every_dashboard_and_rule_query_names_exported_metrics(start_emulator: Any) -> None:
    known = anyio.run(_known_names, start_emulator)
    assert {"kvrouter_rank_reserved_tokens", "sglang:num_used_tokens", "vllm:kv_cache_usage_perc"} <= known
    exprs = dashboard_exprs()
    exprs += [(r.get("record") or r["alert"], r["expr"]) for g in rule_groups() for r in g["rules"]]
    assert len(exprs) > 40
    for where, expr in exprs:
        names = metric_names(expr)
        assert names, f"{where}: no metric in {expr!r}"
        assert names <= known, f"{where}: {sorted(names - known)} exported by nobody ({expr!r})"


def test_metric_name_extraction() -> None:
    expr = (
        'histogram_quantile(0.99, sum by (le, op) (rate(kvrouter_ledger_operation_seconds_bucket{op=~"a|b"}'
        "[$__rate_interval]))) / on (backend) group_left sglang:num_used_tokens > bool 0.5"
    )
    assert metric_names(expr) == {"kvrouter_ledger_operation_seconds_bucket", "sglang:num_used_tokens"}
    assert metric_names("label_values(kvrouter_rank_capacity_tokens, backend)") == {
        "kvrouter_rank_capacity_tokens"
    }


def test_dashboard_model_and_the_docs_five_panels() -> None:
    dash = json.loads(DASHBOARD.read_text())
    assert dash["uid"] == "kvrouter" and dash["schemaVersion"] >= 36
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    for panel in dash["panels"]:
        assert panel["type"] == "row" or panel["datasource"]["uid"] == "prometheus"
        grid = panel["gridPos"]
        assert grid["x"] >= 0 and grid["x"] + grid["w"] <= 24
    titles = {p["title"] for p in dash["panels"]}
    docs = DOCS.read_text()
    first = [t for t in titles if re.match(r"[1-5]\. ", t)]
    assert len(first) == 5
    for title in first:
        assert f"**{title}**" in docs, f"docs/observability.md does not describe panel {title!r}"
