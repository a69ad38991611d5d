"""The Prometheus text exposition format (0.0.4), written for speed.

prometheus_client's ``generate_latest`` spends ~25 µs per sample validating and escaping names that are
fixed in our code (a scrape of a loaded 8-rank router holds several hundred samples, and it runs on the
event loop). This writer emits the same samples with plain string formatting, escaping only label values
that need it, and leaves out the ``*_created`` samples (an extra series per counter and histogram child
that nothing here reads). tests/test_observability_text.py checks it sample for sample against the
library's output and with ``promtool check metrics``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from prometheus_client.registry import Collector

# OpenMetrics family types as the 0.0.4 text format names them (the same munging as generate_latest).
_TYPES = {
    "counter": ("_total", "counter"),
    "info": ("_info", "gauge"),
    "stateset": ("", "gauge"),
    "gaugehistogram": ("", "histogram"),
    "unknown": ("", "untyped"),
}
_OPENMETRICS_ONLY = ("_created", "_gsum", "_gcount")


def format_value(value: float) -> str:
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value))


def _label_value(value: str) -> str:
    if "\\" in value or '"' in value or "\n" in value:
        return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")
    return value


def _lines(collectors: Iterable[Collector]) -> Iterable[str]:
    for collector in collectors:
        for metric in collector.collect():
            suffix, kind = _TYPES.get(metric.type, ("", metric.type))
            name = metric.name + suffix
            doc = metric.documentation.replace("\\", r"\\").replace("\n", r"\n")
            yield f"# HELP {name} {doc}\n# TYPE {name} {kind}\n"
            skip = {metric.name + s for s in _OPENMETRICS_ONLY}
            for s in metric.samples:
                if s.name in skip:
                    continue
                stamp = "" if s.timestamp is None else f" {int(float(s.timestamp) * 1000)}"
                if s.labels:
                    labels = ",".join(f'{k}="{_label_value(v)}"' for k, v in s.labels.items())
                    yield f"{s.name}{{{labels}}} {format_value(s.value)}{stamp}\n"
                else:
                    yield f"{s.name} {format_value(s.value)}{stamp}\n"


def render_text(registry: Collector) -> bytes:
    """Every family of ``registry`` in the text format, ``*_created`` samples left out."""
    return "".join(_lines([registry])).encode()
