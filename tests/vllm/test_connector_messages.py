"""What KVGuard's connector sends between vLLM's scheduler and its workers.

vLLM's multiprocess executor pickles it every step: KVGuard's part travels
as one msgpack blob (``engine_patch.message_codec``), loads verify (or
fail) through it as in process, and a step with nothing of KVGuard's sends
the inner connector's metadata alone."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
from engine_steps import (
    block_checksums,
    consume,
    consumer_params,
    make_scheduler,
    produce,
    request,
    shipped,
    step,
    vllm_config,
    worker_record,
)
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)

from engine_patch.types import KVChecksumBlocks, KVChecksumRecord, KVChecksumScheduled
from engine_patch.vllm.metadata import (
    KVGuardConnectorMetadata,
    KVGuardWorkerMetadata,
    WorkerReport,
)
from engine_patch.vllm.scheduler import KVGuardScheduler

pytestmark = pytest.mark.vllm


def pickled(obj: object) -> bytes:
    return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)


def test_a_workers_record_is_pickled_as_one_msgpack_blob() -> None:
    sums = block_checksums(100)
    meta = KVGuardWorkerMetadata(
        None, [WorkerReport(worker_record({"r": sums}), ["r"], ["f"])]
    )
    data = pickled(meta)
    # Not its dataclasses and arrays one by one.
    assert b"KVChecksumGroup" not in data
    assert b"numpy" not in data
    back = pickle.loads(data)
    assert isinstance(back, KVGuardWorkerMetadata)
    [report] = back.reports
    assert (report.finished_loads, report.failed_loads) == (["r"], ["f"])
    assert isinstance(report.record, KVChecksumRecord)
    assert np.array_equal(report.record.checksums["r"][0].values[:, 0], sums)


def test_a_record_msgpack_cannot_carry_is_pickled_as_it_is() -> None:
    record = KVChecksumRecord(0, 0, fingerprints={0: 2**70})
    back = shipped(KVGuardWorkerMetadata(None, [WorkerReport(record, [], ["f"])]))
    # The scheduler's checks then find it malformed.
    assert back.reports[0].record == record
    assert back.reports[0].failed_loads == ["f"]


def test_the_steps_checksums_are_pickled_as_one_msgpack_blob() -> None:
    scheduled = KVChecksumScheduled(
        reqs_to_send={"p": KVChecksumBlocks(100, {0: (0, [5, 6, 7, 8])})},
        reqs_to_recv={"c": KVChecksumBlocks(70, {0: (1, [9, 10])})},
    )
    meta = KVGuardConnectorMetadata(
        KVConnectorMetadata(), True, scheduled, {"held": True}
    )
    data = pickled(meta)
    assert b"KVChecksumBlocks" not in data
    back = pickle.loads(data)
    assert isinstance(back, KVGuardConnectorMetadata)
    assert (back.checksums, back.hold_loads, back.verdicts) == (
        scheduled,
        True,
        {"held": True},
    )
    assert (
        shipped(KVGuardConnectorMetadata(KVConnectorMetadata(), False)).checksums
        is None
    )


@pytest.mark.parametrize("corrupt", [False, True], ids=["clean", "corrupted"])
def test_a_load_is_judged_from_its_workers_pickled_output(corrupt: bool) -> None:
    scheduler = make_scheduler(KVGuardScheduler, vllm_config("kv_consumer"))
    counts = consume(scheduler, "c", 100, corrupt=corrupt, pickled=True)
    assert counts.get("verified", 0) == (0 if corrupt else 1)
    assert counts.get("mismatch", 0) == (1 if corrupt else 0)


def test_a_producer_sends_checksums_from_its_workers_pickled_output() -> None:
    scheduler = make_scheduler(KVGuardScheduler, vllm_config("kv_producer"))
    assert produce(scheduler, "p", 100, pickled=True).get("sent") == 1


def test_steps_with_nothing_for_the_workers_send_the_inner_metadata_alone() -> None:
    scheduler = make_scheduler(KVGuardScheduler, vllm_config("kv_consumer"))
    # The first step tells the workers not to hold loads.
    first, _ = step(scheduler)
    assert isinstance(first.kv_connector_metadata, KVGuardConnectorMetadata)
    assert first.kv_connector_metadata.hold_loads is False
    idle, _ = step(scheduler)
    assert type(idle.kv_connector_metadata) is type(first.kv_connector_metadata.inner)
    # A load starts: its blocks go to the workers.
    scheduler.add_request(request("c", 100, consumer_params(100, block_checksums(100))))
    started, _ = step(scheduler)
    meta = started.kv_connector_metadata
    assert isinstance(meta, KVGuardConnectorMetadata)
    assert meta.checksums is not None
    assert list(meta.checksums.reqs_to_recv) == ["c"]
    waiting, _ = step(scheduler)
    assert not isinstance(waiting.kv_connector_metadata, KVGuardConnectorMetadata)


class _InnerMeta(KVConnectorWorkerMetadata):
    """An inner connector's worker metadata: the ranks it came from."""

    def __init__(self, *ranks: int) -> None:
        self.ranks = list(ranks)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        assert isinstance(other, _InnerMeta)
        return _InnerMeta(*self.ranks, *other.ranks)


@pytest.mark.parametrize(
    ("first", "second", "ranks"),
    [((0,), None, [0]), (None, (1,), [1]), ((0,), (1,), [0, 1]), (None, None, None)],
)
def test_worker_metadata_aggregates_the_inner_connectors_and_the_reports(
    first: tuple[int, ...] | None,
    second: tuple[int, ...] | None,
    ranks: list[int] | None,
) -> None:
    reports = [WorkerReport(None, [f"r{i}"]) for i in range(2)]
    merged = KVGuardWorkerMetadata(
        None if first is None else _InnerMeta(*first), reports[:1]
    ).aggregate(
        KVGuardWorkerMetadata(
            None if second is None else _InnerMeta(*second), reports[1:]
        )
    )
    assert isinstance(merged, KVGuardWorkerMetadata)
    assert merged.reports == reports
    if ranks is None:
        assert merged.inner is None
    else:
        assert isinstance(merged.inner, _InnerMeta) and merged.inner.ranks == ranks
