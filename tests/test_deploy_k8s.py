"""Kubernetes pieces beyond tests/test_deploy.py's per-file checks: the PrometheusRule cannot drift from
deploy/prometheus/rules/*.yml, and the vLLM component swaps the whole engine (nothing of SGLang left, the
router pointed at vLLM). With kubectl on PATH, both stacks are rendered by kustomize and validated whole."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml
from test_deploy import DEPLOY, K8S_VERSION, crd_schemas, k8s_manifests, pod_containers, yaml_docs

K8S = DEPLOY / "k8s"
COMPONENT = K8S / "vllm"
RULE_FILES = sorted((DEPLOY / "prometheus/rules").glob("*.yml"))
SGLANG_ONLY = {
    ("StatefulSet", "sglang-engine"),
    ("Service", "sglang-engine"),
    ("ServiceMonitor", "sglang-engine"),
}


def _ident(doc: dict[str, Any]) -> tuple[str, str]:
    return doc["kind"], doc["metadata"]["name"]


def _objects(directory: Path) -> dict[tuple[str, str], dict[str, Any]]:
    return {
        _ident(d): d
        for p in sorted(directory.glob("*.yaml"))
        if p.name != "kustomization.yaml"
        for d in yaml_docs(p)
    }


def test_prometheusrule_holds_exactly_the_rule_files_groups() -> None:
    (rule,) = yaml_docs(K8S / "prometheusrule.yaml")
    groups = [g for path in RULE_FILES for g in yaml.safe_load(path.read_text())["groups"]]
    assert len(groups) >= 3
    assert rule["spec"]["groups"] == groups, (
        "deploy/k8s/prometheusrule.yaml differs from deploy/prometheus/rules/*.yml: run "
        "deploy/k8s/render-prometheusrule.sh > deploy/k8s/prometheusrule.yaml"
    )
    rendered = subprocess.run(
        ["bash", str(K8S / "render-prometheusrule.sh")],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    ).stdout
    assert rendered == (K8S / "prometheusrule.yaml").read_text()  # the generator's output, comments kept
    assert "prometheusrule.yaml" in yaml_docs(K8S / "kustomization.yaml")[0]["resources"]


def test_prometheusrule_schema_refuses_what_the_operator_would_not_load() -> None:
    schema = crd_schemas()["PrometheusRule"]
    (rule,) = yaml_docs(K8S / "prometheusrule.yaml")
    jsonschema.validate(rule, schema)
    first = rule["spec"]["groups"][0]["rules"][0]
    for bad in ({**first, "record": "x"}, {**first, "for": "5 minutes"}, {**first, "exprr": "1"}):
        broken = {**rule, "spec": {"groups": [{"name": "g", "rules": [bad]}]}}
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(broken, schema)


def test_vllm_component_replaces_the_sglang_engine_and_the_router_backend() -> None:
    base, own = _objects(K8S), _objects(COMPONENT)
    component = yaml_docs(COMPONENT / "kustomization.yaml")[0]
    assert component["kind"] == "Component"
    deleted = {_ident(yaml.safe_load(p["patch"])) for p in component["patches"] if "patch" in p}
    assert deleted == SGLANG_ONLY and deleted <= base.keys()
    (patch_file,) = [p["path"] for p in component["patches"] if "path" in p]
    (replaced,) = yaml_docs(COMPONENT / patch_file)
    assert _ident(replaced) in base, "the ConfigMap patch must name the base's ConfigMap"
    files = {p.name for p in COMPONENT.glob("*.yaml")} - {"kustomization.yaml", patch_file}
    assert set(component["resources"]) == files
    # The router config differs from the SGLang one in its backend only.
    sglang_cfg = yaml.safe_load(base[_ident(replaced)]["data"]["router.yaml"])
    vllm_cfg = yaml.safe_load(replaced["data"]["router.yaml"])
    assert vllm_cfg.pop("backends") == ["vllm=http://vllm-engine:8000"]
    sglang_cfg.pop("backends")
    assert vllm_cfg == sglang_cfg
    service, monitor = own[("Service", "vllm-engine")], own[("ServiceMonitor", "vllm-engine")]
    assert service["spec"]["ports"][0]["port"] == 8000
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    relabel = {r["targetLabel"]: r["replacement"] for r in monitor["spec"]["endpoints"][0]["relabelings"]}
    assert relabel == {"job": "vllm", "engine_kind": "vllm"}  # what the alerts and dashboard select on
    pod = own[("StatefulSet", "vllm-engine")]["spec"]["template"]["spec"]
    (c,) = pod_containers(own[("StatefulSet", "vllm-engine")])
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 8
    assert {"name": "dshm", "mountPath": "/dev/shm"} in c["volumeMounts"]
    assert next(v for v in pod["volumes"] if v["name"] == "dshm")["emptyDir"]["medium"] == "Memory"
    overlay = yaml_docs(DEPLOY / "k8s-vllm/kustomization.yaml")[0]
    assert overlay["resources"] == ["../k8s"] and overlay["components"] == ["../k8s/vllm"]


def _render(directory: Path) -> list[dict[str, Any]]:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl not on PATH: the structural checks above still ran")
    proc = subprocess.run([kubectl, "kustomize", str(directory)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return [d for d in yaml.safe_load_all(proc.stdout) if d]


@pytest.mark.parametrize(("directory", "engine"), [(K8S, "sglang"), (DEPLOY / "k8s-vllm", "vllm")])
def test_kustomize_renders_a_valid_stack_with_one_engine(directory: Path, engine: str) -> None:
    docs = _render(directory)
    crds = crd_schemas()
    for doc in docs:
        if doc["kind"] in crds:
            jsonschema.validate(doc, crds[doc["kind"]])
        else:
            kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
        if doc["kind"] != "Namespace":
            assert doc["metadata"]["namespace"] == "kvrouter", _ident(doc)
    idents = {_ident(d) for d in docs}
    other = "vllm" if engine == "sglang" else "sglang"
    assert {("StatefulSet", f"{engine}-engine"), ("PrometheusRule", "kvrouter")} <= idents
    assert not any(name.startswith(other) for _, name in idents)
    (config,) = [d for d in docs if d["kind"] == "ConfigMap"]
    backends = yaml.safe_load(config["data"]["router.yaml"])["backends"]
    assert [b.split("=", 1)[0] for b in backends] == [engine]
    engines = [inv for _, d in k8s_manifests() for inv in pod_containers(d) if inv["name"] == engine]
    (rendered,) = [c for d in docs for c in pod_containers(d) if c["name"] == engine]
    assert rendered["args"] == engines[0]["args"]  # kustomize leaves the checked arguments alone


def _by_kind(kind: str) -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d for _, d in k8s_manifests() if d["kind"] == kind}


def test_k8s_router_is_replicated_probed_and_locked_down() -> None:
    router = _by_kind("Deployment")["kvrouter"]
    pod = router["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    assert router["spec"]["replicas"] >= 2
    assert c["livenessProbe"]["httpGet"]["path"] == "/health"
    assert c["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert c["resources"]["requests"] and c["resources"]["limits"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    labels = router["spec"]["template"]["metadata"]["labels"]
    assert (
        _by_kind("PodDisruptionBudget")["kvrouter"]["spec"]["selector"]["matchLabels"].items()
        <= labels.items()
    )


def test_k8s_services_select_pods_and_engine_gets_a_whole_node() -> None:
    pods = [d["spec"]["template"]["metadata"]["labels"] for _, d in k8s_manifests() if pod_containers(d)]
    for name, svc in _by_kind("Service").items():
        assert any(svc["spec"]["selector"].items() <= p.items() for p in pods), (
            f"Service {name} selects nothing"
        )
    engine = _by_kind("StatefulSet")["sglang-engine"]["spec"]["template"]["spec"]
    assert engine["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == 8
    shm = next(v for v in engine["volumes"] if v["name"] == "dshm")
    assert shm["emptyDir"]["medium"] == "Memory"
    assert {"name": "dshm", "mountPath": "/dev/shm"} in engine["containers"][0]["volumeMounts"]
    kustomization = yaml_docs(DEPLOY / "k8s/kustomization.yaml")[0]
    files = {p.name for p in (DEPLOY / "k8s").glob("*.yaml")} - {"kustomization.yaml"}
    assert set(kustomization["resources"]) == files
