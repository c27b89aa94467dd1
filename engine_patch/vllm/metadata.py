"""What KVGuard's connector halves send each other, around the inner
connector's own messages.

vLLM pickles both to and from its worker processes every step: KVGuard's
part travels as msgpack (:mod:`engine_patch.message_codec`), which costs a
fraction of pickling its dataclasses and arrays one by one.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)

from engine_patch.message_codec import (
    decode_record,
    decode_scheduled,
    encode_record,
    encode_scheduled,
)
from engine_patch.types import KVChecksumRecord, KVChecksumScheduled


@dataclass
class KVGuardConnectorMetadata(KVConnectorMetadata):
    """Scheduler → workers, per step.

    ``hold_loads``: whether the workers hold each finished load back from
    vLLM until its verdict (fail-closed without KVGuard's scheduler class,
    which verifies loads in the step that reports them). ``verdicts``: per
    held load the scheduler verified, whether it failed. ``sync_loads``:
    loads among ``checksums.reqs_to_recv`` the inner connector makes inside
    this step's forward (``load_kv_async=False``), checksummed after it.
    """

    inner: KVConnectorMetadata
    hold_loads: bool
    checksums: KVChecksumScheduled | None = None
    verdicts: dict[str, bool] = field(default_factory=dict)
    sync_loads: Sequence[str] = ()

    def __reduce__(self) -> tuple[Callable[..., Any], tuple[Any, ...]]:
        checksums = self.checksums
        return _connector_metadata, (
            self.inner,
            self.hold_loads,
            None if checksums is None else encode_scheduled(checksums),
            self.verdicts,
            self.sync_loads,
        )


def _connector_metadata(
    inner: KVConnectorMetadata,
    hold_loads: bool,
    checksums: bytes | None,
    verdicts: dict[str, bool],
    sync_loads: Sequence[str],
) -> KVGuardConnectorMetadata:
    """Unpickles :class:`KVGuardConnectorMetadata`."""
    return KVGuardConnectorMetadata(
        inner,
        hold_loads,
        None if checksums is None else decode_scheduled(checksums),
        verdicts,
        sync_loads,
    )


@dataclass
class WorkerReport:
    """One worker's step: its checksums, the loads it checksummed, and the
    loads its inner connector failed (checksummed by no one)."""

    record: KVChecksumRecord | None
    finished_loads: list[str]
    failed_loads: list[str] = field(default_factory=list)

    def __reduce__(self) -> tuple[Callable[..., Any], tuple[Any, ...]]:
        data = encode_record(self.record)
        if data is None:
            # No record, or one msgpack cannot carry: pickled as it is, for
            # the scheduler's checks to judge.
            return WorkerReport, (self.record, self.finished_loads, self.failed_loads)
        return _worker_report, (data, self.finished_loads, self.failed_loads)


def _worker_report(
    record: bytes, finished_loads: list[str], failed_loads: list[str]
) -> WorkerReport:
    """Unpickles a :class:`WorkerReport` whose record was encoded; one that
    does not decode is left as bytes, a malformed record."""
    return WorkerReport(decode_record(record), finished_loads, failed_loads)  # type: ignore[arg-type]


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
