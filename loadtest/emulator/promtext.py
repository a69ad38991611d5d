"""A tiny Prometheus text-format writer (the layout prometheus_client emits), rendered per scrape from the
engine's live state: no registry, no global collectors."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

Labels = Mapping[str, str]


def _labels(labels: Labels, extra: str = "") -> str:
    parts = [f'{k}="{_escape(v)}"' for k, v in labels.items()]
    if extra:
        parts.append(extra)
    return "{" + ",".join(parts) + "}" if parts else ""


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _num(value: float) -> str:
    return repr(float(value))


class PromText:
    def __init__(self) -> None:
        self._lines: list[str] = []

    def gauge(self, name: str, help_text: str, samples: Sequence[tuple[Labels, float]]) -> None:
        self._lines += [f"# HELP {name} {help_text}", f"# TYPE {name} gauge"]
        self._lines += [f"{name}{_labels(lb)} {_num(v)}" for lb, v in samples]

    def counter(self, name: str, help_text: str, samples: Sequence[tuple[Labels, float]]) -> None:
        """``name`` without the ``_total`` suffix, which the samples carry."""
        self._lines += [f"# HELP {name} {help_text}", f"# TYPE {name} counter"]
        self._lines += [f"{name}_total{_labels(lb)} {_num(v)}" for lb, v in samples]

    def histogram(
        self,
        name: str,
        help_text: str,
        bounds: Sequence[float],
        samples: Sequence[tuple[Labels, Sequence[int], int, float]],
    ) -> None:
        """``samples``: (labels, per-bucket counts (not cumulative), total count, sum)."""
        self._lines += [f"# HELP {name} {help_text}", f"# TYPE {name} histogram"]
        for lb, counts, count, total in samples:
            acc = 0
            for bound, c in zip(bounds, counts, strict=True):
                acc += c
                le = 'le="' + _num(bound) + '"'
                self._lines.append(f"{name}_bucket{_labels(lb, le)} {_num(acc)}")
            inf = 'le="+Inf"'
            self._lines.append(f"{name}_bucket{_labels(lb, inf)} {_num(count)}")
            self._lines.append(f"{name}_count{_labels(lb)} {_num(count)}")
            self._lines.append(f"{name}_sum{_labels(lb)} {_num(total)}")

    def render(self) -> bytes:
        return ("\n".join(self._lines) + "\n").encode()
