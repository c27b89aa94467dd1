"""The fake engine's Prometheus metrics, one registry per engine (several
run in one test process). Outcome counts are read from their owners at
scrape time rather than copied."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client import Counter as PromCounter
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from engine_patch.stats import KVChecksumStats


@dataclass
class EngineSnapshot:
    """What the engine's state says at scrape time."""

    checksum_stats: KVChecksumStats = field(default_factory=KVChecksumStats)
    checksum_bytes: int = 0
    checksum_seconds: float = 0.0
    blocks_held: int = 0
    requests_running: int = 0
    requests_waiting: int = 0
    faults_injected: Counter[tuple[str, str]] = field(default_factory=Counter)


class _EngineCollector(Collector):
    def __init__(self, snapshot: Callable[[], EngineSnapshot]) -> None:
        self._snapshot = snapshot

    def collect(self) -> Iterator[Metric]:
        snap = self._snapshot()
        stats = snap.checksum_stats
        yield CounterMetricFamily(
            "kvguard_kv_checksum_verified",
            "KV loads whose checksums matched the producer's.",
            value=stats.verified,
        )
        yield CounterMetricFamily(
            "kvguard_kv_checksum_mismatch",
            "KV loads whose checksums did not match the producer's.",
            value=stats.mismatch,
        )
        unverified = CounterMetricFamily(
            "kvguard_kv_checksum_unverified",
            "KV loads (or groups) that could not be verified, by reason.",
            labels=["reason"],
        )
        for reason, count in sorted(stats.unverified.items()):
            unverified.add_metric([str(reason)], count)
        yield unverified
        yield CounterMetricFamily(
            "kvguard_kv_checksum_sent",
            "Producer requests that sent checksums with their KV.",
            value=stats.sent,
        )
        yield CounterMetricFamily(
            "kvguard_kv_checksum_bytes",
            "Bytes of KV the workers checksummed.",
            value=snap.checksum_bytes,
        )
        yield CounterMetricFamily(
            "kvguard_kv_checksum_seconds",
            "Time the workers spent checksumming KV.",
            value=snap.checksum_seconds,
        )
        yield GaugeMetricFamily(
            "kvguard_kv_blocks_held",
            "KV blocks held for remote decodes (until pulled, aborted or expired).",
            value=snap.blocks_held,
        )
        yield GaugeMetricFamily(
            "vllm:num_requests_running",
            "Requests running (prefill or decode).",
            value=snap.requests_running,
        )
        yield GaugeMetricFamily(
            "vllm:num_requests_waiting",
            "Requests waiting to be scheduled or for their KV.",
            value=snap.requests_waiting,
        )
        faults = CounterMetricFamily(
            "kvguard_kv_faults_injected",
            "Faults injected into KV transfers, by fault and side.",
            labels=["fault", "side"],
        )
        for (fault, side), count in sorted(snap.faults_injected.items()):
            faults.add_metric([fault, side], count)
        yield faults


class EngineMetrics:
    """One engine's registry: counters the engine increments, and its state
    read at scrape time."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self, snapshot: Callable[[], EngineSnapshot]) -> None:
        self.registry = CollectorRegistry()
        self.load_failures = PromCounter(
            "kvguard_kv_load_failures",
            "KV loads that failed (checksums, transfer, expired lease).",
            registry=self.registry,
        )
        self.requests_aborted = PromCounter(
            "kvguard_requests_aborted",
            "Requests aborted, and KV held for remote decodes that was dropped.",
            registry=self.registry,
        )
        self.registry.register(_EngineCollector(snapshot))

    def render(self) -> bytes:
        """The registry in Prometheus text format."""
        return generate_latest(self.registry)
