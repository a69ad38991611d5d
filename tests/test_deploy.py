"""Offline validation of deploy/: engine flags against the engines' own flag lists, capacity numbers against
`kvrouter plan`, router configs against Settings, Kubernetes/compose schemas, hadolint, yamllint."""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from router.capacity import PlanInputs, get_gpu, plan
from router.config import Settings
from router.model import load_model
from router.placement import get_policy

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
BIN = Path(sys.executable).parent
K8S_VERSION = "1.33.0"  # the Kubernetes API the manifests target (kubernetes-validate ships its schemas)
# An H200 as CUDA reports it (143,771 MiB): SGLang's --mem-fraction-static is a share of this, not of 141 GB.
H200_CUDA_BYTES = 143_771 * 2**20
SHELL_STOP = {"&", "&&", "||", "|", ";"}


@dataclass
class Invocation:
    """One engine command line found in deploy/: where, which engine, its argument tokens."""

    where: str
    engine: str  # "sglang" or "vllm"
    args: list[str]
    flags: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.flags = [a.split("=", 1)[0] for a in self.args if re.match(r"^--?[A-Za-z]", a)]

    def value(self, flag: str) -> str:
        i = self.args.index(flag)
        return self.args[i + 1]


def allowlist(engine: str) -> set[str]:
    lines = (DEPLOY / "flags" / f"{engine}_flags.txt").read_text().splitlines()
    return {ln.strip() for ln in lines if ln.strip() and not ln.startswith("#")}


def _expand(token: str, env: dict[str, str]) -> str:
    """``${VAR:-default}`` -> a known assignment, else the default; ``${VAR}`` -> a known assignment."""
    token = re.sub(r"\$\{(\w+):-([^}]*)\}", lambda m: env.get(m.group(1), m.group(2)), token)
    return re.sub(r"\$\{(\w+)\}", lambda m: env.get(m.group(1), m.group(0)), token)


def engine_call(tokens: list[str]) -> tuple[str, list[str]] | None:
    for i, tok in enumerate(tokens):
        if tok.endswith("sglang.launch_server"):
            rest = tokens[i + 1 :]
            return "sglang", rest
        if tok == "vllm" and tokens[i + 1 : i + 2] == ["serve"]:
            return "vllm", tokens[i + 2 :]
    return None


def parse_script(path: Path, text: str | None = None) -> list[Invocation]:
    """Engine command lines of a bash recipe: continuations joined, defaults of ``${VAR:-x}`` applied."""
    text = path.read_text() if text is None else text
    lines = [ln for ln in text.splitlines() if not ln.lstrip().startswith("#")]
    env: dict[str, str] = {}
    found = []
    for logical in "\n".join(lines).replace("\\\n", " ").splitlines():
        tokens = shlex.split(logical, comments=True)
        m = re.fullmatch(r"(\w+)=(.*)", tokens[0]) if len(tokens) == 1 else None
        if m:
            env[m.group(1)] = _expand(m.group(2), env)
        call = engine_call(tokens)
        if call:
            args = [_expand(t, env) for t in call[1]]
            args = args[: next((i for i, a in enumerate(args) if a in SHELL_STOP), len(args))]
            found.append(Invocation(path.name, call[0], args))
    return found


def yaml_docs(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def compose_invocations(path: Path) -> list[Invocation]:
    found = []
    for name, svc in yaml_docs(path)[0]["services"].items():
        call = engine_call([str(t) for t in [*svc.get("entrypoint", []), *svc.get("command", [])]])
        if call:
            found.append(Invocation(f"{path.relative_to(ROOT)}:{name}", *call))
    return found


def pod_containers(doc: dict[str, Any]) -> list[dict[str, Any]]:
    if doc.get("kind") not in {"Deployment", "StatefulSet", "DaemonSet", "Job"}:
        return []
    return list(doc["spec"]["template"]["spec"]["containers"])


def k8s_manifests() -> list[tuple[Path, dict[str, Any]]]:
    """deploy/k8s and its components (deploy/k8s/vllm): every manifest, kustomizations left out."""
    files = sorted(p for p in (DEPLOY / "k8s").rglob("*.yaml") if p.name != "kustomization.yaml")
    return [(p, d) for p in files for d in yaml_docs(p)]


def k8s_invocations() -> list[Invocation]:
    found = []
    for path, doc in k8s_manifests():
        for c in pod_containers(doc):
            call = engine_call([str(t) for t in [*c.get("command", []), *c.get("args", [])]])
            if call:
                found.append(Invocation(f"{path.relative_to(ROOT)}:{c['name']}", *call))
    return found


def all_invocations() -> list[Invocation]:
    found = [inv for p in sorted(DEPLOY.rglob("*.sh")) for inv in parse_script(p)]
    for p in sorted((DEPLOY / "compose").glob("*.yml")):
        found += compose_invocations(p)
    return found + k8s_invocations()


def script(name: str) -> Invocation:
    (inv,) = parse_script(DEPLOY / name)
    return inv


# --- engine flags -----------------------------------------------------------------------------------------


def test_every_engine_flag_exists_in_the_engine_source_allowlist() -> None:
    invocations = all_invocations()
    by_engine = {e: [i for i in invocations if i.engine == e] for e in ("sglang", "vllm")}
    # 3 SGLang scripts + compose + k8s; 3 vLLM scripts + compose + k8s: the parser must find them all.
    assert len(by_engine["sglang"]) >= 5 and len(by_engine["vllm"]) >= 5, [i.where for i in invocations]
    assert any(i.where.startswith("deploy/k8s/vllm/") for i in by_engine["vllm"])
    unknown = [
        (inv.where, f)
        for e, invs in by_engine.items()
        for inv in invs
        for f in inv.flags
        if f not in allowlist(e)
    ]
    assert not unknown, f"flags not in deploy/flags/*.txt (not in the engine's source): {unknown}"
    assert all(len(inv.flags) >= 10 for inv in invocations)


def test_flag_check_catches_invented_and_abbreviated_flags(tmp_path: Path) -> None:
    bad = tmp_path / "bad.sh"
    bad.write_text('X="${X:-1}"\nexec python3 -m sglang.launch_server \\\n  --tp 8 \\\n  --enable-dp-attn\n')
    (inv,) = parse_script(bad)
    assert [f for f in inv.flags if f not in allowlist("sglang")] == ["--tp", "--enable-dp-attn"]
    assert {"--tp-size", "--enable-dp-attention", "--moe-a2a-backend"} <= allowlist("sglang")
    assert {"--data-parallel-size", "--enable-expert-parallel", "--all2all-backend"} <= allowlist("vllm")


def test_compose_and_k8s_engines_run_exactly_the_recipe_arguments() -> None:
    sglang, vllm = script("sglang/launch_dp8_ep8.sh"), script("vllm/serve_dp8_internal_lb.sh")
    others = compose_invocations(DEPLOY / "compose/docker-compose.gpu.yml") + k8s_invocations()
    assert len(others) == 4
    for inv in others:
        expected = sglang if inv.engine == "sglang" else vllm
        assert inv.args == expected.args, inv.where


# --- capacity numbers come from `kvrouter plan` -----------------------------------------------------------


def _plan(gpus: int, page: int) -> dict[str, Any]:
    return plan(
        load_model("deepseek-v3"), PlanInputs(gpu=get_gpu("h200"), gpus=gpus, page_size=page)
    ).to_json()


@pytest.mark.parametrize(
    ("name", "gpus", "layout"),
    [
        ("launch_dp8_ep8.sh", 8, "dp_ep"),
        ("launch_dp16_ep16_2nodes.sh", 16, "dp_ep"),
        ("launch_tp8_baseline.sh", 8, "tp"),
    ],
)
def test_sglang_capacity_numbers_match_the_plan(name: str, gpus: int, layout: str) -> None:
    inv = script(f"sglang/{name}")
    page = int(inv.value("--page-size"))
    p = _plan(gpus, page)
    lay = p["layouts"][layout]
    assert int(inv.value("--max-running-requests")) == lay["seqs_at_context"]
    context = int(inv.value("--context-length"))
    assert context == load_model("deepseek-v3").max_context_tokens
    assert context <= lay["kv_tokens_per_rank"], "a sequence must fit one rank's pool"
    assert float(inv.value("--mem-fraction-static")) == round(p["usable_bytes_per_gpu"] / H200_CUDA_BYTES, 2)
    if layout == "dp_ep":
        assert (
            int(inv.value("--tp-size")) == int(inv.value("--dp-size")) == int(inv.value("--ep-size")) == gpus
        )
        assert "--enable-dp-attention" in inv.flags
        # SGLang divides the chunk by the DP size: 1,024 prompt tokens per rank per step.
        assert int(inv.value("--chunked-prefill-size")) // gpus == 1024


@pytest.mark.parametrize(
    "name", ["serve_dp8_internal_lb.sh", "serve_dp8_external_lb.sh", "serve_dp8_multiport.sh"]
)
def test_vllm_per_rank_numbers_match_the_plan(name: str) -> None:
    inv = script(f"vllm/{name}")
    lay = _plan(8, int(inv.value("--block-size")))["layouts"]["dp_ep"]
    assert int(inv.value("--data-parallel-size")) == lay["ranks"] == 8
    # vLLM's --max-num-seqs is per rank (SGLang's --max-running-requests is per server).
    assert int(inv.value("--max-num-seqs")) == lay["seqs_at_context"] // lay["ranks"]
    assert int(inv.value("--max-model-len")) <= lay["kv_tokens_per_rank"]
    assert "--enable-expert-parallel" in inv.flags


# --- router configs ---------------------------------------------------------------------------------------


def router_configs(tmp_path: Path) -> list[tuple[str, Path]]:
    found = [
        (p.parent.name, p) for d in ("sglang", "vllm") for p in sorted((DEPLOY / d).glob("router-*.yaml"))
    ]
    for path, doc in k8s_manifests():
        if doc["kind"] == "ConfigMap" and "router.yaml" in doc.get("data", {}):
            out = tmp_path / f"{path.parent.name}-{path.stem}.yaml"
            out.write_text(doc["data"]["router.yaml"])
            found.append(("vllm" if path.parent.name == "vllm" else "sglang", out))
    return found


def test_every_router_config_loads_with_the_router_settings(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("KVROUTER_CONFIG", "KVROUTER_BACKENDS", "KVROUTER_POLICY", "KVROUTER_REDIS_URL"):
        monkeypatch.delenv(name, raising=False)
    configs = router_configs(tmp_path)
    assert len(configs) == 7
    for engine_dir, path in configs:
        settings = Settings(config_file=str(path))
        get_policy(settings.policy)
        engines = {spec.engine for spec in settings.backend_specs()}
        assert engines and all(e.startswith(engine_dir) for e in engines), path
        assert settings.redis_url, f"{path}: replicas must share the Redis ledger"
    bad = tmp_path / "bad.yaml"
    bad.write_text("backends: ['sglang=http://x:1']\nqueue_maxx: 3\n")
    with pytest.raises(ValueError, match="queue_maxx"):
        Settings(config_file=str(bad))


# --- Dockerfile -------------------------------------------------------------------------------------------


def tool(name: str) -> str:
    path = BIN / name
    assert path.exists(), f"{name} missing: `pip install -e '.[dev]'` installs it"
    return str(path)


def test_dockerfile_passes_hadolint_and_has_the_runtime_shape() -> None:
    proc = subprocess.run(
        [tool("hadolint"), "--failure-threshold", "info", str(ROOT / "Dockerfile")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    text = (ROOT / "Dockerfile").read_text()
    assert len(re.findall(r"^FROM ", text, re.M)) == 2, "multi-stage: build + runtime"
    assert "python:3.11-slim" in text
    assert re.search(r"^USER 10001", text, re.M)
    assert re.search(r'^ENTRYPOINT \["kvrouter", "serve"\]', text, re.M)
    healthcheck = re.search(r"^HEALTHCHECK .*\n.*CMD \[\"python\".*/health", text, re.M)
    assert healthcheck and not re.search(r"^(RUN|HEALTHCHECK|CMD).*curl", text, re.M)


# --- Kubernetes -------------------------------------------------------------------------------------------


def crd_schemas() -> dict[str, dict[str, Any]]:
    """Prometheus Operator kinds: kubernetes-validate has core schemas only, these are subsets of the CRDs."""
    return {
        kind: json.loads((ROOT / f"tests/data/{kind.lower()}.schema.json").read_text())
        for kind in ("ServiceMonitor", "PrometheusRule")
    }


def test_k8s_manifests_validate_against_pinned_schemas() -> None:
    crds = crd_schemas()
    kinds = []
    for path, doc in k8s_manifests():
        kinds.append(doc["kind"])
        if doc["kind"] in crds:
            jsonschema.validate(doc, crds[doc["kind"]])
            continue
        try:
            kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"{path.name} {doc['kind']}/{doc['metadata']['name']}: {exc.message}")
    assert {
        "Deployment",
        "StatefulSet",
        "Service",
        "ConfigMap",
        "PodDisruptionBudget",
        "ServiceMonitor",
        "PrometheusRule",
    } <= set(kinds)
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate({**doc, "spec": {"replicaz": 1}}, K8S_VERSION, strict=True)


# --- compose, YAML, Prometheus, Grafana -------------------------------------------------------------------


def test_compose_files_match_the_compose_specification() -> None:
    files = sorted(str(p) for p in (DEPLOY / "compose").glob("*.yml"))
    assert len(files) == 2
    cmd = [tool("check-jsonschema"), "--builtin-schema", "vendor.compose-spec", *files]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_yamllint_is_clean_on_every_deploy_yaml() -> None:
    cmd = [tool("yamllint"), "--strict", "-c", str(DEPLOY / ".yamllint.yaml"), str(DEPLOY)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.parametrize(
    ("prom", "compose"),
    [
        ("prometheus.yml", "docker-compose.gpu.yml"),
        ("prometheus.emulated.yml", "docker-compose.emulated.yml"),
    ],
)
def test_prometheus_scrapes_the_router_and_engines_of_its_compose(prom: str, compose: str) -> None:
    config = yaml_docs(DEPLOY / "prometheus" / prom)[0]
    services = yaml_docs(DEPLOY / "compose" / compose)[0]["services"]
    jobs = {
        j["job_name"]: [t for sc in j["static_configs"] for t in sc["targets"]]
        for j in config["scrape_configs"]
    }
    assert {"kvrouter", "sglang"} <= jobs.keys()
    for target in (t for targets in jobs.values() for t in targets):
        host, port = target.split(":")
        assert host in services, f"{prom}: {target} is no service of {compose}"
        assert f"--port {port}" in " ".join(map(str, services[host].get("command", [])))
    mounts = " ".join(services["prometheus"]["volumes"])
    assert f"../prometheus/{prom}:/etc/prometheus/prometheus.yml" in mounts
    promtool = shutil.which("promtool")
    if promtool:  # .ci/run installs it; the structural checks above run either way
        proc = subprocess.run(
            [promtool, "check", "config", str(DEPLOY / "prometheus" / prom)], capture_output=True
        )
        assert proc.returncode == 0, proc.stdout + proc.stderr


def test_grafana_provisioning_points_at_the_compose_prometheus_and_dashboards() -> None:
    ds = yaml_docs(DEPLOY / "grafana/provisioning/datasources/prometheus.yml")[0]["datasources"][0]
    assert ds["url"] == "http://prometheus:9090" and ds["uid"] == "prometheus"
    provider = yaml_docs(DEPLOY / "grafana/provisioning/dashboards/kvrouter.yml")[0]["providers"][0]
    for compose in (DEPLOY / "compose").glob("*.yml"):
        volumes = yaml_docs(compose)[0]["services"]["grafana"]["volumes"]
        assert f"../grafana/dashboards:{provider['options']['path']}:ro" in volumes
        assert "../grafana/provisioning:/etc/grafana/provisioning:ro" in volumes
