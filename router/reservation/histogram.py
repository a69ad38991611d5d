"""A decayed, log-spaced histogram of token counts: small, mergeable, serialisable.

Bins are eighth-octaves (bin ``i`` holds ``[2**(i/8), 2**((i+1)/8))`` tokens, 9 % wide), so any length
from 1 token to a million fits in 161 bins and a quantile is off by at most one bin width, upwards.

Decay is *forward* decay by observation count: the n-th observation is added with weight ``g**n``
(``g = 2**(1/half_life)``) instead of shrinking every older count by ``1/g``. Quantiles are
scale-free, so nothing else needs to change, an update costs O(1), and two histograms merge by adding
their normalised counts. The stored scale is folded back into the counts before it overflows.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

BINS_PER_OCTAVE = 8
MAX_BIN = 20 * BINS_PER_OCTAVE  # 2**20 tokens: beyond any context window we serve
_RENORMALISE_AT = 1e100


def bin_of(tokens: float) -> int:
    """The bin holding ``tokens`` (values below 1 go to bin 0, above 2**20 to the last bin)."""
    if tokens <= 1:
        return 0
    return min(MAX_BIN, int(math.log2(tokens) * BINS_PER_OCTAVE))


def bin_upper_tokens(index: int) -> int:
    """Smallest whole token count at or above every value of bin ``index`` (quantiles round up)."""
    return math.ceil(2 ** ((index + 1) / BINS_PER_OCTAVE) - 1e-9)


def bin_mid_tokens(index: int) -> float:
    """Geometric middle of bin ``index``: the value that stands for the bin in moment sums."""
    return float(2 ** ((index + 0.5) / BINS_PER_OCTAVE))


@dataclass(slots=True)
class DecayedHistogram:
    """Counts per bin with exponential forgetting by observation (see the module docstring).

    ``half_life_obs``: after this many newer observations an observation counts half.
    """

    half_life_obs: float = 500.0
    _counts: dict[int, float] = field(default_factory=dict)
    _unit: float = 1.0  # weight the next observation is added with (g**n)
    _total: float = 0.0  # sum of stored counts, in stored units
    observations: int = 0  # how many observations were added (not decayed): ages a merge target

    def __post_init__(self) -> None:
        if not self.half_life_obs > 0:
            raise ValueError(f"half_life_obs must be > 0, got {self.half_life_obs}")

    @property
    def growth(self) -> float:
        return float(2 ** (1.0 / self.half_life_obs))

    @property
    def weight(self) -> float:
        """Decayed number of observations (tends to ~1.44 x half_life in a steady stream)."""
        return self._total / self._unit

    def add(self, tokens: float, weight: float = 1.0) -> None:
        self.observations += 1
        self._unit *= self.growth
        if self._unit > _RENORMALISE_AT:
            self._renormalise()
        i = bin_of(tokens)
        stored = weight * self._unit
        self._counts[i] = self._counts.get(i, 0.0) + stored
        self._total += stored

    def _renormalise(self) -> None:
        unit = self._unit
        self._counts = {i: c / unit for i, c in self._counts.items() if c / unit > 1e-12}
        self._total = sum(self._counts.values())
        self._unit = 1.0

    def normalised(self) -> dict[int, float]:
        """Bin -> decayed count (the newest observation counts 1)."""
        unit = self._unit
        return {i: c / unit for i, c in self._counts.items()}

    def items(self) -> Iterator[tuple[int, float]]:
        """(bin, decayed count) in ascending bin order."""
        unit = self._unit
        for i in sorted(self._counts):
            yield i, self._counts[i] / unit

    def age(self, observations: int) -> None:
        """Decay every count as if ``observations`` newer ones had been added elsewhere."""
        if observations <= 0:
            return
        log2_factor = observations / self.half_life_obs
        if log2_factor > 200:  # older than 200 half-lives: nothing of it is left
            self._counts.clear()
            self._total = 0.0
            return
        self._unit *= 2.0**log2_factor
        if self._unit > _RENORMALISE_AT:
            self._renormalise()

    def merge(self, other: DecayedHistogram) -> None:
        """Apply a delta: ``other`` holds observations newer than all of this one's, so this one ages by
        ``other.observations`` first, then gains ``other``'s counts (as if they had been added here)."""
        self.age(other.observations)
        self.observations += other.observations
        for i, count in other.normalised().items():
            stored = count * self._unit
            self._counts[i] = self._counts.get(i, 0.0) + stored
            self._total += stored

    def to_dict(self) -> dict[str, float]:
        """Sparse ``{bin: decayed count}`` with string keys, plus ``"n"``: observations (JSON / Redis)."""
        out: dict[str, float] = {str(i): c for i, c in sorted(self.normalised().items())}
        out["n"] = self.observations
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, float], half_life_obs: float = 500.0) -> DecayedHistogram:
        h = cls(half_life_obs)
        for key, value in data.items():
            if key == "n":
                if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
                    raise ValueError(f"bad observation count {value!r}")
                h.observations = int(value)
                continue
            try:
                i, count = int(key), float(value)
            except (TypeError, ValueError):
                raise ValueError(f"bad histogram entry {key!r}: {value!r}") from None
            if not 0 <= i <= MAX_BIN or not math.isfinite(count) or count < 0:
                raise ValueError(f"bad histogram entry {key!r}: {value!r}")
            if count > 0:
                h._counts[i] = h._counts.get(i, 0.0) + count
                h._total += count
        return h


def quantile_tokens(bins: Mapping[int, float], q: float) -> int | None:
    """The ``q`` quantile of a bin -> weight mapping, rounded up to its bin's top; None if empty."""
    total = sum(bins.values())
    if total <= 0:
        return None
    need = q * total
    running = 0.0
    last = 0
    for i in sorted(bins):
        running += bins[i]
        last = i
        if running >= need - 1e-12 * total:
            return bin_upper_tokens(i)
    return bin_upper_tokens(last)


def lognormal_bins(median_tokens: float, sigma: float, weight: float) -> dict[int, float]:
    """A log-normal prior spread over the bins, ``weight`` pseudo-observations in all."""
    if not median_tokens >= 1 or not sigma > 0 or not weight > 0:
        raise ValueError("prior needs median_tokens >= 1, sigma > 0 and weight > 0")
    mu = math.log(median_tokens)

    def cdf(tokens: float) -> float:
        return 0.5 * (1.0 + math.erf((math.log(tokens) - mu) / (sigma * math.sqrt(2.0))))

    out: dict[int, float] = {}
    for i in range(MAX_BIN + 1):
        lo = cdf(2 ** (i / BINS_PER_OCTAVE)) if i else 0.0
        hi = cdf(2 ** ((i + 1) / BINS_PER_OCTAVE)) if i < MAX_BIN else 1.0
        if hi - lo > 1e-9:
            out[i] = (hi - lo) * weight
    return out
