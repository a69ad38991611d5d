"""A small Prometheus text-format reader for the handful of engine series the router needs.

Engines expose hundreds of series (histograms dominate); we want five or six gauges. Lines are filtered
by metric name before any label parsing, which makes this several times faster than
``prometheus_client.parser`` on a DP-8 scrape (see tests/test_backends_prom.py for the measurement).

SGLang registers ``sglang:<name>``, but gateways and Prometheus ingest sometimes rewrite it to
``sglang_<name>`` (reference/sglang.md §4); both spellings are accepted and reported as ``sglang:``.
"""

from __future__ import annotations

import math
import re
from collections.abc import Collection, Mapping
from dataclasses import dataclass

# name, optional {labels} (greedy to the last '}' so a '}' inside a quoted value is harmless), value.
_LINE_RE = re.compile(r"([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?[ \t]+(\S+)")
_LABEL_RE = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"')
_UNESCAPES = {"\\\\": "\\", '\\"': '"', "\\n": "\n"}
_ESCAPE_RE = re.compile(r'\\[\\"n]')
_ALIASED_PREFIXES = {"sglang_": "sglang:", "vllm_": "vllm:"}


@dataclass(frozen=True, slots=True)
class Sample:
    name: str
    labels: Mapping[str, str]
    value: float


def canonical_name(name: str) -> str:
    """``sglang_num_used_tokens`` → ``sglang:num_used_tokens`` (the colon form is the engine's own)."""
    for alias, canon in _ALIASED_PREFIXES.items():
        if name.startswith(alias):
            return canon + name[len(alias) :]
    return name


def _alias(name: str) -> str:
    """The underscore spelling of a colon-prefixed name (what a rewriting gateway would emit)."""
    return name.replace(":", "_", 1)


def parse_labels(text: str) -> dict[str, str]:
    labels: dict[str, str] = {}
    for m in _LABEL_RE.finditer(text):
        value = m.group(2)
        if "\\" in value:
            value = _ESCAPE_RE.sub(lambda e: _UNESCAPES[e.group(0)], value)
        labels[m.group(1)] = value
    return labels


def parse_value(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        return math.nan


def parse_samples(text: str, names: Collection[str]) -> list[Sample]:
    """Samples whose canonical name is in ``names``; every other line is skipped unparsed."""
    wanted = frozenset(names)
    prefixes = tuple(wanted | {_alias(n) for n in wanted})
    out: list[Sample] = []
    for line in text.splitlines():
        if not line.startswith(prefixes):
            continue  # comments, blank lines and other engines' series
        m = _LINE_RE.match(line)
        if m is None:
            continue
        name = canonical_name(m.group(1))
        if name not in wanted:
            continue
        labels_text = m.group(2)
        labels = parse_labels(labels_text) if labels_text else {}
        out.append(Sample(name=name, labels=labels, value=parse_value(m.group(3))))
    return out


def by_label(samples: Collection[Sample], name: str, label: str) -> dict[str, list[Sample]]:
    """Group one metric's samples by the value of ``label`` (samples without it are dropped)."""
    groups: dict[str, list[Sample]] = {}
    for s in samples:
        if s.name == name and label in s.labels:
            groups.setdefault(s.labels[label], []).append(s)
    return groups
