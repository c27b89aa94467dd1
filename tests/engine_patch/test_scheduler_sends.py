"""KVChecksumScheduler (hand-built worker records, no torch): what a producer
sends, the sum of its workers' checksums in its ``kv_transfer_params``."""

from __future__ import annotations

import base64
import logging

import numpy as np
import pytest
from kv_host_fakes import (
    FakeBlocks,
    FakeConnectorOutput,
    FakeWorkers,
    block_sums,
    producer_request,
    scheduled_values,
    token_values,
)
from scheduler_harness import (
    RNG,
    Producer,
    R,
    full,
    kv_config,
)

from engine_patch.host import FinishReason
from engine_patch.payload import KVChecksumPayload


def test_producer_sends_the_sum_of_every_workers_checksums() -> None:
    config = kv_config(full(16), full(32))
    workers = FakeWorkers(tp=2, pp=2, fingerprints={0: 11, 1: 22})
    producer = Producer(config, workers)
    tokens = {0: token_values(RNG, 70), 1: token_values(RNG, 70)}
    req = producer_request("p", 70)
    producer.prefill(req, FakeBlocks.of([5, 6, 7, 8, 9], [3, 4, 5]), tokens)
    encoded = producer.finish(req)
    assert encoded is not None
    payload = KVChecksumPayload.from_bytes(base64.b64decode(encoded))
    assert payload.tp_size == 2
    assert payload.num_tokens == 70
    fp0, bs0, start0, values0 = payload.groups[0]
    assert (fp0, bs0, start0) == (11, 16, 0)
    np.testing.assert_array_equal(values0, block_sums(tokens[0], 16, 0, 5, 70))
    fp1, bs1, start1, values1 = payload.groups[1]
    assert (fp1, bs1, start1) == (22, 32, 0)
    np.testing.assert_array_equal(values1, block_sums(tokens[1], 32, 0, 3, 70))
    # Connectors that send checksums in their own messages get the same bytes.
    assert producer.scheduler.take_kv_checksums_to_send() == {
        "p": base64.b64decode(encoded)
    }
    assert producer.scheduler.take_kv_checksums_to_send() == {}
    assert producer.scheduler.stats.sent == 1


def test_producer_without_returned_params_still_gives_the_connector_its_checksums() -> (
    None
):
    producer = Producer(kv_config(full()))
    req = producer_request("p", 16)
    producer.prefill(req, FakeBlocks.of([1]), {0: token_values(RNG, 16)})
    req.finish_reason = FinishReason.LENGTH
    producer.scheduler.request_finished(req, None)
    assert set(producer.scheduler.take_kv_checksums_to_send()) == {"p"}


@pytest.mark.parametrize("reason", [FinishReason.ABORT, FinishReason.ERROR])
def test_aborted_or_failed_producers_send_nothing(reason: FinishReason) -> None:
    producer = Producer(kv_config(full()))
    req = producer_request("p", 16)
    producer.prefill(req, FakeBlocks.of([1]), {0: token_values(RNG, 16)})
    assert producer.finish(req, reason) is None
    assert producer.scheduler.take_kv_checksums_to_send() == {}
    assert producer.scheduler.stats.sent == 0
    assert not producer.scheduler.stats.not_sent


def test_producer_finished_before_its_prompt_sends_nothing() -> None:
    producer = Producer(kv_config(full()))
    assert producer.finish(producer_request("p", 16)) is None
    assert producer.scheduler.take_kv_checksums_to_send() == {}


def test_producer_missing_a_workers_report_sends_no_checksums(
    caplog: pytest.LogCaptureFixture,
) -> None:
    producer = Producer(kv_config(full()), FakeWorkers(tp=2))
    scheduler = producer.scheduler
    req = producer_request("p", 16)
    producer.manager.by_request["p"] = FakeBlocks.of([1])
    req.num_computed_tokens = 16
    scheduler.add_send(req, 16, producer.manager)
    scheduled = scheduler.build_checksum_meta()
    assert scheduled is not None
    values = scheduled_values(
        scheduled.reqs_to_send["p"], {0: token_values(RNG, 16)}, producer.config
    )
    records = producer.workers.report("p", values, ranks=[(0, 1)])
    scheduler.update_from_output(FakeConnectorOutput(records), set())
    with caplog.at_level(logging.DEBUG, logger="kvguard.engine_patch.scheduler"):
        assert producer.finish(req) is None
    assert scheduler.stats.not_sent == {R.INCOMPLETE: 1}
    assert f"KV checksums not sent: {R.INCOMPLETE}." in caplog.messages
    assert "1 of 2 workers reported" in caplog.text


def test_preempted_producers_re_prefill_replaces_the_earlier_checksums() -> None:
    config = kv_config(full())
    producer = Producer(config)
    req = producer_request("p", 40)
    first = {0: token_values(RNG, 40)}
    producer.prefill(req, FakeBlocks.of([1, 2, 3]), first)
    # Preempted, then prefilled again into other blocks, with other KV.
    second = {0: token_values(RNG, 40)}
    producer.prefill(req, FakeBlocks.of([7, 8, 9]), second)
    encoded = producer.finish(req)
    assert encoded is not None
    payload = KVChecksumPayload.from_bytes(base64.b64decode(encoded))
    np.testing.assert_array_equal(
        payload.groups[0][3], block_sums(second[0], 16, 0, 3, 40)
    )


def test_a_stale_report_of_other_blocks_leaves_the_send_without_checksums() -> None:
    producer = Producer(kv_config(full()))
    scheduler = producer.scheduler
    req = producer_request("p", 40)
    producer.manager.by_request["p"] = FakeBlocks.of([1, 2, 3])
    req.num_computed_tokens = 40
    scheduler.add_send(req, 40, producer.manager)
    scheduler.build_checksum_meta()
    # The worker's report is of two blocks, e.g. an earlier prefill's.
    records = producer.workers.report("p", {0: (0, np.zeros(2, dtype=np.uint64))})
    scheduler.update_from_output(FakeConnectorOutput(records), set())
    assert producer.finish(req) is None
    assert scheduler.stats.not_sent == {R.OTHER_BLOCKS: 1}


def test_producer_skipped_groups_and_groups_no_worker_reports_are_not_sent() -> None:
    config = kv_config(full(), full(), full())
    # Group 2 holds only drafter layers: the workers have none of them.
    workers = FakeWorkers(fingerprints={0: 1, 1: 2}, skipped=frozenset({1}))
    producer = Producer(config, workers)
    req = producer_request("p", 16)
    producer.manager.by_request["p"] = FakeBlocks.of([1], [2], [3])
    req.num_computed_tokens = 16
    producer.scheduler.add_send(req, 16, producer.manager)
    scheduled = producer.scheduler.build_checksum_meta()
    assert scheduled is not None
    values = scheduled_values(
        scheduled.reqs_to_send["p"],
        {g: token_values(RNG, 16) for g in range(3)},
        config,
    )
    del values[2]
    producer.scheduler.update_from_output(
        FakeConnectorOutput(workers.report("p", values)), set()
    )
    encoded = producer.finish(req)
    assert encoded is not None
    payload = KVChecksumPayload.from_bytes(base64.b64decode(encoded))
    assert set(payload.groups) == {0}
