"""Scenario parsing, arrival statistics, length distributions and synthetic prompts."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from loadtest.workload import (
    ScenarioError,
    builtin_scenarios,
    estimate_tokens,
    load_scenario,
    parse_scenario,
    synthetic_prompt,
    synthetic_token_ids,
)

BASE = """\
name: t
seed: 5
requests: 4000
arrival: {process: poisson, rate_rps: 50}
classes:
  - weight: 1
    prompt_tokens: {dist: fixed, value: 100}
    output_tokens: {dist: fixed, value: 10}
"""


def _scenario(arrival: str = "{process: poisson, rate_rps: 50}", classes: str = "", top: str = "") -> str:
    text = BASE.replace("{process: poisson, rate_rps: 50}", arrival)
    if classes:
        text = text.split("classes:")[0] + "classes:\n" + classes
    return text + top


def test_builtins_load_generate_sorted_and_deterministic() -> None:
    names = builtin_scenarios()
    for expected in (
        "chat-short",
        "long-context-mix",
        "uniform-4k",
        "six-long-users",
        "bursty",
        "chat-overask",
    ):
        assert expected in names
    for name in names:
        sc = load_scenario(name)
        reqs = sc.generate()
        assert len(reqs) > 100, name
        arrivals = [r.arrival_s for r in reqs]
        assert arrivals == sorted(arrivals)
        assert [r.index for r in reqs] == list(range(len(reqs)))
        assert sc.duration_s is not None and arrivals[-1] < sc.duration_s
        assert reqs == load_scenario(name).generate()


def test_poisson_rate_and_exponential_gaps() -> None:
    sc = parse_scenario(_scenario(), "t.yaml").with_overrides(duration_s=200.0)
    times = np.array([r.arrival_s for r in sc.generate()])
    assert abs(len(times) / 200.0 - 50.0) < 50.0 * 0.05
    gaps = np.diff(times)
    assert abs(gaps.mean() - 0.02) < 0.02 * 0.05
    assert abs(gaps.std() / gaps.mean() - 1.0) < 0.05  # exponential: CV = 1


def test_request_count_rescales_to_exact_rate() -> None:
    reqs = parse_scenario(_scenario(), "t.yaml").generate()
    assert len(reqs) == 4000
    assert reqs[0].arrival_s == 0.0
    assert reqs[-1].arrival_s == pytest.approx(3999 / 50.0)


def test_burstiness_below_one_raises_gap_variance_at_same_mean() -> None:
    cvs = {}
    for burst in (0.25, 1.0, 4.0):
        text = _scenario(arrival=f"{{process: gamma, rate_rps: 50, burstiness: {burst}}}")
        sc = parse_scenario(text, "t.yaml").with_overrides(duration_s=200.0)
        gaps = np.diff([r.arrival_s for r in sc.generate()])
        assert abs(gaps.mean() - 0.02) < 0.02 * 0.1
        cvs[burst] = gaps.std() / gaps.mean()
    assert cvs[0.25] == pytest.approx(2.0, rel=0.1)  # CV = 1/sqrt(burstiness)
    assert cvs[4.0] == pytest.approx(0.5, rel=0.1)
    assert cvs[0.25] > cvs[1.0] > cvs[4.0]


def test_constant_arrivals_evenly_spaced() -> None:
    sc = parse_scenario(_scenario(arrival="{process: constant, rate_rps: 4}"), "t.yaml")
    sc = sc.with_overrides(duration_s=10.0)
    times = [r.arrival_s for r in sc.generate()]
    assert len(times) == 40
    assert np.allclose(np.diff(times), 0.25)


def test_length_distributions_realised_as_asked() -> None:
    classes = """\
  - weight: 3
    prompt_tokens: {dist: lognormal, mean: 2000, sigma: 0.5, max: 1000000}
    output_tokens: {dist: uniform, min: 100, max: 800}
  - weight: 1
    prompt_tokens: {dist: normal, mean: 5000, std: 300}
    output_tokens: {dist: histogram, values: [10, 20], weights: [3, 1]}
"""
    reqs = parse_scenario(_scenario(classes=classes), "t.yaml").with_overrides(requests=20000).generate()
    a = [r for r in reqs if r.class_index == 0]
    b = [r for r in reqs if r.class_index == 1]
    assert len(a) / len(reqs) == pytest.approx(0.75, abs=0.02)
    pa = np.array([r.prompt_tokens for r in a])
    assert pa.mean() == pytest.approx(2000, rel=0.03)
    assert np.median(pa) == pytest.approx(2000 * np.exp(-0.125), rel=0.03)
    oa = np.array([r.output_tokens for r in a])
    assert oa.min() >= 100 and oa.max() <= 800 and oa.mean() == pytest.approx(450, rel=0.03)
    pb = np.array([r.prompt_tokens for r in b])
    assert pb.mean() == pytest.approx(5000, rel=0.01) and pb.std() == pytest.approx(300, rel=0.06)
    ob = np.array([r.output_tokens for r in b])
    assert set(ob.tolist()) == {10, 20} and (ob == 10).mean() == pytest.approx(0.75, abs=0.03)
    assert all(r.max_tokens == r.output_tokens for r in reqs)  # default: ask exactly what is used


def test_max_tokens_forms_and_clipping() -> None:
    classes = """\
  - weight: 1
    prompt_tokens: {dist: fixed, value: 100, max: 50}
    output_tokens: {dist: uniform, min: 100, max: 400}
    max_tokens: {multiple: 8, min: 4096}
  - weight: 1
    prompt_tokens: {dist: histogram, edges: [10, 20, 1000], weights: [1, 0]}
    output_tokens: {dist: fixed, value: 300}
    max_tokens: absent
  - weight: 1
    prompt_tokens: {dist: fixed, value: 10}
    output_tokens: {dist: fixed, value: 300}
    max_tokens: {dist: fixed, value: 200, absent_fraction: 0.5}
"""
    reqs = parse_scenario(_scenario(classes=classes), "t.yaml").generate()
    by = {c: [r for r in reqs if r.class_index == c] for c in range(3)}
    assert all(r.prompt_tokens == 50 for r in by[0])  # clipped to max
    assert all(r.max_tokens == max(4096, 8 * r.output_tokens) for r in by[0])
    assert all(r.max_tokens is None and r.output_tokens == 300 for r in by[1])
    assert all(10 <= r.prompt_tokens <= 20 for r in by[1])
    present = [r for r in by[2] if r.max_tokens is not None]
    assert len(present) / len(by[2]) == pytest.approx(0.5, abs=0.06)
    assert all(r.max_tokens == 200 and r.output_tokens == 200 for r in present)  # truncated by max_tokens
    assert all(r.output_tokens == 300 for r in by[2] if r.max_tokens is None)


def test_prefix_groups_unique_across_classes_and_shared_text() -> None:
    sc = load_scenario("six-long-users")
    reqs = sc.with_overrides(requests=3000).generate()
    long = [r for r in reqs if r.prefix_group is not None]
    assert {r.prefix_group for r in long} <= set(range(6)) and len(long) > 5
    assert all(r.prompt_tokens > r.prefix_tokens == 96000 for r in long)
    a = long[0]
    b = next(r for r in long[1:] if r.prefix_group == a.prefix_group)
    ta, tb = a.prompt(sc.seed), b.prompt(sc.seed)
    assert ta[: 4 * 96000] == tb[: 4 * 96000]
    assert ta[4 * 96000 : 4 * 96000 + 400] != tb[4 * 96000 : 4 * 96000 + 400]


@pytest.mark.parametrize("tokens", [0, 1, 7, 4096, 131072])
def test_synthetic_prompt_exact_under_byte_estimate(tokens: int) -> None:
    text = synthetic_prompt(tokens, seed=tokens + 3)
    assert estimate_tokens(text) == tokens and len(text.encode()) == 4 * tokens
    assert len(synthetic_token_ids(tokens, seed=1)) == tokens
    assert text == synthetic_prompt(tokens, seed=tokens + 3)
    if tokens > 10:
        assert text != synthetic_prompt(tokens, seed=tokens + 4)


def test_overrides() -> None:
    sc = load_scenario("chat-short")
    o = sc.with_overrides(rate_rps=2.0, requests=50)
    assert o.arrival.rate_rps == 2.0 and o.requests == 50 and o.duration_s is None
    assert len(o.generate()) == 50
    # Same shapes whatever the rate: the streams are independent.
    fast = sc.with_overrides(rate_rps=20.0, requests=50).generate()
    assert [r.prompt_tokens for r in fast] == [r.prompt_tokens for r in o.generate()]
    with pytest.raises(ScenarioError, match="rate_rps"):
        sc.with_overrides(rate_rps=0.0)


BAD = [
    (
        "arrival: {process: poisson, rate_rps: 50}",
        "arrival: {process: weibull, rate_rps: 50}",
        4,
        "arrival.process",
    ),
    (
        "arrival: {process: poisson, rate_rps: 50}",
        "arrival: {process: poisson, rate_rps: -1}",
        4,
        "arrival.rate_rps",
    ),
    ("arrival: {process: poisson, rate_rps: 50}", "arrival: {process: poisson}", 4, "rate_rps"),
    ("{dist: fixed, value: 100}", "{dist: uniform, min: 100, max: 10}", 7, "classes[0].prompt_tokens.max"),
    ("{dist: fixed, value: 10}", "{dist: gaussian, value: 10}", 8, "classes[0].output_tokens.dist"),
    ("{dist: fixed, value: 10}", "{dist: fixed, vlaue: 10}", 8, "did you mean 'value'"),
    ("  - weight: 1", "  - weight: heavy", 6, "classes[0].weight"),
    ("requests: 4000", "requests: 4000.5", 3, "requests"),
    ("seed: 5", "sede: 5", 2, "unknown field"),
]


@pytest.mark.parametrize(("old", "new", "line", "needle"), BAD)
def test_bad_scenarios_name_field_and_line(old: str, new: str, line: int, needle: str) -> None:
    with pytest.raises(ScenarioError) as info:
        parse_scenario(BASE.replace(old, new), "bad.yaml")
    msg = str(info.value)
    assert msg.startswith(f"bad.yaml:{line}:"), msg
    assert needle in msg
    assert "\n" not in msg


def test_bad_yaml_syntax_and_missing_file(tmp_path: Path) -> None:
    f = tmp_path / "s.yaml"
    f.write_text("name: x\nclasses: [\n  {weight: 1\n")
    with pytest.raises(ScenarioError, match=r"s\.yaml:\d+: YAML syntax error"):
        load_scenario(str(f))
    f.write_text(BASE.replace("requests: 4000\n", ""))
    with pytest.raises(ScenarioError, match="duration_s"):
        load_scenario(str(f))
    with pytest.raises(ScenarioError, match=r"built-ins: .*chat-short"):
        load_scenario(str(tmp_path / "nope.yaml"))
