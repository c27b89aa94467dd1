"""KVChecksumScheduler (hand-built worker records, no torch): loads that
cannot be verified, counted and logged by reason, failed under fail-closed."""

from __future__ import annotations

import base64
import logging

import numpy as np
import pytest
from kv_host_fakes import (
    FakeBlocks,
    FakeConnectorOutput,
    FakeWorkers,
    consumer_request,
    producer_request,
    token_values,
)
from scheduler_harness import (
    RNG,
    Consumer,
    Producer,
    R,
    corrupt,
    full,
    kv_config,
    load_with_payload,
)

from engine_patch.kv_cache import KVCacheConfig, KVCacheGroup
from engine_patch.payload import KV_TRANSFER_PARAMS_KEY, KVChecksumPayload


def payload_params(
    *groups: tuple[int, int, int, int, list[int]],
    num_tokens: int = 40,
    tp_size: int = 1,
) -> dict[str, object]:
    payload = KVChecksumPayload(
        tp_size,
        num_tokens,
        {
            g: (fp, bs, start, np.array(values, dtype=np.uint64))
            for g, fp, bs, start, values in groups
        },
    )
    return {KV_TRANSFER_PARAMS_KEY: payload.to_base64()}


def wrong_version() -> str:
    import msgspec

    data = msgspec.msgpack.encode((2, 1, 40, [(0, 0xF00D, 16, 0, b"\0" * 24)]))
    return base64.b64encode(data).decode()


UNVERIFIED_CASES = {
    "no payload": (dict(params=None), R.NO_CHECKSUMS),
    "not base64": (dict(params={KV_TRANSFER_PARAMS_KEY: "%%%"}), R.INVALID_CHECKSUMS),
    "not text": (dict(params={KV_TRANSFER_PARAMS_KEY: 123}), R.INVALID_CHECKSUMS),
    "garbage bytes": (
        dict(params={KV_TRANSFER_PARAMS_KEY: base64.b64encode(b"\x93abc").decode()}),
        R.INVALID_CHECKSUMS,
    ),
    "wrong version": (
        dict(params={KV_TRANSFER_PARAMS_KEY: wrong_version()}),
        R.INVALID_CHECKSUMS,
    ),
    "a worker did not report": (
        dict(
            params=payload_params((0, 0xF00D, 16, 0, [1, 2, 3])),
            consumer_workers=FakeWorkers(tp=2),
            ranks=[(0, 0)],
        ),
        R.INCOMPLETE,
    ),
    "group sent but skipped by the consumer": (
        dict(
            params=payload_params((0, 0xF00D, 16, 0, [1, 2, 3])),
            consumer_workers=FakeWorkers(skipped=frozenset({0})),
        ),
        R.ONE_SIDE,
    ),
    "group checksummed by the consumer but not sent": (
        dict(params=payload_params()),
        R.ONE_SIDE,
    ),
    "other layers on the producer": (
        dict(params=payload_params((0, 0xBAD, 16, 0, [1, 2, 3]))),
        R.OTHER_LAYERS,
    ),
    "block sizes not multiples": (
        dict(params=payload_params((0, 0xF00D, 24, 0, [1, 2]))),
        R.BLOCK_SIZES,
    ),
    "first loaded block inside a producer block": (
        dict(
            params=payload_params((0, 0xF00D, 32, 0, [1]), num_tokens=32),
            consumer_blocks=FakeBlocks.of([1, 2]),
            num_tokens=32,
            num_local_tokens=16,
        ),
        R.START_INSIDE,
    ),
    "no block in common": (
        dict(
            params=payload_params((0, 0xF00D, 16, 0, [1]), num_tokens=16),
            consumer_blocks=FakeBlocks.of([1, 2, 3]),
            num_local_tokens=32,
        ),
        R.NO_COMMON_BLOCK,
    ),
    "only a last block, holding other tokens on the producer": (
        dict(
            params=payload_params((0, 0xF00D, 16, 0, [1, 2, 3]), num_tokens=41),
            num_local_tokens=32,
        ),
        R.NO_COMMON_BLOCK,
    ),
    "the loaded group skipped on both sides": (
        dict(
            params=payload_params(),
            consumer_workers=FakeWorkers(skipped=frozenset({0})),
        ),
        R.SKIPPED,
    ),
    "no loaded group checksummed on either side (drafter layers only)": (
        dict(
            params=payload_params(),
            consumer_workers=FakeWorkers(fingerprints={}, unheld=frozenset({0})),
        ),
        R.NOTHING_CHECKSUMMED,
    ),
    "no transfer group on either side (fail-open left out every group)": (
        dict(
            params=payload_params(),
            consumer_config=KVCacheConfig(
                [KVCacheGroup(full())], transfer_group_ids=()
            ),
        ),
        R.NOTHING_CHECKSUMMED,
    ),
}


@pytest.mark.parametrize("fail_closed", [True, False], ids=["closed", "open"])
@pytest.mark.parametrize("case", list(UNVERIFIED_CASES))
def test_an_unverified_load_fails_only_when_fail_closed(
    case: str, fail_closed: bool, caplog: pytest.LogCaptureFixture
) -> None:
    kwargs, reason = UNVERIFIED_CASES[case]
    with caplog.at_level(logging.DEBUG, logger="kvguard.engine_patch.scheduler"):
        consumer = load_with_payload(fail_closed=fail_closed, **kwargs)  # type: ignore[arg-type]
    assert consumer.failed == ({"c"} if fail_closed else set())
    assert consumer.stats.unverified == {reason: 1}
    assert consumer.stats.verified == consumer.stats.mismatch == 0
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert [r.message for r in warnings] == [f"KV checksums not verified: {reason}."]
    assert any(
        r.levelno == logging.DEBUG and "request c not verified" in r.message
        for r in caplog.records
    )


def test_a_group_skipped_on_both_sides_does_not_hide_a_mismatch_of_another() -> None:
    config = kv_config(full(), full())
    consumer = load_with_payload(
        payload_params((0, 0xF00D, 16, 0, [0, 0, 0])),
        consumer_config=config,
        consumer_workers=FakeWorkers(
            fingerprints={0: 0xF00D, 1: 1}, skipped=frozenset({1})
        ),
        consumer_blocks=FakeBlocks.of([1, 2, 3], [4, 5, 6]),
    )
    # Group 0 is compared (and mismatches: other random KV), group 1 is not
    # (unverified, but a mismatch is what the load fails for).
    assert consumer.stats.mismatch == 1
    assert not consumer.stats.unverified


def test_a_stale_worker_report_leaves_the_load_unverified() -> None:
    consumer = Consumer(kv_config(full()))
    req = consumer_request("c", 40, payload_params((0, 0xF00D, 16, 0, [1, 2, 3])))
    consumer.start_load(req, FakeBlocks.of([1, 2, 3]))
    consumer.scheduler.build_checksum_meta()
    records = consumer.workers.report("c", {0: (1, np.zeros(3, dtype=np.uint64))})
    failed = consumer.scheduler.update_from_output(
        FakeConnectorOutput(records, {"c"}), set()
    )
    assert failed == {"c"}
    assert consumer.stats.unverified == {R.OTHER_BLOCKS: 1}


def test_an_unverified_reason_is_warned_once_and_detailed_per_request(
    caplog: pytest.LogCaptureFixture,
) -> None:
    consumer = Consumer(kv_config(full()))
    with caplog.at_level(logging.DEBUG, logger="kvguard.engine_patch.scheduler"):
        for i in range(3):
            req = consumer_request(f"c{i}", 16)
            consumer.load(req, FakeBlocks.of([1]), {0: token_values(RNG, 16)})
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    debug = [r.message for r in caplog.records if r.levelno == logging.DEBUG]
    for i in range(3):
        assert any(f"request c{i} not verified" in m for m in debug)
    assert consumer.stats.unverified == {R.NO_CHECKSUMS: 3}


def test_stats_count_every_outcome() -> None:
    config = kv_config(full())
    tokens = {0: token_values(RNG, 32)}
    producer = Producer(config)
    consumer = Consumer(config, fail_closed=False)
    for i, loaded in enumerate([tokens, tokens, {0: corrupt(tokens[0], 3)}, None]):
        req = producer_request(f"r{i}", 32)
        producer.prefill(req, FakeBlocks.of([1, 2]), tokens)
        encoded = producer.finish(req)
        params = {KV_TRANSFER_PARAMS_KEY: encoded} if loaded is not None else {}
        consumer.load(
            consumer_request(f"r{i}", 32, params),
            FakeBlocks.of([3, 4]),
            loaded or tokens,
        )
    assert producer.scheduler.stats.sent == 4
    assert consumer.stats.verified == 2
    assert consumer.stats.mismatch == 1
    assert consumer.stats.unverified == {R.NO_CHECKSUMS: 1}


@pytest.mark.parametrize("fail_closed", [True, False])
def test_a_load_that_cannot_be_checksummed_is_refused_fail_closed(
    fail_closed: bool,
) -> None:
    consumer = Consumer(kv_config(full()), fail_closed=fail_closed)
    scheduler = consumer.scheduler
    req = consumer_request("r", 32)
    scheduler.on_new_request(req)
    refused = scheduler.on_unverifiable_load(req, R.SYNC_LOAD)
    assert refused is fail_closed
    # The host asks again while the request waits for blocks: same answer,
    # counted once.
    assert scheduler.on_unverifiable_load(req, R.SYNC_LOAD) is fail_closed
    assert consumer.stats.unverified == {R.SYNC_LOAD: 1}
    # Fail-open, the load goes ahead unchecked: nothing waits for a verdict.
    req.num_computed_tokens = 32
    scheduler.add_recv(req, FakeBlocks.of([1, 2]), 0)
    assert scheduler.build_checksum_meta() is None


def test_only_a_consumers_load_from_its_producer_is_refused() -> None:
    consumer = Consumer(kv_config(full()))
    scheduler = consumer.scheduler
    # A request of no P/D pair: its load (a cache tier of its engine's
    # connector) is not one KVGuard checks.
    plain = consumer_request("plain", 32)
    plain.kv_transfer_params = None
    scheduler.on_new_request(plain)
    assert not scheduler.on_unverifiable_load(plain, R.SYNC_LOAD)
    assert not consumer.stats.unverified


def test_a_refused_load_is_forgotten_when_its_request_finishes() -> None:
    consumer = Consumer(kv_config(full()))
    scheduler = consumer.scheduler
    req = consumer_request("r", 32)
    scheduler.on_new_request(req)
    assert scheduler.on_unverifiable_load(req, R.SYNC_LOAD)
    scheduler.request_finished(req, None)
    # The same id again, for a request of no P/D pair.
    again = consumer_request("r", 32)
    again.kv_transfer_params = None
    scheduler.on_new_request(again)
    assert not scheduler.on_unverifiable_load(again, R.SYNC_LOAD)
