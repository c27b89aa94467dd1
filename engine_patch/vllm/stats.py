"""KVGuard's counters through vLLM's connector stats: per interval from the
scheduler (verification outcomes) and the workers (bytes and time
checksummed), aggregated by vLLM, logged, and exported to Prometheus by the
API server, beside the inner connector's own stats.
"""

from __future__ import annotations

import importlib
from collections import Counter
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, NamedTuple, cast

from prometheus_client import Counter as PromCounter
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
    PromMetric,
    PromMetricT,
)
from vllm.v1.metrics.utils import create_metric_per_engine

from engine_patch.stats import KVChecksumStats
from engine_patch.vllm.errors import record_failures

if TYPE_CHECKING:
    from vllm.config import VllmConfig

# Plain counts, summed when stats aggregate.
_COUNTS = ("verified", "mismatch", "sent", "failed_loads", "checksum_bytes",
           "held_loads")  # fmt: skip
# Seconds, summed.
_SECONDS = ("checksum_seconds", "hold_seconds", "scheduler_seconds")
# Counts by reason text.
_BY_REASON = ("unverified", "not_sent")


# The plain counts and seconds at zero; copied, not rebuilt, for each delta
# the scheduler takes (one per outcome, with its caches cold).
_ZERO_COUNTS: dict[str, Any] = {
    **dict.fromkeys(_COUNTS, 0),
    **dict.fromkeys(_SECONDS, 0.0),
}


def _empty_counts() -> dict[str, Any]:
    counts = _ZERO_COUNTS.copy()
    for key in _BY_REASON:
        counts[key] = {}
    # Engine request ids of the loads KVGuard failed: their error messages.
    counts["failed_requests"] = {}
    return counts


class Snapshot(NamedTuple):
    """The scheduler's outcome counts at some point, to take deltas against.

    A tuple, so that taking and comparing one is cheap: the scheduler takes
    one per outcome, with its caches cold.
    """

    verified: int = 0
    mismatch: int = 0
    sent: int = 0
    unverified: dict[str, int] = {}  # noqa: RUF012 (never mutated)
    not_sent: dict[str, int] = {}  # noqa: RUF012 (never mutated)

    @classmethod
    def of(cls, stats: KVChecksumStats) -> Snapshot:
        return cls(
            stats.verified,
            stats.mismatch,
            stats.sent,
            dict(stats.unverified),
            dict(stats.not_sent),
        )


def _by_reason_delta(
    now: Mapping[str, int], before: Mapping[str, int]
) -> dict[str, int]:
    if now == before:
        return {}
    return {
        reason: count - before.get(reason, 0)
        for reason, count in now.items()
        if count != before.get(reason, 0)
    }


def checksum_deltas(now: Snapshot, before: Snapshot) -> dict[str, Any]:
    """The scheduler's outcomes between two snapshots, as stats counts."""
    counts = _empty_counts()
    counts["verified"] = now.verified - before.verified
    counts["mismatch"] = now.mismatch - before.mismatch
    counts["sent"] = now.sent - before.sent
    counts["unverified"] = _by_reason_delta(now.unverified, before.unverified)
    counts["not_sent"] = _by_reason_delta(now.not_sent, before.not_sent)
    return counts


def _inner_class(connector: str, module_path: str | None) -> type[Any]:
    """The inner connector's class, by name or module path."""
    if module_path:
        found: type[Any] = getattr(importlib.import_module(module_path), connector)
        return found
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    return KVConnectorFactory.get_connector_class_by_name(connector)


class KVGuardConnectorStats(KVConnectorStats):
    """``data``: ``"kv_checksums"`` (counts, see ``_COUNTS``/``_BY_REASON``,
    and ``checksum_seconds``) and, when the inner connector has stats,
    ``"inner"``: its connector name, module path and stats (an object in
    process, its ``to_dict()`` once serialized)."""

    def __init__(self, data: dict[str, Any] | None = None) -> None:
        super().__init__(data=data if data is not None else {})
        if "kv_checksums" not in self.data:
            self.data["kv_checksums"] = _empty_counts()

    @classmethod
    def build(cls, data: dict[str, Any] | None) -> KVGuardConnectorStats:
        """Stats from their ``to_dict()`` (or in-process) form; the inner
        connector's rebuilt by its class."""
        if data is None:
            return cls()
        data = dict(data)
        inner = data.get("inner")
        if inner is not None and isinstance(inner.get("stats"), dict):
            inner_cls = _inner_class(inner["connector"], inner.get("module_path"))
            stats = inner_cls.build_kv_connector_stats(data=inner["stats"])
            data["inner"] = {**inner, "stats": stats} if stats is not None else None
        return cls(data)

    @property
    def counts(self) -> dict[str, Any]:
        counts: dict[str, Any] = self.data["kv_checksums"]
        return counts

    @property
    def inner(self) -> KVConnectorStats | None:
        inner = self.data.get("inner")
        return None if inner is None else inner["stats"]

    def set_inner(
        self, connector: str, module_path: str | None, stats: KVConnectorStats | None
    ) -> None:
        """Carry the inner connector's stats of the interval."""
        if stats is not None:
            self.data["inner"] = {
                "connector": connector,
                "module_path": module_path,
                "stats": stats,
            }

    def to_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {"kv_checksums": self.counts}
        if (inner := self.inner) is not None:
            data["inner"] = {**self.data["inner"], "stats": inner.to_dict()}
        return data

    def reset(self) -> None:
        self.data = {"kv_checksums": _empty_counts()}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        assert isinstance(other, KVGuardConnectorStats)
        mine, theirs = self.counts, other.counts
        for key in (*_COUNTS, *_SECONDS):
            mine[key] = mine.get(key, 0) + theirs.get(key, 0)
        for key in _BY_REASON:
            merged = Counter(mine[key])
            merged.update(theirs.get(key, {}))
            mine[key] = dict(merged)
        mine["failed_requests"] = {
            **mine.get("failed_requests", {}),
            **theirs.get("failed_requests", {}),
        }
        other_inner = other.inner
        if other_inner is not None:
            if (inner := self.inner) is None:
                self.data["inner"] = other.data["inner"]
            else:
                self.data["inner"]["stats"] = inner.aggregate(other_inner)
        return self

    def reduce(self) -> dict[str, int | float]:
        counts = self.counts
        reduced: dict[str, int | float] = {
            "KV checksums verified": counts["verified"],
            "mismatched": counts["mismatch"],
            "unverified": sum(counts["unverified"].values()),
            "loads failed": counts["failed_loads"],
            "sent": counts["sent"],
        }
        if counts["checksum_seconds"] > 0:
            reduced["checksum GB/s"] = round(
                counts["checksum_bytes"] / counts["checksum_seconds"] / 1e9, 3
            )
        if counts["held_loads"]:
            reduced["verification wait ms"] = round(
                counts["hold_seconds"] / counts["held_loads"] * 1e3, 2
            )
        if (inner := self.inner) is not None and not inner.is_empty():
            reduced.update(inner.reduce())
        return reduced

    def is_empty(self) -> bool:
        counts = self.counts
        inner = self.inner
        return (
            not any(counts[key] for key in _COUNTS)
            and not any(counts[key] for key in _BY_REASON)
            and (inner is None or inner.is_empty())
        )


class KVGuardPromMetrics(KVConnectorPromMetrics):
    """Prometheus counters ``kvguard_kv_checksum_*_total`` (the fake engine's
    names), beside the inner connector's metrics."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
        inner: KVConnectorPromMetrics | None,
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._inner = inner

        # vLLM types its counter class (metric_types[Counter]) as any of its
        # metric classes; it makes counters.
        def counter(name: str, doc: str) -> dict[int, PromCounter]:
            metric = self._counter_cls(
                name=name, documentation=doc, labelnames=labelnames
            )
            return cast(
                "dict[int, PromCounter]",
                create_metric_per_engine(metric, per_engine_labelvalues),
            )

        def by_reason(name: str, doc: str) -> PromCounter:
            return cast(
                "PromCounter",
                self._counter_cls(
                    name=name, documentation=doc, labelnames=[*labelnames, "reason"]
                ),
            )

        self._counters = {
            "verified": counter(
                "kvguard_kv_checksum_verified",
                "KV loads whose checksums matched the producer's.",
            ),
            "mismatch": counter(
                "kvguard_kv_checksum_mismatch",
                "KV loads whose checksums did not match the producer's.",
            ),
            "sent": counter(
                "kvguard_kv_checksum_sent",
                "Producer requests that sent checksums with their KV.",
            ),
            "failed_loads": counter(
                "kvguard_kv_load_failures",
                "KV loads KVGuard failed (fail-closed: mismatched or unverified).",
            ),
            "checksum_bytes": counter(
                "kvguard_kv_checksum_bytes",
                "Bytes of KV the workers checksummed.",
            ),
            "checksum_seconds": counter(
                "kvguard_kv_checksum_seconds",
                "Time the workers spent checksumming KV.",
            ),
            "held_loads": counter(
                "kvguard_kv_loads_held",
                "Finished KV loads held back from vLLM until verified.",
            ),
            "hold_seconds": counter(
                "kvguard_kv_load_hold_seconds",
                "Time finished KV loads waited for their verification.",
            ),
            "scheduler_seconds": counter(
                "kvguard_kv_checksum_scheduler_seconds",
                "Time KVGuard's scheduler-side code took in the scheduler.",
            ),
        }
        self._by_reason = {
            "unverified": by_reason(
                "kvguard_kv_checksum_unverified",
                "KV loads that could not be verified, by reason.",
            ),
            "not_sent": by_reason(
                "kvguard_kv_checksum_not_sent",
                "Producer requests whose checksums could not be sent, by reason.",
            ),
        }

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        counts = transfer_stats_data.get("kv_checksums", {})
        # The API server learns here why its requests' loads failed, before
        # their (generic) errors reach the clients: see errors.py.
        record_failures(counts.get("failed_requests") or {})
        for key, metrics in self._counters.items():
            if value := counts.get(key):
                metrics[engine_idx].inc(value)
        labelvalues = self.per_engine_labelvalues[engine_idx]
        for key, metric in self._by_reason.items():
            for reason, value in counts.get(key, {}).items():
                metric.labels(*labelvalues, reason).inc(value)
        inner = transfer_stats_data.get("inner")
        if self._inner is not None and inner is not None:
            self._inner.observe(inner["stats"], engine_idx)
