"""What KVGuard's connector halves send each other, around the inner
connector's own messages."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)

from engine_patch.types import KVChecksumRecord, KVChecksumScheduled


@dataclass
class KVGuardConnectorMetadata(KVConnectorMetadata):
    """Scheduler → workers, per step.

    ``hold_loads``: whether the workers hold each finished load back from
    vLLM until its verdict (fail-closed without KVGuard's scheduler class,
    which verifies loads in the step that reports them). ``verdicts``: per
    held load the scheduler verified, whether it failed.
    """

    inner: KVConnectorMetadata
    hold_loads: bool
    checksums: KVChecksumScheduled | None = None
    verdicts: dict[str, bool] = field(default_factory=dict)


@dataclass
class WorkerReport:
    """One worker's step: its checksums and the loads it checksummed."""

    record: KVChecksumRecord | None
    finished_loads: list[str]


@dataclass
class KVGuardWorkerMetadata(KVConnectorWorkerMetadata):
    """Workers → scheduler, per step, aggregated over the workers."""

    inner: KVConnectorWorkerMetadata | None
    reports: list[WorkerReport] = field(default_factory=list)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        assert isinstance(other, KVGuardWorkerMetadata)
        if self.inner is None:
            inner = other.inner
        elif other.inner is None:
            inner = self.inner
        else:
            inner = self.inner.aggregate(other.inner)
        return KVGuardWorkerMetadata(inner, self.reports + other.reports)
