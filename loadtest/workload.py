"""Scenarios: a seeded, open-loop request stream described in YAML (DESIGN.md §4).

``load_scenario("chat-short")`` loads a built-in (``loadtest/scenarios/*.yaml``), anything else is a
path. ``scenario.generate()`` returns every request of the run, sorted by arrival, identical for a seed.
Each :class:`RequestSpec` carries the real output length the engine will produce (``output_tokens``)
and what the client asks for (``max_tokens``; None = the field is absent), which may be far larger.

Randomness comes from independent streams spawned from the seed (arrivals, class choice, then one per
class), so changing the rate or the duration keeps the sequence of request shapes.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import numpy as np

from loadtest.arrivals import Arrival, arrival_times_s, parse_arrival
from loadtest.distributions import (
    LengthDist,
    MaxTokensSpec,
    parse_length,
    parse_max_tokens,
    realise_max_tokens,
)
from loadtest.prompts import estimate_tokens, synthetic_prompt, synthetic_token_ids
from loadtest.scenario_yaml import Fields, ScenarioError, YamlDoc, parse_yaml

__all__ = [
    "Arrival",
    "LengthDist",
    "MaxTokensSpec",
    "PrefixSpec",
    "RequestSpec",
    "Scenario",
    "ScenarioError",
    "Slo",
    "WorkloadClass",
    "builtin_scenarios",
    "estimate_tokens",
    "load_scenario",
    "parse_scenario",
    "synthetic_prompt",
    "synthetic_token_ids",
]

TOP_KEYS = {
    "name",
    "description",
    "seed",
    "duration_s",
    "requests",
    "arrival",
    "classes",
    "slo",
    "max_concurrency",
}
CLASS_KEYS = {"name", "weight", "prompt_tokens", "output_tokens", "max_tokens", "prefix"}


@dataclass(frozen=True)
class Slo:
    """Service-level objectives in milliseconds (None = not constrained); vLLM's ``--goodput`` keys."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2el_ms: float | None = None


@dataclass(frozen=True)
class PrefixSpec:
    """Requests of the class share one of ``group_count`` prefixes of ``tokens`` tokens."""

    group_count: int
    tokens: int


@dataclass(frozen=True)
class WorkloadClass:
    weight: float
    prompt_tokens: LengthDist
    output_tokens: LengthDist
    max_tokens: MaxTokensSpec = dataclasses.field(default_factory=MaxTokensSpec)
    prefix: PrefixSpec | None = None
    name: str = ""


@dataclass(frozen=True, slots=True)
class RequestSpec:
    """One request of a run. ``output_tokens`` is what the engine will generate (already capped by
    ``max_tokens``); ``max_tokens`` is what the client asks (None = absent). ``prefix_group`` is unique
    across classes; the first ``prefix_tokens`` prompt tokens are shared within a group."""

    index: int
    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    max_tokens: int | None
    class_index: int
    prefix_group: int | None = None
    prefix_tokens: int = 0

    def prompt_seed(self, scenario_seed: int) -> int:
        return (scenario_seed * 1_000_003 + self.index) & 0x7FFFFFFFFFFFFFFF

    def prompt(self, scenario_seed: int, minus_tokens: int = 0) -> str:
        """The synthetic prompt text: exactly ``prompt_tokens - minus_tokens`` (at least 1) tokens under the
        byte estimate; ``minus_tokens`` leaves room for what a chat template adds (the prefix is kept)."""
        return synthetic_prompt(
            max(1, self.prompt_tokens - minus_tokens),
            self.prompt_seed(scenario_seed),
            self.prefix_group,
            prefix_tokens=self.prefix_tokens,
            prefix_seed=scenario_seed,
        )

    def token_ids(self, scenario_seed: int) -> list[int]:
        return synthetic_token_ids(
            self.prompt_tokens,
            self.prompt_seed(scenario_seed),
            self.prefix_group,
            prefix_tokens=self.prefix_tokens,
            prefix_seed=scenario_seed,
        )


@dataclass(frozen=True)
class Scenario:
    name: str
    seed: int
    duration_s: float | None
    requests: int | None
    arrival: Arrival
    classes: tuple[WorkloadClass, ...]
    slo: Slo = dataclasses.field(default_factory=Slo)
    max_concurrency: int | None = None
    description: str = ""

    def with_overrides(
        self, *, rate_rps: float | None = None, duration_s: float | None = None, requests: int | None = None
    ) -> Scenario:
        """A copy with another rate and/or bound. Giving only one bound drops the other."""
        if rate_rps is not None and not rate_rps > 0:
            raise ScenarioError(f"rate_rps must be > 0, got {rate_rps}")
        if duration_s is not None and not (duration_s > 0 and math.isfinite(duration_s)):
            raise ScenarioError(f"duration_s must be a positive number, got {duration_s}")
        if requests is not None and requests < 1:
            raise ScenarioError(f"requests must be >= 1, got {requests}")
        out = self
        if rate_rps is not None:
            out = dataclasses.replace(out, arrival=dataclasses.replace(out.arrival, rate_rps=float(rate_rps)))
        if duration_s is not None or requests is not None:
            out = dataclasses.replace(out, duration_s=duration_s, requests=requests)
            if out.duration_s is None and out.requests is None:  # pragma: no cover - guarded above
                raise ScenarioError("a scenario needs duration_s or requests")
            if math.isinf(out.arrival.rate_rps) and out.requests is None:
                raise ScenarioError("rate_rps: inf needs a request count")
        return out

    def generate(self) -> list[RequestSpec]:
        """Every request of the run, sorted by arrival; the same list for the same scenario."""
        arr_ss, class_ss, *per_class_ss = np.random.SeedSequence(self.seed).spawn(2 + len(self.classes))
        times = arrival_times_s(self.arrival, np.random.default_rng(arr_ss), self.duration_s, self.requests)
        n = len(times)
        weights = np.array([c.weight for c in self.classes])
        picks = np.random.default_rng(class_ss).choice(len(self.classes), size=n, p=weights / weights.sum())
        prompt = np.zeros(n, np.int64)
        output = np.zeros(n, np.int64)
        asked = np.zeros(n, np.int64)
        present = np.zeros(n, np.bool_)
        group = np.full(n, -1, np.int64)
        prefix_len = np.zeros(n, np.int64)
        group_base = 0
        for ci, (cls, ss) in enumerate(zip(self.classes, per_class_ss, strict=True)):
            rng = np.random.default_rng(ss)
            mask = picks == ci
            k = int(mask.sum())
            p = cls.prompt_tokens.sample(rng, k)
            natural = cls.output_tokens.sample(rng, k)
            a, pres = realise_max_tokens(cls.max_tokens, natural, rng)
            if cls.prefix is not None:
                # The shared prefix is part of the prompt; keep at least one own token after it.
                p = np.maximum(p, cls.prefix.tokens + 1)
                group[mask] = group_base + rng.integers(0, cls.prefix.group_count, size=k)
                prefix_len[mask] = cls.prefix.tokens
                group_base += cls.prefix.group_count
            prompt[mask] = p
            output[mask] = np.where(pres, np.minimum(natural, np.maximum(a, 1)), natural)
            asked[mask] = a
            present[mask] = pres
        return [
            RequestSpec(
                index=i,
                arrival_s=float(times[i]),
                prompt_tokens=int(prompt[i]),
                output_tokens=int(output[i]),
                max_tokens=int(asked[i]) if present[i] else None,
                class_index=int(picks[i]),
                prefix_group=int(group[i]) if group[i] >= 0 else None,
                prefix_tokens=int(prefix_len[i]),
            )
            for i in range(n)
        ]

    def to_dict(self) -> dict[str, object]:
        """A JSON-able record of the scenario (for results files)."""
        return dataclasses.asdict(self)


def builtin_scenarios() -> list[str]:
    """Names of the scenarios shipped in ``loadtest/scenarios/``."""
    folder = resources.files("loadtest") / "scenarios"
    return sorted(p.name[: -len(".yaml")] for p in folder.iterdir() if p.name.endswith(".yaml"))


def load_scenario(name_or_path: str) -> Scenario:
    """A built-in scenario by name, or a YAML file by path. Raises :class:`ScenarioError`."""
    if name_or_path in builtin_scenarios():
        res = resources.files("loadtest") / "scenarios" / f"{name_or_path}.yaml"
        return parse_scenario(res.read_text(encoding="utf-8"), f"{name_or_path}.yaml")
    path = Path(name_or_path)
    if not path.is_file():
        known = ", ".join(builtin_scenarios())
        raise ScenarioError(f"{name_or_path}: no such scenario file or built-in (built-ins: {known})")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ScenarioError(f"{name_or_path}: cannot read: {exc}") from None
    return parse_scenario(text, str(path))


def parse_scenario(text: str, source: str = "<scenario>") -> Scenario:
    doc = parse_yaml(text, source)
    top = doc.root()
    top.check_keys(TOP_KEYS)
    duration = top.number("duration_s", positive=True)
    requests = top.integer("requests", min_value=1)
    if duration is None and requests is None:
        raise top.error(None, "needs 'duration_s' (seconds) or 'requests' (a count), or both")
    arrival = parse_arrival(top)
    if math.isinf(arrival.rate_rps) and requests is None:
        raise doc.error(("arrival", "rate_rps"), "an infinite rate needs 'requests' (a count)")
    return Scenario(
        name=top.text("name", default=Path(source).stem) or "scenario",
        seed=top.integer("seed", default=0, min_value=0) or 0,
        duration_s=duration,
        requests=requests,
        arrival=arrival,
        classes=_parse_classes(top, doc),
        slo=_parse_slo(top),
        max_concurrency=top.integer("max_concurrency", min_value=1),
        description=top.text("description", default="") or "",
    )


def _parse_classes(top: Fields, doc: YamlDoc) -> tuple[WorkloadClass, ...]:
    out = []
    for i, raw in top.items("classes", required=True):
        c = Fields(doc, ("classes", i), raw) if isinstance(raw, dict) else None
        if c is None:
            raise doc.error(("classes", i), "each class must be a mapping (weight, prompt_tokens, ...)")
        c.check_keys(CLASS_KEYS)
        weight = c.number("weight", default=1.0, positive=True)
        prompt = parse_length(c, "prompt_tokens")
        output = parse_length(c, "output_tokens")
        assert prompt is not None and output is not None
        out.append(
            WorkloadClass(
                weight=float(weight or 1.0),
                prompt_tokens=prompt,
                output_tokens=output,
                max_tokens=parse_max_tokens(c),
                prefix=_parse_prefix(c),
                name=c.text("name", default="") or "",
            )
        )
    return tuple(out)


def _parse_prefix(c: Fields) -> PrefixSpec | None:
    n = c.mapping("prefix")
    if n is None:
        return None
    n.check_keys({"group_count", "tokens"})
    groups = n.integer("group_count", required=True, min_value=1)
    tokens = n.integer("tokens", required=True, min_value=1)
    return PrefixSpec(group_count=groups or 1, tokens=tokens or 1)


def _parse_slo(top: Fields) -> Slo:
    n = top.mapping("slo")
    if n is None:
        return Slo()
    n.check_keys({"ttft_ms", "tpot_ms", "e2el_ms"})
    return Slo(
        ttft_ms=n.number("ttft_ms", positive=True),
        tpot_ms=n.number("tpot_ms", positive=True),
        e2el_ms=n.number("e2el_ms", positive=True),
    )
