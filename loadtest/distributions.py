"""Token-length distributions of a scenario class, and the ``max_tokens`` a client asks for.

Length spec (YAML mapping, all lengths in tokens, realised values are whole numbers clipped to
``[min, max]``; ``min`` defaults to 1):

- ``{dist: fixed, value: 500}``
- ``{dist: uniform, min: 100, max: 800}`` (inclusive)
- ``{dist: lognormal, mean: 2000, sigma: 0.8, max: 16000}``: ``mean`` is the arithmetic mean of the
  unclipped distribution (mu = ln(mean) - sigma^2/2); give ``median`` instead to set exp(mu).
- ``{dist: normal, mean: 1000, std: 200}``
- ``{dist: histogram, values: [4096, 8192], weights: [3, 1]}`` (discrete), or
  ``{dist: histogram, edges: [0, 1000, 4000], weights: [0.7, 0.3]}`` (uniform inside each bin).

``max_tokens`` spec: omitted (the client asks exactly the real output length), ``absent`` (the field is
not sent), a length spec (independent draw; the real output is truncated to it), or
``{multiple: 8, min: 4096, max: 32768}`` (a multiple of the real output). Any mapping form may add
``absent_fraction: 0.2`` (that share of requests sends no ``max_tokens``).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from loadtest.scenario_yaml import Fields, ScenarioError

IntArray = npt.NDArray[np.int64]
DISTS = ("fixed", "uniform", "lognormal", "normal", "histogram")


@dataclass(frozen=True)
class LengthDist:
    """One token-length distribution; :meth:`sample` is vectorised and deterministic for an rng state."""

    dist: str
    min_tokens: int = 1
    max_tokens: int | None = None
    value: float = 0.0
    mean: float = 0.0
    sigma: float = 0.0
    values: tuple[float, ...] = ()
    edges: tuple[float, ...] = ()
    weights: tuple[float, ...] = ()

    def sample(self, rng: np.random.Generator, n: int) -> IntArray:
        raw = self._raw(rng, n)
        hi = self.max_tokens if self.max_tokens is not None else np.iinfo(np.int64).max
        return np.clip(np.rint(raw), self.min_tokens, hi).astype(np.int64)

    def _raw(self, rng: np.random.Generator, n: int) -> npt.NDArray[np.float64]:
        if self.dist == "fixed":
            return np.full(n, self.value, dtype=np.float64)
        if self.dist == "uniform":
            hi = self.max_tokens if self.max_tokens is not None else self.min_tokens
            return rng.integers(self.min_tokens, hi + 1, size=n).astype(np.float64)
        if self.dist == "lognormal":
            mu = math.log(self.mean) - self.sigma**2 / 2.0
            return rng.lognormal(mu, self.sigma, size=n)
        if self.dist == "normal":
            return rng.normal(self.mean, self.sigma, size=n)
        p = np.asarray(self.weights, dtype=np.float64) / sum(self.weights)
        if self.values:
            return np.asarray(self.values, dtype=np.float64)[rng.choice(len(self.values), size=n, p=p)]
        idx = rng.choice(len(self.weights), size=n, p=p)
        lo: npt.NDArray[np.float64] = np.asarray(self.edges[:-1], dtype=np.float64)[idx]
        hi_edges: npt.NDArray[np.float64] = np.asarray(self.edges[1:], dtype=np.float64)[idx]
        out: npt.NDArray[np.float64] = lo + rng.random(n) * (hi_edges - lo)
        return out

    def expected_mean(self) -> float:
        """Mean of the unclipped distribution (for sizing docs and sanity checks)."""
        if self.dist == "fixed":
            return self.value
        if self.dist == "uniform":
            hi = self.max_tokens if self.max_tokens is not None else self.min_tokens
            return (self.min_tokens + hi) / 2.0
        if self.dist in ("lognormal", "normal"):
            return self.mean
        p = np.asarray(self.weights) / sum(self.weights)
        if self.values:
            return float(np.dot(p, self.values))
        mids = (np.asarray(self.edges[:-1]) + np.asarray(self.edges[1:])) / 2.0
        return float(np.dot(p, mids))


@dataclass(frozen=True)
class MaxTokensSpec:
    """How a class sets ``max_tokens``: ``equal`` (= real output), ``absent``, ``dist`` or ``multiple``."""

    mode: str = "equal"
    dist: LengthDist | None = None
    multiple: float = 1.0
    min_tokens: int = 1
    max_tokens: int | None = None
    absent_fraction: float = 0.0


def parse_length(f: Fields, key: str, *, required: bool = True) -> LengthDist | None:
    node = f.mapping(key, required=required)
    if node is None:
        return None
    return _parse_length_node(node)


def _parse_length_node(n: Fields, extra_keys: frozenset[str] = frozenset()) -> LengthDist:
    kind = n.text("dist", choices=DISTS)
    if kind is None:
        raise n.error(None, f"missing required field 'dist' (one of {', '.join(DISTS)})")
    allowed = {"dist", "min", "max", *extra_keys} | _PARAMS[kind]
    n.check_keys(allowed)
    lo = n.integer("min", default=1, min_value=1)
    hi = n.integer("max", min_value=1)
    assert lo is not None
    if hi is not None and hi < lo:
        raise n.error("max", f"must be >= min ({lo}), got {hi}")
    if kind == "fixed":
        value = n.number("value", required=True, min_value=0)
        return LengthDist(kind, min_tokens=lo, max_tokens=hi, value=float(value or 0.0))
    if kind == "uniform":
        if hi is None:
            raise n.error(None, "missing required field 'max' (uniform needs min and max)")
        return LengthDist(kind, min_tokens=lo, max_tokens=hi)
    if kind in ("lognormal", "normal"):
        return _parse_bell(n, kind, lo, hi)
    return _parse_histogram(n, lo, hi)


_PARAMS: dict[str, set[str]] = {
    "fixed": {"value"},
    "uniform": set(),
    "lognormal": {"mean", "median", "sigma"},
    "normal": {"mean", "std"},
    "histogram": {"values", "edges", "weights"},
}


def _parse_bell(n: Fields, kind: str, lo: int, hi: int | None) -> LengthDist:
    if kind == "normal":
        mean = n.number("mean", required=True, positive=True)
        std = n.number("std", required=True, min_value=0)
        return LengthDist(kind, min_tokens=lo, max_tokens=hi, mean=float(mean or 0), sigma=float(std or 0))
    sigma = float(n.number("sigma", required=True, min_value=0) or 0.0)
    if n.has("mean") == n.has("median"):
        raise n.error(None, "lognormal needs exactly one of 'mean' (arithmetic) or 'median'")
    if n.has("median"):
        median = float(n.number("median", required=True, positive=True) or 1.0)
        mean = median * math.exp(sigma**2 / 2.0)
    else:
        mean = float(n.number("mean", required=True, positive=True) or 1.0)
    return LengthDist(kind, min_tokens=lo, max_tokens=hi, mean=mean, sigma=sigma)


def _number_list(n: Fields, key: str) -> tuple[float, ...]:
    out: list[float] = []
    for i, v in n.items(key, required=True):
        if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or v < 0:
            raise n.doc.error((*n.path, key, i), f"must be a non-negative number, got {v!r}")
        out.append(float(v))
    return tuple(out)


def _parse_histogram(n: Fields, lo: int, hi: int | None) -> LengthDist:
    if n.has("values") == n.has("edges"):
        raise n.error(None, "histogram needs exactly one of 'values' (discrete) or 'edges' (bins)")
    weights = _number_list(n, "weights")
    if sum(weights) <= 0:
        raise n.error("weights", "must not all be zero")
    if n.has("values"):
        values = _number_list(n, "values")
        if len(values) != len(weights):
            raise n.error("weights", f"needs one weight per value ({len(values)}), got {len(weights)}")
        return LengthDist("histogram", min_tokens=lo, max_tokens=hi, values=values, weights=weights)
    edges = _number_list(n, "edges")
    if len(edges) != len(weights) + 1:
        raise n.error("edges", f"needs len(weights) + 1 = {len(weights) + 1} edges, got {len(edges)}")
    if any(b <= a for a, b in itertools.pairwise(edges)):
        raise n.error("edges", "must be strictly increasing")
    return LengthDist("histogram", min_tokens=lo, max_tokens=hi, edges=edges, weights=weights)


def parse_max_tokens(f: Fields, key: str = "max_tokens") -> MaxTokensSpec:
    """Parse a class's ``max_tokens`` field (see the module docstring for the forms)."""
    raw = f.data.get(key)
    if raw is None:
        return MaxTokensSpec()
    if isinstance(raw, str):
        if raw.strip().lower() in ("absent", "none", "omit"):
            return MaxTokensSpec(mode="absent")
        raise f.error(key, f"must be 'absent' or a mapping, got {raw!r}")
    n = f.mapping(key, required=True)
    assert n is not None
    frac = float(n.number("absent_fraction", default=0.0, min_value=0.0) or 0.0)
    if frac > 1.0:
        raise n.error("absent_fraction", f"must be between 0 and 1, got {frac:g}")
    if n.has("multiple"):
        n.check_keys({"multiple", "min", "max", "absent_fraction"})
        mult = float(n.number("multiple", required=True, positive=True) or 1.0)
        lo = n.integer("min", default=1, min_value=1)
        hi = n.integer("max", min_value=1)
        if hi is not None and lo is not None and hi < lo:
            raise n.error("max", f"must be >= min ({lo}), got {hi}")
        return MaxTokensSpec(
            "multiple", multiple=mult, min_tokens=lo or 1, max_tokens=hi, absent_fraction=frac
        )
    if not n.has("dist"):
        raise n.error(
            None, "needs 'dist' (a length distribution) or 'multiple' (a factor of the real output)"
        )
    dist = _parse_length_node(n, frozenset({"absent_fraction"}))
    return MaxTokensSpec("dist", dist=dist, absent_fraction=frac)


def realise_max_tokens(
    spec: MaxTokensSpec, natural_output: IntArray, rng: np.random.Generator
) -> tuple[IntArray, npt.NDArray[np.bool_]]:
    """Return ``(max_tokens, present)`` for every request; ``max_tokens`` is meaningless where absent."""
    n = len(natural_output)
    if spec.mode == "equal":
        asked = natural_output.copy()
    elif spec.mode == "absent":
        return np.zeros(n, dtype=np.int64), np.zeros(n, dtype=np.bool_)
    elif spec.mode == "multiple":
        hi = spec.max_tokens if spec.max_tokens is not None else np.iinfo(np.int64).max
        asked = np.clip(np.ceil(natural_output * spec.multiple), spec.min_tokens, hi).astype(np.int64)
    elif spec.dist is not None:
        asked = spec.dist.sample(rng, n)
    else:  # pragma: no cover - parse_max_tokens never builds this
        raise ScenarioError(f"bad max_tokens spec {spec}")
    present = rng.random(n) >= spec.absent_fraction if spec.absent_fraction > 0 else np.ones(n, np.bool_)
    return asked, present
