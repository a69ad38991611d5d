"""Output-length predictor: what similar requests generated lately, as a quantile.

"Similar" is a bucket key: route, model, prompt-length octave and an optional client hint. Each
observation updates the key at four levels of detail (full key, without hint, without prompt bucket,
everything); a query walks from the most specific level to the global one and answers from the first
that holds ``min_weight`` decayed observations. The global level is blended with a configured log-normal
prior, so a cold router still answers and a noisy bucket never does.

The state is a handful of sparse histograms (see :mod:`router.reservation.histogram`): ``to_dict`` gives
plain ints/floats for Redis or JSON, ``merge`` adds another predictor's counts (another replica's
delta). No clock, no I/O: the caller decides when to observe and when to share.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from router.reservation.histogram import DecayedHistogram, bin_mid_tokens, lognormal_bins, quantile_tokens

_SEP = "|"
_MAX_HINT_CHARS = 64
_GLOBAL = _SEP.join(("*", "*", "*", "*"))
TAIL_DROPPED = 1e-4


@dataclass(frozen=True, slots=True)
class PredictorConfig:
    """``quantile`` of the observed lengths is the initial output reservation (``modes.predicted``).

    ``half_life_obs``: observations of a key after which an older one counts half (adaptation speed).
    ``prior_*``: the cold-start belief (log-normal, ``prior_weight`` pseudo-observations).
    ``max_keys``: cap on distinct keys (client hints are untrusted input; past the cap new keys are not
    created and their requests use the coarser levels).
    """

    quantile: float = 0.5
    half_life_obs: float = 500.0
    prior_median_tokens: float = 256.0
    prior_sigma: float = 1.0
    prior_weight: float = 8.0
    min_weight: float = 16.0
    max_keys: int = 4096

    def __post_init__(self) -> None:
        if not 0.0 < self.quantile < 1.0:
            raise ValueError(f"quantile must be in (0, 1), got {self.quantile}")
        if not self.half_life_obs > 0 or not self.min_weight > 0 or self.max_keys < 1:
            raise ValueError("half_life_obs and min_weight must be > 0, max_keys >= 1")
        lognormal_bins(self.prior_median_tokens, self.prior_sigma, self.prior_weight)  # validates


@dataclass(frozen=True, slots=True)
class RequestKey:
    """What makes two requests similar. ``hint`` is a client label (e.g. a task name); "" if none."""

    route: str = ""
    model: str = ""
    prompt_tokens: int = 0
    hint: str = ""

    @property
    def prompt_bucket(self) -> int:
        """Octave of the prompt length: 1k and 1.9k tokens share a bucket, 2k starts the next."""
        return max(0, self.prompt_tokens).bit_length()

    def levels(self) -> tuple[str, ...]:
        """Storage keys from the most specific to the global one (duplicates removed)."""
        hint = self.hint.replace(_SEP, "/")[:_MAX_HINT_CHARS]
        r, m, b = self.route.replace(_SEP, "/"), self.model.replace(_SEP, "/"), str(self.prompt_bucket)
        route = _route_level(self.route, self.model)
        out = [_SEP.join((r, m, b, hint)), _SEP.join((r, m, b, "")), route, _GLOBAL]
        return tuple(dict.fromkeys(out))


def _route_level(route: str, model: str) -> str:
    """The level of every request of ``route`` and ``model``, whatever its prompt length or hint."""
    return _SEP.join((route.replace(_SEP, "/"), model.replace(_SEP, "/"), "*", ""))


Distribution = tuple[tuple[float, float], ...]
"""(representative length in tokens, probability) pairs, ascending, summing to 1."""


@dataclass(slots=True)
class Predictor:
    config: PredictorConfig = field(default_factory=PredictorConfig)
    _hists: dict[str, DecayedHistogram] = field(default_factory=dict)
    _prior: dict[int, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        c = self.config
        self._prior = lognormal_bins(c.prior_median_tokens, c.prior_sigma, c.prior_weight)

    # ---- learning ------------------------------------------------------------------------------------
    def observe(self, key: RequestKey, output_tokens: int) -> None:
        """A request of ``key`` finished after generating ``output_tokens``."""
        for level in key.levels():
            hist = self._hists.get(level)
            if hist is None:
                if len(self._hists) >= self.config.max_keys and level != _GLOBAL:
                    continue
                hist = self._hists[level] = DecayedHistogram(self.config.half_life_obs)
            hist.add(max(1, output_tokens))

    def merge(self, other: Predictor) -> None:
        """Add ``other``'s observations (a replica's delta) to this predictor's."""
        for level, hist in other._hists.items():
            mine = self._hists.get(level)
            if mine is None:
                if len(self._hists) >= self.config.max_keys and level != _GLOBAL:
                    continue
                mine = self._hists[level] = DecayedHistogram(self.config.half_life_obs)
            mine.merge(hist)

    # ---- answering -----------------------------------------------------------------------------------
    def bins(self, key: RequestKey | None) -> dict[int, float]:
        """Bin -> weight of the most specific level with enough weight (global level: + prior).
        ``key`` None: the global level (every request seen)."""
        return self._bins_at(key.levels() if key is not None else (_GLOBAL,))

    def _bins_at(self, levels: tuple[str, ...]) -> dict[int, float]:
        for level in levels:
            hist = self._hists.get(level)
            if level == _GLOBAL:
                out = dict(self._prior)
                if hist is not None:
                    for i, count in hist.normalised().items():
                        out[i] = out.get(i, 0.0) + count
                return out
            if hist is not None and hist.weight >= self.config.min_weight:
                return hist.normalised()
        raise AssertionError("unreachable: the global level is always last")

    def quantile_tokens(self, key: RequestKey | None, q: float | None = None) -> int:
        """The ``q`` (default: configured) quantile of output lengths of requests like ``key``."""
        q = self.config.quantile if q is None else q
        if not 0.0 < q < 1.0:
            raise ValueError(f"quantile must be in (0, 1), got {q}")
        value = quantile_tokens(self.bins(key), q)
        return 1 if value is None else value

    def route_quantile_tokens(self, route: str, model: str) -> int:
        """The configured quantile over every request of ``route`` and ``model`` (any prompt length or hint):
        their own level once it holds ``min_weight``, else the global one with the prior (for /metrics)."""
        value = quantile_tokens(self._bins_at((_route_level(route, model), _GLOBAL)), self.config.quantile)
        return 1 if value is None else value

    def distribution(self, key: RequestKey | None) -> Distribution:
        """The predicted output-length distribution for ``key`` (for the over-commit budget), without its
        last ``TAIL_DROPPED`` of probability: a prior's (or one outlier's) far tail would otherwise set the
        worst case of every request."""
        bins = self.bins(key)
        total = sum(bins.values())
        kept: list[tuple[float, float]] = []
        running = 0.0
        for i in sorted(bins):
            if bins[i] <= 0:
                continue
            kept.append((bin_mid_tokens(i), bins[i]))
            running += bins[i]
            if running >= (1.0 - TAIL_DROPPED) * total:
                break
        kept_total = math.fsum(w for _, w in kept)
        return tuple((v, w / kept_total) for v, w in kept)

    def version(self, key: RequestKey | None) -> tuple[str, int]:
        """(level that answers for ``key``, observations it has seen): equal versions, equal answers."""
        for level in key.levels() if key is not None else (_GLOBAL,):
            hist = self._hists.get(level)
            if level == _GLOBAL:
                return level, 0 if hist is None else hist.observations
            if hist is not None and hist.weight >= self.config.min_weight:
                return level, hist.observations
        raise AssertionError("unreachable: the global level is always last")

    def weight(self, key: RequestKey) -> float:
        """Decayed observations behind the answer for ``key`` (0 = prior only)."""
        for level in key.levels():
            hist = self._hists.get(level)
            if hist is not None and (hist.weight >= self.config.min_weight or level == _GLOBAL):
                return hist.weight
        return 0.0

    # ---- sharing -------------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """Plain data: ``{"version": 1, "half_life_obs": h, "keys": {key: {bin: count}}}``."""
        return {
            "version": 1,
            "half_life_obs": self.config.half_life_obs,
            "keys": {level: h.to_dict() for level, h in sorted(self._hists.items())},
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], config: PredictorConfig | None = None) -> Predictor:
        """Inverse of :meth:`to_dict`; raises ValueError on malformed data (never half-loads)."""
        config = config or PredictorConfig()
        if not isinstance(data, Mapping) or data.get("version") != 1:
            raise ValueError("predictor state must be a mapping with version 1")
        keys = data.get("keys")
        if not isinstance(keys, Mapping):
            raise ValueError("predictor state needs a 'keys' mapping")
        p = cls(config)
        for level, bins in keys.items():
            if not isinstance(level, str) or level.count(_SEP) != 3 or not isinstance(bins, Mapping):
                raise ValueError(f"bad predictor key {level!r}")
            p._hists[level] = DecayedHistogram.from_dict(bins, config.half_life_obs)
        return p

    def __len__(self) -> int:
        return len(self._hists)


def mean_tokens(dist: Distribution) -> float:
    return math.fsum(v * p for v, p in dist)
