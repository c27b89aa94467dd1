"""The proxy's Prometheus metrics, on a registry of its own per application.

Instance state is collected at scrape time from the live pools, so removed
instances vanish from /metrics instead of leaving stale series.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Iterable, Iterator, Sequence
from itertools import accumulate

from prometheus_client import CollectorRegistry, Counter, Gauge
from prometheus_client.core import GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from proxy.instances import Instance

_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
_GAP = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5)


class LoopSeries:
    """One label set's buckets of a ``LoopHistogram``: what ``observe``
    updates."""

    __slots__ = ("_bounds", "counts", "sum")

    def __init__(self, bounds: list[float]) -> None:
        self._bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last: above all bounds
        self.sum = 0.0

    def observe(self, value: float) -> None:
        # A bucket holds the values up to and including its bound.
        self.counts[bisect_left(self._bounds, value)] += 1
        self.sum += value


class LoopHistogram(Collector):
    """A histogram that only the event loop observes: one ``observe`` is a
    bisection and two additions, a tenth of ``prometheus_client.Histogram``'s
    locked updates. For figures taken per request or per relayed chunk.

    With ``labelnames``, ``labels`` gives each label set's series, made on
    first use as prometheus_client makes them; without, ``observe`` updates
    the one series. A scrape (in a thread) copies the counts; an observation
    landing during the copy shows in the next scrape's sum or count.
    """

    def __init__(
        self,
        name: str,
        documentation: str,
        buckets: Iterable[float],
        registry: CollectorRegistry,
        labelnames: Sequence[str] = (),
    ) -> None:
        self._name = name
        self._documentation = documentation
        self._bounds = sorted(buckets)
        self._labelnames = tuple(labelnames)
        self._series: dict[tuple[str, ...], LoopSeries] = {}
        if not self._labelnames:
            self.labels()  # exposed from the start, as prometheus_client does
        registry.register(self)

    def labels(self, *values: str) -> LoopSeries:
        """The series of the label set ``values`` (in ``labelnames`` order).

        Raises:
            ValueError: ``values`` does not name every label.
        """
        series = self._series.get(values)
        if series is None:
            if len(values) != len(self._labelnames):
                raise ValueError(f"{self._name} takes labels {self._labelnames}")
            series = self._series[values] = LoopSeries(self._bounds)
        return series

    def observe(self, value: float) -> None:
        """Observes ``value`` in the one series of a histogram without labels
        (a hot path holds ``labels()`` instead: one call fewer).

        Raises:
            ValueError: the histogram has labels.
        """
        self.labels().observe(value)

    def collect(self) -> Iterator[HistogramMetricFamily]:
        bounds = [*map(floatToGoString, self._bounds), "+Inf"]
        family = HistogramMetricFamily(
            self._name, self._documentation, labels=self._labelnames
        )
        for values, series in list(self._series.items()):
            counts, total = list(series.counts), series.sum
            family.add_metric(
                list(values),
                list(zip(bounds, map(float, accumulate(counts)), strict=True)),
                total,
            )
        yield family


class _InstanceCollector(Collector):
    def __init__(
        self,
        instances: Callable[[], Iterable[Instance]],
        in_flight: Callable[[], float] = lambda: 0.0,
    ) -> None:
        """``instances`` and ``in_flight`` are read at scrape time."""
        self._instances = instances

    def collect(self) -> Iterator[GaugeMetricFamily]:
        labels = ["model", "role", "instance"]
        healthy = GaugeMetricFamily(
            "kvguard_proxy_instance_healthy",
            "1 while health checks pass",
            labels=labels,
        )
        up = GaugeMetricFamily(
            "kvguard_proxy_instance_up",
            "1 while the instance takes new requests (healthy, not drained or ejected)",
            labels=labels,
        )
        ejected = GaugeMetricFamily(
            "kvguard_proxy_instance_ejected",
            "1 while ejected for KV integrity failures",
            labels=labels,
        )
        drained = GaugeMetricFamily(
            "kvguard_proxy_instance_drained",
            "1 while drained by an admin",
            labels=labels,
        )
        in_flight = GaugeMetricFamily(
            "kvguard_proxy_instance_in_flight", "Requests in flight", labels=labels
        )
        for inst in self._instances():
            values = [inst.model, inst.role, inst.url]
            healthy.add_metric(values, float(inst.healthy))
            up.add_metric(values, float(inst.usable() and not inst.ejected))
            ejected.add_metric(values, float(inst.ejected))
            drained.add_metric(values, float(inst.drained))
            in_flight.add_metric(values, float(inst.in_flight))
        yield from (healthy, up, ejected, drained, in_flight)


class ProxyMetrics:
    """Counters and histograms the request flow updates."""

    def __init__(
        self,
        instances: Callable[[], Iterable[Instance]],
        in_flight: Callable[[], float] = lambda: 0.0,
    ) -> None:
        """``instances`` and ``in_flight`` are read at scrape time."""
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(
            "kvguard_proxy_requests",
            "Client requests by route and outcome",
            ["route", "outcome"],
            registry=r,
        )
        self.ttft = LoopHistogram(
            "kvguard_proxy_ttft_seconds",
            "Time to the first byte sent to the client (streams: first token)",
            _LATENCY,
            r,
            ["route"],
        )
        self.inter_token = LoopHistogram(
            "kvguard_proxy_inter_token_seconds",
            "Gaps between relayed stream chunks",
            _GAP,
            r,
        )
        self.e2e = LoopHistogram(
            "kvguard_proxy_e2e_seconds",
            "Client request duration, end to end",
            _LATENCY,
            r,
            ["route"],
        )
        self.leg = LoopHistogram(
            "kvguard_proxy_leg_seconds",
            "Per-leg latency: prefill (whole), decode (to first data or full reply)",
            _LATENCY,
            r,
            ["leg"],
        )
        self.retries = Counter(
            "kvguard_proxy_retries",
            "Retried attempts by reason",
            ["reason"],
            registry=r,
        )
        self.integrity_failures = Counter(
            "kvguard_proxy_kv_integrity_failures",
            "KV loads that failed their checksum, by prefill and decode",
            ["prefill", "decode"],
            registry=r,
        )
        self.upstream_failures = Counter(
            "kvguard_proxy_upstream_failures",
            "Non-integrity backend failures (count towards health)",
            ["role", "instance", "reason"],
            registry=r,
        )
        self.prefills_without_kv = Counter(
            "kvguard_proxy_prefills_without_kv_params",
            "Prefills answered without kv_transfer_params, whose decodes "
            "prefilled the prompt again (a prefill instance without a KV "
            "connector)",
            ["instance"],
            registry=r,
        )
        self.ejections = Counter(
            "kvguard_proxy_ejections",
            "Ejections for KV integrity failures (kind: instance or pair)",
            ["role", "instance", "kind"],
            registry=r,
        )
        self.reconnects = Counter(
            "kvguard_proxy_backend_reconnects",
            "Requests retried on a new connection after a pooled one was closed "
            "or reset before any reply byte (not held against the instance)",
            ["role"],
            registry=r,
        )
        self.in_flight = Gauge(
            "kvguard_proxy_in_flight", "Client requests in flight", registry=r
        )
        self.in_flight.set_function(in_flight)
        r.register(_InstanceCollector(instances))
        self._requests_children: dict[tuple[str, str], Counter] = {}
        self.leg_prefill = self.leg.labels("prefill")
        self.leg_decode = self.leg.labels("decode")
        self.gaps = self.inter_token.labels()

    def count_request(self, route: str, outcome: str) -> None:
        child = self._requests_children.get((route, outcome))
        if child is None:
            child = self._requests_children[(route, outcome)] = self.requests.labels(
                route, outcome
            )
        child.inc()

    def forget_instance(self, role: str, url: str) -> None:
        """Drops the series of an instance that left (reload, admin, DNS):
        under DNS churn they would otherwise grow without bound."""

        def own(values: tuple[str, ...]) -> bool:
            return values[:2] == (role, url)

        column = 0 if role == "prefill" else 1
        remove_series(self.upstream_failures, ("role", "instance", "reason"), own)
        remove_series(self.ejections, ("role", "instance", "kind"), own)
        remove_series(
            self.integrity_failures, ("prefill", "decode"), lambda v: v[column] == url
        )
        if role == "prefill":
            remove_series(
                self.prefills_without_kv, ("instance",), lambda v: v[0] == url
            )


def remove_series(
    metric: Counter | Gauge,
    names: tuple[str, ...],
    matches: Callable[[tuple[str, ...]], bool],
) -> None:
    """Removes ``metric``'s series (label values in ``names`` order) that
    ``matches``."""
    series = {
        tuple(sample.labels[name] for name in names)
        for family in metric.collect()
        for sample in family.samples
    }
    for values in series:
        if matches(values):
            metric.remove(*values)
