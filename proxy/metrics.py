"""The proxy's Prometheus metrics, on a registry of its own per application.

Instance state is collected at scrape time from the live pools, so removed
instances vanish from /metrics instead of leaving stale series. Latency
histograms are ``Histogram`` below, not prometheus_client's: they are
observed for every relayed token, and its ``observe`` (locks, a linear bucket
search) cost six times as much.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Iterable, Iterator, Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge
from prometheus_client.core import GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from proxy.instances import Instance

_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
_GAP = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5)


class HistogramChild:
    """One labelled series: a count per bucket (``le`` inclusive) and a sum.

    Observed from the event loop's thread only; a scrape from another thread
    may see a count and the sum one observation apart, as Prometheus allows.
    """

    __slots__ = ("_bounds", "counts", "sum")

    def __init__(self, bounds: Sequence[float]) -> None:
        self._bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last one is +Inf
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self._bounds, value)] += 1
        self.sum += value


class Histogram(Collector):
    """A histogram family whose ``labels(...).observe`` costs a bisect."""

    def __init__(
        self,
        name: str,
        documentation: str,
        labelnames: Sequence[str] = (),
        buckets: Sequence[float] = _LATENCY,
        registry: CollectorRegistry | None = None,
    ) -> None:
        self._name = name
        self._doc = documentation
        self._labelnames = tuple(labelnames)
        self._bounds = tuple(float(b) for b in buckets)
        self._children: dict[tuple[str, ...], HistogramChild] = {}
        if registry is not None:
            registry.register(self)

    def labels(self, *values: str) -> HistogramChild:
        child = self._children.get(values)
        if child is None:
            if len(values) != len(self._labelnames):
                raise ValueError(f"{self._name}: expected labels {self._labelnames}")
            child = self._children[values] = HistogramChild(self._bounds)
        return child

    def observe(self, value: float) -> None:
        """For a family without labels."""
        self.labels().observe(value)

    def describe(self) -> Iterator[HistogramMetricFamily]:
        yield HistogramMetricFamily(self._name, self._doc, labels=self._labelnames)

    def collect(self) -> Iterator[HistogramMetricFamily]:
        family = HistogramMetricFamily(self._name, self._doc, labels=self._labelnames)
        edges = [floatToGoString(b) for b in self._bounds] + ["+Inf"]
        for values, child in list(self._children.items()):
            running = 0
            buckets = []
            for edge, count in zip(edges, list(child.counts), strict=True):
                running += count
                buckets.append((edge, running))
            family.add_metric(list(values), buckets, child.sum)
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
        self.ttft = Histogram(
            "kvguard_proxy_ttft_seconds",
            "Time to the first byte sent to the client (streams: first token)",
            ["route"],
            buckets=_LATENCY,
            registry=r,
        )
        self.inter_token = Histogram(
            "kvguard_proxy_inter_token_seconds",
            "Gaps between relayed stream chunks",
            buckets=_GAP,
            registry=r,
        )
        self.e2e = Histogram(
            "kvguard_proxy_e2e_seconds",
            "Client request duration, end to end",
            ["route"],
            buckets=_LATENCY,
            registry=r,
        )
        self.leg = Histogram(
            "kvguard_proxy_leg_seconds",
            "Per-leg latency: prefill (whole), decode (to first data or full reply)",
            ["leg"],
            buckets=_LATENCY,
            registry=r,
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
        self._route_children: dict[str, tuple[HistogramChild, HistogramChild]] = {}
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

    def route_histograms(self, route: str) -> tuple[HistogramChild, HistogramChild]:
        """(ttft, e2e) children for ``route``, cached: labels() is not free."""
        pair = self._route_children.get(route)
        if pair is None:
            pair = self._route_children[route] = (
                self.ttft.labels(route),
                self.e2e.labels(route),
            )
        return pair
