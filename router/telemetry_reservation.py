"""Metrics of the output reservations (:mod:`router.reservation`): what the book predicts, grows and learns.

The :class:`~router.reservation.book.ReservationBook` tells :class:`ReservationMetrics` (its ``meter``) what
it decides; those are per-process counters and a histogram, updated in memory on the request path (a
child bound once per label set) and, with several workers, summed through the multiprocess files like every
other counter. The current predicted quantile per route is read from the predictor at scrape time: a walk
over a few (route, model) pairs and one quantile each, no ledger or Redis call.

Labels are bounded: ``route`` is one of the generation routes, ``model`` a model some backend serves (a
request for another one is refused before the book sees it), ``outcome`` ``ok`` or ``refused``. Client
hints (``X-KVRouter-Output-Hint``) and prompt lengths key the predictor but never become labels.
"""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from router.reservation.predictor import Predictor, RequestKey

# Initial output reservations: a short chat answer (tens of tokens) to a long generation (the whole window).
PREDICTED_BUCKETS_TOKENS = (8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536,
                            131072)  # fmt: skip
MAX_ROUTES = 64  # (route, model) pairs kept for the quantile gauge; bounded anyway by routes x served models


class ReservationMetrics(Collector):
    """The book's meter (:class:`~router.reservation.book.BookMeter`) and the collector of the quantile
    gauge. Register the counters in ``registry`` (the process's metric registry), this collector in the
    exposed one."""

    def __init__(self, registry: CollectorRegistry | None) -> None:
        self.predicted = Histogram(
            "kvrouter_reservation_predicted_output_tokens",
            "Output tokens in the first reservation of streams sized from the prediction (mode predicted)",
            ["route", "model"],
            buckets=PREDICTED_BUCKETS_TOKENS,
            registry=registry,
        )
        growths = Counter(
            "kvrouter_reservation_growths",
            "Reservation growths asked of the ledger as generation passed the reservation, by outcome",
            ["outcome"],
            registry=registry,
        )
        self._growths = {True: growths.labels("ok"), False: growths.labels("refused")}  # zeros for rate()
        self.learned_requests = Counter(
            "kvrouter_reservation_learned_requests",
            "Finished requests whose output length the predictor learned, by route",
            ["route"],
            registry=registry,
        )
        self._predicted: dict[tuple[str, str], Histogram] = {}
        self._learned: dict[str, Counter] = {}
        self._pairs: dict[tuple[str, str], None] = {}  # (route, model) seen, in order: the gauge's series
        self._predictor: Predictor | None = None

    def watch(self, predictor: Predictor) -> None:
        """Read the quantile gauge from ``predictor`` (the book's) at scrape time."""
        self._predictor = predictor

    # -- BookMeter -----------------------------------------------------------------------------------------

    def planned(self, key: RequestKey, output_tokens: int) -> None:
        pair = (key.route, key.model)
        child = self._predicted.get(pair)
        if child is None:
            child = self._predicted[pair] = self.predicted.labels(*pair)
            self._remember(pair)
        child.observe(output_tokens)

    def grown(self, ok: bool) -> None:
        self._growths[ok].inc()

    def learned(self, key: RequestKey) -> None:
        child = self._learned.get(key.route)
        if child is None:
            child = self._learned[key.route] = self.learned_requests.labels(key.route)
        child.inc()
        pair = (key.route, key.model)
        if pair not in self._pairs:
            self._remember(pair)

    def _remember(self, pair: tuple[str, str]) -> None:
        if len(self._pairs) < MAX_ROUTES:
            self._pairs[pair] = None

    # -- Collector -----------------------------------------------------------------------------------------

    def collect(self) -> Iterable[Metric]:
        predictor = self._predictor
        gauge = GaugeMetricFamily(
            "kvrouter_reservation_predicted_quantile_tokens",
            "Learned output length at the configured quantile (--reservation-quantile) for the route and "
            "model, over all prompt lengths (the prior while cold): what mode predicted reserves",
            labels=["route", "model"],
        )
        if predictor is not None:
            for route, model in list(self._pairs):
                gauge.add_metric([route, model], predictor.route_quantile_tokens(route, model))
        yield gauge
